"""Issue 17's exactness study: speculative vs plain decoding on held-out prompts, per weight
format and backend, counting the outputs that differ and the first position where they do.

    .venv/bin/python recipes/exactness.py [N_PROMPTS] [NEW_TOKENS] [ARMS] [OUT_DIR]

ARMS (comma-separated, default gguf,gguf+compile,bf16,int8,int4,fp32):
- a `quantize` value (gguf, int4, int8, bf16, fp32, none): the eager native target. Plain and
  speculative (K=3) decoding both run in the batching engine, 8 requests at a time (the same
  round as `generate`, faster here); for `gguf`, the default, speculative decoding also runs
  through `generate` one request at a time.
- `FORMAT+compile`: `compile=True`, one request at a time, plain against speculative (K=3), and
  the compiled plain outputs against the eager ones of the same format when those were written.
- `program=DIR`: an `eagle3 export` program, one request at a time, plain against K=3.

One JSON per arm lands in OUT_DIR (default docs/bench/exactness); an arm whose file exists is
skipped, so a cut run resumes. `OUT_DIR/summary.json` gathers them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import eagle3
from eagle3.bench.prompts import prompt_set
from eagle3.engine import Engine, EngineConfig

K = 3
BATCH = 8


def chat_ids(tok: Any, rec: dict) -> list[int]:
    """The conversation through the chat template; a target without one (the toy) gets the text."""
    try:
        return tok.apply_chat_template(rec["messages"])
    except eagle3.Eagle3Error:
        return tok.encode(rec["messages"][0]["content"])


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(want: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    firsts = [first_difference(a, b) for a, b in zip(want, got)]
    return {"outputs_differ": sum(f is not None for f in firsts),
            "first_difference_at": [f for f in firsts if f is not None]}


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - t0, 1)


def in_engine(spec: Any, prompts: list[list[int]], new: int, speculate: bool) -> dict[str, Any]:
    cfg = EngineConfig(max_batch=BATCH, max_queue=len(prompts), speculate=speculate,
                       num_draft_tokens=K if speculate else None)
    engine = Engine(spec, cfg).start(background=False)
    try:
        def run() -> list[list[int]]:
            reqs = [engine.submit(p, new) for p in prompts]
            engine.run_until_idle()
            return [r.token_ids for r in reqs]
        outs, seconds = timed(run)
        m = engine.metrics()
    finally:
        engine.stop()
    drafts = m["spec_decode_num_drafts"]
    tau = 1 + m["spec_decode_num_accepted_tokens"] / drafts if drafts else None
    return {"outputs": outs, "seconds": seconds, "tau": tau}


def one_by_one(spec: Any, prompts: list[list[int]], new: int, k: int | None) -> dict[str, Any]:
    outs, seconds = timed(lambda: [spec.generate(p, new, num_draft_tokens=k).token_ids for p in prompts])
    return {"outputs": outs, "seconds": seconds}


def arm(name: str, prompts: list[list[int]], new: int, out_dir: Path) -> dict[str, Any]:
    fmt, _, backend = name.partition("+")
    if fmt.startswith("program="):
        spec = eagle3.load("default", backend="executorch", program=fmt.split("=", 1)[1])
        plain = one_by_one(spec.plain(), prompts, new, None)
        specd = one_by_one(spec, prompts, new, K)
        return {"path": "program, one request at a time", "plain": plain, "speculative": specd,
                "vs_plain": compare(plain["outputs"], specd["outputs"])}
    if backend == "compile":
        spec = eagle3.load("default", quantize=fmt, compile=True)
        spec.generate(prompts[0], 8)  # compile outside the timings
        spec.plain().generate(prompts[0], 8)
        plain = one_by_one(spec.plain(), prompts, new, None)
        specd = one_by_one(spec, prompts, new, K)
        out = {"path": "compiled, one request at a time", "plain": plain, "speculative": specd,
               "vs_plain": compare(plain["outputs"], specd["outputs"])}
        eager = out_dir / f"{fmt}.json"
        if eager.exists():
            out["plain_vs_eager_plain"] = compare(json.loads(eager.read_text())["plain"]["outputs"],
                                                  plain["outputs"])
        return out
    spec = eagle3.load("default", quantize=fmt)
    plain = in_engine(spec, prompts, new, speculate=False)
    specd = in_engine(spec, prompts, new, speculate=True)
    out = {"path": f"engine, {BATCH} requests at a time",
           "exact_kernels": bool(getattr(spec.target, "exact", False)),
           "plain": plain, "speculative": specd, "vs_plain": compare(plain["outputs"], specd["outputs"])}
    if fmt == "gguf":
        single = one_by_one(spec, prompts, new, K)
        out["generate_speculative"] = single
        out["generate_vs_plain"] = compare(plain["outputs"], single["outputs"])
    return out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    arms = (sys.argv[3] if len(sys.argv) > 3 else "gguf,gguf+compile,bf16,int8,int4,fp32").split(",")
    out_dir = Path(sys.argv[4] if len(sys.argv) > 4 else "docs/bench/exactness")
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    tok = eagle3.load("default").tokenizer
    prompts = [chat_ids(tok, rec) for _, rec in prompt_set("sharegpt-heldout", n)]
    for name in arms:
        path = out_dir / f"{name.replace('/', '_').replace('=', '-')}.json"
        if path.exists():
            print(f"{name}: done before ({path})", file=sys.stderr)
            continue
        t0 = time.time()
        try:
            measured = arm(name, prompts, new, out_dir)
        except Exception as e:  # one arm's failure (a missing program) leaves the others to run
            print(f"{name}: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        result = {"arm": name, "prompts": len(prompts), "max_new_tokens": new, "num_draft_tokens": K,
                  **measured, "wall_s": round(time.time() - t0, 1)}
        result["plain_tokens"] = sum(len(o) for o in result["plain"]["outputs"])
        path.write_text(json.dumps(result) + "\n")
        print(f"{name}: {result['vs_plain']['outputs_differ']}/{len(prompts)} outputs differ "
              f"({result['wall_s']} s)", file=sys.stderr, flush=True)
    summary = {}
    for path in sorted(out_dir.glob("*.json")):
        if path.name == "summary.json":
            continue
        r = json.loads(path.read_text())
        row = {k: r[k] for k in ("path", "prompts", "max_new_tokens", "plain_tokens", "vs_plain", "wall_s")}
        for key in ("generate_vs_plain", "plain_vs_eager_plain", "exact_kernels"):
            if key in r:
                row[key] = r[key]
        for key in ("plain", "speculative", "generate_speculative"):
            if key in r:
                toks = sum(len(o) for o in r[key]["outputs"])
                row[f"{key}_tokens_per_s"] = round(toks / r[key]["seconds"], 1)
                if r[key].get("tau") is not None:
                    row[f"{key}_tau"] = round(r[key]["tau"], 3)
        summary[r["arm"]] = row
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
