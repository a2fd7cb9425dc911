"""K per batch size: measured round costs and the acceptance seen so far.

Speculation pays when verifying K+1 tokens per row costs little more than one,
which holds for small batches and fades as the batch (B rows x K+1 tokens) fills
the matmuls. `BatchCosts.measure` times, at start-up and for a few batch sizes,
the engine's own batched forwards: a target forward over T tokens per row, a
draft catch-up over T tokens and a one-token draft step. A round with K drafts
then costs

    round(B, K) = verify(B, K+1) + catch_up(B, K+1) + (K-1) * draft_step(B)

and yields tau(K) tokens per row (`AutoK.tau`, from the engine's per-position
acceptance counts). `best_k` picks the K (0 = plain decoding) with the most
tokens per second, so a batch where speculation would not pay decodes plainly.
Costs between measured batch sizes are interpolated linearly.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..decoding.autok import AutoK
from .kv import PagePool
from .step import BatchRunner


def probe_batch_sizes(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]


def fit_line(ms: list[float]) -> list[float]:
    """Timings at T = 1..n smoothed to a + b*T (Theil-Sen: median pairwise slope, b >= 0), so one
    disturbed measurement on a busy machine cannot make a larger K look cheaper than a smaller one."""
    n = len(ms)
    if n < 2:
        return list(ms)
    slopes = [(ms[j] - ms[i]) / (j - i) for i in range(n) for j in range(i + 1, n)]
    b = max(0.0, statistics.median(slopes))
    a = max(statistics.median(m - b * t for t, m in enumerate(ms)), min(ms))  # never <= 0
    return [a + b * t for t in range(n)]


class BatchCosts:
    """Milliseconds of the batched forwards, per measured batch size."""

    def __init__(self, verify: dict[int, list[float]], catch_up: dict[int, list[float]]) -> None:
        self.verify = verify  # B -> [ms for T = 1 .. kmax+1]
        self.catch_up = catch_up  # B -> [ms for T = 1 .. kmax+1] (T = 1 is a draft step)

    @classmethod
    @torch.no_grad()
    def measure(cls, runner: BatchRunner, batch_sizes: list[int], kmax: int, context: int,
                repeats: int = 3) -> BatchCosts:
        """Time the forwards on fake rows of `context` positions (interleaved medians, then a
        line in T per batch size: `fit_line`)."""
        pool: PagePool = runner.pool
        T_all = list(range(1, kmax + 2))
        verify: dict[int, list[float]] = {}
        catch_up: dict[int, list[float]] = {}
        for B in batch_sizes:
            rids = [f"probe-{b}" for b in range(B)]
            need = context + kmax + 2
            if B * pool.pages_for(need) > pool.num_pages - pool.reserved:
                continue
            try:
                for rid in rids:
                    pool.admit(rid, need)
                    pool.grow(rid, need)
                tv: dict[int, list[float]] = {T: [] for T in T_all}
                tc: dict[int, list[float]] = {T: [] for T in T_all}
                for rep in range(repeats + 1):  # the first pass warms up
                    for T in T_all:
                        tokens = torch.ones(B, T, dtype=torch.long)
                        t0 = time.perf_counter()
                        logits, taps = runner.target_forward(rids, [context] * B, tokens)
                        logits.argmax(-1).tolist()
                        t1 = time.perf_counter()
                        ids, _ = runner.draft_forward(rids, [context] * B, tokens,
                                                      runner.draft.fuse(taps), [T] * B)
                        ids.tolist()
                        t2 = time.perf_counter()
                        if rep:
                            tv[T].append((t1 - t0) * 1e3)
                            tc[T].append((t2 - t1) * 1e3)
                verify[B] = fit_line([statistics.median(tv[T]) for T in T_all])
                catch_up[B] = fit_line([statistics.median(tc[T]) for T in T_all])
            finally:
                for rid in rids:
                    pool.release(rid)
        return cls(verify, catch_up)

    def _at(self, table: dict[int, list[float]], B: int, T: int) -> float:
        sizes = sorted(table)
        lo = max([b for b in sizes if b <= B], default=sizes[0])
        hi = min([b for b in sizes if b >= B], default=sizes[-1])
        if lo == hi:
            return table[lo][T - 1] * (B / lo if B > lo else 1.0)
        w = (B - lo) / (hi - lo)
        return (1 - w) * table[lo][T - 1] + w * table[hi][T - 1]

    def round_ms(self, B: int, k: int) -> float:
        """Predicted milliseconds of one round with k drafts per row (k = 0: a plain step)."""
        if k == 0:
            return self._at(self.verify, B, 1)
        return (self._at(self.verify, B, k + 1) + self._at(self.catch_up, B, k + 1)
                + (k - 1) * self._at(self.catch_up, B, 1))

    def best_k(self, B: int, auto: AutoK, kmax: int, greedy: int | None = None) -> int:
        """The k in 0..kmax with the most tokens per millisecond at batch size B (ties: smaller k).

        `greedy` rows of the B speculate (tau(k) tokens per round); the rest (sampled rows)
        yield one token per round whatever k is.
        """
        greedy = B if greedy is None else greedy
        best, best_rate = 0, B / self.round_ms(B, 0)
        for k in range(1, min(kmax, len(next(iter(self.verify.values()))) - 1) + 1):
            rate = (greedy * auto.tau(k) + B - greedy) / self.round_ms(B, k)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best

    def as_dict(self) -> dict[str, Any]:
        return {"verify_ms": {str(b): [round(x, 3) for x in v] for b, v in self.verify.items()},
                "catch_up_ms": {str(b): [round(x, 3) for x in v] for b, v in self.catch_up.items()}}
