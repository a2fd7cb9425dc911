"""PNG plots of a bench report (matplotlib, no display needed)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import Eagle3Error
from .report import PEER_NAMES


def check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise Eagle3Error("--plots needs matplotlib: pip install matplotlib (or drop --plots)") from None


def save_plots(report: dict[str, Any], out_dir: str) -> list[str]:
    """Write speedup.png, acceptance.png and accept_hist.png to `out_dir`; returns their paths."""
    from matplotlib.figure import Figure

    os.makedirs(out_dir, exist_ok=True)
    rows = [r for r in report["rows"] if isinstance(r["k"], int)]
    paths = []

    def save(fig: Figure, name: str) -> None:
        fig.tight_layout()
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=100)

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    proposers = list(dict.fromkeys(r.get("proposer") for r in rows))
    for pr in proposers:  # one line per proposer (`decoding.suffix`)
        own = [r for r in rows if r.get("proposer") == pr]
        ks = [r["k"] for r in own]
        name = {None: "EAGLE-3", "eagle": "EAGLE-3", "hybrid": "EAGLE-3 + suffix"}.get(pr, pr)
        ax.plot(ks, [r["speedup"] for r in own], "o-", label=f"{name} (measured)")
        if any(r["predicted_speedup"] is not None for r in own) and pr in (None, "eagle"):
            ax.plot(ks, [r["predicted_speedup"] for r in own], "x--", label="cost model (head alone)")
    for r in report["rows"]:
        if r.get("proposer") == "suffix":
            ax.axhline(r["speedup"], ls="-.", color="C5", label="suffix alone (no head)")
    for name, r in report["peers"].items():
        ax.axhline(r["speedup"], ls=":", color=f"C{2 + list(report['peers']).index(name)}",
                   label=PEER_NAMES.get(name, name))
    ax.axhline(1.0, color="gray", lw=0.8, label="plain (eagle3)")
    ax.set(xlabel="draft tokens per round K", ylabel="speedup vs plain decoding", title="Speedup")
    ax.legend(fontsize=8)
    save(fig, "speedup.png")

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for r in rows:
        rates = [float("nan") if x is None else x for x in r["accept_rate_per_position"]]
        ax.plot(range(1, len(rates) + 1), rates, "o-",
                label=f"{r['proposer']} K={r['k']}" if r.get("proposer") else f"K={r['k']}")
    ax.set(xlabel="draft position", ylabel="accepted / drafted there", ylim=(0, 1.05),
           title="Acceptance per position")
    if rows:
        ax.legend(fontsize=8)
    save(fig, "acceptance.png")

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    best = next((r for r in rows if r["k"] == report["best_k"]), None)
    if best is not None:
        ax.bar(range(len(best["accept_len_hist"])), best["accept_len_hist"])
    ax.set(xlabel="accepted draft tokens per round", ylabel="rounds",
           title=f"Accepted-length histogram (K={report['best_k']})")
    save(fig, "accept_hist.png")
    sourced = [r for r in report["rows"] if r.get("suffix_rounds")]
    if sourced:  # accepted tokens per source: the head's and the text's (`decoding.suffix`)
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        names = [f"{r.get('proposer')} " + (f"K={r['k']}" if r["k"] is not None else
                                            "tree" if r.get("tree") else "") for r in sourced]
        head = [r["head_accepted_tokens"] for r in sourced]
        ax.bar(names, head, label="from the head")
        ax.bar(names, [r["suffix_accepted_tokens"] for r in sourced], bottom=head, label="from the text")
        ax.set(ylabel="accepted draft tokens", title="Accepted draft tokens per source")
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        ax.legend(fontsize=8)
        save(fig, "accepted_by_source.png")
    return paths


def save_concurrency_plot(report: dict[str, Any], out_dir: str) -> str:
    """latency_throughput.png for a `--concurrency` report: per mode (speculation off / on), one
    point per concurrency (the offered load: requests kept in flight), throughput against
    median and p90 end-to-end latency, and throughput against the load."""
    from matplotlib.figure import Figure

    os.makedirs(out_dir, exist_ok=True)
    rows = report["concurrency"]
    fig = Figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
    for i, (mode, label) in enumerate((("plain", "plain decoding"), ("eagle", "EAGLE-3"))):
        tput = [r[mode]["tokens_per_s"] for r in rows]
        median = [r[mode]["e2e_s_median"] for r in rows]
        left.plot(tput, median, "o-", color=f"C{i}", label=f"{label}, median")
        if all(r[mode].get("e2e_s_p90") is not None for r in rows):
            left.plot(tput, [r[mode]["e2e_s_p90"] for r in rows], "x:", color=f"C{i}", label=f"{label}, p90")
        for r, x in zip(rows, tput, strict=True):
            left.annotate(f"c={r['concurrency']}", (x, r[mode]["e2e_s_median"]), fontsize=7,
                          textcoords="offset points", xytext=(3, 3))
        right.plot([r["concurrency"] for r in rows], tput, "o-", color=f"C{i}", label=label)
    left.set(xlabel="throughput (generated tokens/s)", ylabel="end-to-end latency, queue included (s)",
             title="Latency against throughput")
    right.set(xlabel="offered load (requests in flight)", ylabel="generated tokens/s", title="Throughput")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "latency_throughput.png")
    fig.savefig(path, dpi=100)
    return path
