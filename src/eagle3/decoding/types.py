"""The plain data types at the seam between drafting and verification (vLLM's habit):
a round's `Plan`, each row group's `Proposal`, each row's `Verdict`; and what a sequence
carries from round to round (`SequenceState`, its counters `SpecStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .tree import TreeShape

if TYPE_CHECKING:
    from .sampling import Sampler


@dataclass(frozen=True)
class Plan:
    """What a round drafts: `k` chain tokens per row, or a `tree`; neither = plain decoding."""

    k: int = 0
    tree: TreeShape | None = None

    @property
    def drafts(self) -> bool:
        return self.tree is not None or self.k > 0


@dataclass
class Proposal:
    """Each drafting row's nodes under its anchor (node 0), parents before children.

    tokens (G, N) target ids; parents (G, N) node indices (0 = the anchor); depth (G, N+1)
    with depth[:, 0] = 0; mask (G, N+1, N+1): row i marks node i and its ancestors; q: per
    row (N, V) the draft probabilities each node was sampled from, or None (argmax or tree
    nodes). Row g uses its first `counts[g]` nodes (any prefix is a connected tree).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    q: list[torch.Tensor | None]
    counts: list[int]
    errors: dict[int, str] = field(default_factory=dict)  # row -> why its own drafting failed
    rows: list[int] = field(default_factory=list)  # the batch rows these are (set by the round)
    tree: bool = True  # False: chains, verified under the plain causal mask (no mask built)
    head_counts: list[int] | None = None  # per row, how many of its nodes the head drafted (the
    # rest came from the text: `decoding.suffix`); None: all of them
    suffix: list[list[int] | None] | None = None  # per row, the suffix chain grafted in


@dataclass
class Verdict:
    """One row's outcome: accepted node path (root excluded), the tokens it yields (accepted
    nodes then the next token), the depths of its drafted nodes; filled by the commit: the
    tokens actually emitted (`new`), `done`, drafts counted and accepted; or the error that
    failed this row alone."""

    seq: Any
    path: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    new: list[int] = field(default_factory=list)
    done: bool = False
    drafted: int = 0
    accepted: int = 0
    error: str | None = None
    head_nodes: int = 0  # how many of the drafted nodes (the first ones) the head drafted
    suffix: list[int] | None = None  # the suffix chain grafted into this row's nodes

    @property
    def head_accepted(self) -> int:
        """Accepted nodes the head drafted (the path's nodes among the first `head_nodes`)."""
        return sum(j <= self.head_nodes for j in self.path)

    @property
    def text_accepted(self) -> int:
        """Accepted nodes only the text proposed (`decoding.suffix`)."""
        return len(self.path) - self.head_accepted


@dataclass
class SpecStats:
    """One sequence's speculation counters. `as_dict()` gives them under the JSON keys of
    `GenerationResult.stats` (the engine reports them with vLLM's names)."""

    rounds: int = 0  # verify rounds that drafted
    draft_tokens: int = 0  # emittable draft tokens verified
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    accept_len_hist: list[int] = field(default_factory=list)  # rounds per accepted length
    target_forwards: int = 0
    seconds: float = 0.0
    num_draft_tokens: int | None = None  # the chain's K (automatic: the latest choice)
    tree: dict[str, int] | None = None  # the tree's shape, when drafting one
    suffix_rounds: int = 0  # rounds that verified drafts from the text (`decoding.suffix`)
    suffix_draft_tokens: int = 0  # of draft_tokens, those only the text proposed
    suffix_accepted_tokens: int = 0  # of accepted_tokens, those only the text proposed

    @property
    def mean_accept_len(self) -> float:
        """Tokens per drafting round (tau): 1 + accepted per round."""
        return 1.0 + self.accepted_tokens / self.rounds if self.rounds else 1.0

    def size(self, depth: int) -> None:
        """Lists long enough for drafts `depth` deep (they grow later if a round drafts deeper)."""
        for lst, n in ((self.accepted_per_position, depth), (self.drafted_per_position, depth),
                       (self.accept_len_hist, depth + 1)):
            lst.extend([0] * (n - len(lst)))

    def record(self, drafted: int, accepted: int, deepest: int, suffix_drafted: int = 0,
               suffix_accepted: int = 0) -> None:
        """One verify round: `drafted` emittable draft tokens, `accepted` of them accepted, drafts
        reaching position `deepest` (a chain's length, a tree's depth); of them, the text's own
        (`suffix_drafted` nodes the head did not draft, `suffix_accepted` of them accepted)."""
        self.size(deepest)
        if suffix_drafted:
            self.suffix_rounds += 1
            self.suffix_draft_tokens += suffix_drafted
            self.suffix_accepted_tokens += suffix_accepted
        self.rounds += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.accept_len_hist[accepted] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        for i in range(deepest):
            self.drafted_per_position[i] += 1

    def as_dict(self) -> dict[str, Any]:
        out = {"rounds": self.rounds, "draft_tokens": self.draft_tokens,
               "accepted_tokens": self.accepted_tokens,
               "accepted_per_position": list(self.accepted_per_position),
               "drafted_per_position": list(self.drafted_per_position),
               "mean_accept_len": self.mean_accept_len, "accept_len_hist": list(self.accept_len_hist),
               "target_forwards": self.target_forwards, "seconds": self.seconds,
               "suffix_rounds": self.suffix_rounds, "suffix_draft_tokens": self.suffix_draft_tokens,
               "suffix_accepted_tokens": self.suffix_accepted_tokens}
        if self.tree is not None:
            out["tree"] = dict(self.tree)
        if self.num_draft_tokens is not None:
            out["num_draft_tokens"] = self.num_draft_tokens
        return out


@dataclass(eq=False)
class SequenceState:
    """One sequence's decoding state: what the round reads and advances."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    sampler: Sampler | None = None
    drafts: bool = True  # whether the head drafts for this row (False: plain decoding, or a
    # proposer without the head)
    plan: Plan | None = None  # this sequence's own plan, whatever the batch's (sampled rows: a
    # fixed one, so that a seed's draws never depend on the batch or on timings)
    out: list[int] = field(default_factory=list)  # generated tokens; out[-1] is the anchor
    target_len: int = 0  # positions with target K/V
    draft_len: int = 0  # positions with draft K/V
    pending_ids: list[int] = field(default_factory=list)  # tokens the draft has not seen
    pending_feats: list[torch.Tensor] = field(default_factory=list)  # their target taps (n, F)
    proposer: Any = None  # who drafts (`decoding.proposers.Proposer`); None: the head, when `drafts`
    suffix: Any = None  # the text's index and record (`decoding.suffix.SuffixState`), for the
    # proposers that draft from the text
    root: torch.Tensor | None = None  # (Vd,) draft logits after the last catch-up
    boundary: torch.Tensor | None = None  # (H,) the feature that follows
    done: bool = False
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def anchor(self) -> int:
        return self.out[-1]

    def room(self) -> int:
        """Tokens this sequence may still emit."""
        return self.max_new_tokens - len(self.out)
