"""Automatic plans, for both drivers: one `Planner` per speculator or engine.

A `Planner` holds the cost model (`costs.RoundCosts`, measured once on its runner), the
acceptance seen so far (`costs.Acceptance`) and the measured round times against the model's
(`costs.Observed`), and chooses the plan with the most tokens per millisecond
(`costs.choose_plan`). When to choose again differs by driver, and is written here too:

- the engine (`held`): a choice holds for REPICK_EVERY rounds at one batch size (a choice
  every round would chase the noise in single rounds' timings);
- `generate` (`Generation`, one per generation at batch 1): again after 2, 4 and every 8
  drafting rounds; plain rounds re-probe the head with K=1 every PROBE_EVERY rounds; and once
  per planner, EXPLORE_PLAIN plain rounds are timed before drafting is trusted to pay.
"""

from __future__ import annotations

from typing import Any

from .costs import REPICK_EVERY as REPICK_EVERY
from .costs import Acceptance, Observed, RoundCosts, choose_plan, repick_now, verify_len
from .suffix import SuffixBudget
from .tree import TreeShape
from .types import Plan, Verdict

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
        self.explored = False  # whether plain rounds were timed (`Generation`)
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

    def choose(self, B: int, text: bool = False) -> Plan:
        """The plan with the most tokens per millisecond at batch size B, plain decoding included
        (`text`: for rows that also draft from the text)."""
        return choose_plan(self.costs, self.acceptance, B, self.kmax, self.tree, observed=self.observed,
                           text=text)

    def observe(self, B: int, plan: Plan, ms: float, text: bool = False, nodes: int = 0) -> None:
        """A round of `plan` at batch size B took `ms`, verifying `nodes` drafted nodes in its
        widest row: corrects the model's time for it. Nodes past the plan's own (the text's) are
        priced by the model too, so the correction measures the round's host work, not how many
        text nodes happened to ride along."""
        extra = nodes - (verify_len(plan) - 1 if plan.drafts else 0)
        predicted = self.costs.round_ms(B, plan)
        if extra > 0:
            predicted += self._suffix_extra(B, plan, extra)[extra]
        self.observed.record(B, plan, ms, predicted, text)

    def _suffix_extra(self, B: int, plan: Plan, nodes: int) -> tuple[float, ...]:
        """`RoundCosts.suffix_extra_ms`, kept per cost model (asked every round)."""
        if self._extra[0] is not self.costs:
            self._extra = (self.costs, {})
        memo = self._extra[1]
        extra = memo.get((B, plan, nodes))
        if extra is None:
            extra = memo[B, plan, nodes] = self.costs.suffix_extra_ms(B, plan, nodes)
        return extra

    def record(self, drafted: int, accepted: int, tree: bool = False) -> None:
        """One drafting round's acceptance (drafted = the chain's K; a tree's accepted path)."""
        self.acceptance.record(drafted, accepted, tree=tree)

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

    def held(self, B: int, text: bool = False) -> Plan:
        """The engine's plan for a batch of B rows (`text`: some draft from the text too): chosen
        again after REPICK_EVERY rounds at one batch size, or when the batch changes."""
        h = self._held
        if h is not None and h[0] == (B, text) and h[2] < REPICK_EVERY:
            self._held = (h[0], h[1], h[2] + 1)
            return h[1]
        plan = self.choose(B, text)
        self._held = ((B, text), plan, 1)
        return plan

    def generation(self, text: bool = False) -> Generation:
        """The plans of one generation at batch 1 (`generate`), starting from a fresh choice
        (`text`: the row also drafts from the text)."""
        return Generation(self, text)


class Generation:
    """Automatic K through one generation at batch 1: `plan` is the next round's; `after` takes
    each round's verdict and time and moves it on."""

    def __init__(self, planner: Planner, text: bool = False) -> None:
        self.planner, self.text = planner, text
        self.plan = planner.choose(1, text)
        self.plain_rounds = 0  # plain rounds so far
        self.plain_streak = 0  # plain rounds in a row, the last one included
        self.explore = 0  # plain rounds left to time

    def after(self, v: Verdict, drafting_rounds: int, ms: float, typical: bool) -> Plan:
        """The plan after a round of `self.plan` that gave `v` in `ms` milliseconds;
        `drafting_rounds` so far in this generation; `typical`: the round did not also run the
        head over the prompt."""
        p, planner = self.plan, self.planner
        self.plain_streak = self.plain_streak + 1 if not p.drafts else 0
        if self.text:  # what the text added, beyond the head
            planner.acceptance.record_text(bool(v.head_nodes), v.text_accepted)
        if v.head_nodes:  # the head drafted (nodes from the text alone teach nothing about it)
            planner.record(v.head_nodes, v.head_accepted)
            if v.head_nodes == p.k and typical:  # a full round of the plan (text nodes included)
                planner.observe(1, p, ms, self.text, len(v.depths))
            if repick_now(drafting_rounds):
                p = planner.choose(1, self.text)
                if p.drafts and not planner.explored and not planner.observed.seen(1, Plan(), self.text):
                    # Plain rounds were never timed here: the calibration's few forwards can
                    # misjudge them on a busy machine, and only a run puts them right.
                    p, self.explore, planner.explored = Plan(), EXPLORE_PLAIN, True
        elif not p.drafts:
            # Plain rounds teach nothing about the head (the draft's backlog is kept, so it can
            # resume): every PROBE_EVERY of them, rounds of K=1 measure its acceptance on this
            # text again before the next choice.
            self.plain_rounds += 1
            if self.plain_streak > PLAIN_SETTLE:  # steady plain decoding, as plain would run
                planner.observe(1, p, ms, self.text, len(v.depths))
            if self.explore:
                self.explore -= 1
                if not self.explore:
                    p = planner.choose(1, self.text)
            elif self.plain_rounds % PROBE_EVERY == 0:
                p = Plan(1)
        self.plan = p
        return p
