"""The cost model: what a round costs at a batch size, what it yields, and the plan to run.

Speculation pays when verifying K+1 tokens per row costs little more than one,
which holds for small batches and fades as the batch (B rows x T tokens) fills the
matmuls. `RoundCosts.measure` times a runner's own forwards on this machine, for a
few batch sizes (1 for `generate`): a target forward over T tokens per row and a
draft forward over T tokens per row. A round then costs

    chain of K   verify(B, K+1) + draft(B, K+1) (catch-up) + (K-1) draft(B, 1)
    tree         verify(B, N+1) + draft(B, depth+1) + (depth-1) draft(B, top_k)
    plain        verify(B, 1)

and yields tau tokens per row: for a chain, tau(K) = 1 + sum_j prod_{i<j} q_i from the
per-position acceptance rates q_i that `Acceptance` counts (shrunk towards the previous
position's rate, position 0 towards a prior of 0.8, where data is thin); for a tree, its
running mean tokens per round. `choose_plan` picks the plan with the most tokens per
second, plain decoding included, so a batch where speculation would not pay decodes plainly.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from .layout import causal_layout
from .round import SequenceState
from .runner import Runner
from .tree import TreeShape
from .types import Plan

AUTO_MAX_K = 8
PRIOR_ACCEPT, PRIOR_ROUNDS = 0.8, 4.0
REPICK_EVERY = 8  # rounds between choices within one generation
# A drafting plan must promise this much more than plain decoding's tokens per millisecond to be
# chosen over it: a smaller predicted gain is within the noise of the timings behind it (the
# observed round times vary by more between runs), and where the head accepts little such plans
# lost in measured runs (`make run`'s chat turn, docs/weight-formats.md "What a round costs").
PLAIN_MARGIN = 0.05
REPICK_EARLY = (2, 4)  # and these rounds of a generation, while the acceptance is still the prior's


def repick_now(rounds: int) -> bool:
    """Whether automatic K chooses again after this many drafting rounds of a generation: early
    (a wrong prior costs every round until the data overrides it), then every REPICK_EVERY."""
    return rounds in REPICK_EARLY or rounds % REPICK_EVERY == 0


class Acceptance:
    """Per-position chain acceptance counts and tree tokens per round, over many rounds."""

    def __init__(self, max_k: int = AUTO_MAX_K) -> None:
        self.max_k = max_k
        self.reached = [0] * max_k  # rounds that drafted position i after accepting 0..i-1
        self.accepted = [0] * max_k  # ... and accepted it too
        self.tree_rounds, self.tree_tokens = 0, 0
        # Tokens drafts from the text (`decoding.suffix`) added beyond the head's, per round of
        # rows that have them: [plain rounds, rounds the head drafted].
        self.text_rounds, self.text_added = [0, 0], [0, 0]
        self._rates: list[float] | None = None  # `rates`, until the next record

    def record(self, k: int, accepted: int, tree: bool = False) -> None:
        """One round: k drafts (a chain) or a tree, the first `accepted` of them accepted."""
        self._rates = None
        if tree:
            self.tree_rounds += 1
            self.tree_tokens += accepted + 1
            return
        for i in range(min(accepted + 1, k, self.max_k)):
            self.reached[i] += 1
            if i < accepted:
                self.accepted[i] += 1

    def record_text(self, head: bool, added: int) -> None:
        """One round of a row with a suffix proposer: `added` accepted tokens only the text
        proposed; `head`: whether the head drafted too."""
        self.text_rounds[head] += 1
        self.text_added[head] += added

    def text_gain(self, head: bool) -> float:
        """Mean tokens per round the text adds (0 before any such round): in plain rounds, or in
        rounds the head drafted (beyond the head's own)."""
        n = self.text_rounds[head]
        return self.text_added[head] / n if n else 0.0

    def rates(self) -> list[float]:
        """q_i: P(position i accepted | positions before it accepted), shrunk (module docstring)."""
        if self._rates is not None:
            return self._rates
        rates, prior = [], PRIOR_ACCEPT
        for a, r in zip(self.accepted, self.reached, strict=True):
            prior = (a + prior * PRIOR_ROUNDS) / (r + PRIOR_ROUNDS)
            rates.append(prior)
        self._rates = rates
        return rates

    def tau(self, k: int) -> float:
        """Expected tokens per round with k chain drafts."""
        total, p = 1.0, 1.0
        for q in self.rates()[:k]:
            p *= q
            total += p
        return total

    def tau_tree(self, shape: TreeShape) -> float:
        """Tokens per tree round so far; before any, the chain estimate at the tree's depth
        (a tree accepts at least what its best chain would)."""
        prior = self.tau(min(shape.depth, self.max_k))
        return (self.tree_tokens + prior * PRIOR_ROUNDS) / (self.tree_rounds + PRIOR_ROUNDS)


def fit_line(ms: list[float], at: list[int] | None = None) -> list[float]:
    """Timings `ms` taken at T = `at` (default 1..len(ms)) smoothed to a + b*T and given at
    every T = 1..max(at). Theil-Sen (median pairwise slope, b >= 0), so one disturbed
    measurement on a busy machine cannot make a larger K look cheaper than a smaller one."""
    at = list(range(1, len(ms) + 1)) if at is None else at
    n = max(at)
    if len(ms) < 2:
        return [ms[0]] * n
    pairs = [(i, j) for i in range(len(ms)) for j in range(i + 1, len(ms))]
    b = max(0.0, statistics.median((ms[j] - ms[i]) / (at[j] - at[i]) for i, j in pairs))
    a = max(statistics.median(m - b * (t - 1) for t, m in zip(at, ms, strict=True)), min(ms))  # never <= 0
    return [a + b * t for t in range(n)]


def probe_lengths(max_T: int) -> list[int]:
    """The tokens per row a calibration times: 1, 2, 3, the middle and max_T (the line through
    them is the model)."""
    return sorted({t for t in (1, 2, 3, (max_T + 1) // 2, max_T) if 1 <= t <= max_T})


def probe_batch_sizes(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]


# rows(B, positions): B sequences with room for `positions` positions, or None when the
# runner has no room for them (a full KV pool); released on exit.
Rows = Callable[[int, int], AbstractContextManager[list[SequenceState] | None]]


class RoundCosts:
    """Milliseconds of a runner's forwards per batch size B and tokens per row T (1..max_T)."""

    def __init__(self, verify: dict[int, list[float]], draft: dict[int, list[float]],
                 plain: dict[int, float] | None = None, context: int = 0, seconds: float = 0.0) -> None:
        self.context = context  # the cache length the times were measured at
        self.seconds = seconds  # how long measuring took
        self.verify = verify  # B -> [ms at T = 1 ..]
        self.draft = draft  # B -> [ms at T = 1 ..]
        self.plain = plain or {b: v[0] for b, v in verify.items()}  # B -> a plain step (no taps)
        self._round: dict[tuple[int, Plan], float] = {}  # round_ms, asked several times a round

    @classmethod
    @torch.no_grad()
    def measure(cls, runner: Runner, rows: Rows, batch_sizes: list[int], max_T: int,
                context: int, repeats: int = 3) -> RoundCosts:
        """Time the forwards on `rows(B, positions)` (sequences `context` positions long) at
        the `probe_lengths`: interleaved medians, then a line in T per batch size (`fit_line`).
        Batch sizes whose rows cannot be had (a full pool) are skipped."""
        t0 = time.perf_counter()
        lengths = probe_lengths(max_T)
        verify: dict[int, list[float]] = {}
        draft: dict[int, list[float]] = {}
        plain: dict[int, float] = {}
        for B in batch_sizes:
            with rows(B, context + max_T + 1) as seqs:
                if seqs is not None:
                    verify[B], draft[B], plain[B] = _time_batch(runner, seqs, context, lengths,
                                                                repeats)
        return cls(verify, draft, plain, context, time.perf_counter() - t0)

    @property
    def max_T(self) -> int:
        return len(next(iter(self.verify.values())))

    def _at(self, table: dict[int, Any], B: int, T: int | None = None) -> float:
        """Interpolated linearly between measured batch sizes (scaled past the largest)."""
        sizes = sorted(table)
        get = (lambda b: table[b]) if T is None else (lambda b: table[b][min(T, len(table[b])) - 1])
        lo = max([b for b in sizes if b <= B], default=sizes[0])
        hi = min([b for b in sizes if b >= B], default=sizes[-1])
        if lo == hi:
            return get(lo) * (B / lo if B > lo else 1.0)
        w = (B - lo) / (hi - lo)
        return (1 - w) * get(lo) + w * get(hi)

    def verify_ms(self, B: int, T: int) -> float:
        """A verify over T tokens per row at batch size B, the line extended past max_T."""
        last = self._at(self.verify, B, self.max_T)
        if T <= self.max_T:
            return self._at(self.verify, B, T)
        slope = last - self._at(self.verify, B, self.max_T - 1) if self.max_T > 1 else 0.0
        return last + slope * (T - self.max_T)

    def suffix_extra_ms(self, B: int, plan: Plan, nodes: int) -> tuple[float, ...]:
        """The extra milliseconds of 0..nodes more verify tokens per row in a round of `plan` at
        batch size B (the batch's verify widens for every row; after a plain round's step, the
        first node costs the switch to a verify)."""
        T0 = verify_len(plan) if plan.drafts else 1
        base = self.verify_ms(B, T0) if plan.drafts else self._at(self.plain, B)
        return (0.0, *(max(0.0, self.verify_ms(B, T0 + d) - base) for d in range(1, nodes + 1)))

    def round_ms(self, B: int, plan: Plan) -> float:
        """Predicted milliseconds of one round of `plan` at batch size B."""
        ms = self._round.get((B, plan))
        if ms is None:
            ms = self._round[B, plan] = self._round_ms(B, plan)
        return ms

    def _round_ms(self, B: int, plan: Plan) -> float:
        if plan.tree is not None:
            t = plan.tree
            depth = min(t.depth, t.total_tokens)
            return (self._at(self.verify, B, t.total_tokens + 1) + self._at(self.draft, B, depth + 1)
                    + (depth - 1) * self._at(self.draft, B, t.top_k))
        if plan.k == 0:
            return self._at(self.plain, B)
        return (self._at(self.verify, B, plan.k + 1) + self._at(self.draft, B, plan.k + 1)
                + (plan.k - 1) * self._at(self.draft, B, 1))

    def predicted_speedup(self, tau: float, plan: Plan, B: int = 1) -> float | None:
        """tau tokens per round of `plan` against plain decoding, by this model's times (None when
        the plan's verify size was not measured)."""
        if verify_len(plan) > self.max_T:
            return None
        return tau * self.round_ms(B, Plan()) / self.round_ms(B, plan)

    def cost_ratios(self) -> dict[str, Any]:
        """At batch 1: cost(T)/cost(1) of a verify over T tokens against a plain step, and a draft
        step against a plain step (what `eagle3 bench` reports)."""
        plain = self._at(self.plain, 1)
        return {"cache_len": self.context, "target_forward_ms": plain,
                "verify_cost_ratio": {str(T): self._at(self.verify, 1, T) / plain
                                      for T in range(2, self.max_T + 1)},
                "draft_step_ms": self._at(self.draft, 1, 1),
                "draft_step_over_target_forward": self._at(self.draft, 1, 1) / plain}

    def as_dict(self) -> dict[str, Any]:
        return {"verify_ms": {str(b): [round(x, 3) for x in v] for b, v in self.verify.items()},
                "draft_ms": {str(b): [round(x, 3) for x in v] for b, v in self.draft.items()},
                "plain_ms": {str(b): round(v, 3) for b, v in self.plain.items()}}


class Observed:
    """Measured round times against the model's: per (batch size, plan), a running mean of
    actual / predicted milliseconds. The forwards the model times leave out a round's host
    work (scheduling, layouts, ragged catch-ups); this puts it back, as measured."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        # (batch size, plan, text_drafts) -> ratio; text_drafts: rounds whose rows also draft
        # from the text (`decoding.suffix`), which verify more than the plan's own nodes
        self.ratio: dict[tuple[int, Plan, bool], float] = {}

    def record(self, B: int, plan: Plan, actual_ms: float, predicted_ms: float,
               text_drafts: bool = False) -> None:
        key, r = (B, plan, text_drafts), actual_ms / max(predicted_ms, 1e-6)
        old = self.ratio.get(key)
        self.ratio[key] = r if old is None else (1 - self.weight) * old + self.weight * r

    def seen(self, B: int, plan: Plan, text_drafts: bool = False) -> bool:
        """Whether rounds of `plan` at batch size B were measured."""
        return (B, plan, text_drafts) in self.ratio

    def scale(self, B: int, plan: Plan, text_drafts: bool = False) -> float:
        """The correction for this plan at this batch size. A drafting plan that has not run yet
        borrows the correction of the drafting plan run at this size whose verify is nearest in
        length (else 1): an untried plan would otherwise look cheaper than every tried one, by
        the host work only a run shows, and be tried round after round."""
        own = self.ratio.get((B, plan, text_drafts))
        if own is not None or not plan.drafts:
            return 1.0 if own is None else own
        tried = [(abs(verify_len(p) - verify_len(plan)), r) for (b, p, t), r in self.ratio.items()
                 if b == B and p.drafts and t == text_drafts]
        return min(tried, key=lambda t: t[0])[1] if tried else 1.0


def verify_len(plan: Plan) -> int:
    """Tokens per row a round of `plan` verifies."""
    return plan.tree.total_tokens + 1 if plan.tree is not None else plan.k + 1


def choose_plan(costs: RoundCosts, acceptance: Acceptance, B: int, kmax: int,
                tree: TreeShape | None = None, min_k: int = 0,
                observed: Observed | None = None, text_drafts: bool = False) -> Plan:
    """The plan with the most tokens per millisecond at batch size B: plain (unless min_k > 0;
    drafting must beat it by PLAIN_MARGIN), chains of min_k..kmax, and `tree` when given (ties:
    the cheaper, plain first). With
    `observed`, each plan's predicted time is corrected by its measured rounds: a plan whose
    rounds ran slower than predicted loses its edge, and plain decoding (corrected or not)
    is then picked wherever speculation no longer pays."""
    kmax = min(kmax, costs.max_T - 1)
    # (or min_k alone: a context too short to time min_k + 1 tokens)
    candidates = [Plan(k) for k in range(max(min_k, 0), kmax + 1)] or [Plan(max(min_k, 0))]
    if tree is not None and tree.total_tokens + 1 <= costs.max_T:
        candidates.append(Plan(tree=tree))
    best, best_rate = candidates[0], -1.0
    for plan in candidates:
        tau = (acceptance.tau_tree(plan.tree) if plan.tree is not None else acceptance.tau(plan.k))
        if text_drafts:  # what the text adds to this plan's rounds
            tau += acceptance.text_gain(plan.drafts)
        scale = observed.scale(B, plan, text_drafts) if observed is not None else 1.0
        ms = costs.round_ms(B, plan) * scale
        rate = B * tau / ms * (1.0 if plan.drafts else 1.0 + PLAIN_MARGIN)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = plan, rate
    return best


def draft_forward(runner: Runner, seqs: list[SequenceState], tokens: torch.Tensor, feats: torch.Tensor,
                  layout: Any, context: int) -> None:
    """A draft forward over T tokens per row and its greedy pick, as rounds run it: a lone row
    through the runner's one-op chain where it has one (`one_op_chain`: the LM head on the last
    row only), else the runner's `draft`."""
    if len(seqs) == 1 and runner.one_op_chain(tokens[0], feats[0], context, 1) is not None:
        return
    out, _ = runner.draft(seqs, tokens, feats, layout)
    out.argmax(-1).tolist()


def _time_batch(runner: Runner, seqs: list[SequenceState], context: int, lengths: list[int],
                repeats: int) -> tuple[list[float], list[float], float]:
    """(verify ms per T, draft ms per T, for T = 1..max(lengths); plain step ms) for these rows
    at `context`, measured at T in `lengths`."""
    dev = runner.device
    B = len(seqs)
    T_all = lengths
    tv: dict[int, list[float]] = {T: [] for T in T_all}
    td: dict[int, list[float]] = {T: [] for T in T_all}
    tp: list[float] = []
    starts = [context] * B
    for rep in range(repeats + 1):  # the first pass warms up
        t0 = time.perf_counter()
        logits, _ = runner.target(seqs, torch.ones(B, 1, dtype=torch.long, device=dev),
                                   causal_layout(starts, 1, device=dev), with_features=False,
                                   last_only=True)
        logits.argmax(-1).tolist()
        if rep:
            tp.append((time.perf_counter() - t0) * 1e3)
        for T in T_all:
            tokens = torch.ones(B, T, dtype=torch.long, device=dev)
            layout = causal_layout(starts, T, device=dev)
            t0 = time.perf_counter()
            logits, taps = runner.target(seqs, tokens, layout, with_features=runner.has_draft)
            logits.argmax(-1).tolist()
            # the head's fc over the verified rows, counted with the verify: a round runs it over
            # the accepted ones at the next catch-up, never in the chain's own steps
            feats = runner.features(taps) if taps is not None else None
            t1 = time.perf_counter()
            if feats is not None:
                draft_forward(runner, seqs, tokens, feats, layout, context)
            t2 = time.perf_counter()
            if rep:
                tv[T].append((t1 - t0) * 1e3)
                td[T].append((t2 - t1) * 1e3)
    return (fit_line([statistics.median(tv[T]) for T in T_all], T_all),
            fit_line([statistics.median(td[T]) for T in T_all], T_all), statistics.median(tp))
