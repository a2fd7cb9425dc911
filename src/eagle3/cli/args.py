"""Argument helpers shared by the verbs: targets, heads, K, trees, sampling."""

from __future__ import annotations

import argparse

from ..errors import Eagle3Error

DRAFT_HELP = ("EAGLE-3 head directory, or 'none' for plain decoding (default: the default head for "
              "--target default, else none)")


def int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def num_draft_tokens(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got '{text}'") from None


QUANTIZE_HELP = ("weight format of the native target's linear layers (and the head's): auto "
                 "(default: gguf for a .gguf file stored quantized, else fp32), fp32, bf16, int8 (GGUF "
                 "Q8_0: blocks of 32), int4 (Q4_1: blocks of 32; int4-g64, int8-g64 set the group), gguf "
                 "(a .gguf target's Q8_0/Q4_0/Q4_1 codes as stored, other types to the nearest format), "
                 "or none (stock PyTorch layers). Every format but none runs row-invariant kernels on "
                 "any x86-64 CPU (AVX-512 VNNI, AVX-VNNI, AVX2 or scalar, the same bits on each; EAGLE3_ISA "
                 "forces one): speculative output is bit-identical to plain decoding in the same "
                 "format. int8/int4/gguf multiply int8-quantized activations by the codes in exact "
                 "integer arithmetic, as llama.cpp does; the rest of the model stays float32")


def add_target_args(p: argparse.ArgumentParser, backends: bool = False, engine: bool = False,
                    quantize: bool = True) -> None:
    """--target, --backend, --program, --dtype, --device, --max-seq-len, --quantize. `backends`:
    bench's comma-separated list; `engine`: the serving engine's eager native backends only
    (no --program); `quantize`: offer --quantize (export has its own)."""
    p.add_argument("--target", default="default",
                   help="target: a checkpoint directory (Hugging Face layout), a .gguf file (or a "
                        "directory holding one), a model name (eagle3 models: smollm2-135m-instruct, "
                        "gemma-3-270m), or 'default' (SmolLM2-135M-Instruct with the head trained "
                        "here; default)")
    if engine:  # checked in the verb, so that a wrong value is one line, not argparse's usage dump
        p.add_argument("--backend", default="auto", metavar="auto|native",
                       help="the engine runs the eager native PyTorch target: auto (default) or native")
    elif backends:  # bench: a comma-separated list, run side by side
        p.add_argument("--backend", default="auto", metavar="eager,executorch",
                       help="backends to measure side by side, comma-separated: eager (= auto: the "
                            "native PyTorch target when supported), native, hf (the transformers "
                            "adapter), executorch (the exported program --program DIR); speedups "
                            "are against the first one's plain decoding (default auto)")
    else:
        p.add_argument("--backend", default="auto", choices=("auto", "native", "hf", "executorch"),
                       help="native PyTorch target, the transformers adapter, auto (native when "
                            "the architecture is supported), or executorch (an exported program: "
                            "--program DIR)")
    if not engine:
        p.add_argument("--program", default=None, metavar="DIR",
                       help="with --backend executorch: the --out directory of `eagle3 export`")
    p.add_argument("--dtype", default=None, help="compute dtype: float32 (default), bfloat16, float16")
    p.add_argument("--device", default=None,
                   help="where the target and head run: cpu (default), cuda, cuda:N")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache size in tokens (default: min(max_position_embeddings, 4096))")
    if quantize:
        p.add_argument("--quantize", default="auto", metavar="FORMAT",
                       help=QUANTIZE_HELP + (". bench: a comma-separated list (e.g. fp32,int4,gguf), "
                                             "each format its own rows in the same run"
                                             if backends else ""))


def add_tree_args(p: argparse.ArgumentParser, tree_help: str) -> None:
    """--tree / --chain and the tree's shape (--tree-* imply --tree)."""
    from ..decoding.tree import DEFAULT_TREE as d

    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--tree", action="store_true", help=tree_help)
    shape.add_argument("--chain", action="store_true", help="chain drafting (default)")
    p.add_argument("--tree-top-k", type=int, default=None, metavar="K",
                   help=f"children per expanded node (default {d.top_k}; implies --tree)")
    p.add_argument("--tree-depth", type=int, default=None, metavar="D",
                   help=f"tree levels = longest acceptable draft (default {d.depth}; implies --tree)")
    p.add_argument("--tree-total-tokens", type=int, default=None, metavar="N",
                   help=f"nodes verified per round (default {d.total_tokens}; implies --tree)")


PROPOSER_HELP = ("who drafts: eagle (the head), suffix (continuations of earlier matches in the "
                 "prompt and output: no head needed, works with --draft none), hybrid (both, merged "
                 "in one verified tree); default: hybrid for greedy requests with a head, eagle "
                 "when sampling, plain decoding without a head (docs/suffix.md)")


def add_proposer_arg(p: argparse.ArgumentParser) -> None:
    from ..decoding.proposers import PROPOSERS

    p.add_argument("--proposer", default=None, choices=PROPOSERS, help=PROPOSER_HELP)


def decoding_kwargs(args: argparse.Namespace, sampling: bool = True) -> dict:
    """generate()'s keyword arguments from the command line (--tree-* imply --tree); without
    `sampling`, only the tree."""
    tree = None
    custom = {key: getattr(args, f"tree_{key}") for key in ("top_k", "depth", "total_tokens")
              if getattr(args, f"tree_{key}") is not None}
    if args.chain and custom:
        raise Eagle3Error("--chain contradicts --tree-top-k/--tree-depth/--tree-total-tokens; "
                          "drop one")
    if args.tree or custom:
        tree = custom or True
    if not sampling:
        return {"tree": tree}
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                num_draft_tokens=args.num_draft_tokens, tree=tree, stop_token_ids=args.stop_ids,
                proposer=getattr(args, "proposer", None))
