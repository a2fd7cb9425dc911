"""The head's weight format on the default's GGUF target: int4 (what `quantize="gguf"` gives the
head, `kernels.prepare_target`) against int8 and float32, the head alone, greedy chains of K = 2
and 3, on each prompt set (issue 64: the best tau per millisecond of drafting is the default).

    python recipes/head_format_speed.py [--sets sharegpt-heldout,humaneval] [--limit 24]
        [--formats int4,int8,float32] [--max-new-tokens 128] [--repeats 3]
        [--head models/default/head] [--json docs/bench/head-format-gguf.json]

One process per run: on each set, plain decoding and the arms take turns on each prompt,
`--repeats` times; tokens/s are medians over the repeats, tau and the head's drafting
milliseconds per drafted token (catch-up included, `decoding.profile`) counted over the first
repeat, and every greedy output is compared with plain decoding's. `eagle3.load` has no knob for
the head's format alone (it follows the target's), so each arm swaps the format the loader asks
for while it builds that one speculator.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import eagle3  # noqa: E402
import eagle3.kernels.steps as steps  # noqa: E402
from eagle3.bench.prompts import read_prompt_records  # noqa: E402
from eagle3.decoding.profile import profiling  # noqa: E402
from eagle3.targets.tokenizer import load_tokenizer  # noqa: E402
from eagle3.train.data import prompt_from_record  # noqa: E402


def load(head: str, head_format: str):
    """The default target with its GGUF codes and `head` in `head_format`."""
    quantize_model = steps.quantize_model

    def head_in(model, fmt, group=None, layer=None):
        if fmt == "int4" and layer is None and hasattr(model, "midlayer"):  # the head's call
            return quantize_model(model, head_format, None)
        return quantize_model(model, fmt, group, layer)

    steps.quantize_model = head_in
    try:
        return eagle3.load("default", head, quantize="gguf")
    finally:
        steps.quantize_model = quantize_model


def run_set(name: str, specs: dict, plain, args) -> dict:
    """One prompt set: plain and every (format, K) arm in turn, `args.repeats` times."""
    tok = load_tokenizer("default")
    prompts = [prompt_from_record(rec, tok, where)
               for where, rec in read_prompt_records(name, args.limit)]
    arms = [("plain", None, 0)] + [(f"{fmt} K={k}", fmt, k) for k in (2, 3) for fmt in specs]
    rates = {arm: [] for arm, _, _ in arms}
    counts = {arm: [0, 0, 0, 0.0] for arm, _, _ in arms}  # rounds, accepted, drafted, draft seconds
    reference, identical = {}, True
    for rep in range(args.repeats):
        for arm, fmt, k in arms:
            t0, tokens = time.perf_counter(), 0
            for i, p in enumerate(prompts):
                with profiling() as prof:
                    r = (specs[fmt].generate(p, args.max_new_tokens, proposer="eagle", num_draft_tokens=k)
                         if k else plain.generate(p, args.max_new_tokens))
                tokens += len(r.token_ids)
                if not k:
                    reference[i] = r.token_ids
                    continue
                identical &= r.token_ids == reference[i]
                if rep == 0:
                    c = counts[arm]
                    c[0] += r.stats["rounds"]
                    c[1] += r.stats["accepted_tokens"]
                    c[2] += r.stats["draft_tokens"]
                    c[3] += prof.draft_seconds
            rates[arm].append(tokens / (time.perf_counter() - t0))
            print(f"{name} {arm} repeat {rep}: {rates[arm][-1]:.1f} tok/s", flush=True)
    median = {arm: round(statistics.median(v), 1) for arm, v in rates.items()}
    return {"outputs_identical": identical, "tokens_per_s_median": median,
            "tau": {arm: round(1 + c[1] / c[0], 4) for arm, c in counts.items() if c[0]},
            "draft_ms_per_draft_token": {arm: round(1e3 * c[3] / c[2], 4)
                                         for arm, c in counts.items() if c[2]},
            "speedup": {arm: round(v / median["plain"], 3) for arm, v in median.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="sharegpt-heldout,humaneval")
    ap.add_argument("--formats", default="int4,int8,float32")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--head", default="models/default/head")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    specs = {fmt: load(args.head, fmt) for fmt in args.formats.split(",")}
    plain = eagle3.load("default", "none", quantize="gguf")
    out = {"prompts": args.limit, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
           "head": args.head,
           "sets": {name: run_set(name, specs, plain, args) for name in args.sets.split(",")}}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
