"""Plans, for both drivers (`decoding.driver`): one `Planner` per speculator or engine, and
the `Schedule` that says which plan each round of a generation or of the engine runs.

A `Planner` holds the cost model (`costs.RoundCosts`, measured once on its runner), the
acceptance seen so far (`costs.Acceptance`) and the measured round times against the model's
(`costs.Observed`), and chooses the plan with the most tokens per millisecond
(`costs.choose_plan`). `Planner.schedule` turns a request's choices (fixed K, a tree,
sampling, automatic) into a schedule:

- `Fixed`: the same plan every round (a given K or tree, a sampled request's chain, no head);
- `Held` (the engine's automatic plans): a choice holds for REPICK_EVERY rounds at one batch
  size (a choice every round would chase the noise in single rounds' timings);
- `Adaptive` (one per automatic generation at batch 1): again after 2, 4 and every 8 drafting
  rounds; plain rounds re-probe the head with K=1 every PROBE_EVERY rounds; and once per
  planner, EXPLORE_PLAIN plain rounds are timed before drafting is trusted to pay.

`text_drafts` everywhere: whether some rows of the round also draft from the text
(`decoding.suffix`), whose gain the plan counts and whose round times are kept apart.
"""

from __future__ import annotations

from typing import Any, Protocol

from .costs import REPICK_EVERY as REPICK_EVERY
from .costs import Acceptance, Observed, RoundCosts, choose_plan, repick_now, verify_len
from .request import SAMPLING_K
from .suffix import SuffixBudget
from .tree import TreeShape
from .types import Plan, SequenceState, Verdict

PROBE_EVERY = 32  # plain rounds of automatic K between probes of the head (K=1)
EXPLORE_PLAIN = 8  # plain rounds automatic K runs once per planner to time them
PLAIN_SETTLE = 3  # plain rounds after drafting ones that are not timed: the head's forwards evicted
#                   part of the target from the caches, and the next few steps refill them


class Planner:
    """The cost model, the acceptance and the observed round times of one driver; chooses plans."""

    def __init__(self, kmax: int, tree: TreeShape | None = None) -> None:
        self.kmax, self.tree = kmax, tree
        self.costs: RoundCosts | None = None
        self.acceptance = Acceptance(max(kmax, 1))  # over every round this planner saw
        self.observed = Observed()
        self.explored = False  # whether plain rounds were timed (`Adaptive`)
        # Text drafts' runs over every request of this driver, per proposer kind (`decoding.suffix`)
        self.suffix_runs: dict[str, list[list[int]]] = {}
        # suffix_extra_ms per (B, plan, nodes) of one cost model (it is asked every round)
        self._extra: tuple[RoundCosts | None, dict] = (None, {})
        self._held: tuple[int, Plan, int] | None = None  # (batch size, plan, rounds it ran)

    def measure(self, runner: Any, batch_sizes: list[int], max_T: int, context: int) -> RoundCosts:
        """Time the runner's forwards on its probe rows (`RoundCosts.measure`) and keep them."""
        self.costs = RoundCosts.measure(runner, runner.probe_rows, batch_sizes, max_T, context)
        return self.costs

    def forget_costs(self) -> None:
        """After the runner changes (compiled): its costs and observed times are stale."""
        self.costs, self.observed, self._held = None, Observed(), None

    def choose(self, B: int, text_drafts: bool = False) -> Plan:
        """The plan with the most tokens per millisecond at batch size B, plain decoding included."""
        return choose_plan(self.costs, self.acceptance, B, self.kmax, self.tree, observed=self.observed,
                           text_drafts=text_drafts)

    def observe(self, B: int, plan: Plan, ms: float, text_drafts: bool = False, nodes: int = 0) -> None:
        """A round of `plan` at batch size B took `ms`, verifying `nodes` drafted nodes in its
        widest row: corrects the model's time for it. Nodes past the plan's own (the text's) are
        priced by the model too, so the correction measures the round's host work, not how many
        text nodes happened to ride along."""
        extra = nodes - (verify_len(plan) - 1 if plan.drafts else 0)
        predicted = self.costs.round_ms(B, plan)
        if extra > 0:
            predicted += self._suffix_extra(B, plan, extra)[extra]
        self.observed.record(B, plan, ms, predicted, text_drafts)

    def _suffix_extra(self, B: int, plan: Plan, nodes: int) -> tuple[float, ...]:
        """`RoundCosts.suffix_extra_ms`, kept per cost model (asked every round)."""
        if self._extra[0] is not self.costs:
            self._extra = (self.costs, {})
        memo = self._extra[1]
        extra = memo.get((B, plan, nodes))
        if extra is None:
            extra = memo[B, plan, nodes] = self.costs.suffix_extra_ms(B, plan, nodes)
        return extra

    def learn(self, seqs: list[SequenceState], verdicts: list[Verdict], plan: Plan) -> None:
        """A round's acceptance, row by row (failed rows apart): what the text added beyond the
        head for rows that draft from it, and the head's own acceptance (the text's nodes teach
        nothing about the head)."""
        for s, v in zip(seqs, verdicts, strict=True):
            if v.error is not None:
                continue
            if s.suffix is not None:
                self.acceptance.record_text(bool(v.head_nodes), v.text_accepted)
            if v.head_nodes:
                self.acceptance.record(v.head_nodes, v.head_accepted, tree=plan.tree is not None)

    def suffix_budget(self, B: int, plan: Plan, nodes: int) -> SuffixBudget | None:
        """What suffix nodes cost in a round of `plan` at batch size B (`decoding.suffix`): the
        milliseconds per emitted token of the round and the extra milliseconds of 0..nodes more
        verify tokens; None before the cost model is measured."""
        if self.costs is None:
            return None
        a = self.acceptance
        tau = (a.tau_tree(plan.tree) if plan.tree is not None else a.tau(plan.k)) if plan.drafts else 1.0
        ms = self.costs.round_ms(B, plan) * self.observed.scale(B, plan, True)
        return SuffixBudget(ms / (B * tau), self._suffix_extra(B, plan, nodes))

    def held(self, B: int, text_drafts: bool = False) -> Plan:
        """The engine's plan for a batch of B rows: chosen again after REPICK_EVERY rounds at one
        batch size, or when the batch changes."""
        h = self._held
        if h is not None and h[0] == (B, text_drafts) and h[2] < REPICK_EVERY:
            self._held = (h[0], h[1], h[2] + 1)
            return h[1]
        plan = self.choose(B, text_drafts)
        self._held = ((B, text_drafts), plan, 1)
        return plan

    def schedule(self, *, drafts: bool, k: int | None = None, tree: TreeShape | None = None,
                 greedy: bool = True, automatic: bool = True, batched: bool = False) -> Schedule:
        """The schedule for a request's rounds (`batched`: the engine's, over every request):
        plain decoding without drafts from the head; a given tree or K; a sampled request's
        fixed chain (SAMPLING_K: its draws then never depend on timings); else automatic."""
        if not drafts:
            return Fixed(Plan())
        if tree is not None and (not automatic or not batched):
            return Fixed(Plan(tree=tree))
        if k is not None:
            return Fixed(Plan(k))
        if not greedy and not batched:
            return Fixed(Plan(SAMPLING_K))
        return Held(self) if batched else Adaptive(self)


class Schedule(Protocol):
    """Which plan each round runs, and what the planner learns from it."""

    automatic: bool  # whether the planner chooses the plans

    def plan(self, B: int, text_drafts: bool) -> Plan: ...

    def after(self, seqs: list[SequenceState], plan: Plan, verdicts: list[Verdict], ms: float,
              typical: bool, text_drafts: bool) -> None: ...


class Fixed:
    """The same plan every round; nothing to learn."""

    automatic = False

    def __init__(self, plan: Plan) -> None:
        self.fixed = plan

    def plan(self, B: int, text_drafts: bool) -> Plan:
        return self.fixed

    def after(self, seqs: list[SequenceState], plan: Plan, verdicts: list[Verdict], ms: float,
              typical: bool, text_drafts: bool) -> None:
        pass


class Held:
    """The engine's automatic plans (`Planner.held`); every round teaches the planner."""

    automatic = True

    def __init__(self, planner: Planner) -> None:
        self.planner = planner

    def plan(self, B: int, text_drafts: bool) -> Plan:
        return self.planner.held(B, text_drafts)

    def after(self, seqs: list[SequenceState], plan: Plan, verdicts: list[Verdict], ms: float,
              typical: bool, text_drafts: bool) -> None:
        """A round of `plan` over `seqs` took `ms`; `typical`: no row's catch-up covered more
        than a drafting round leaves (`round.usual_catch_up`), so its time is the plan's."""
        planner = self.planner
        if planner.costs is not None and (typical or not plan.drafts):
            planner.observe(len(seqs), plan, ms, text_drafts, max(len(v.depths) for v in verdicts))
        planner.learn(seqs, verdicts, plan)


class Adaptive:
    """Automatic K through one generation at batch 1: `plan` is the next round's; `after` takes
    each round's verdict and time and moves it on."""

    automatic = True

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.next: Plan | None = None  # chosen at the first round (text_drafts known then)
        self.plain_rounds = 0  # plain rounds so far
        self.plain_streak = 0  # plain rounds in a row, the last one included
        self.explore = 0  # plain rounds left to time

    def plan(self, B: int, text_drafts: bool) -> Plan:
        if self.next is None:
            self.next = self.planner.choose(1, text_drafts)
        return self.next

    def after(self, seqs: list[SequenceState], plan: Plan, verdicts: list[Verdict], ms: float,
              typical: bool, text_drafts: bool) -> None:
        """The plan after a round of `plan` that gave `verdicts` (one row) in `ms` milliseconds;
        `typical`: the round did not also run the head over the prompt."""
        (s,), (v,) = seqs, verdicts
        p, planner = plan, self.planner
        if v.error is not None:
            return
        self.plain_streak = self.plain_streak + 1 if not p.drafts else 0
        planner.learn(seqs, verdicts, p)
        if v.head_nodes:  # the head drafted (nodes from the text alone teach nothing about it)
            if v.head_nodes == p.k and typical:  # a full round of the plan (text nodes included)
                planner.observe(1, p, ms, text_drafts, len(v.depths))
            if repick_now(s.stats.rounds):
                p = planner.choose(1, text_drafts)
                if p.drafts and not planner.explored and not planner.observed.seen(1, Plan(), text_drafts):
                    # Plain rounds were never timed here: the calibration's few forwards can
                    # misjudge them on a busy machine, and only a run puts them right.
                    p, self.explore, planner.explored = Plan(), EXPLORE_PLAIN, True
        elif not p.drafts:
            # Plain rounds teach nothing about the head (the draft's backlog is kept, so it can
            # resume): every PROBE_EVERY of them, rounds of K=1 measure its acceptance on this
            # text again before the next choice.
            self.plain_rounds += 1
            if self.plain_streak > PLAIN_SETTLE:  # steady plain decoding, as plain would run
                planner.observe(1, p, ms, text_drafts, len(v.depths))
            if self.explore:
                self.explore -= 1
                if not self.explore:
                    p = planner.choose(1, text_drafts)
            elif self.plain_rounds % PROBE_EVERY == 0:
                p = Plan(1)
        self.next = p
