"""The `eagle3` command line. Every verb has `--help`; user mistakes exit 2 with one line."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import Eagle3Error

DEFAULT_PROMPT = "def parse_args(argv):"


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default",
                   help="target checkpoint directory (Hugging Face layout) or 'default' (the "
                        "embedded model; default)")
    p.add_argument("--backend", default="auto", choices=("auto", "native", "hf"),
                   help="native PyTorch target, the transformers adapter, or auto (native when "
                        "the architecture is supported)")
    p.add_argument("--dtype", default=None, help="compute dtype: float32 (default), bfloat16, float16")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache size in tokens (default: min(max_position_embeddings, 4096))")


def cmd_generate(args: argparse.Namespace) -> int:
    import eagle3

    spec = eagle3.load(args.target, args.draft, dtype=args.dtype, backend=args.backend,
                       max_seq_len=args.max_seq_len, taps=args.taps)
    tok = spec.tokenizer
    if args.prompt_ids is not None:
        if args.prompt is not None:
            raise Eagle3Error("give either a PROMPT or --prompt-ids, not both")
        ids = args.prompt_ids
    else:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
        if tok is None:
            raise Eagle3Error(f"target {args.target} ships no tokenizer.json, so a text prompt cannot "
                              "be encoded; pass --prompt-ids 1,2,3")
        ids = tok.encode(text)
    tree = True if args.tree else None
    result = spec.generate(ids, args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                           num_draft_tokens=args.num_draft_tokens, tree=tree,
                           stop_token_ids=args.stop_ids)
    stats = dict(result.stats)
    n = len(result.token_ids)
    stats["tokens_per_s"] = n / stats["seconds"] if stats["seconds"] > 0 else 0.0
    text = tok.decode(result.token_ids) if tok is not None else ""
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": text, "stats": stats}))
        return 0
    print(text if tok is not None else ",".join(map(str, result.token_ids)))
    if not args.quiet:
        print(f"eagle3: {n} new tokens in {stats['seconds']:.2f}s ({stats['tokens_per_s']:.1f} tok/s), "
              f"{stats['target_forwards']} target forwards, tau {stats['mean_accept_len']:.2f}",
              file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .draft import convert_head

    src_fmt = convert_head(args.src, args.dst, args.to)
    print(f"converted {args.src} ({src_fmt}) -> {args.dst} ({args.to})")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import inspect_path

    info = inspect_path(args.path)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for k, v in info.items():
            print(f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3", description="Lossless EAGLE-3 speculative decoding: generate exactly the "
        "tokens the target model would generate alone, faster.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a completion (plain or speculative)",
                       description="Generate a completion. Greedy output is token-identical to "
                       "plain decoding with the target alone.")
    g.add_argument("prompt", nargs="?", default=None,
                   help=f"prompt text (needs the target's tokenizer; default '{DEFAULT_PROMPT}')")
    g.add_argument("--prompt-ids", type=_int_list, default=None, metavar="1,2,3",
                   help="prompt as comma-separated token ids instead of text")
    _add_target_args(g)
    g.add_argument("--draft", default=None,
                   help="EAGLE-3 head directory, or 'none' for plain decoding (default: the default "
                        "head for --target default, else none)")
    g.add_argument("--taps", type=_int_list, default=None, metavar="2,16,29",
                   help="target layers feeding the head (default: the head config's ids, else "
                        "2,L//2,L-3); tap k = hidden state entering layer k")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help="draft tokens per round (chain drafting)")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--tree", action="store_true", help="dynamic tree drafting")
    shape.add_argument("--chain", action="store_true", help="chain drafting (default)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--stop-ids", type=_int_list, default=None, metavar="1,2",
                   help="stop after any of these token ids (default: the target's EOS ids)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object {token_ids, text, stats} instead of text")
    g.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("inspect", help="describe a target checkpoint or an EAGLE-3 head",
                       description="Describe a checkpoint directory. Targets: architecture, sizes, "
                       "default taps, maximum length. EAGLE-3 heads: format, sizes, vocabulary, "
                       "taps, whether an embedding ships.")
    i.add_argument("path", help="target checkpoint or EAGLE-3 head directory")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=cmd_inspect)

    c = sub.add_parser("convert", help="convert an EAGLE-3 head between formats",
                       description="Convert an EAGLE-3 head between the official EAGLE release, "
                       "SGLang and vLLM speculators formats (auto-detected source, tensor-for-tensor "
                       "lossless). Tap ids are copied verbatim.")
    c.add_argument("src", help="source head directory")
    c.add_argument("dst", help="destination directory (created)")
    c.add_argument("--to", required=True, choices=("official", "sglang", "speculators"),
                   help="target format")
    c.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except Eagle3Error as e:
        print(f"eagle3: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eagle3: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
