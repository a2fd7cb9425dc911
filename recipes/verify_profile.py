"""Where a round's time goes: `torch.profiler` over real decoding of the default target and head
(its GGUF's codes, eager, batch 1, greedy) on held-out chat prompts, per target forward, for plain
decoding, chains and the default tree, with the wall time no profiled op covers (host Python).

    python recipes/verify_profile.py [--prompts 3] [--tokens 128] [--threads 2]
                                     [--json docs/bench/verify-profile-<cpu>.json]

Per mode: rounds (= target forwards after the prefill), wall ms per round, and for each op (the
eagle3 kernels, `aten::*` glue) its total ms per round and calls per round; `host` = wall minus
the top-level ops' time. The `eagle3::decoder_layer` and `eagle3::wlinear` rows say how the
target's own kernels scale with the rows a verify carries (the head's linears are `wlinear` too:
a draft step's own are counted under "draft" only in `eagle3 bench`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import eagle3
from eagle3.bench.prompts import encode_prompts, prompt_set
from eagle3.kernels import cpu_name, isa

MODES = {"plain": {}, "K=2": {"num_draft_tokens": 2},
         "K=4": {"num_draft_tokens": 4}, "tree 3x6x12": {"tree": True}}


def run(spec, prompts: list[list[int]], tokens: int, kw: dict) -> tuple[float, int]:
    start, rounds = time.perf_counter(), 0
    for ids in prompts:
        r = spec.generate(ids, tokens, **({"proposer": "eagle", **kw} if kw else {}))
        rounds += r.stats["target_forwards"] - 1
    return time.perf_counter() - start, rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec, plain = eagle3.load("default"), eagle3.load("default", "none")
    prompts = encode_prompts(prompt_set("sharegpt-heldout", args.prompts), spec, args.tokens)
    out = {"cpu": cpu_name(), "isa": isa(), "threads": args.threads, "prompts": args.prompts,
           "tokens": args.tokens, "modes": {}}
    for name, kw in MODES.items():
        s = spec if kw else plain
        run(s, prompts[:1], 16, kw)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall, rounds = run(s, prompts, args.tokens, kw)
        ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        top = 0.0
        for e in prof.events():
            if e.cpu_parent is None and e.name.startswith(("eagle3::", "aten::")):
                top += e.cpu_time_total
            if e.name.startswith(("eagle3::", "aten::")):
                ops[e.name][0] += e.self_cpu_time_total
                ops[e.name][1] += 1
        per = {k: {"ms_per_round": v[0] / 1e3 / rounds, "calls_per_round": v[1] / rounds}
               for k, v in sorted(ops.items(), key=lambda kv: -kv[1][0]) if v[0] / 1e3 / rounds >= 0.005}
        out["modes"][name] = {"rounds": rounds, "wall_ms_per_round": wall * 1e3 / rounds,
                              "ops_ms_per_round": top / 1e3 / rounds,
                              "host_ms_per_round": (wall * 1e6 - top) / 1e3 / rounds, "self_ms": per}
        m = out["modes"][name]
        print(f"{name}: {rounds} rounds, wall {m['wall_ms_per_round']:.2f} ms/round, ops "
              f"{m['ops_ms_per_round']:.2f}, host {m['host_ms_per_round']:.2f}")
        for k, v in list(per.items())[:10]:
            print(f"   {k:40s} {v['ms_per_round']:7.3f} ms  {v['calls_per_round']:6.1f} calls")
    text = json.dumps(out, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
