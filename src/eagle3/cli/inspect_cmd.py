"""`eagle3 inspect`: describe a target or a head."""

from __future__ import annotations

import argparse
import json


def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspection import inspect_path

    info = inspect_path(args.path)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for k, v in info.items():
            print(f"{k:<{width}}  {v}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    i = sub.add_parser("inspect", help="describe a target (directory, .gguf, model name) or a head",
                       description="Describe a target or head. Targets (checkpoint directory, .gguf "
                       "file or model name): architecture, sizes, default taps, maximum length; GGUF "
                       "files also their quantization types and tokenizer. EAGLE-3 heads: format, "
                       "sizes, vocabulary, taps, whether an embedding ships.")
    i.add_argument("path", help="target checkpoint directory, .gguf file, model name, or EAGLE-3 head "
                                "directory")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=cmd_inspect)
