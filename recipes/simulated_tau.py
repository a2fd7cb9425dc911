"""Simulated tau of a head on a prompt set, to set beside `eagle3 bench`'s measured tau.

The target answers each prompt greedily (through the engine, as `train-draft` regenerates),
then the head's training-time-test unroll over those answers gives, per depth k, the share
of rows whose first k drafts are all the target's tokens (`eagle3.train.simulate`): what a
greedy chain of K drafts accepts, tau(K) = 1 + the shares up to K. This is the number
`train-draft --eval-every` logs while training; here it runs on any head and prompt set. It
also reports the walked tau (`walked_tau`): the same unroll read round by round, as a greedy
decode of these answers takes them (each round starts after the last one's bonus token), i.e.
the tau `eagle3 bench` measures for a chain of K on the same answers; and the draft
vocabulary's coverage: the share of the answers' tokens the head can draft at all.

    python recipes/simulated_tau.py [--target default] [--head models/default/head]
        [--prompts sharegpt-heldout|humaneval|FILE] [--limit 32] [--max-new-tokens 128]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    import os

    from eagle3.bench.prompts import read_prompt_records
    from eagle3.draft import attach_head, load_head
    from eagle3.targets import load_target
    from eagle3.targets.default import default_head_dir
    from eagle3.targets.tokenizer import load_tokenizer
    from eagle3.train.data import collate, prompt_from_record, regenerate
    from eagle3.train.simulate import chain_runs, depth_hits, simulated_tau, walked_rounds, walked_tau
    from eagle3.train.trainer import target_forward

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--head", default=None, help="head directory (default: the default's head)")
    ap.add_argument("--prompts", default="sharegpt-heldout")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-k", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--cache", default=None,
                    help="keep the target's answers in this directory and reuse them on the next run")
    args = ap.parse_args(argv)
    if args.cache:
        os.makedirs(args.cache, exist_ok=True)

    target = load_target(args.target)
    _, head = load_head(args.head or default_head_dir(), max_len=target.config.max_seq_len)
    attach_head(head, target)
    tok = load_tokenizer(args.target)
    records = read_prompt_records(args.prompts, args.limit)
    ids = [prompt_from_record(rec, tok, where) for where, rec in records]
    key = json.dumps([args.target, args.max_new_tokens])
    samples = regenerate(target, ids, response_len=args.max_new_tokens, chunk_dir=args.cache, key=key,
                         eos_ids=target.config.eos_token_ids, batch_size=16, progress=True)
    hits = rows = torch.zeros(args.max_k)
    walked = torch.zeros(args.max_k, 2, dtype=torch.long)
    with torch.no_grad():
        for i in range(0, len(samples), args.batch):
            tokens, mask = collate(samples[i:i + args.batch])
            _, taps = target_forward(target, tokens)
            runs, room = chain_runs(head, tokens, mask, taps, args.max_k)
            h, r = depth_hits(runs, room, args.max_k)
            hits, rows = hits + h, rows + r
            walked += walked_rounds(runs, mask, args.max_k)
    answers = torch.cat([s.tokens[s.mask] for s in samples])  # the target's response tokens
    out = {"target": args.target, "head": args.head or "default", "prompts": args.prompts,
           "samples": len(samples), "response_tokens": int(answers.numel()),
           # the share of them the head can draft at all (its draft vocabulary)
           "draft_vocab_size": head.config.draft_vocab_size,
           "draft_vocab_coverage": round(float(head.t2d[answers].float().mean()), 4),
           "share_first_k_right": [round(float(h / max(r, 1)), 4) for h, r in zip(hits, rows)],
           "simulated_tau": simulated_tau(hits, rows),
           "walked_tau": walked_tau(walked)}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
