"""`eagle3 export`: lower target + head to an ExecuTorch program."""

from __future__ import annotations

import argparse
import sys

from ..errors import Eagle3Error
from .args import add_target_args, int_list


def cmd_export(args: argparse.Namespace) -> int:
    import os

    import eagle3

    from ..export import export_program

    if args.backend not in ("auto", "native"):
        raise Eagle3Error("export lowers the native PyTorch target: use --backend native or auto")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.device not in (None, "cpu"):
        raise Eagle3Error("export lowers for the CPU (XNNPACK); drop --device")
    spec = eagle3.load(args.target, args.draft, dtype=args.dtype, backend="native",
                       max_seq_len=args.max_seq_len, taps=args.taps, quantize="none", calibrate=False)
    tdir = os.path.dirname(spec.tokenizer.path) if spec.tokenizer is not None else None
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"eagle3: {msg}", file=sys.stderr))
    export_program(spec, args.out, max_seq_len=args.max_seq_len,
                          max_draft_tokens=args.max_draft_tokens, quantize=args.quantize,
                          source={"target": args.target, "draft": args.draft}, tokenizer_dir=tdir,
                          log=log)
    print(args.out)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("export", help="export target + head to an ExecuTorch program (XNNPACK)",
                       description="torch.export the speculator's prefill / target_verify / "
                       "draft_decode / decode methods (dynamic lengths, KV caches as buffers shared "
                       "by every method) and lower them to one ExecuTorch program with the XNNPACK "
                       "backend: OUT/program.pte, OUT/eagle3_program.json (bounds, taps, vocabulary, "
                       "d2t) and the target's tokenizer. Run it with `eagle3 generate --backend "
                       "executorch --program OUT`. Needs pip install 'eagle3[export]'. Lowering "
                       "takes one to a few minutes.")
    add_target_args(e, quantize=False)
    e.add_argument("--draft", default=None,
                   help="EAGLE-3 head directory (default: the default head for --target default)")
    e.add_argument("--taps", type=int_list, default=None, metavar="2,16,29",
                   help="target layers feeding the head (default: the head config's ids)")
    e.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")
    e.add_argument("--max-draft-tokens", type=int, default=8, metavar="K",
                   help="largest chain the exported target_verify accepts (verify over up to K+1 "
                        "tokens; default 8, the largest automatic K)")
    e.add_argument("--quantize", default="none", choices=("none", "int8", "int4"),
                   help="quantize the linear layers: int8 weights per output channel or int4 "
                        "weights in groups of 32, activations int8 per token at run time "
                        "(XNNPACK's dynamically quantized linear); default none. Prints the "
                        "measured logit error")
    e.add_argument("--threads", type=int, default=None, help="torch threads while exporting")
    e.add_argument("--quiet", action="store_true", help="no progress lines")
    e.set_defaults(func=cmd_export)
