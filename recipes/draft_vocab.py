"""Choosing the draft vocabulary by measurement: coverage and the draft step's cost per size.

For each draft vocabulary size (default 8k, 16k, 32k and the whole vocabulary): the vocabulary
`train-draft` would build from the campaign's regenerated responses (the most frequent response
tokens), its coverage of the target's own greedy answers to held-out prompts (the share of
answer tokens the head can draft at all: an upper bound on first-position acceptance), and the
time of one draft step (`Eagle3Speculator.draft_decode`, one token at position ~300, the
default's target, a head of that size with random weights: the cost does not depend on them),
against a plain target decode step. Timed interleaved, median of --reps.

    python recipes/draft_vocab.py [--sizes 8192,16384,32768,49152] [--json docs/bench/draft-vocab.json]

Needs the campaign's chunks (`recipes/campaign.py regen`) and caches the held-out answers in
out/campaign/eval (shared with the campaign's evaluation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def answers(prompt_set: str, limit: int, cache: Path) -> torch.Tensor:
    """The default target's greedy answer tokens (128 new tokens) to `limit` prompts of a set."""
    from eagle3.bench.prompts import read_prompt_records
    from eagle3.targets import load_target
    from eagle3.targets.tokenizer import load_tokenizer
    from eagle3.train.data import prompt_from_record, regenerate

    target, tok = load_target("default"), load_tokenizer("default")
    ids = [prompt_from_record(rec, tok, where) for where, rec in read_prompt_records(prompt_set, limit)]
    cache.mkdir(parents=True, exist_ok=True)
    samples = regenerate(target, ids, response_len=128, eos_ids=target.config.eos_token_ids, batch_size=16,
                         chunk_dir=str(cache), key=json.dumps(["default", 128]), progress=False)
    return torch.cat([s.tokens[s.mask] for s in samples])


def step_times(sizes: list[int], reps: int) -> dict[str, float]:
    """Median ms of one draft step per size, and of one plain target decode step."""
    import eagle3
    from eagle3.draft.formats import load_head, save_head
    from eagle3.targets.default import default_head_dir

    _, base = load_head(default_head_dir())
    specs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dv in sizes:
            cfg = dataclasses.replace(base.config, draft_vocab_size=dv)
            head = type(base)(cfg, max_len=2048, with_embedding=False)
            torch.manual_seed(0)
            for p in head.parameters():
                torch.nn.init.normal_(p, std=0.02)
            head.d2t.zero_()
            head.t2d.zero_()
            head.t2d[:dv] = True
            save_head(head.to(torch.bfloat16), f"{tmp}/{dv}", "official")
            specs[dv] = eagle3.load("default", f"{tmp}/{dv}")
    T = 300
    pos = T - 1  # the draft cache holds slots 0..T-2 after seeding; each step writes slot T-1
    times: dict = {dv: [] for dv in sizes} | {"target": []}
    ref = specs[sizes[0]]
    prompt = torch.randint(0, 40000, (1, T), generator=torch.Generator().manual_seed(0))
    for spec in specs.values():
        _, feat = spec.prefill(prompt, torch.arange(T), kv_len=T)
        spec.draft_decode(prompt[:, 1:], feat[:, :-1], torch.arange(T - 1), kv_len=T - 1)
    tok, f1 = prompt[:, -1:], None
    for _ in range(reps):
        for dv, spec in specs.items():
            f1 = torch.zeros(1, 1, spec.draft.config.hidden_size)  # a step reads the last hidden state
            spec.draft_cache.truncate(pos)  # rewind: every rep times the same step
            t0 = time.perf_counter()
            spec.draft_decode(tok, f1, torch.tensor([pos]), kv_len=pos + 1)
            times[dv].append(time.perf_counter() - t0)
        ref.target_cache.truncate(T)
        t0 = time.perf_counter()
        ref.decode(tok, torch.tensor([T]), kv_len=T + 1)
        times["target"].append(time.perf_counter() - t0)
    return {str(k): round(1000 * statistics.median(v), 3) for k, v in times.items()}


def main() -> int:
    from eagle3.kernels import cpu_name
    from eagle3.train.data import load_regenerated
    from eagle3.train.vocab import build_draft_vocab

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8192,16384,32768,49152")
    ap.add_argument("--data", default=str(ROOT / "models/default/campaign/data"))
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    sizes = [int(x) for x in args.sizes.split(",")]
    samples = load_regenerated(args.data)
    tokens = torch.cat([s.tokens for s in samples])
    mask = torch.cat([s.mask for s in samples])
    sets = {"sharegpt-heldout": answers("sharegpt-heldout", args.limit, ROOT / "out/campaign/eval"),
            "humaneval": answers("humaneval", args.limit, ROOT / "out/campaign/eval-humaneval")}
    out = {"training_response_tokens": int(mask.sum()), "samples": len(samples), "coverage": {}}
    for dv in sizes:
        _, _, t2d = build_draft_vocab(tokens, mask, 49152, dv)
        out["coverage"][str(dv)] = {name: round(float(t2d[a].float().mean()), 4) for name, a in sets.items()}
    out["step_ms"] = step_times(sizes, args.reps)
    out["machine"] = cpu_name()
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
