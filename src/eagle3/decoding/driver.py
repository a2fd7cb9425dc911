"""The driver: what runs around each round, the same for `generate` (one request, batch 1) and
the engine (its batch).

`Driver.start` makes a request's `SequenceState` (its sampler, its proposer and the
proposer's state, a sampled row's own plan); `Driver.round` asks the `Schedule`
(`decoding.planner`) for the round's plan, prices the text's drafts by the cost model, runs
`decoding.round.run_round`, and hands the verdicts and the round's time back to the schedule,
which teaches the planner. `generate` (`speculator.Eagle3Speculator.run`) loops over it for one
sequence; the engine (`engine.engine.Engine.step`) over its running requests, with admission,
aborts and events around it.
"""

from __future__ import annotations

import time
from typing import Any

from .planner import Planner, Schedule
from .proposers import PROPOSERS
from .request import SAMPLING_K, GenerationRequest
from .round import run_round, usual_catch_up
from .sampling import Sampler
from .suffix import SuffixBudget
from .types import Plan, SequenceState, Verdict


class Driver:
    """Rounds on one runner under one planner."""

    def __init__(self, runner: Any, planner: Planner) -> None:
        self.runner, self.planner = runner, planner

    def start(self, id: str, req: GenerationRequest, schedule: Schedule) -> SequenceState:
        """A checked request's decoding state (`req.proposer` resolved). A sampled request under
        automatic plans drafts its own fixed chain: its draws then never depend on timings or on
        the batch it shares."""
        proposer = PROPOSERS[req.proposer]
        sampler = None if req.sampling.greedy else Sampler(req.sampling, self.runner.device)
        head = self.runner.has_draft and proposer.uses_head
        own = Plan(SAMPLING_K) if sampler is not None and getattr(schedule, "automatic", False) else None
        seq = SequenceState(id, req.prompt, req.max_new_tokens, req.stop_ids, sampler, drafts=head,
                            plan=own, proposer=proposer if head or not proposer.uses_head else None)
        if seq.proposer is not None:
            seq.proposer.start(seq, self.planner.suffix_runs if sampler is None else None)
        return seq

    def round(self, seqs: list[SequenceState], schedule: Schedule) -> tuple[Plan, list[Verdict]]:
        """One round over `seqs` (none done): its plan and each row's verdict."""
        text_drafts = any(s.suffix is not None for s in seqs)
        plan = schedule.plan(len(seqs), text_drafts)
        # A row's first drafting round also runs the head over its prompt, and one after plain
        # rounds over their tokens: not the plan's usual cost, which the schedule must not learn.
        typical = all(usual_catch_up(s, s.plan or plan) for s in seqs)
        t0 = time.perf_counter()
        self.price_text_drafts(seqs, plan)
        verdicts = run_round(self.runner, seqs, plan)
        schedule.after(seqs, plan, verdicts, (time.perf_counter() - t0) * 1e3, typical, text_drafts)
        return plan, verdicts

    def price_text_drafts(self, seqs: list[SequenceState], plan: Plan) -> None:
        """What text nodes cost in this round (`decoding.suffix`), the same for every greedy row;
        sampled rows keep the fixed rule, so that a seed's draws never depend on the batch or on
        timings."""
        budgets: dict[int, SuffixBudget | None] = {}
        for s in seqs:
            if s.suffix is not None and s.sampler is None:
                n = s.suffix.nodes
                if n not in budgets:
                    budgets[n] = self.planner.suffix_budget(len(seqs), plan, n)
                s.suffix.budget = budgets[n]
