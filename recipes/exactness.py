"""Issue 17's exactness study: speculative vs plain decoding on held-out prompts, per weight
format, counting the outputs that differ and the first position where they do.

    .venv/bin/python recipes/exactness.py [N_PROMPTS] [NEW_TOKENS] [FORMATS] > docs/bench/exactness.json

FORMATS: comma-separated `quantize` values (default none,fp32,int4,gguf; none = stock PyTorch
layers and SDPA, the path before the row-invariant kernels).
"""

from __future__ import annotations

import json
import sys
import time

import torch

import eagle3
from eagle3.bench.prompts import prompt_set


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    formats = (sys.argv[3] if len(sys.argv) > 3 else "none,fp32,int4,gguf").split(",")
    torch.set_num_threads(2)
    out = {"prompts": n, "max_new_tokens": new, "formats": {}}
    for fmt in formats:
        spec = eagle3.load("default", quantize=fmt)
        plain = spec.plain()
        records = prompt_set("sharegpt-heldout", n)
        differ, first, tokens, t0 = 0, [], 0, time.time()
        for _, rec in records:
            ids = spec.tokenizer.apply_chat_template(rec["messages"])
            a = plain.generate(ids, new).token_ids
            b = spec.generate(ids, new, num_draft_tokens=3).token_ids
            tokens += len(a)
            if a != b:
                differ += 1
                first.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
        out["formats"][fmt] = {"outputs_differ": differ, "first_difference_at": first,
                               "plain_tokens": tokens, "seconds": round(time.time() - t0, 1),
                               "exact_kernels": bool(getattr(spec.target, "exact", False))}
        print(f"{fmt}: {differ}/{n} outputs differ", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
