"""`eagle3 convert`: convert an EAGLE-3 head between formats."""

from __future__ import annotations

import argparse


def cmd_convert(args: argparse.Namespace) -> int:
    from ..draft import convert_head

    src_fmt = convert_head(args.src, args.dst, args.to)
    print(f"converted {args.src} ({src_fmt}) -> {args.dst} ({args.to})")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("convert", help="convert an EAGLE-3 head between formats",
                       description="Convert an EAGLE-3 head between the official EAGLE release, "
                       "SGLang and vLLM speculators formats (auto-detected source, tensor-for-tensor "
                       "lossless). Tap ids are copied verbatim.")
    c.add_argument("src", help="source head directory")
    c.add_argument("dst", help="destination directory (created)")
    c.add_argument("--to", required=True, choices=("official", "sglang", "speculators"),
                   help="target format")
    c.set_defaults(func=cmd_convert)
