"""Where a training step of the campaign goes: the target's forward (online features), the
TTT unroll's forward and backward, the optimizer, timed on the campaign's own batches (the
campaign's head, batch 8, 4 TTT steps, bf16 autocast, as `campaign.py train` runs them), and
the share of rows that carry loss at each TTT step.

    python recipes/train_step_profile.py --steps 6 [--json docs/bench/train-step.json]
        [--target-dtype float32] [--no-autocast]   # the alternatives, for CPUs without AMX
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from eagle3.draft import attach_head  # noqa: E402
from eagle3.draft.formats import load_head  # noqa: E402
from eagle3.targets import load_target  # noqa: E402
from eagle3.train.data import collate, load_regenerated  # noqa: E402
from eagle3.train.trainer import epoch_batches, target_forward  # noqa: E402
from eagle3.train.ttt import ttt_loss  # noqa: E402

CAMPAIGN = ROOT / "models" / "default" / "campaign"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="batches timed (after one warm-up batch)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--target-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the target's weights for the features (the campaign: bfloat16)")
    ap.add_argument("--no-autocast", action="store_true",
                    help="the head's forward and backward in float32 (the campaign: bf16 autocast)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    samples = load_regenerated(str(CAMPAIGN / "data"))
    longest = max(s.tokens.numel() for s in samples)  # the campaign's turns run to 1,024 + 160
    target = load_target("smollm2-135m-instruct", dtype=args.target_dtype, max_seq_len=longest)
    _, head = load_head(str(CAMPAIGN / "head"))
    head = head.float()
    head.embed_tokens = torch.nn.Embedding.from_pretrained(target.embedding_weight.float(), freeze=True)
    attach_head(head, target)
    params = [p.requires_grad_(True) for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=1e-5)
    batches = epoch_batches([s.tokens.numel() for s in samples], 8, len(samples) // 8, 0)
    parts = {"target_forward": 0.0, "ttt_forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    tokens_total = 0
    loss_share = torch.zeros(4)
    for n, idx in enumerate(batches[:args.steps + 1]):
        tokens, mask = collate([samples[i] for i in idx])
        marks = [time.perf_counter()]
        tlogits, taps = target_forward(target, tokens, head.vocab_ids())
        marks.append(time.perf_counter())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_autocast):
            loss = ttt_loss(head, tokens, mask, taps, tlogits, steps=4)[0]
        marks.append(time.perf_counter())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        marks.append(time.perf_counter())
        opt.step()
        marks.append(time.perf_counter())
        if n == 0:
            continue  # warm-up
        for k, a, b in zip(parts, marks, marks[1:]):
            parts[k] += b - a
        tokens_total += int(mask.sum())
        T = tokens.shape[1]
        for i in range(4):  # step i of row t predicts token t+2+i
            loss_share[i] += mask[:, 2 + i:].sum() / (mask.shape[0] * (T - 1))
    step_s = sum(parts.values()) / args.steps
    out = {"threads": args.threads, "batches": args.steps, "batch": 8,
           "target_dtype": args.target_dtype, "autocast": not args.no_autocast,
           "step_s": round(step_s, 3),
           "parts_s": {k: round(v / args.steps, 3) for k, v in parts.items()},
           "loss_tokens_per_s": round(tokens_total / sum(parts.values()), 1),
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
           "rows_with_loss_share_per_ttt_step": [round(x, 3) for x in (loss_share / args.steps).tolist()]}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
