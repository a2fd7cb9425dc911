"""`eagle3 bench --concurrency 1,4,8`: the engine with speculation off vs on, per concurrency.

Concurrency c means c requests decode together (`EngineConfig(max_batch=c)`) and
every prompt is queued at once, so a new request joins as soon as one finishes
(c clients that each send their next request when the last one is answered; TTFT
and end-to-end latency therefore include the time spent queued, reported apart
as queue time). For each repetition and each c, the plain engine
and the speculative engine each serve the whole prompt set in turn (interleaved);
throughput = generated tokens / wall time over all requests, medians over
repetitions. Latencies are per request: time to first token, inter-token latency
(mean gap after the first token), end-to-end. Every output is compared with
single-request plain greedy decoding of the same prompt. Each repetition also runs
the prompts one by one through `generate` (the same speculator, automatic K), the
single-request path the engine at concurrency 1 should match (`generate_tokens_per_s`,
`engine_vs_generate`). With `tree`, the speculative engines may pick that tree too.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from ..engine import Engine, EngineConfig


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _quantile(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of xs, or None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _serve_all(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    reqs = [engine.submit(p, max_new_tokens) for p in prompts]
    engine.run_until_idle()
    wall = time.perf_counter() - t0
    failed = [r for r in reqs if r.finish_reason not in ("stop", "length")]
    if failed:
        raise RuntimeError(f"{len(failed)} requests did not finish: {failed[0].error}")
    ms = [r.metrics for r in reqs]
    return {"tokens": sum(len(r.token_ids) for r in reqs), "seconds": wall,
            "outputs": [r.token_ids for r in reqs],
            "ttft_s": [m["ttft_s"] for m in ms], "itl_s": [m["itl_s"] for m in ms],
            "queue_s": [m["queue_s"] for m in ms],
            "e2e_s": [m["e2e_s"] for m in ms]}


def _generate_all(spec: Any, prompts: list[list[int]], max_new_tokens: int,
                  num_draft_tokens: int | None, proposer: str | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    outs = [spec.generate(p, max_new_tokens, num_draft_tokens=num_draft_tokens,
                          proposer=proposer).token_ids for p in prompts]
    return {"tokens": sum(len(o) for o in outs), "seconds": time.perf_counter() - t0, "outputs": outs}


def run_concurrency_bench(spec: Any, prompts: list[list[int]], concurrencies: list[int], *,
                          max_new_tokens: int, repeats: int, num_draft_tokens: int | None = None,
                          tree: Any = None, progress: bool = False,
                          proposer: str | None = None) -> dict[str, Any]:
    """Speculation off vs on at each concurrency, interleaved; see the module docstring."""
    n = len(prompts)
    want = [spec.plain().generate(p, max_new_tokens).token_ids for p in prompts]
    engines: dict[tuple[int, bool], Engine] = {}
    for c in concurrencies:
        for on in (False, True):
            cfg = EngineConfig(max_batch=c, max_queue=max(64, n), speculate=on,
                               num_draft_tokens=num_draft_tokens, tree=tree if on else None,
                               proposer=proposer if on else None)
            engines[(c, on)] = Engine(spec, cfg).start(background=False)
    spec.calibrate()  # the single-request path's cost model, before any timing
    _generate_all(spec, prompts[:2], min(8, max_new_tokens), num_draft_tokens, proposer)
    single: list[dict[str, Any]] = []
    for engine in engines.values():  # warm-up: one pass over a few prompts
        _serve_all(engine, prompts[:2], min(8, max_new_tokens))
    runs: dict[tuple[int, bool], list[dict[str, Any]]] = {key: [] for key in engines}
    before = {key: e.metrics() for key, e in engines.items()}
    for e in engines.values():  # count the measured rounds only
        e.k_history.clear()
    for rep in range(repeats):
        single.append(_generate_all(spec, prompts, max_new_tokens, num_draft_tokens, proposer))
        for c in concurrencies:
            for on in (False, True):
                runs[(c, on)].append(_serve_all(engines[(c, on)], prompts, max_new_tokens))
                if progress:
                    print(f"\rrepetition {rep + 1}/{repeats}, concurrency {c}, speculation "
                          f"{'on ' if on else 'off'}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    rows = []
    for c in concurrencies:
        row: dict[str, Any] = {"concurrency": c}
        for on, name in ((False, "plain"), (True, "eagle")):
            rs = runs[(c, on)]
            engine = engines[(c, on)]
            m, m0 = engine.metrics(), before[(c, on)]
            drafts = m["spec_decode_num_drafts"] - m0["spec_decode_num_drafts"]
            accepted = m["spec_decode_num_accepted_tokens"] - m0["spec_decode_num_accepted_tokens"]
            from_text = m["suffix_accepted_tokens"] - m0["suffix_accepted_tokens"]
            row[name] = {
                "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in rs),
                "ttft_ms_median": _ms(_median([x for r in rs for x in r["ttft_s"]])),
                "itl_ms_median": _ms(_median([x for r in rs for x in r["itl_s"]])),
                "queue_ms_median": _ms(_median([x for r in rs for x in r["queue_s"]])),
                "e2e_s_median": _median([x for r in rs for x in r["e2e_s"]]),
                "e2e_s_p90": _quantile([x for r in rs for x in r["e2e_s"]], 0.9),
                "ttft_ms_p90": _ms(_quantile([x for r in rs for x in r["ttft_s"]], 0.9)),
                "requests_per_s": statistics.median(len(r["outputs"]) / r["seconds"] for r in rs),
                "outputs_identical": all(r["outputs"] == want for r in rs),
                "speculation": engine.speculate,
                "mean_accept_len": 1.0 + accepted / drafts if drafts else None,
                "suffix_accepted_tokens": from_text, "head_accepted_tokens": accepted - from_text,
                "accept_len_hist": [a - b for a, b in zip(m["accept_len_hist"], m0["accept_len_hist"])],
                "accepted_per_position": [a - b for a, b in zip(m["spec_decode_num_accepted_tokens_per_pos"],
                                                               m0["spec_decode_num_accepted_tokens_per_pos"])],
                "rounds_by_batch_and_k": {str(b): {str(k): v for k, v in sorted(ks.items())}
                                          for b, ks in sorted(engine.k_history.items())},
            }
            if engine.costs is not None:
                row[name]["batch_costs_ms"] = engine.costs.as_dict()
        row["speedup"] = row["eagle"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
        row["outputs_identical"] = row["eagle"]["outputs_identical"]
        rows.append(row)
    generate_rate = statistics.median(r["tokens"] / r["seconds"] for r in single)
    for row in rows:
        row["engine_vs_generate"] = row["eagle"]["tokens_per_s"] / generate_rate
    for engine in engines.values():
        engine.stop()
    top = rows[-1]
    return {
        "mode": "concurrency",
        "settings": {"prompts": n, "max_new_tokens": max_new_tokens, "repeats": repeats,
                     "concurrency": concurrencies,
                     "num_draft_tokens": "auto" if num_draft_tokens is None else num_draft_tokens,
                     "tree": getattr(tree, "as_dict", lambda: tree)()},
        "generate_tokens_per_s": generate_rate,
        "generate_outputs_identical": all(r["outputs"] == want for r in single),
        "concurrency": rows,
        # The single-request contract keys, taken at the highest concurrency measured.
        "baseline_tokens_per_s": top["plain"]["tokens_per_s"],
        "eagle_tokens_per_s": top["eagle"]["tokens_per_s"],
        "speedup": top["speedup"],
        "mean_accept_len": top["eagle"]["mean_accept_len"],
        "accept_len_hist": top["eagle"]["accept_len_hist"],
        "accepted_per_position": top["eagle"]["accepted_per_position"],
        "outputs_identical": all(r["outputs_identical"] for r in rows),
    }


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown_concurrency(report: dict[str, Any]) -> str:
    """The serving table: one line per concurrency and mode."""
    s = report["settings"]
    lines = [f"Serving benchmark: {s['prompts']} prompts x {s['max_new_tokens']} new tokens, "
             f"{s['repeats']} interleaved repetitions (medians), K = {s['num_draft_tokens']}", "",
             "| concurrency | speculation | tok/s | speedup | queue ms | TTFT ms | ITL ms | e2e s | tau "
             "| identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["concurrency"]:
        for name in ("plain", "eagle"):
            r = row[name]
            sp = f"{row['speedup']:.2f}x" if name == "eagle" else "1.00x"
            tau = f"{r['mean_accept_len']:.2f}" if r["mean_accept_len"] else "-"
            lines.append(f"| {row['concurrency']} | {'on' if name == 'eagle' else 'off'} | "
                         f"{r['tokens_per_s']:.1f} | {sp} | {_f(r['queue_ms_median'], '.1f')} | "
                         f"{_f(r['ttft_ms_median'], '.1f')} | {_f(r['itl_ms_median'], '.2f')} | "
                         f"{r['e2e_s_median']:.2f} | {tau} | "
                         f"{'yes' if r['outputs_identical'] else 'NO'} |")
    lines.append("")
    ratios = ", ".join(f"{r['concurrency']}: {r['engine_vs_generate']:.2f}x" for r in report["concurrency"])
    lines.append(f"Single-request generate (same speculator, one prompt at a time): "
                 f"{report['generate_tokens_per_s']:.1f} tok/s; the engine at each concurrency / that: "
                 + ratios)
    for row in report["concurrency"]:
        ks = row["eagle"]["rounds_by_batch_and_k"]
        lines.append(f"concurrency {row['concurrency']}: rounds by batch size -> {{K: rounds}}: {ks}")
    return "\n".join(lines)
