"""What drafts from the text itself would add, measured before building on it (docs/suffix.md).

On the target's greedy answers to a prompt set (the default's outputs: speculation is
lossless) this walks each answer round by round as `generate` would, with

    head      the head's greedy chain of K drafts (its run of right drafts from the
              training-time-test unroll, `train.simulate.chain_runs`)
    suffix    the continuation of the longest earlier match (>= m tokens) of prompt + output
              so far (`decoding.suffix.SuffixIndex`), D drafts
    hybrid    both in one tree: the round accepts the longer of the two runs

and reports tokens per round (tau) for each, the extra tokens per round the suffix adds on top
of the head, and, per match length, how often a match exists and how many of its tokens the
target accepts (the prior `decoding.suffix.PRIOR_GAIN` and the thresholds come from here).

    python recipes/suffix_gain.py [--prompts sharegpt-heldout humaneval rewrite] [--limit 64]
        [--k 4] [--d 8] [--json docs/bench/suffix-gain.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CACHES = {"sharegpt-heldout": "out/campaign/eval", "humaneval": "out/campaign/eval-humaneval"}


def samples_for(name: str, limit: int, target, tok, max_new: int):
    from eagle3.bench.prompts import read_prompt_records
    from eagle3.train.data import prompt_from_record, regenerate

    cache = ROOT / CACHES.get(name, f"out/suffix/eval-{Path(name).stem}")
    os.makedirs(cache, exist_ok=True)
    ids = [prompt_from_record(rec, tok, where) for where, rec in read_prompt_records(name, limit)]
    return regenerate(target, ids, response_len=max_new, chunk_dir=str(cache),
                      key=json.dumps(["default", max_new]), eos_ids=target.config.eos_token_ids,
                      batch_size=16, progress=True)


def walk(text: list[int], start: int, head_runs: list[int] | None, k: int, d: int, min_match: int,
         mode: str, per_len: dict) -> tuple[int, int, int]:
    """One answer (text[start:]) round by round: (rounds, tokens after the first, extra tokens
    the suffix gave beyond the head's run). head_runs[a]: the head's right drafts after anchor a."""
    from eagle3.decoding.suffix import SuffixIndex

    index = SuffixIndex(text[:start + 1])
    a, rounds, extra = start, 0, 0  # a: the anchor (emitted, not yet verified)
    end = len(text) - 1
    while a < end:
        left = end - a
        h = min(head_runs[a], k, left) if mode != "suffix" else 0
        s = 0
        if mode != "eagle":
            length, at = index.match(min_match)
            if length:
                cont = index.continuation(at, min(d, left))
                while s < len(cont) and cont[s] == text[a + 1 + s]:
                    s += 1
                row = per_len.setdefault(min(length, 8), [0, 0, 0, [0] * (d + 1), [0] * (d + 1)])
                row[0] += 1
                row[1] += s
                row[2] += max(0, s - h)
                row[3][s] += 1  # the run's histogram: what fewer nodes would have accepted
                row[4][max(0, s - h)] += 1
        acc = max(h, s)
        extra += acc - h
        step = min(acc + 1, left)
        index.extend(text[a + 1:a + 1 + step])
        a += step
        rounds += 1
    return rounds, len(text) - 1 - start, extra


def main(argv: list[str] | None = None) -> int:
    from eagle3.draft import attach_head, load_head
    from eagle3.targets import load_target
    from eagle3.targets.default import default_head_dir
    from eagle3.targets.tokenizer import load_tokenizer
    from eagle3.train.data import collate
    from eagle3.train.simulate import chain_runs
    from eagle3.train.trainer import target_forward

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", nargs="+", default=["sharegpt-heldout", "humaneval", "rewrite"])
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="the head's chain length")
    ap.add_argument("--d", type=int, default=8, help="suffix drafts per round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    target = load_target("default")
    _, head = load_head(default_head_dir(), max_len=target.config.max_seq_len)
    attach_head(head, target)
    tok = load_tokenizer("default")
    report = {"k": args.k, "d": args.d, "max_new_tokens": args.max_new_tokens, "sets": {}}
    for name in args.prompts:
        samples = samples_for(name, args.limit, target, tok, args.max_new_tokens)
        runs_all = []
        with torch.no_grad():
            for i in range(0, len(samples), 8):
                batch = samples[i:i + 8]
                tokens, mask = collate(batch)
                _, taps = target_forward(target, tokens)
                runs, _ = chain_runs(head, tokens, mask, taps, args.k)
                runs_all += [r.tolist() for r in runs]
        texts = [(s.tokens.tolist(), int(s.mask.nonzero()[0]) - 1 if s.mask.any() else None)
                 for s in samples]  # the answer's first token (prefill's) sits at start + 1
        rows = {}
        for mode in ("eagle", "suffix", "hybrid"):
            for m in ((1, 2, 3, 4) if mode != "eagle" else (0,)):
                per_len: dict = {}
                R = N = E = 0
                for (text, s0), runs in zip(texts, runs_all, strict=True):
                    if s0 is None or s0 + 2 >= len(text):
                        continue
                    # runs[t]: drafts after anchor x_{t+1}; so after anchor a: runs[a - 1]
                    head_runs = [0] + runs[:len(text) - 1]
                    r, n, e = walk(text, s0 + 1, head_runs, args.k, args.d, m, mode, per_len)
                    R, N, E = R + r, N + n, E + e
                key = mode if mode == "eagle" else f"{mode} m>={m}"
                rows[key] = {"tau": round(N / R, 3), "rounds": R, "extra_per_round": round(E / R, 3)}
                if mode != "eagle":  # per match length (8 = 8 or more)
                    rows[key]["by_match_len"] = {
                        str(n): {"share_of_rounds": round(v[0] / R, 4),
                                 "accepted_per_proposal": round(v[1] / v[0], 3),
                                 "extra_per_proposal": round(v[2] / v[0], 3),
                                 "run_hist": v[3], "extra_hist": v[4]} for n, v in sorted(per_len.items())}
                print(name, key, json.dumps(rows[key]), flush=True)
        report["sets"][name] = {"samples": len(samples), "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
