"""Acceptance: which of a round's drafted nodes the target keeps, and its next token.

One function for every mode:
    greedy chain / tree   the longest root-to-leaf path whose every token is the target's
                          argmax after its parent; the next token is the argmax after it
    sampled chain         speculative sampling against the draft's q (`sampling.speculative_accept`)
    sampled tree          recursive rejection over deterministic children (`sampling.tree_accept`)
    no drafts             the target's own next token (plain decoding)
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import brief
from ..kernels import argmax
from .sampling import speculative_accept, tree_accept
from .types import Proposal, Verdict


def greedy_path(verify_ids: list[int], tokens: list[int], parents: list[int]) -> list[int]:
    """The longest root-to-leaf path (node indices, root excluded) whose every token is the
    target's greedy choice after its parent. Node j (1..N) has tokens[j-1], parents[j-1]."""
    path, node = [], 0
    for j, (tok, par) in enumerate(zip(tokens, parents, strict=True), start=1):
        if par == node and tok == verify_ids[node]:  # parents precede children: one pass
            path.append(j)
            node = j
    return path


def accept(seqs: list[Any], logits: torch.Tensor, tokens: torch.Tensor,
           proposals: list[Proposal]) -> list[Verdict]:
    """Verdicts for every row of a verified batch: logits (B, T, V) after each verified token
    tokens (B, T) (anchor first); each proposal's `rows` hold its nodes. One host sync for the
    greedy decisions of the whole batch; sampled rows draw from their own samplers."""
    B, T = tokens.shape
    parts = [argmax(logits).flatten(), tokens.flatten()]
    for p in proposals:
        parts += [p.parents.flatten(), p.depth.flatten()]
    host = torch.cat(parts).tolist()
    ids = [host[b * T:(b + 1) * T] for b in range(B)]
    toks = [host[B * T + b * T:B * T + (b + 1) * T] for b in range(B)]
    node_of: dict[int, tuple[Proposal, int, list[int], list[int]]] = {}  # row -> its nodes
    off = 2 * B * T
    for p in proposals:
        G, N = p.tokens.shape
        par = host[off:off + G * N]
        dep = host[off + G * N:off + G * N + G * (N + 1)]
        off += G * N + G * (N + 1)
        for g, b in enumerate(p.rows):
            node_of[b] = (p, g, par[g * N:g * N + p.counts[g]],
                          dep[g * (N + 1) + 1:g * (N + 1) + 1 + p.counts[g]])
    out = []
    for b, seq in enumerate(seqs):
        p, g, node_parents, depths = node_of.get(b, (None, None, [], []))
        n = len(node_parents)
        node_toks = toks[b][1:n + 1]
        v = Verdict(seq, depths=depths)
        if p is not None:  # how many nodes the head drafted, and the text's chain (`decoding.suffix`)
            v.head_nodes = p.head_counts[g] if p.head_counts is not None else n
            v.suffix = p.suffix[g] if p.suffix is not None else None
        if p is not None and g in p.errors:  # its drafting already failed
            v.error = p.errors[g]
            out.append(v)
            continue
        try:
            sampler = seq.sampler
            if sampler is None:
                v.path = greedy_path(ids[b], node_toks, node_parents)
                nxt = ids[b][v.path[-1] if v.path else 0]
            elif n == 0:
                nxt = int(sampler.sample(sampler.probs(logits[b, 0])))
            elif p.q[g] is not None:
                a, nxt = speculative_accept(sampler, sampler.probs(logits[b, :n + 1]),
                                            tokens[b, 1:n + 1], p.q[g][:n])
                v.path = list(range(1, a + 1))
            else:
                v.path, nxt = tree_accept(sampler, sampler.probs(logits[b, :n + 1]), node_toks,
                                          node_parents)
            v.tokens = [node_toks[j - 1] for j in v.path] + [nxt]
        except Exception as e:  # this row's own handling (its sampler) failed: it alone fails
            v.error = brief(e)
        out.append(v)
    return out
