"""The plain data types at the seam between drafting and verification (vLLM's habit):
a round's `Plan`, each row group's `Proposal`, each row's `Verdict`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .tree import TreeShape


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
