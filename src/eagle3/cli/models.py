"""`eagle3 models`: the model names eagle3 knows and whether they are installed."""

from __future__ import annotations

import argparse
import json


def cmd_models(args: argparse.Namespace) -> int:
    from ..targets.named import describe_models

    rows = describe_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        state = "installed" if r["installed"] else f"not installed ({r['install']})"
        print(f"{r['name']:<24} {state}")
        print(f"{'':<24} weights: {r['source']}; licence: {r['license']}; "
              f"chat template: {'yes' if r['chat'] else 'no (base model)'}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("models", help="list the models eagle3 knows by name",
                       description="The registered model names (--target NAME), where their weights "
                       "come from (pip packages that carry GGUF files; nothing is downloaded at run "
                       "time), their licences and whether they are installed here.")
    m.add_argument("--json", action="store_true", help="print JSON")
    m.set_defaults(func=cmd_models)
