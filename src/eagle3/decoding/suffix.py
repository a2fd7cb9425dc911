"""Drafts from the text itself: a per-request suffix index proposes the continuation of the
longest earlier match of the text's end (prompt lookup / suffix decoding), at no draft forward.

`SuffixIndex` maps every n-gram of the request's tokens (n = 1..max_match) to the position
right after its latest occurrence, updated as tokens are accepted: the text's last n tokens
find their latest earlier occurrence in one dictionary lookup per n, longest first. (A suffix
automaton would find unbounded matches; matches past `max_match` tokens add nothing measurable,
docs/suffix.md, and the table gives the latest occurrence, which is the one that repeats.)
Its memory is bounded by max_match entries per token and freed with the request.

`SuffixProposer` adds what decides how many nodes a proposal is worth: the tokens its
proposals added per match length (shrunk towards a measured prior), against what d more
verify tokens cost in this round (`SuffixBudget`, from the cost model). The round
(`decoding.round`) grafts the proposal onto the head's chain or tree (`add_suffix_drafts`):
a node is shared where the two agree, the rest is a new branch, verified in the same target
forward under one ancestor mask (docs/suffix.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import Eagle3Error
from .tree import chain_proposal
from .types import Proposal, SequenceState

PROPOSERS = ("eagle", "suffix", "hybrid")
DEFAULT_PROPOSER = "hybrid"  # with a head (docs/suffix.md: never below the head alone)
MAX_MATCH = 8  # longest n-gram indexed
MIN_MATCH = 1  # shortest match that may propose (the cost model decides whether it does)
SUFFIX_NODES = 8  # most suffix nodes a row verifies per round
MIN_GAIN = 1.0  # without a cost model: the expected tokens a proposal of SUFFIX_NODES must add
# Tokens a proposal of 8 nodes adds, by match length (index = length, 8 = 8 or more), measured
# on the default's greedy outputs (held-out ShareGPT, HumanEval, `rewrite`; docs/suffix.md,
# docs/bench/suffix-gain.json), rounded down across the sets: alone, and beyond the head's
# chain of 4 (hybrid). Each request's own runs take over from these (PRIOR_WEIGHT proposals).
PRIOR_ALONE = (0.0, 0.7, 1.5, 2.4, 3.0, 3.0, 3.5, 3.5, 6.0)
PRIOR_EXTRA = (0.0, 0.6, 1.5, 2.1, 2.8, 2.8, 3.0, 3.0, 5.0)
PRIOR_WEIGHT = 2.0


def resolve_proposer(proposer: str | None, has_head: bool, trees: bool = True,
                     greedy: bool = True) -> str:
    """Who drafts: 'eagle' (the head alone; without a head, plain decoding), 'suffix' (the text
    alone, no head needed) or 'hybrid' (both, one tree: needs a runner that verifies trees).
    None: DEFAULT_PROPOSER for a greedy request with a head on a tree-capable runner, else
    'eagle' (a sampled chain grafted with suffix nodes loses its draft q: docs/suffix.md)."""
    if proposer is None:
        return DEFAULT_PROPOSER if has_head and trees and greedy else "eagle"
    if proposer not in PROPOSERS:
        raise Eagle3Error(f"proposer must be one of {', '.join(PROPOSERS)}, got {proposer!r}")
    if proposer in ("eagle", "hybrid") and not has_head:
        raise Eagle3Error(f"proposer '{proposer}' needs a draft head; load one, or use "
                          "proposer='suffix' (drafts from the text alone)")
    if proposer == "hybrid" and not trees:
        raise Eagle3Error("proposer 'hybrid' verifies a tree, which the transformers adapter "
                          "cannot; load with backend='native' or use proposer 'eagle' or 'suffix'")
    return proposer


class SuffixIndex:
    """The latest earlier occurrence of each n-gram (n <= max_match) of a growing token list."""

    def __init__(self, tokens: list[int] = (), max_match: int = MAX_MATCH) -> None:
        if max_match < 1:
            raise Eagle3Error(f"max_match must be >= 1, got {max_match}")
        self.max_match = max_match
        self.text: list[int] = []
        self.table: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.text)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens. The n-grams ending at the last token are indexed only when the next
        one arrives (their continuation), so a lookup never finds the text's end itself."""
        text, table = self.text, self.table
        for t in tokens:
            end = len(text)  # the n-grams ending at end - 1 now have a continuation: text[end]
            for n in range(1, min(self.max_match, end) + 1):
                table[tuple(text[end - n:end])] = end
            text.append(int(t))

    def match(self, min_match: int = 1) -> tuple[int, int]:
        """(length, start) of the longest suffix of the text (>= min_match tokens) seen earlier,
        and where its latest occurrence's continuation starts; (0, -1) when there is none."""
        text = self.text
        for n in range(min(self.max_match, len(text) - 1), min_match - 1, -1):
            at = self.table.get(tuple(text[-n:]))
            if at is not None:
                return n, at
        return 0, -1

    def continuation(self, start: int, n: int) -> list[int]:
        """n tokens from `start`, read on past the text's end as the repetition it implies (a
        continuation that runs into the text's end goes on with what it just proposed)."""
        text = self.text
        out: list[int] = []
        for i in range(n):
            j = start + i
            out.append(text[j] if j < len(text) else out[j - len(text)])
        return out


@dataclass(frozen=True)
class SuffixBudget:
    """What verify slots cost this round, by the cost model (`planner.Planner.suffix_budget`):
    the milliseconds one emitted token costs, and the extra milliseconds of d more nodes."""

    ms_per_token: float
    extra_ms: tuple[float, ...]  # extra_ms[d], d = 0..nodes


@dataclass
class SuffixProposer:
    """One request's suffix drafts: the index, and per match length the tokens its proposals
    added (a histogram of runs), which decide how many nodes the next proposal gets."""

    index: SuffixIndex
    prior: tuple[float, ...] = PRIOR_ALONE  # tokens a proposal adds by match length, before data
    min_match: int = MIN_MATCH
    nodes: int = SUFFIX_NODES  # most nodes per round
    budget: SuffixBudget | None = None  # set by the driver before each round; None: MIN_GAIN rules
    runs: list[list[int]] = field(default_factory=list)  # [match length][run] -> proposals
    # The runs of every request of one driver with this prior (`new_runs`, shared and added to):
    # the fixed prior shrunk towards them is this request's prior, so that a workload whose text
    # drafts fail (or pay) stops re-learning that in each request.
    pool: list[list[int]] | None = None
    last: tuple[int, int] = (0, 0)  # the pending proposal's (match length, nodes)

    def __post_init__(self) -> None:
        self.runs = self.runs or new_runs(self.nodes)

    @classmethod
    def over(cls, tokens: list[int], **kw: object) -> SuffixProposer:
        return cls(SuffixIndex(tokens), **kw)

    def gain(self, length: int, d: int) -> float:
        """Expected tokens a proposal of d nodes after a match of `length` tokens adds: this
        request's runs (each counted up to d), shrunk towards the driver's pooled runs, shrunk in
        turn towards the fixed prior (spread evenly over the nodes: the measured gains are of
        SUFFIX_NODES-node proposals)."""
        return self.gains(length, d)[d]

    def gains(self, length: int, n: int) -> list[float]:
        """`gain(length, d)` for d = 0..n, in one pass over the histograms (asked every round)."""
        at = min(length, MAX_MATCH)
        est = [self.prior[at] * d / SUFFIX_NODES for d in range(n + 1)]
        for hist in ([self.pool[at]] if self.pool is not None else []) + [self.runs[at]]:
            total = sum(hist)
            if not total:  # no runs: the estimate stays
                continue
            # seen(d) = sum_r c_r min(r, d): each step in d adds the runs longer than d
            seen, longer = 0, total - hist[0]
            for d in range(1, n + 1):
                seen += longer
                longer -= hist[d] if d < len(hist) else 0
                est[d] = (seen + est[d] * PRIOR_WEIGHT) / (total + PRIOR_WEIGHT)
            est[0] = est[0] * PRIOR_WEIGHT / (total + PRIOR_WEIGHT)
        return est

    def choose(self, length: int, n: int) -> int:
        """Nodes to propose (0..n) after a match of `length`: the most expected tokens per
        millisecond by the budget, else n when the expected gain reaches MIN_GAIN."""
        b = self.budget
        if b is None or len(b.extra_ms) <= 1:
            return n if self.gain(length, n) >= MIN_GAIN else 0
        best, best_net = 0, 0.0
        top = min(n, len(b.extra_ms) - 1)
        gains = self.gains(length, top)
        for d in range(1, top + 1):
            net = gains[d] * b.ms_per_token - b.extra_ms[d]
            if net > best_net:
                best, best_net = d, net
        return best

    def propose(self, n: int) -> list[int]:
        """Up to n tokens to verify after the text (empty: no match worth verifying)."""
        self.last = (0, 0)
        if n <= 0:
            return []
        length, start = self.index.match(self.min_match)
        d = self.choose(length, n) if length else 0
        if not d:
            return []
        self.last = (length, d)
        return self.index.continuation(start, d)

    def observe(self, agreed: int, added: int) -> None:
        """The pending proposal's outcome: its first `agreed` tokens were accepted, `added` of the
        accepted tokens only it proposed (the head's nodes held the rest). A proposal accepted
        whole counts as a run of `nodes` (it might have gone on), so that a short proposal that
        paid leads to longer ones."""
        length, d = self.last
        if d:
            run = self.nodes if agreed >= d else min(added, self.nodes)
            for hist in (self.runs, self.pool) if self.pool is not None else (self.runs,):
                hist[min(length, MAX_MATCH)][run] += 1
            self.last = (0, 0)


def new_runs(nodes: int = SUFFIX_NODES) -> list[list[int]]:
    """An empty histogram of runs: [match length 0..MAX_MATCH][tokens added 0..nodes]."""
    return [[0] * (nodes + 1) for _ in range(MAX_MATCH + 1)]


def suffix_proposer(proposer: str | None, prompt: list[int],
                    pools: dict[str, list[list[int]]] | None = None) -> SuffixProposer | None:
    """A request's proposer over its prompt when `proposer` drafts from the text, else None;
    `pools`: a driver's pooled runs per proposer kind (`SuffixProposer.pool`), grown here. Greedy
    requests only: a sampled request's drafts (so its random draws) must not depend on the
    requests before it."""
    if proposer not in ("suffix", "hybrid"):
        return None
    pool = pools.setdefault(proposer, new_runs()) if pools is not None else None
    return SuffixProposer.over(prompt, prior=PRIOR_EXTRA if proposer == "hybrid" else PRIOR_ALONE,
                               pool=pool)


def graft(tokens: list[int], parents: list[int], chain: list[int]) -> tuple[list[int], list[int], int]:
    """Merge a chain of tokens under the root into a tree given as node tokens and parents (node
    j = 1..N has tokens[j-1], parents[j-1], 0 = the root): follow the tree while a child carries
    the chain's next token, then hang the rest of the chain there as new nodes. Returns the new
    nodes' tokens and parents and the number of chain tokens the tree already held."""
    children = {(p, t): j for j, (t, p) in enumerate(zip(tokens, parents, strict=True), start=1)}
    node, shared = 0, 0
    while shared < len(chain) and (node, chain[shared]) in children:
        node = children[(node, chain[shared])]
        shared += 1
    new_tokens, new_parents = [], []
    nxt = len(tokens) + 1
    for t in chain[shared:]:
        new_tokens.append(t)
        new_parents.append(node)
        node, nxt = nxt, nxt + 1
    return new_tokens, new_parents, shared


def grow_mask(mask: torch.Tensor, depth: torch.Tensor,
              parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """An ancestor mask (N+1, N+1) and depths (N+1,) grown by nodes with these parents (each
    after every node before it): a new node sees itself and its parent's ancestors."""
    N, M = mask.shape[0] - 1, len(parents)
    out = torch.zeros(N + M + 1, N + M + 1, dtype=torch.bool, device=mask.device)
    out[:N + 1, :N + 1] = mask
    dep = torch.cat([depth, depth.new_zeros(M)])
    for i, p in enumerate(parents):
        j = N + 1 + i
        out[j] = out[p]
        out[j, j] = True
        dep[j] = dep[p] + 1
    return out, dep


def suffix_room(seq: SequenceState, max_len: int, head_nodes: int) -> int:
    """Suffix nodes a row may add to its `head_nodes`: the proposer's budget, within the cache
    (the commit must fit, as `round.grant`) and what the row may still emit past the next token
    (so its positions stay within prompt + max_new_tokens + head nodes: the engine's worst case
    per request needs no more pages)."""
    return max(0, min(seq.suffix.nodes, max_len - seq.target_len - 2 - head_nodes, seq.room() - 1))


def take_rows(p: Proposal, keep: list[int]) -> Proposal:
    """The proposal's rows `keep` (group indices) alone."""
    idx = torch.tensor(keep, dtype=torch.long, device=p.tokens.device)
    return Proposal(p.tokens[idx], p.parents[idx], p.depth[idx], p.mask[idx], [p.q[g] for g in keep],
                    [p.counts[g] for g in keep],
                    {i: p.errors[g] for i, g in enumerate(keep) if g in p.errors},
                    [p.rows[g] for g in keep], p.tree)


def with_suffix(p: Proposal, g: int, chain: list[int]) -> Proposal:
    """Row g of a head proposal with `chain` grafted in (`graft`), as a one-row proposal: still a
    chain (verified under the causal mask) when the text's chain only extends the head's, else a
    tree. A sampled chain's q is dropped: the row is then accepted by recursive rejection over
    deterministic candidates (`sampling.tree_accept`), lossless for any candidates drawn before
    the target's uniforms."""
    n = p.counts[g]
    toks, pars = p.tokens[g, :n].tolist(), p.parents[g, :n].tolist()
    new_t, new_p, shared = graft(toks, pars, chain)
    dev = p.tokens.device
    errors = {0: p.errors[g]} if g in p.errors else {}
    if not p.tree and shared == n:  # the head's whole chain, then more: a longer chain
        t = chain_proposal(torch.tensor([toks + new_t], device=dev))
        return Proposal(*t, q=[None], counts=[n + len(new_t)], errors=errors, rows=[p.rows[g]],
                        tree=False, head_counts=[n], suffix=[chain])
    mask, depth = grow_mask(p.mask[g, :n + 1, :n + 1], p.depth[g, :n + 1], new_p)
    tokens = torch.tensor([toks + new_t], device=dev)
    parents = torch.tensor([pars + new_p], device=dev)
    return Proposal(tokens, parents, depth[None], mask[None], [None], [n + len(new_t)], errors,
                    [p.rows[g]], True, head_counts=[n], suffix=[chain])


def chain_only(b: int, chain: list[int], device: torch.device) -> Proposal:
    """A row's suffix chain alone (the head does not draft for it this round)."""
    tokens = torch.tensor([chain], device=device)
    return Proposal(*chain_proposal(tokens), q=[None], counts=[len(chain)], rows=[b], tree=False,
                    head_counts=[0], suffix=[chain])


def add_suffix_drafts(seqs: list[SequenceState], proposals: list[Proposal], max_len: int,
                      device: torch.device) -> list[Proposal]:
    """The round's proposals with each suffix-drafting row's proposal (`SuffixProposer.propose`)
    merged in: grafted onto the head's nodes for that row (which then leaves its group as a
    one-row tree), or on its own when the head drafts nothing for it."""
    where = {b: (i, g) for i, p in enumerate(proposals) for g, b in enumerate(p.rows)}
    grafted: dict[int, dict[int, list[int]]] = {}  # proposal index -> {group row: chain}
    alone: list[Proposal] = []
    for b, s in enumerate(seqs):
        if s.suffix is None:
            continue
        i, g = where.get(b, (None, None))
        head = proposals[i].counts[g] if i is not None else 0
        chain = s.suffix.propose(suffix_room(s, max_len, head))
        if not chain:
            continue
        if i is None:
            alone.append(chain_only(b, chain, device))
        elif g not in proposals[i].errors:
            grafted.setdefault(i, {})[g] = chain
    out = []
    for i, p in enumerate(proposals):
        rows = grafted.get(i)
        if not rows:
            out.append(p)
            continue
        keep = [g for g in range(len(p.rows)) if g not in rows]
        if keep:
            out.append(take_rows(p, keep))
        out += [with_suffix(p, g, chain) for g, chain in rows.items()]
    return out + alone
