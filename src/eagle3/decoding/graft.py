"""Merging draft trees: a chain of tokens grafted onto a proposal's chain or tree.

A proposer that drafts tokens without a model (`decoding.suffix`'s text matches) adds them to
the head's nodes for a row (`decoding.proposers.HybridProposer`): `graft` follows the tree
while a child carries the chain's next token and hangs the rest there, `grow_mask` extends
the ancestor mask and depths to the new nodes, and `with_chain` / `chain_alone` give the
row's `Proposal` (still a chain, under the causal mask, when the chain only extends the
head's). `merge_chains` does it for a round's proposals.
"""

from __future__ import annotations

import torch

from .tree import chain_proposal
from .types import Proposal


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


def take_rows(p: Proposal, keep: list[int]) -> Proposal:
    """The proposal's rows `keep` (group indices) alone."""
    idx = torch.tensor(keep, dtype=torch.long, device=p.tokens.device)
    return Proposal(p.tokens[idx], p.parents[idx], p.depth[idx], p.mask[idx], [p.q[g] for g in keep],
                    [p.counts[g] for g in keep],
                    {i: p.errors[g] for i, g in enumerate(keep) if g in p.errors},
                    [p.rows[g] for g in keep], p.tree)


def with_chain(p: Proposal, g: int, chain: list[int]) -> Proposal:
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


def chain_alone(b: int, chain: list[int], device: torch.device) -> Proposal:
    """Batch row b's chain alone (no other proposer drafts for it this round)."""
    tokens = torch.tensor([chain], device=device)
    return Proposal(*chain_proposal(tokens), q=[None], counts=[len(chain)], rows=[b], tree=False,
                    head_counts=[0], suffix=[chain])


def merge_chains(proposals: list[Proposal], chains: dict[int, list[int]],
                 device: torch.device) -> list[Proposal]:
    """The proposals with each row b of `chains` (batch rows -> a chain of tokens) merged in:
    grafted onto that row's nodes (it then leaves its group as a one-row proposal), or alone
    when no proposal holds the row. A row whose own drafting failed keeps its error, unmerged."""
    where = {b: (i, g) for i, p in enumerate(proposals) for g, b in enumerate(p.rows)}
    grafted: dict[int, dict[int, list[int]]] = {}  # proposal index -> {group row: chain}
    alone = []
    for b, chain in chains.items():
        i, g = where.get(b, (None, None))
        if i is None:
            alone.append(chain_alone(b, chain, device))
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
        out += [with_chain(p, g, chain) for g, chain in rows.items()]
    return out + alone
