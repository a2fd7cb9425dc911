"""Drafts from the text itself: a per-request suffix index proposes the continuation of the
longest earlier match of the text's end (prompt lookup / suffix decoding), at no draft forward.

`SuffixIndex` maps every n-gram of the request's tokens (n = 1..max_match) to the position
right after its latest occurrence, updated as tokens are accepted: the text's last n tokens
find their latest earlier occurrence in one dictionary lookup per n, longest first. (A suffix
automaton would find unbounded matches; matches past `max_match` tokens add nothing measurable,
docs/suffix.md, and the table gives the latest occurrence, which is the one that repeats.)
Its memory is bounded by max_match entries per token and freed with the request.

`SuffixState` adds what decides how many nodes a proposal is worth: the tokens its
proposals added per match length (shrunk towards a measured prior), against what d more
verify tokens cost in this round (`SuffixBudget`, from the cost model). The proposers
(`decoding.proposers`: 'suffix' alone, 'hybrid' grafted onto the head's chain or tree by
`decoding.graft`) turn its chains into the round's proposals: a node is shared where the two
agree, the rest is a new branch, verified in the same target forward under one ancestor mask
(docs/suffix.md). This module knows tokens only, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import Eagle3Error

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
class SuffixState:
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
    def over(cls, tokens: list[int], **kw: object) -> SuffixState:
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

    def catch_up(self, out: list[int], prompt_len: int) -> None:
        """Index the output tokens `out` (after a prompt of `prompt_len` tokens, indexed at the
        start) not yet indexed, so a proposal continues the whole text so far."""
        self.index.extend(out[len(self.index) - prompt_len:])

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
