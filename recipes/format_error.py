"""Each weight format's error against float32 on the default target, measured on held-out prompts.

    .venv/bin/python recipes/format_error.py [N_PROMPTS] [NEW_TOKENS] [FORMATS] > docs/bench/format-error.json

The float32 target decodes each prompt greedily; every format then reads the same tokens
(prompt, then the continuation 9 tokens per call: the verify path, whose rows equal 1-token
decode rows bitwise) and its logits at the continuation's positions are compared with
float32's: max / mean absolute error, and how often its argmax agrees (greedy agreement).
FORMATS: comma-separated `quantize` values (default bf16,int8,int4,gguf), each optionally with
the KV cache's dtype: `gguf@kv=float32`, `fp32@kv=bfloat16` (default: the target's own).
"""

from __future__ import annotations

import json
import sys

import torch

import eagle3
from eagle3.bench.prompts import prompt_set
from eagle3.train.data import prompt_from_record

CHUNK = 9


@torch.no_grad()
def continuation_logits(t, ids: list[int], cont: list[int]) -> torch.Tensor:
    """(len(cont), V) logits predicting cont[1:] and the token after it, prompt read first."""
    cache = t.new_cache(1, len(ids) + len(cont))
    P = len(ids)
    t(torch.tensor([ids]), torch.arange(P), cache, kv_len=P)
    out = []
    for s in range(0, len(cont), CHUNK):
        chunk = cont[s:s + CHUNK]
        logits, _ = t(torch.tensor([chunk]), torch.arange(P + s, P + s + len(chunk)), cache,
                      kv_len=P + s + len(chunk))
        out.append(logits[0].float())
    return torch.cat(out)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    formats = (sys.argv[3] if len(sys.argv) > 3 else "bf16,int8,int4,gguf").split(",")
    torch.set_num_threads(2)
    ref = eagle3.load("default", "none", quantize="fp32")
    tok = ref.tokenizer
    cases = []
    for where, rec in prompt_set("sharegpt-heldout", n):
        ids = prompt_from_record(rec, tok, where)
        cont = ref.generate(ids, new, stop_token_ids=[]).token_ids
        cases.append((ids, cont, continuation_logits(ref.target, ids, cont)))
    mean_abs_logit = sum(float(w.abs().mean()) for *_, w in cases) / len(cases)
    out = {"prompts": n, "new_tokens": new, "reference": "fp32", "mean_abs_logit": round(mean_abs_logit, 3),
           "formats": {}}
    for fmt in formats:
        quantize, _, kv = fmt.partition("@kv=")
        t = eagle3.load("default", "none", quantize=quantize).target
        if kv:
            t.kv_dtype = getattr(torch, kv)
        err_max, err_sum, agree, total = 0.0, 0.0, 0, 0
        for ids, cont, want in cases:
            got = continuation_logits(t, ids, cont)
            d = (got - want).abs()
            err_max, err_sum = max(err_max, float(d.max())), err_sum + float(d.mean()) * d.shape[0]
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += d.shape[0]
        out["formats"][fmt] = {"weight_format": t.weight_format,
                               "kv_dtype": str(t.new_cache(1, 1).k[0].dtype).removeprefix("torch."),
                               "max_abs_error": round(err_max, 4),
                               "mean_abs_error": round(err_sum / total, 5),
                               "greedy_agreement": round(agree / total, 4), "positions": total}
        print(f"{fmt}: {out['formats'][fmt]}", file=sys.stderr, flush=True)
        del t
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
