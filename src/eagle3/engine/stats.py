"""The engine's statistics: counters over every request (finished ones folded in, running ones
as of their last round), outcomes, and the plans each batch size ran. `Engine.metrics()` reads
them under the engine's lock; the names are vLLM's."""

from __future__ import annotations

from typing import Any

from ..decoding.types import Plan

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "suffix_draft_tokens", "suffix_accepted_tokens", "prompt_tokens", "generation_tokens")
OUTCOMES = {"finished": "requests_finished", "aborted": "requests_aborted", "failed": "requests_failed"}


class EngineStats:
    """Counters of finished requests, outcomes, running requests' counters as of their last
    round (`published`), and rounds per plan per batch size (`k_history`)."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.per_pos: list[int] = []
        self.hist: list[int] = []
        self.outcomes = dict.fromkeys(OUTCOMES.values(), 0)
        self.published: dict[str, dict[str, Any]] = {}  # running requests' metrics, per round
        self.k_history: dict[int, dict[Any, int]] = {}  # batch size -> {k or "tree": rounds}

    def round(self, plan: Plan, metrics: dict[str, dict[str, Any]]) -> None:
        """A round of `plan` over the requests whose metrics are `metrics` {id: metrics}."""
        key = "tree" if plan.tree is not None else plan.k
        per_size = self.k_history.setdefault(len(metrics), {})
        per_size[key] = per_size.get(key, 0) + 1
        self.published = metrics

    def finish(self, outcome: str, m: dict[str, Any]) -> None:
        """A request retired with `outcome` ('finished', 'aborted', 'failed') and metrics `m`."""
        self.outcomes[OUTCOMES[outcome]] += 1
        for c in COUNTERS:
            self.totals[c] += m[c]
        add_into(self.per_pos, m["spec_decode_num_accepted_tokens_per_pos"])
        add_into(self.hist, m["accept_len_hist"])

    def counters(self, running: list[Any]) -> dict[str, Any]:
        """Every counter, the running requests' last published rounds included, and the outcomes."""
        out: dict[str, Any] = dict(self.totals)
        per_pos, hist = list(self.per_pos), list(self.hist)
        for r in running:
            m = self.published.get(r.id) or r.metrics  # as of its last round (engine thread)
            for c in COUNTERS:
                out[c] += m[c]
            add_into(per_pos, m["spec_decode_num_accepted_tokens_per_pos"])
            add_into(hist, m["accept_len_hist"])
        out["spec_decode_num_accepted_tokens_per_pos"] = per_pos
        out["accept_len_hist"] = hist
        drafts = out["spec_decode_num_drafts"]
        out["mean_accept_len"] = 1.0 + out["spec_decode_num_accepted_tokens"] / drafts if drafts else None
        out.update(self.outcomes)
        return out


def add_into(total: list[int], counts: list[int]) -> None:
    """total += counts elementwise, growing total as needed."""
    total.extend([0] * (len(counts) - len(total)))
    for i, n in enumerate(counts):
        total[i] += n
