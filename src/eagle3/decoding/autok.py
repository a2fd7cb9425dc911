"""Choosing K, the number of chain drafts per round, from a cost model and measured acceptance.

A round that drafts K tokens costs one target forward over K+1 tokens plus K
draft forwards, and yields tau(K) tokens on average, so against plain decoding

    speedup(K) = tau(K) / (cost(K+1)/cost(1) + K * draft/target)

`measure_cost` times those forwards on this machine, through the compiled steps
when the speculator is compiled (`eagle3 bench` reports the same numbers).
tau(K) = 1 + sum_j prod_{i<j} q_i, where q_i is the acceptance rate of draft
position i given that the earlier ones were accepted: counted per round by
`AutoK.record` over the speculator's automatic generations, and shrunk towards
the previous position's rate (position 0: a prior of 0.8, typical of EAGLE-3
heads) where there is little data.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from ..targets.decoder import slots_upto
from .profile import sync

if TYPE_CHECKING:
    from ..speculator import Eagle3Speculator

AUTO_MAX_K = 8
PRIOR_ACCEPT, PRIOR_ROUNDS = 0.8, 4.0
REPICK_EVERY = 8  # rounds between choices within one generation
DRAFT_PROBE_STEPS = 4  # the draft cost is timed over a chain of this many steps


@torch.no_grad()
def measure_cost(spec: Eagle3Speculator, prompt: list[int], sizes: list[int],
                 repeats: int) -> dict[str, Any]:
    """cost(T)/cost(1) of a verify forward over T tokens (T in `sizes`) against a plain
    decoding step, on a cache holding `prompt`, and draft step / plain step (a draft
    step timed as 1/4 of a 4-step chain, as rounds run them): medians of interleaved
    timings, through the compiled steps when the speculator has them."""
    from .chain import ChainDrafter  # chain.py imports this module

    # Room after the prompt for the largest verify and the probe's draft chain.
    prompt = prompt[:max(1, spec.max_seq_len - max([*sizes, DRAFT_PROBE_STEPS + 1]))]
    n = len(prompt)
    sizes = [m for m in sorted({1, *sizes}) if n + m <= spec.max_seq_len]
    pos = slots_upto(spec.max_seq_len)
    x = torch.tensor([prompt])
    spec.reset_caches()
    tok, feat = spec.prefill(x, pos[:n], kv_len=n)
    drafter = ChainDrafter(spec, pos)
    first, boundary = drafter.prefill_prompt(torch.cat([x[:, 1:], tok.view(1, 1)], dim=1), feat)
    times: dict[int, list[float]] = {m: [] for m in sizes}
    draft_times: list[float] = []
    for _ in range(repeats):
        for m in sizes:
            t0 = time.perf_counter()
            plain = m == 1  # cost(1) is a plain decoding step: no taps, the last logits only
            ids, _ = spec._target(tok.view(1, 1).expand(1, m), pos[n:n + m], n + m, with_taps=not plain,
                                  last_only=plain)
            sync(ids)
            times[m].append(time.perf_counter() - t0)
            spec.target.truncate_cache(spec.target_cache, n)
        t0 = time.perf_counter()
        ids = drafter.chain_round(first, boundary, DRAFT_PROBE_STEPS + 1)  # rewinds the draft cache
        sync(ids)
        draft_times.append((time.perf_counter() - t0) / DRAFT_PROBE_STEPS)
    spec.reset_caches()
    med = {m: statistics.median(t) for m, t in times.items()}
    draft = statistics.median(draft_times)
    return {"cache_len": n, "target_forward_ms": med[1] * 1e3,
            "verify_cost_ratio": {str(m): med[m] / med[1] for m in sizes if m > 1},
            "draft_step_ms": draft * 1e3, "draft_step_over_target_forward": draft / med[1]}


@torch.no_grad()
def warm_auto_graphs(spec: Eagle3Speculator, prompt: list[int]) -> None:
    """Compile, once, the chain graphs of every K that auto may choose: the first round's
    chain and the rebuild + chain of later rounds (AUTO_MAX_K + 1 rows). Without this, a
    K chosen for the first time compiles inside a generation (seconds per graph)."""
    from .chain import ChainDrafter  # chain.py imports this module

    rows = AUTO_MAX_K + 1
    n = len(prompt)
    pos = slots_upto(spec.max_seq_len)
    x = torch.tensor([prompt])
    spec.reset_caches()
    tok, feat = spec.prefill(x, pos[:n], kv_len=n)
    anchor = tok.view(1, 1)
    drafter = ChainDrafter(spec, pos)
    first, boundary = drafter.prefill_prompt(torch.cat([x[:, 1:], anchor], dim=1), feat)
    _, vfeat = spec.target_verify(anchor.expand(1, rows), pos[n:n + rows], kv_len=n + rows)
    for k in range(1, AUTO_MAX_K + 1):
        drafter.chain_round(first, boundary, k)
        drafter.chain_after_verify(anchor.expand(1, rows - 1), 0, anchor, vfeat, n, k, rows)
        drafter.length = n
        spec.draft_cache.truncate(n)
    spec.reset_caches()


def predicted_speedup(tau: float, k: int, cost: dict[str, Any]) -> float | None:
    """tau / (cost(K+1)/cost(1) + K * draft/target); None when cost(K+1) was not measured."""
    ratio = cost["verify_cost_ratio"].get(str(k + 1))
    return tau / (ratio + k * cost["draft_step_over_target_forward"]) if ratio is not None else None


class AutoK:
    """Per-position acceptance counts and the K they and `cost` favour."""

    def __init__(self, cost: dict[str, Any], max_k: int = AUTO_MAX_K) -> None:
        self.cost = cost
        self.max_k = max_k
        self.reached = [0] * max_k  # rounds that drafted position i after accepting 0..i-1
        self.accepted = [0] * max_k  # ... and accepted it too

    def record(self, k: int, accepted: int) -> None:
        """One round: k drafts, the first `accepted` of them accepted."""
        for i in range(min(accepted + 1, k, self.max_k)):
            self.reached[i] += 1
            if i < accepted:
                self.accepted[i] += 1

    def rates(self) -> list[float]:
        """q_i: P(position i accepted | positions before it accepted), each shrunk towards
        the previous position's estimate (position 0: the prior), so positions with little
        or no data look like the last ones measured."""
        rates, prior = [], PRIOR_ACCEPT
        for a, r in zip(self.accepted, self.reached):
            prior = (a + prior * PRIOR_ROUNDS) / (r + PRIOR_ROUNDS)
            rates.append(prior)
        return rates

    def tau(self, k: int) -> float:
        """Expected tokens per round with k drafts."""
        total, p = 1.0, 1.0
        for q in self.rates()[:k]:
            p *= q
            total += p
        return total

    def choose(self) -> int:
        """The K in 1..max_k with the highest predicted speedup (ties: the smaller K)."""
        best, best_speed = 1, -1.0
        for k in range(1, self.max_k + 1):
            speed = predicted_speedup(self.tau(k), k, self.cost)
            if speed is not None and speed > best_speed + 1e-9:
                best, best_speed = k, speed
        return best
