"""`eagle3 convert`: convert an EAGLE-3 head between formats."""

from __future__ import annotations

import argparse


def cmd_convert(args: argparse.Namespace) -> int:
    from ..draft import convert_head
    from ..errors import Eagle3Error

    if args.to == "gguf":
        from ..draft.llamacpp import head_to_gguf

        if args.target is None:
            raise Eagle3Error("--to gguf needs --target (the head's target: its vocabulary and "
                              "layer count go into the file)")
        head_to_gguf(args.src, args.dst, args.target)
        print(f"converted {args.src} -> {args.dst} (llama.cpp GGUF, for {args.target})")
        return 0
    if args.target is not None:
        raise Eagle3Error("--target applies to --to gguf only; drop it")
    src_fmt = convert_head(args.src, args.dst, args.to)
    print(f"converted {args.src} ({src_fmt}) -> {args.dst} ({args.to})")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("convert", help="convert an EAGLE-3 head between formats",
                       description="Convert an EAGLE-3 head between the official EAGLE release, "
                       "SGLang and vLLM speculators formats (auto-detected source, tensor-for-tensor "
                       "lossless), or into llama.cpp's GGUF (--to gguf --target T, written by "
                       "llama.cpp's own convert_hf_to_gguf.py from the sources `make llama.cpp` "
                       "unpacks; run it with llama-speculative-simple -md). Tap ids are copied "
                       "verbatim.")
    c.add_argument("src", help="source head directory")
    c.add_argument("dst", help="destination directory (created), or a .gguf file for --to gguf")
    c.add_argument("--to", required=True, choices=("official", "sglang", "speculators", "gguf"),
                   help="target format")
    c.add_argument("--target", default=None,
                   help="with --to gguf: the head's target (checkpoint directory, .gguf file, model "
                        "name or 'default'), whose vocabulary and layer count llama.cpp checks")
    c.set_defaults(func=cmd_convert)
