"""The bench report as Markdown: one table row per arm, then the best K and the cost model."""

from __future__ import annotations

from typing import Any

from ..decoding.sampling import SamplingParams
from .harness import sampling_name

PEER_NAMES = {"hf": "transformers greedy", "lookup": "transformers prompt lookup",
              "assisted": "transformers assisted"}
COLUMNS = ("decoding", "tok/s", "speedup", "model", "tau", "accept", "from text", "accept per position %",
           "accepted-length hist", "draft ms/rd", "verify ms/rd", "other ms/rd", "draft tok / step",
           "verify / step", "syncs/rd", "identical")


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _row(name: str, r: dict) -> list[str]:
    spec = r.get("arm") == "eagle3"
    counts = spec or "mean_accept_len" in r  # a peer's own speculation counts (llama.cpp)
    return [name, _f(r["tokens_per_s"], ".1f"), _f(r["speedup"]) + "x", _f(r.get("predicted_speedup")),
            _f(r["mean_accept_len"]) if counts else "-",
            _f(r["acceptance_rate"], ".0%") if counts else "-",
            f"{r['suffix_accepted_tokens']}/{r['accepted_tokens']}" if r.get("suffix_rounds") else "-",
            " ".join(_f(None if a is None else 100 * a, ".0f") for a in r["accept_rate_per_position"])
            if spec else "-",
            " ".join(f"{n}:{c}" for n, c in enumerate(r["accept_len_hist"]) if c) if spec else "-",
            _f(r.get("draft_ms_per_round")), _f(r.get("verify_ms_per_round")),
            _f(r.get("other_ms_per_round")), _f(r.get("draft_token_over_plain_step"), ".3f"),
            _f(r.get("verify_over_plain_step")), _f(r.get("host_syncs_per_round")),
            "n/a (sampled)" if r["outputs_identical"] is None else
            "yes" if r["outputs_identical"] else f"NO ({r['mismatched_runs']} runs{_prefix(r)})"]


def _prefix(r: dict) -> str:
    p = r.get("mean_common_prefix")
    return "" if p is None else f"; the first {p:.1f} tokens agree on average"


def _name(r: dict) -> str:
    t = r.get("tree")
    name = ("plain (eagle3)" if r["arm"] == "plain" else
            "EAGLE-3 tree {top_k}x{depth}x{total_tokens}".format(**t) if t else
            f"EAGLE-3 K=auto ({r['chosen_k']} last)" if r["k"] == "auto" else f"EAGLE-3 K={r['k']}")
    if r.get("proposer") == "suffix":
        name = "suffix (text alone, no head)"
    elif r.get("proposer") == "hybrid":
        name = name.replace("EAGLE-3", "hybrid EAGLE-3 + suffix")
    if r.get("temperature"):
        name += ", sampled " + sampling_name(SamplingParams(r["temperature"], r.get("top_p", 1.0),
                                                            r.get("top_k", 0)))
    if r.get("backend"):  # several backends: which one, and the speedup against its own plain
        name = f"{r['backend']}: {name}"
        if r["arm"] != "plain" and r.get("speedup_vs_backend_plain") is not None:
            name += f" ({r['speedup_vs_backend_plain']:.2f}x own plain)"
    return name


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table plus two summary lines."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in report["rows"] + report.get("sampled_rows", []):
        lines.append("| " + " | ".join(_row(_name(r), r)) + " |")
    for peer, r in report["peers"].items():
        lines.append("| " + " | ".join(_row(PEER_NAMES.get(peer, peer), r)) + " |")
    s = report["settings"]
    lines += ["", f"{s['prompts']} prompts x {s['repeats']} interleaved repetitions, up to "
              f"{s['max_new_tokens']} new tokens; medians over repetitions; per round = per target "
              "forward after the prefill (syncs/rd counts the prefill's sync too); accept per position "
              "= accepted there / rounds that drafted there; eagle3's rows "
              f"{'compiled (--compile)' if s.get('compiled') else 'eager'}, "
              f"{s.get('torch_threads', '?')} threads."]
    if len(s.get("backends", [])) > 1:
        same = {r["backend"]: r["matches_first_backend_plain"] for r in report["rows"]
                if "matches_first_backend_plain" in r}
        lines.append(f"Backends: {', '.join(s['backends'])}; speedup is against {s['backends'][0]} "
                     "plain decoding, the name says the speedup against the backend's own plain; "
                     "identical = equal to the backend's own plain decoding. Plain decoding equal to "
                     f"{s['backends'][0]}'s: " + ", ".join(f"{b} {'yes' if v else 'no'}"
                                                           for b, v in same.items()) + ".")
    if report["best_k"] is not None:
        where = f" on {report['best_backend']}" if len(s.get("backends", [])) > 1 else ""
        lines.append(f"Best K={report['best_k']}{where}: {report['eagle_tokens_per_s']:.1f} tok/s vs plain "
                     f"{report['baseline_tokens_per_s']:.1f}, speedup {report['speedup']:.2f}x, "
                     f"tau {report['mean_accept_len']:.2f}.")
    lines.append("Outputs identical to plain greedy in every greedy run of ours: "
                 f"{'yes' if report['outputs_identical'] else 'NO'}.")
    if report.get("sampled_rows"):
        lines.append("Sampled rows: speedup against sampled plain decoding; tree nodes count as "
                     "drafted tokens (accept = accepted / nodes); sampling is lossless in "
                     "distribution, so outputs are not compared.")
    costs = report.get("cost_models") or {"": report["cost_model"]}
    for backend, c in costs.items():
        if c is None:
            continue
        ratios = " ".join(f"{m}:{v:.2f}" for m, v in c["verify_cost_ratio"].items())
        which = f" ({backend})" if len(costs) > 1 else ""
        lines.append(f"Cost model{which} (cache of {c['cache_len']} tokens): plain decoding step "
                     f"{c['target_forward_ms']:.2f} ms; cost(K+1)/cost(1) = verify over K+1 tokens / plain "
                     f"step: {ratios or '-'}; draft step / plain step "
                     f"{c['draft_step_over_target_forward']:.2f}; "
                     "model = tau x plain step / (verify(K+1) + catch-up(K+1) + (K-1) draft steps).")
    return "\n".join(lines)
