"""What a verify forward costs per row on this CPU, and whether a tree's mask adds to it: the
default target (`eagle3.load("default")`, its GGUF's codes as the command line runs them) after a
100-token prompt, one forward of T new rows with the causal mask of a chain and with the
ancestor mask of a 3-ary tree (positions by depth), medians of 30.

    python recipes/verify_rows.py [--rows 1,3,5,8,9,13,16] [--json docs/bench/verify-rows.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import eagle3

PROMPT = 100


def tree_args(T: int) -> dict:
    """The (T, PROMPT+T) ancestor mask and the rope positions of a 3-ary tree's first T nodes
    (node i's parent is (i-1)//3), as a tree verify passes them."""
    mask = torch.zeros(T, PROMPT + T, dtype=torch.bool)
    mask[:, :PROMPT] = True
    depth = [0] * T
    for i in range(T):
        j = i
        mask[i, PROMPT + i] = True
        while j > 0:
            j = (j - 1) // 3
            mask[i, PROMPT + j] = True
            depth[i] += 1
    return {"attn_mask": mask, "rope_pos": torch.tensor([PROMPT + d for d in depth])}


def median_ms(target, cache, T: int, tree: bool, reps: int = 30) -> float:
    tokens = torch.randint(0, 40000, (1, T), generator=torch.Generator().manual_seed(T))
    kw = tree_args(T) if tree else {}
    times = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.perf_counter()
            target.forward_logits_taps(tokens, torch.arange(PROMPT, PROMPT + T), cache,
                                       kv_len=PROMPT + T, **kw)
            times.append(time.perf_counter() - t0)
    return round(sorted(times)[reps // 2] * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,3,5,8,9,13,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = eagle3.load("default", calibrate=False).target
    cache = target.new_cache(1, 512)
    prompt = torch.randint(0, 40000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        target.forward_logits_taps(prompt, torch.arange(PROMPT), cache, kv_len=PROMPT, prefill=True)
    rows = [{"rows": T, "causal_ms": median_ms(target, cache, T, False),
             "tree_mask_ms": median_ms(target, cache, T, True)} for T in map(int, args.rows.split(","))]
    out = {"threads": args.threads, "prompt_tokens": PROMPT, "rows": rows}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
