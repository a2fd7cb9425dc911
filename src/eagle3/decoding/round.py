"""One speculative round over a batch of sequences: the only decoding loop body in eagle3.

`generate` runs it at batch 1 on a `StaticBackend`; the engine runs it over its
page pool (`engine.kv.PagedBackend`). A sequence's anchor (its last token, emitted
but not yet in the target cache) sits at position P = `target_len`; the draft cache
holds positions 0..P-1, its last output (`root` logits, `boundary` feature) predicts
the token after the anchor. A round with `Plan(k, tree)`:

    catch_up   teacher-force each row's pending tokens with their target features into
               the draft: its new root and boundary
    propose    a `Proposal` per row: k chain drafts (argmax, or sampled from the draft's
               q for sampled rows), or a dynamic tree (`decoding.tree.expand_tree`)
    verify     one target forward over [anchor, nodes] per row, ancestor masks, RoPE
               positions P + depth
    accept     `decoding.accept.accept`: greedy path, or speculative / recursive-rejection
               sampling: a `Verdict` (accepted path, next token)
    commit     the accepted nodes' target K/V to contiguous positions (trees only), the
               target length past them, tokens emitted up to a stop id or max_new_tokens,
               the accepted path's features queued for the next catch-up, stats

The corrected/bonus token never gets a target forward of its own: it is the next
round's anchor, so a round costs one target forward. Capacity: a row
verifies at most min(nodes, max_len - P - 2) nodes, so its commit always fits; at 0
the round is a plain decoding step for that row, and `Plan()` (no drafts) is plain
decoding. Host synchronisations: one per round for greedy rows (verify ids, drafts
and parents in one `.tolist()`), more for sampled rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import brief
from ..kernels import argmax, prefill_matmuls
from ..targets.decoder import slots_upto
from .accept import accept
from .backend import Backend
from .layout import Layout, causal_layout
from .profile import active
from .sampling import Sampler
from .tree import TreeShape, chain_proposal, expand_tree
from .types import Plan, Proposal, Verdict


def empty_stats() -> dict[str, Any]:
    """The speculation counters of one sequence (the engine reports them with vLLM's names)."""
    return {"rounds": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": [],
            "drafted_per_position": [], "mean_accept_len": 1.0, "accept_len_hist": [],
            "target_forwards": 0, "seconds": 0.0}


def size_stats(stats: dict[str, Any], depth: int) -> None:
    """Lists long enough for drafts `depth` deep (they grow later if a round drafts deeper)."""
    for key, n in (("accepted_per_position", depth), ("drafted_per_position", depth),
                   ("accept_len_hist", depth + 1)):
        stats[key].extend([0] * (n - len(stats[key])))


def record_round(stats: dict[str, Any], drafted: int, accepted: int, deepest: int) -> None:
    """One verify round: `drafted` emittable draft tokens, `accepted` of them accepted, drafts
    reaching position `deepest` (a chain's length, a tree's depth)."""
    size_stats(stats, deepest)
    stats["rounds"] += 1
    stats["draft_tokens"] += drafted
    stats["accepted_tokens"] += accepted
    stats["accept_len_hist"][accepted] += 1
    for i in range(accepted):
        stats["accepted_per_position"][i] += 1
    for i in range(deepest):
        stats["drafted_per_position"][i] += 1
    stats["mean_accept_len"] = 1.0 + stats["accepted_tokens"] / stats["rounds"]


def emit(out: list[int], tokens: list[int], stop_ids: frozenset[int], max_new_tokens: int) -> bool:
    """Append `tokens` to `out` up to the first stop id or max_new_tokens; True when done."""
    for t in tokens:
        out.append(t)
        if t in stop_ids or len(out) >= max_new_tokens:
            return True
    return False


@dataclass(eq=False)
class Sequence:
    """One sequence's decoding state: what the round reads and advances."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    sampler: Sampler | None = None
    drafts: bool = True  # False: never drafts (plain decoding even with a head)
    plan: Plan | None = None  # this sequence's own plan, whatever the batch's (sampled rows: a
    # fixed one, so that a seed's draws never depend on the batch or on timings)
    out: list[int] = field(default_factory=list)  # generated tokens; out[-1] is the anchor
    target_len: int = 0  # positions with target K/V
    draft_len: int = 0  # positions with draft K/V
    pending_ids: list[int] = field(default_factory=list)  # tokens the draft has not seen
    pending_feats: list[torch.Tensor] = field(default_factory=list)  # their features (n, H)
    root: torch.Tensor | None = None  # (Vd,) draft logits after the last catch-up
    boundary: torch.Tensor | None = None  # (H,) the feature that follows
    done: bool = False
    stats: dict[str, Any] = field(default_factory=empty_stats)

    @property
    def anchor(self) -> int:
        return self.out[-1]

    def room(self) -> int:
        """Tokens this sequence may still emit."""
        return self.max_new_tokens - len(self.out)


def grant(seq: Sequence, plan: Plan, max_len: int, fixed_shapes: bool = False) -> int:
    """Draft nodes this row may verify this round (0: it decodes plainly). With `fixed_shapes`
    (compiled steps: one graph per K) a chain keeps K up to the cache's end rather than
    shrinking near max_new_tokens; the surplus drafts are verified and dropped, and not
    counted in the stats."""
    if not plan.drafts or not seq.drafts or seq.root is None and not seq.pending_ids:
        return 0
    fits = max_len - seq.target_len - 2  # the commit (<= nodes + 1 tokens) must fit the cache
    if plan.tree is not None:
        return max(0, min(plan.tree.total_tokens, fits))
    return max(0, min(plan.k, fits, fits if fixed_shapes else seq.room() - 1))


def draft_span(plan: Plan) -> int:
    """Draft positions past the anchor a round writes (speculative slots, overwritten later)."""
    if plan.tree is not None:
        return plan.tree.top_k * (min(plan.tree.depth, plan.tree.total_tokens) - 1)
    return max(plan.k - 1, 0)


# -- the steps ------------------------------------------------------------------------------------
@torch.no_grad()
def prefill(backend: Backend, seq: Sequence) -> int:
    """The prompt's target forward: the first token; the prompt is queued for the draft, whose
    catch-up waits for the row's first drafting round (a row that only ever decodes plainly, as
    rows of a full batch often do, never pays for it)."""
    prof = active()
    prof.tic()
    n = len(seq.prompt)
    backend.reserve(seq, n)
    prompt = torch.tensor([seq.prompt], device=backend.device)
    drafts = backend.has_draft and seq.drafts and seq.max_new_tokens > 1
    with prefill_matmuls():  # the same call in plain and speculative decoding: stock kernels
        logits, feats = backend.target([seq], prompt, causal_layout([0], n, device=backend.device),
                                       with_features=drafts, last_only=True)
    row = logits[0, -1]
    first = int(argmax(row) if seq.sampler is None else seq.sampler.sample(seq.sampler.probs(row)))
    seq.stats["target_forwards"] += 1
    seq.target_len = n
    seq.done = emit(seq.out, [first], seq.stop_ids, seq.max_new_tokens)
    if drafts and not seq.done:
        seq.pending_ids, seq.pending_feats = [*seq.prompt[1:], first], [feats[0]]
    prof.toc("prefill", logits, syncs=1)
    return first


def catch_up(backend: Backend, seqs: list[Sequence], alone_over: int | None = None) -> None:
    """Feed each row's pending tokens and features to the draft: sets `root` and `boundary`.

    Rows whose backlog exceeds `alone_over` tokens (after plain rounds: more than a round
    commits) catch up on their own, so the batch is not padded to the longest backlog.
    """
    rows = [s for s in seqs if s.pending_ids]
    for s in [s for s in rows if alone_over is not None and len(s.pending_ids) > alone_over]:
        _catch_up_rows(backend, [s])
    rows = [s for s in rows if s.pending_ids]
    if rows:
        _catch_up_rows(backend, rows)


def backlog(rows: list[Sequence], width: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Each row's pending tokens (G, width) and features (G, width, H), padded to `width` by
    repeating its last token and feature, and the real counts. The one packing every catch-up
    uses; padding is never read first (attention is causal, later writes overwrite it)."""
    counts = [len(s.pending_ids) for s in rows]
    tokens = torch.tensor([s.pending_ids + s.pending_ids[-1:] * (width - n)
                           for s, n in zip(rows, counts, strict=True)], device=device)
    feats = []
    for s, n in zip(rows, counts, strict=True):
        f = torch.cat(s.pending_feats) if len(s.pending_feats) > 1 else s.pending_feats[0]  # (n, H)
        feats.append(torch.cat([f, f[-1:].expand(width - n, -1)]) if n < width else f)
    return tokens, torch.stack(feats), counts


def caught_up(rows: list[Sequence], roots: torch.Tensor, bounds: torch.Tensor, counts: list[int]) -> None:
    """The draft has seen each row's backlog: its new root (Vd,) and boundary (H,)."""
    for b, s in enumerate(rows):
        s.root, s.boundary = roots[b], bounds[b]
        s.draft_len += counts[b]
        s.pending_ids, s.pending_feats = [], []


def _catch_up_rows(backend: Backend, rows: list[Sequence]) -> None:
    """One batched draft forward over these rows' backlogs (padded to the longest). A row whose
    draft has seen nothing yet catches up its prompt: compiled backends run that call eagerly
    (one shape per prompt length)."""
    dev = backend.device
    T = max(len(s.pending_ids) for s in rows)
    tokens, feats, counts = backlog(rows, T, dev)
    valid = counts if len(rows) > 1 else None  # the common case (generate): no padding
    logits, h = backend.draft(rows, tokens, feats, causal_layout([s.draft_len for s in rows], T, valid, dev),
                              prompt=any(s.draft_len == 0 for s in rows))
    last = torch.tensor(counts, device=dev) - 1
    idx = torch.arange(len(rows), device=dev)
    caught_up(rows, logits[idx, last], h[idx, last], counts)  # (G, Vd), (G, H)


def propose(backend: Backend, rows: list[Sequence], plan: Plan, counts: list[int]) -> Proposal:
    """Draft each row's nodes: a tree for `plan.tree`, else a chain of plan.k (see `Plan`)."""
    root = torch.stack([s.root for s in rows])  # (G, Vd)
    boundary = torch.stack([s.boundary for s in rows])[:, None]  # (G, 1, H)
    starts = [s.draft_len for s in rows]
    if plan.tree is not None:
        shape = plan.tree
        # Deeper levels could not be committed (the round groups rows by this depth); RoPE
        # positions are capped at the cache's end all the same.
        depth = min(shape.depth, max(counts))
        n = min(shape.total_tokens, TreeShape(shape.top_k, depth).max_nodes)  # >= every count
        if backend.fused_tree is not None and len(rows) == 1 and depth == shape.depth:  # one graph
            t = backend.fused_tree(root, boundary, starts[0], shape.top_k, depth, n)
            return Proposal(*t, q=[None], counts=counts)
        t = expand_tree(lambda tok, feat, lay: backend.draft(rows, tok, feat, lay),
                        backend.to_target_ids, root, boundary, starts, shape.top_k, depth, n,
                        [backend.max_len - 1 - p for p in starts])
        return Proposal(*t, q=[None] * len(rows), counts=counts)
    errors: dict[int, str] = {}
    tokens, qs = draft_chain(backend, rows, root, boundary, starts, max(counts), counts, errors)
    return Proposal(*chain_proposal(tokens), q=qs, counts=counts, errors=errors, tree=False)


def fusable(backend: Backend, plan: Plan, rows: list[Sequence]) -> bool:
    """Whether the backend's fused greedy chain (compiled steps) serves this group."""
    return (backend.fused_chain is not None and plan.tree is None
            and len(rows) == 1 and rows[0].sampler is None and bool(rows[0].pending_ids)
            and rows[0].draft_len > 0)  # a prompt's catch-up is not a fixed shape


def propose_fused(backend: Backend, s: Sequence, plan: Plan, count: int) -> Proposal:
    """catch_up + a greedy chain of `count` drafts as one backend call. The catch-up runs over
    at least plan.k + 1 rows (`backlog`'s padding), so a compiled backend keeps one graph per K
    whatever the last round accepted."""
    n = len(s.pending_ids)
    tokens, feats, counts = backlog([s], max(n, min(plan.k + 1, backend.max_len - s.draft_len)),
                                    backend.device)
    drafts, root, boundary = backend.fused_chain(tokens, feats, s.draft_len, n - 1, count)
    caught_up([s], root[None], boundary[None], counts)
    return Proposal(*chain_proposal(drafts), q=[None], counts=[count], tree=False)


def draft_chain(backend: Backend, rows: list[Sequence], root: torch.Tensor, boundary: torch.Tensor,
                starts: list[int], k: int, counts: list[int] | None = None,
                errors: dict[int, str] | None = None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """k drafts per row (G, k): argmax for greedy rows; sampled rows draw from the draft's
    distribution (the target's temperature / top-k / top-p) and keep q in the target vocabulary.
    Row g needs only its first counts[g] drafts: its later steps are padding (never written).
    A sampled row whose sampler raises drafts argmax from then on, its error in `errors`."""
    errors = {} if errors is None else errors
    dev = backend.device
    sampled = [g for g, s in enumerate(rows) if s.sampler is not None]
    V = None
    if sampled:
        vocab_ids = backend.to_target_ids(torch.arange(root.shape[-1], device=dev))  # (Vd,)
        V = backend.vocab_size
    logits, feat = root, boundary
    drafts, qs = [], [[] for _ in rows]
    for i in range(k):
        ids = argmax(logits)  # (G,) draft vocabulary
        if sampled:
            ids = ids.clone()
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
        tok = backend.to_target_ids(ids)  # (G,)
        drafts.append(tok)
        if i < k - 1:
            valid = None if counts is None or min(counts) > i + 1 else [int(c > i + 1) for c in counts]
            out, feat = backend.draft(rows, tok[:, None], feat,
                                      causal_layout([p + i for p in starts], 1, valid, dev))
            logits = out[:, 0]
    q = [torch.stack(qs[g]) if rows[g].sampler is not None and qs[g] else None
         for g in range(len(rows))]
    return torch.stack(drafts, dim=1), q


def verify(backend: Backend, seqs: list[Sequence],
           proposals: list[Proposal]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One target forward over [anchor, the row's nodes] per row: logits (B, T, V), features,
    and the verified tokens (B, T). Rows that do not draft verify their anchor alone."""
    dev = backend.device
    B = len(seqs)
    T = 1 + max((max(p.counts) for p in proposals), default=0)
    tokens = torch.tensor([[s.anchor] * T for s in seqs], device=dev)
    counts = [1] * B
    region = rope = None
    if any(p.tree for p in proposals):  # ancestor masks and depths; chains are causal
        ar = slots_upto(T, dev)
        region = (ar[None, :] <= ar[:, None])[None].repeat(B, 1, 1)  # (B, T, T)
        rope = ar[None].repeat(B, 1)
    for p in proposals:
        idx = torch.tensor(p.rows, device=dev)
        n = min(T - 1, p.tokens.shape[1])
        tokens[idx, 1:n + 1] = p.tokens[:, :n]
        for g, b in enumerate(p.rows):
            counts[b] = p.counts[g] + 1
        if region is not None:
            region[idx, :n + 1, :n + 1] = p.mask[:, :n + 1, :n + 1]
            rope[idx, :n + 1] = p.depth[:, :n + 1]
    layout = Layout([s.target_len for s in seqs], slots_upto(T, dev), region=region, rope=rope,
                    region_pos=rope, counts=counts if B > 1 else None)
    with_features = backend.has_draft and any(s.drafts for s in seqs)
    logits, feats = backend.target(seqs, tokens, layout, with_features=with_features)
    return logits, feats, tokens


def commit(backend: Backend, seq: Sequence, verdict: Verdict, feats: torch.Tensor | None,
           b: int) -> None:
    """Advance one row past its verdict (see the module docstring); fills `verdict.new`."""
    P = seq.target_len
    path = verdict.path
    a = len(path)
    if path != list(range(1, a + 1)):  # accepted nodes' K/V to contiguous positions
        backend.compact(seq, [P + j for j in path], P + 1)
    seq.target_len = P + a + 1
    room = seq.room() - 1
    depths = verdict.depths
    if depths and room > 0:  # stats count what could be emitted: nodes past max_new_tokens are not
        verdict.drafted = sum(d <= room for d in depths)
        verdict.accepted = min(a, room)
        record_round(seq.stats, verdict.drafted, verdict.accepted, min(max(depths), room))
    seq.stats["target_forwards"] += 1
    emitted = verdict.tokens
    new_start = len(seq.out)
    seq.done = emit(seq.out, emitted, seq.stop_ids, seq.max_new_tokens)
    verdict.new = seq.out[new_start:]
    verdict.done = seq.done
    if feats is not None and seq.drafts and not seq.done:
        seq.pending_ids.extend(emitted)
        seq.pending_feats.append(feats[b, [0, *path]])


@torch.no_grad()
def run_round(backend: Backend, seqs: list[Sequence], plan: Plan) -> list[Verdict]:
    """The whole transaction for one round over `seqs` (none of them done): each row drafts by
    its own plan when it has one, else by `plan`; rows of one plan draft together, all verify
    in one target forward."""
    prof = active()
    prof.tic()
    plans = [s.plan or plan for s in seqs]
    grants = [grant(s, p, backend.max_len, backend.fixed_shapes)
              for s, p in zip(seqs, plans, strict=True)]
    for s, p, n in zip(seqs, plans, grants, strict=True):  # pages for the round's writes
        backend.reserve(s, s.target_len + (max(n + 1, draft_span(p)) if n else 1))
    # Rows draft together when their drafts are the same function of their own state: one plan,
    # and for trees one depth (a row near the cache's end expands fewer levels), so a row's
    # proposal never depends on the batch it shares.
    groups: dict[tuple[Plan, int], list[int]] = {}
    for b, (p, n) in enumerate(zip(plans, grants, strict=True)):
        if n > 0:
            groups.setdefault((p, min(p.tree.depth, n) if p.tree else 0), []).append(b)
    proposals = []
    if groups:
        fused = {key for key, rows in groups.items() if fusable(backend, key[0], [seqs[b] for b in rows])}
        catch_up(backend, [seqs[b] for key, rows in groups.items() if key not in fused for b in rows],
                 alone_over=max(grants) + 1)
        for key, rows in groups.items():
            if key in fused:
                proposal = propose_fused(backend, seqs[rows[0]], key[0], grants[rows[0]])
            else:
                proposal = propose(backend, [seqs[b] for b in rows], key[0], [grants[b] for b in rows])
            proposal.rows = rows
            proposals.append(proposal)
        prof.toc("draft", proposals[-1].tokens)
    logits, feats, tokens = verify(backend, seqs, proposals)
    verdicts = accept(seqs, logits, tokens, proposals)
    prof.toc("verify", syncs=1)
    for b, (s, v) in enumerate(zip(seqs, verdicts, strict=True)):
        if v.error is not None:
            continue
        try:
            commit(backend, s, v, feats, b)
        except Exception as e:  # this row's own handling failed: it alone fails
            v.error = brief(e)
    return verdicts
