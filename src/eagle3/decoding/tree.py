"""Tree shapes and dynamic tree drafting (EAGLE-2/3), batched over rows.

`expand_tree` grows each row's tree under its anchor: the top_k children of each
of the top_k best frontier nodes for `depth` levels (depth-1 batched draft
forwards under an ancestor mask), then `select_tree` keeps the N nodes of highest
cumulative log-probability (a connected tree: a child never outscores its
parent). The round (`decoding.round`) verifies the nodes in one target forward
with the same ancestor mask, RoPE positions P + depth, and accepts a path
(`decoding.accept`). The draft's tree nodes are written at scratch positions past
the committed prefix (P + (level-1) top_k + i), which the next catch-up overwrites.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import Eagle3Error
from .layout import Layout

MAX_TREE_NODES = 256
MAX_TREE_DRAFT_SLOTS = 256  # top_k * (depth - 1): the draft cache's room past max_seq_len


@dataclass(frozen=True)
class TreeShape:
    """Expand `top_k` children per frontier node for `depth` levels; verify `total_tokens` nodes."""

    top_k: int = 3
    depth: int = 6
    total_tokens: int = 12

    @property
    def max_nodes(self) -> int:
        """Candidates a tree of this top_k and depth scores: k + (depth - 1) k^2."""
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    @property
    def draft_slots(self) -> int:
        """Draft cache slots a round uses past the committed prefix."""
        return self.top_k * (self.depth - 1)

    def as_dict(self) -> dict[str, int]:
        return {"top_k": self.top_k, "depth": self.depth, "total_tokens": self.total_tokens}


# The fastest shape measured on the toy model, eager (docs/decoding.md, "Trees and sampling"):
# wider or deeper trees accept more but cost more than they gain.
DEFAULT_TREE = TreeShape()


def parse_tree(tree: Any) -> TreeShape | None:
    """None/False -> chain; True -> DEFAULT_TREE; a dict (any of top_k, depth, total_tokens)
    or a TreeShape -> that shape, the missing keys from DEFAULT_TREE."""
    if tree is None or tree is False:
        return None
    if tree is True:
        return DEFAULT_TREE
    if isinstance(tree, TreeShape):
        fields = tree.as_dict()
    elif isinstance(tree, dict):
        unknown = sorted(set(tree) - {"top_k", "depth", "total_tokens"})
        if unknown:
            raise Eagle3Error(f"unknown tree key '{unknown[0]}': the tree takes top_k, depth and "
                              "total_tokens")
        fields = {**DEFAULT_TREE.as_dict(), **tree}
    else:
        raise Eagle3Error(f"tree must be True, False/None, or a dict of top_k, depth, total_tokens; "
                          f"got {tree!r}")
    for key, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise Eagle3Error(f"tree {key} must be a positive integer, got {value!r}")
    shape = TreeShape(**fields)
    if shape.draft_slots > MAX_TREE_DRAFT_SLOTS:
        raise Eagle3Error(f"tree top_k {shape.top_k} x (depth {shape.depth} - 1) = {shape.draft_slots} "
                          f"draft slots is more than the {MAX_TREE_DRAFT_SLOTS} the draft cache "
                          "reserves; lower top_k or depth")
    if shape.total_tokens > min(shape.max_nodes, MAX_TREE_NODES):
        raise Eagle3Error(f"tree total_tokens {shape.total_tokens} is more than the "
                          f"{min(shape.max_nodes, MAX_TREE_NODES)} nodes a tree of top_k "
                          f"{shape.top_k} and depth {shape.depth} can hold (at most k + (depth-1) k^2, "
                          f"and {MAX_TREE_NODES}); lower total_tokens or raise top_k / depth")
    return shape


def chain_proposal(tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Chains (G, k) as trees: node i's parent is node i - 1. Returns tokens, parents (G, k),
    depth (G, k+1), ancestor mask (G, k+1, k+1) (read-only views of one cached set per k)."""
    G, k = tokens.shape
    key = (k, tokens.device)
    shapes = _CHAINS.get(key)
    if shapes is None:
        n = torch.arange(k + 1, device=tokens.device)
        shapes = _CHAINS[key] = (n[:-1], n, n[None, :] <= n[:, None])
    parents, depth, mask = shapes
    return tokens, parents.expand(G, k), depth.expand(G, k + 1), mask.expand(G, k + 1, k + 1)


_CHAINS: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}  # every round asks again


DraftStep = Callable[[torch.Tensor, torch.Tensor, Layout], tuple[torch.Tensor, torch.Tensor]]


def expand_tree(draft: DraftStep, to_target: Callable[[torch.Tensor], torch.Tensor],
                root: torch.Tensor, boundary: torch.Tensor, starts: list[int], k: int, depth: int,
                n: int, max_rope: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """Each row's tree from its root logits (G, Vd) and feature (G, 1, H); keeps the best n nodes.

    `draft(tokens (G, k), features (G, k, H), layout)` is the runner's draft forward; level
    l's k frontier nodes are written at positions starts[g] + (l-1)k + i with RoPE position
    starts[g] + l - 1 (capped at starts[g] + max_rope[g]) and see the committed prefix and
    their ancestors. No host synchronisation. Returns `select_tree`'s tensors.
    """
    G = root.shape[0]
    dev = root.device
    scratch = k * (depth - 1)
    ar = torch.arange(k, device=dev)
    scratch_ar = torch.arange(scratch, device=dev)
    top = torch.log_softmax(root.float(), -1).topk(k)  # (G, k)
    # Every scored candidate, level by level: token, cumulative log-prob, parent candidate.
    tokens, scores = [to_target(top.indices)], [top.values]
    parents = [torch.full((G, k), -1, dtype=torch.long, device=dev)]
    levels = [torch.ones(G, k, dtype=torch.long, device=dev)]
    front = ar.expand(G, k)  # the frontier's candidate indices
    front_tok, front_score = tokens[0], top.values
    H = boundary.shape[-1]
    front_feat = boundary.expand(G, k, H)
    front_anc = torch.zeros(G, k, scratch, dtype=torch.bool, device=dev)  # ancestors' scratch slots
    n_cand = k
    cap = torch.tensor(max_rope if max_rope is not None else [depth] * G, device=dev)[:, None]
    for level in range(1, depth):
        own = scratch_ar[None, :] == ((level - 1) * k + ar)[:, None]  # (k, scratch)
        tree_mask = front_anc | own  # (G, k, scratch)
        layout = Layout(starts, (level - 1) * k + ar, region=tree_mask[:, :, :level * k],
                        rope=cap.clamp(max=level - 1).expand(G, k))
        logits, h = draft(front_tok, front_feat, layout)  # (G, k, Vd), (G, k, H)
        child = torch.log_softmax(logits.float(), -1).topk(k)  # (G, k, k)
        child_score = (front_score[:, :, None] + child.values).flatten(1)  # (G, k*k)
        child_tok = to_target(child.indices).flatten(1)
        tokens.append(child_tok)
        scores.append(child_score)
        parents.append(front.repeat_interleave(k, dim=1))
        levels.append(torch.full((G, k * k), level + 1, dtype=torch.long, device=dev))
        if level < depth - 1:
            best = child_score.topk(k).indices  # (G, k) the next frontier
            par = best // k
            front = n_cand + best
            front_tok, front_score = child_tok.gather(1, best), child_score.gather(1, best)
            front_feat = h.gather(1, par[:, :, None].expand(G, k, H))
            front_anc = tree_mask.gather(1, par[:, :, None].expand(G, k, scratch))
        n_cand += k * k
    return select_tree(torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1),
                       torch.cat(levels, 1), n, depth)


def select_tree(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor,
                levels: torch.Tensor, n: int, depth: int) -> tuple[torch.Tensor, ...]:
    """Keep each row's n best candidates (G, M) by score as a tree.

    Candidates are listed level by level, so a parent precedes its children, and a
    child's cumulative log-probability never exceeds its parent's: a stable
    descending sort keeps a parent ahead of its children even on ties, so the top
    n are a connected tree. Sorted back into candidate order, parents come first
    (and any prefix of the nodes is a connected tree too). Returns tokens (G, n),
    parents (G, n) (0 = the root), depth (G, n+1), ancestor mask (G, n+1, n+1).
    """
    G = tokens.shape[0]
    dev = tokens.device
    keep = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n].sort(dim=1).values
    node_of = torch.zeros_like(tokens).scatter_(
        1, keep, torch.arange(1, n + 1, device=dev).expand(G, n))
    par = parents.gather(1, keep)
    tree_parents = torch.where(par >= 0, node_of.gather(1, par.clamp_min(0)), 0)  # (G, n)
    node_depth = torch.cat([levels.new_zeros(G, 1), levels.gather(1, keep)], 1)  # (G, n+1)
    up = torch.cat([tree_parents.new_zeros(G, 1), tree_parents], 1)  # the root is its own parent
    mask = torch.eye(n + 1, dtype=torch.bool, device=dev).expand(G, n + 1, n + 1)
    for _ in range(depth):  # each pass adds one more generation of ancestors (levels <= depth)
        mask = mask | mask.gather(1, up[:, :, None].expand(G, n + 1, n + 1))
    return tokens.gather(1, keep), tree_parents, node_depth, mask
