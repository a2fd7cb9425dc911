"""Drafting: catch each row's draft up on its backlog, then draft a chain or a tree.

A round hands each group of rows that share a plan to its runner's `draft_chain` or
`draft_tree`. `EagerDrafting` gives a runner both, built on its own `draft` forward:
every runner uses it, and a compiled `StaticRunner` swaps in fused graphs of the same
steps where their shapes are fixed (one greedy row that has drafted before), falling back
to these elsewhere. `chain_steps` is the one chain loop, eager or traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import brief
from ..kernels import argmax
from .layout import causal_layout
from .tree import TreeShape, chain_proposal, expand_tree
from .types import Proposal


def backlog(runner: Any, rows: list[Any],
            width: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Each row's pending tokens (G, width) and features (G, width, H), padded to `width` by
    repeating its last token and feature, and the real counts. The one packing every catch-up
    uses; padding is never read first (attention is causal, later writes overwrite it). The
    rows' queued taps become features here, in one `runner.features` call."""
    counts = [len(s.pending_ids) for s in rows]
    tokens = torch.tensor([s.pending_ids + s.pending_ids[-1:] * (width - n)
                           for s, n in zip(rows, counts, strict=True)], device=runner.device)
    taps = []
    for s, n in zip(rows, counts, strict=True):
        f = torch.cat(s.pending_feats) if len(s.pending_feats) > 1 else s.pending_feats[0]  # (n, F)
        taps.append(torch.cat([f, f[-1:].expand(width - n, -1)]) if n < width else f)
    return tokens, runner.features(taps[0][None] if len(taps) == 1 else torch.stack(taps)), counts


def caught_up(rows: list[Any], roots: torch.Tensor, bounds: torch.Tensor, counts: list[int]) -> None:
    """The draft has seen each row's backlog: its new root (Vd,) and boundary (H,)."""
    for b, s in enumerate(rows):
        s.root, s.boundary = roots[b], bounds[b]
        s.draft_len += counts[b]
        s.pending_ids, s.pending_feats = [], []


def catch_up(runner: Any, seqs: list[Any], alone_over: int | None = None) -> None:
    """Feed each row's pending tokens and features to the draft: sets `root` and `boundary`.

    Rows whose backlog exceeds `alone_over` tokens (after plain rounds: more than a round
    commits) catch up on their own, so the batch is not padded to the longest backlog.
    """
    rows = [s for s in seqs if s.pending_ids]
    for s in [s for s in rows if alone_over is not None and len(s.pending_ids) > alone_over]:
        catch_up_rows(runner, [s])
    rows = [s for s in rows if s.pending_ids]
    if rows:
        catch_up_rows(runner, rows)


def catch_up_rows(runner: Any, rows: list[Any],
                  packed: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None) -> None:
    """One batched draft forward over these rows' backlogs (padded to the longest; `packed`:
    their `backlog` already built)."""
    dev = runner.device
    T = max(len(s.pending_ids) for s in rows)
    tokens, feats, counts = packed or backlog(runner, rows, T)
    valid = counts if len(rows) > 1 else None  # the common case (generate): no padding
    logits, h = runner.draft(rows, tokens, feats, causal_layout([s.draft_len for s in rows], T, valid, dev))
    last = torch.tensor(counts, device=dev) - 1
    idx = torch.arange(len(rows), device=dev)
    caught_up(rows, logits[idx, last], h[idx, last], counts)  # (G, Vd), (G, H)


Pick = Callable[[int, torch.Tensor], torch.Tensor]
ChainStep = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def greedy(i: int, logits: torch.Tensor) -> torch.Tensor:
    return argmax(logits)


def chain_steps(step: ChainStep, to_target_ids: Callable[[torch.Tensor], torch.Tensor],
                logits: torch.Tensor, feat: torch.Tensor, k: int, pick: Pick = greedy) -> torch.Tensor:
    """k drafts per row (G, k) in target ids from root logits (G, Vd) and feature (G, 1, H):
    `pick(i, logits)` chooses draft i (draft-vocabulary ids, (G,)), `step(i, tokens (G,),
    feat)` runs the draft on it and returns the next logits (G, Vd) and feature."""
    drafts = []
    for i in range(k):  # unrolled when traced: k is static
        tok = to_target_ids(pick(i, logits))  # (G,)
        drafts.append(tok)
        if i < k - 1:
            logits, feat = step(i, tok, feat)
    return torch.stack(drafts, dim=1)


def root_state(rows: list[Any]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The rows' root logits (G, Vd), boundary features (G, 1, H) and draft lengths."""
    return (torch.stack([s.root for s in rows]), torch.stack([s.boundary for s in rows])[:, None],
            [s.draft_len for s in rows])


def draft_chain(runner: Any, rows: list[Any], root: torch.Tensor, boundary: torch.Tensor,
                starts: list[int], k: int, counts: list[int] | None = None,
                errors: dict[int, str] | None = None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """k drafts per row (G, k) by the runner's draft forward: argmax for greedy rows; sampled
    rows draw from the draft's distribution (the target's temperature / top-k / top-p) and keep
    q in the target vocabulary. Row g needs only its first counts[g] drafts: its later steps are
    padding (never written). A sampled row whose sampler raises drafts argmax from then on, its
    error in `errors`."""
    errors = {} if errors is None else errors
    dev = runner.device
    sampled = [g for g, s in enumerate(rows) if s.sampler is not None]
    qs: list[list[torch.Tensor]] = [[] for _ in rows]
    pick: Pick = greedy
    if sampled:
        vocab_ids = runner.to_target_ids(torch.arange(root.shape[-1], device=dev))  # (Vd,)
        V = runner.vocab_size

        def sample(i: int, logits: torch.Tensor) -> torch.Tensor:
            ids = argmax(logits).clone()
            for g in sampled:
                if counts is not None and i >= counts[g] or g in errors:
                    continue  # past this row's drafts: no draw, so its random stream is its own
                sampler = rows[g].sampler
                try:
                    q_draft = sampler.probs(logits[g])  # (Vd,)
                    ids[g] = sampler.sample(q_draft)
                except Exception as e:  # this row's own sampler failed: it alone fails
                    errors[g] = brief(e)
                    continue
                qs[g].append(q_draft.new_zeros(V).index_add_(0, vocab_ids, q_draft))
            return ids

        pick = sample

    def step(i: int, tok: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        valid = None if counts is None or min(counts) > i + 1 else [int(c > i + 1) for c in counts]
        layout = causal_layout([p + i for p in starts], 1, valid, dev)
        out, feat = runner.draft(rows, tok[:, None], feat, layout)
        return out[:, 0], feat

    drafts = chain_steps(step, runner.to_target_ids, root, boundary, k, pick)
    q = [torch.stack(qs[g]) if rows[g].sampler is not None and qs[g] else None
         for g in range(len(rows))]
    return drafts, q


def draft_tree(runner: Any, rows: list[Any], shape: TreeShape, counts: list[int],
               fused: Callable[..., tuple[torch.Tensor, ...]] | None = None) -> Proposal:
    """Each row's dynamic tree (`decoding.tree.expand_tree`) after its catch-up; row g keeps its
    first counts[g] nodes: a lone row through the runner's `one_op_tree` where it has one
    (catch-up and tree in one C++ call). `fused(root, boundary, start, top_k, depth, n)`: a
    runner's one-graph expansion of a lone row's full-depth tree, used where it applies."""
    # Deeper levels could not be committed (the round groups rows by this depth); RoPE
    # positions are capped at the cache's end all the same.
    depth = min(shape.depth, max(counts))
    n = min(shape.total_tokens, TreeShape(shape.top_k, depth).max_nodes)  # >= every count
    s = rows[0]
    if len(rows) == 1 and s.pending_ids and fused is None:
        tokens, feats, caught = backlog(runner, [s], len(s.pending_ids))
        start = s.draft_len + caught[0]  # the tree's, after the catch-up
        out = runner.one_op_tree(tokens[0], feats[0], s.draft_len, shape.top_k, depth, n,
                                 runner.max_len - 1 - start)
        if out is not None:
            caught_up([s], out[4][None], out[5][None], caught)
            return Proposal(*out[:4], q=[None], counts=counts)
        catch_up_rows(runner, [s], (tokens, feats, caught))
    else:
        catch_up(runner, rows, alone_over=max(counts) + 1)
    root, boundary, starts = root_state(rows)
    if fused is not None and len(rows) == 1 and depth == shape.depth:
        return Proposal(*fused(root, boundary, starts[0], shape.top_k, depth, n), q=[None], counts=counts)
    t = expand_tree(lambda tok, feat, lay: runner.draft(rows, tok, feat, lay),
                    runner.to_target_ids, root, boundary, starts, shape.top_k, depth, n,
                    [runner.max_len - 1 - p for p in starts])
    return Proposal(*t, q=[None] * len(rows), counts=counts)


def draft_chain_proposal(runner: Any, rows: list[Any], counts: list[int]) -> Proposal:
    """Each row's chain of counts[g] drafts after its catch-up: a lone greedy row through the
    runner's `one_op_chain` where it has one (catch-up and chain in one C++ call), else step by
    step."""
    s = rows[0]
    if len(rows) == 1 and s.sampler is None and s.pending_ids:
        tokens, feats, caught = backlog(runner, [s], len(s.pending_ids))
        out = runner.one_op_chain(tokens[0], feats[0], s.draft_len, max(counts))
        if out is not None:
            drafts, root, bound = out
            caught_up([s], root[None], bound[None], caught)
            return Proposal(*chain_proposal(drafts[None]), q=[None], counts=counts, tree=False)
        catch_up_rows(runner, [s], (tokens, feats, caught))
    catch_up(runner, rows, alone_over=max(counts) + 1)
    root, boundary, starts = root_state(rows)
    errors: dict[int, str] = {}
    tokens, qs = draft_chain(runner, rows, root, boundary, starts, max(counts), counts, errors)
    return Proposal(*chain_proposal(tokens), q=qs, counts=counts, errors=errors, tree=False)


class EagerDrafting:
    """`draft_chain` / `draft_tree` for a runner, by its own `draft` forward."""

    def draft_chain(self, rows: list[Any], k: int, counts: list[int]) -> Proposal:
        """Chains for rows of plan K = `k`; row g verifies its first counts[g] <= k drafts."""
        return draft_chain_proposal(self, rows, counts)

    def draft_tree(self, rows: list[Any], shape: TreeShape, counts: list[int]) -> Proposal:
        """Trees of `shape`; row g verifies its first counts[g] nodes."""
        return draft_tree(self, rows, shape, counts)

    def one_op_chain(self, tokens: torch.Tensor, feats: torch.Tensor, start: int,
                     k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A lone greedy row's catch-up (tokens (R,), features (R, H) from position `start`) and
        k drafts as one op: (drafts (k,), root logits (Vd,), boundary feature (H,)), or None
        where this runner has none (then `draft_chain_proposal` steps from Python)."""
        return None

    def one_op_tree(self, tokens: torch.Tensor, feats: torch.Tensor, start: int, top_k: int,
                    depth: int, n: int, max_rope: int) -> tuple[torch.Tensor, ...] | None:
        """A lone row's catch-up (as `one_op_chain`) and its tree as one op: (tokens (1, n),
        parents, depth, mask, root logits (Vd,), boundary feature (H,)), or None where this
        runner has none (then `draft_tree` expands it from Python)."""
        return None

    def warm(self, max_k: int, start: int) -> None:
        """Build what rounds of up to `max_k` drafts need before any generation times them
        (positions from `start` are scratch). Eager runners need nothing."""
