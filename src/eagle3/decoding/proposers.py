"""Who drafts a round's nodes: the `Proposer` interface, its implementations and their registry.

Each row of a round has a proposer (`SequenceState.proposer`, named by its request and
resolved by `decoding.request.resolve_proposer`). The round (`decoding.round`) asks each
proposer for the `Proposal`s of its rows (`propose_round`), verifies them all in one target
forward, and after the commit tells each row's proposer its `Verdict` (`observe`):

    eagle    the EAGLE-3 head, through the runner's `draft_chain` / `draft_tree`
             (`decoding.drafting`), K chain tokens or the plan's tree
    suffix   continuations of earlier matches in the text (`decoding.suffix`), no head
    hybrid   both: the text's chain grafted onto the head's nodes (`decoding.graft`)

A proposer holds no per-request state itself; what a request needs (the text's index) lives on
its `SequenceState`, made by `start`. Adding a drafter (an n-gram corpus, MTP heads, a small
draft model) is one subclass of `Proposer` and one `register` line.
"""

from __future__ import annotations

from typing import Any

from .graft import chain_alone, merge_chains
from .suffix import PRIOR_ALONE, PRIOR_EXTRA, SuffixState, new_runs
from .types import Plan, Proposal, SequenceState, Verdict


class Proposer:
    """Drafts nodes for the rows that chose it. Class attributes say what it needs:
    `uses_head` (its rows draft through the EAGLE head: a head must be loaded, and the
    round queues the head's backlog for them), `grafts` (its proposals may be trees under a
    chain plan: a runner that verifies trees), `greedy_only` (it draws nothing, so a sampled
    request's drafts would lose the draft distribution: it is never a sampled request's
    default)."""

    name = ""
    uses_head = False
    grafts = False
    greedy_only = False

    def start(self, seq: SequenceState, pools: dict[str, list[list[int]]] | None) -> None:
        """A request's own state, at admission (`pools`: its driver's shared statistics, None for
        sampled requests, whose drafts must not depend on the requests before them)."""

    def nodes(self, seq: SequenceState, max_len: int, head_nodes: int) -> int:
        """The most nodes this row may verify this round beyond the head's `head_nodes` (the
        round reserves cache pages for them)."""
        return 0

    def propose(self, runner: Any, rows: list[SequenceState], plan: Plan,
                counts: list[int]) -> list[Proposal]:
        """The rows' proposals, each proposal's `rows` indexing `rows`; `counts[g]`: the head
        nodes the plan grants row g (0: none this round)."""
        raise NotImplementedError

    def observe(self, seq: SequenceState, verdict: Verdict) -> None:
        """A committed verdict of this row (its `new` tokens emitted)."""


def room(seq: SequenceState, max_len: int, head_nodes: int, most: int) -> int:
    """Nodes a row may add to its `head_nodes`, up to `most`: within the cache (the commit must
    fit, as `round.grant`) and what the row may still emit past the next token (so its positions
    stay within prompt + max_new_tokens + head nodes: the engine's worst case per request needs
    no more pages)."""
    return max(0, min(most, max_len - seq.target_len - 2 - head_nodes, seq.room() - 1))


class HeadProposer(Proposer):
    """The EAGLE-3 head: the plan's chain or tree, drafted in the runner's way."""

    name = "eagle"
    uses_head = True

    def propose(self, runner: Any, rows: list[SequenceState], plan: Plan,
                counts: list[int]) -> list[Proposal]:
        if not plan.drafts or not any(counts):
            return []
        p = (runner.draft_tree(rows, plan.tree, counts) if plan.tree is not None
             else runner.draft_chain(rows, plan.k, counts))
        p.rows = list(range(len(rows)))
        return [p]


class SuffixProposer(Proposer):
    """Drafts from the text itself (`decoding.suffix`): a chain per row, priced by the cost
    model's budget that the driver sets on the row's `SuffixState` before each round."""

    name = "suffix"
    greedy_only = True
    prior = PRIOR_ALONE  # tokens a proposal adds by match length, before this workload's runs

    def start(self, seq: SequenceState, pools: dict[str, list[list[int]]] | None) -> None:
        pool = pools.setdefault(self.name, new_runs()) if pools is not None else None
        seq.suffix = SuffixState.over(seq.prompt, prior=self.prior, pool=pool)

    def nodes(self, seq: SequenceState, max_len: int, head_nodes: int) -> int:
        return room(seq, max_len, head_nodes, seq.suffix.nodes)

    def chains(self, runner: Any, rows: list[SequenceState], heads: list[int]) -> dict[int, list[int]]:
        """Row g's text chain after its `heads[g]` head nodes, for the rows with one."""
        out = {}
        for g, s in enumerate(rows):
            s.suffix.catch_up(s.out, len(s.prompt))
            chain = s.suffix.propose(self.nodes(s, runner.max_len, heads[g]))
            if chain:
                out[g] = chain
        return out

    def propose(self, runner: Any, rows: list[SequenceState], plan: Plan,
                counts: list[int]) -> list[Proposal]:
        chains = self.chains(runner, rows, [0] * len(rows))
        return [chain_alone(g, chain, runner.device) for g, chain in chains.items()]

    def observe(self, seq: SequenceState, verdict: Verdict) -> None:
        if verdict.suffix is not None:  # how far the text's chain agreed, what it alone added
            kept = verdict.tokens[:len(verdict.path)]
            agreed = next((i for i, (x, y) in enumerate(zip(verdict.suffix, kept)) if x != y),
                          min(len(verdict.suffix), len(kept)))
            seq.suffix.observe(agreed, verdict.text_accepted)


class HybridProposer(SuffixProposer):
    """The head's nodes with the text's chain grafted in, one tree per row that has both."""

    name = "hybrid"
    uses_head = True
    grafts = True
    prior = PRIOR_EXTRA  # beyond the head's chain

    def propose(self, runner: Any, rows: list[SequenceState], plan: Plan,
                counts: list[int]) -> list[Proposal]:
        head = HEAD.propose(runner, rows, plan, counts)
        drafted = [0] * len(rows)
        for p in head:
            for g, b in enumerate(p.rows):
                drafted[b] = p.counts[g]
        return merge_chains(head, self.chains(runner, rows, drafted), runner.device)


PROPOSERS: dict[str, Proposer] = {}


def register(proposer: Proposer) -> Proposer:
    """Make `proposer` a name requests may ask for (`--proposer`, the API's `proposer`)."""
    PROPOSERS[proposer.name] = proposer
    return proposer


HEAD = register(HeadProposer())  # also the drafter of hybrid rows and of rows built without a proposer
register(SuffixProposer())
register(HybridProposer())


def propose_round(runner: Any, seqs: list[SequenceState], plans: list[Plan],
                  grants: list[int]) -> list[Proposal]:
    """Every row's proposals, `rows` in batch indices: rows draft together when they share a
    proposer, a plan, and for trees one depth (a row near the cache's end expands fewer levels),
    so a row's proposal never depends on the batch it shares."""
    groups: dict[tuple[Proposer, Plan, int], list[int]] = {}
    for b, (s, p, n) in enumerate(zip(seqs, plans, grants, strict=True)):
        proposer = s.proposer or (HEAD if s.drafts else None)
        if proposer is not None:
            key = (p, min(p.tree.depth, n) if p.tree else 0) if n else (Plan(), 0)
            groups.setdefault((proposer, *key), []).append(b)
    out = []
    for (proposer, p, _), rows in groups.items():
        for proposal in proposer.propose(runner, [seqs[b] for b in rows], p, [grants[b] for b in rows]):
            proposal.rows = [rows[g] for g in proposal.rows]
            out.append(proposal)
    return out
