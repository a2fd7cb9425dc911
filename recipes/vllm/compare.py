"""Compare vLLM's outputs (run.py JSON files) with each other and with eagle3's plain greedy
decoding (float32, the default target) on the same prompts (run with eagle3's .venv).

    .venv/bin/python recipes/vllm/compare.py out-plain.json out-eagle3.json ...
"""

import json
import os
import sys

import eagle3

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "build", "vllm")


def main() -> None:
    runs = {p: json.load(open(p)) for p in sys.argv[1:]}
    n = max(len(r["outputs"]) for r in runs.values())
    prompts = json.load(open(os.path.join(ROOT, "prompts.json")))[:n]
    spec = eagle3.load("default", "none")
    ours = [spec.generate(spec.tokenizer.encode(p), 64).token_ids for p in prompts]
    report = {}
    for path, r in runs.items():
        same = sum(a == b for a, b in zip(r["outputs"], ours))
        report[path] = {k: r[k] for k in ("dtype", "mode", "k", "tokens_per_s", "spec_decode")}
        report[path]["equal_to_eagle3_fp32_plain"] = f"{same}/{len(r['outputs'])}"
    plains = {r["dtype"]: r for r in runs.values() if r["mode"] == "plain"}
    for path, r in runs.items():
        if r["mode"] == "eagle3" and r["dtype"] in plains:
            p = plains[r["dtype"]]["outputs"]
            report[path]["equal_to_own_plain"] = f"{sum(a == b for a, b in zip(r['outputs'], p))}/{len(p)}"
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
