"""The `eagle3` command line: one module per verb, shared argument helpers in `args`.

(`eagle3 inspect` lives in `inspect_cmd`, so that no module is named like the standard library's.)

Every verb has `--help`; user mistakes exit 2 with one line (`eagle3: error: ...`).
"""

from __future__ import annotations

import argparse
import sys

from ..errors import Eagle3Error
from . import bench, chat, convert, export, generate, inspect_cmd, models, serve, train

VERBS = (generate, chat, models, inspect_cmd, convert, train, export, serve, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3", description="Lossless EAGLE-3 speculative decoding: generate exactly the "
        "tokens the target model would generate alone, faster.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for verb in VERBS:
        verb.add_parser(sub)
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


__all__ = ["build_parser", "main"]
