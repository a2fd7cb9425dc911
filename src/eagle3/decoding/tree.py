"""Tree drafting (EAGLE-2/3 dynamic tree) and the speculative loop that verifies any draft tree.

A round with anchor `x` at position P (emitted, not yet in the target cache;
the draft cache holds slots 0..P-1, its last output `root_logits` predicting
the token after x):

    propose        a tree of N nodes under the root x: `draft_tree` expands the
                   top_k children of each of the top_k best frontier nodes for
                   `depth` levels (depth-1 batched draft forwards under an
                   ancestor mask) and keeps the N nodes of highest cumulative
                   log-probability (a connected tree: a child never outscores
                   its parent); `sample_chain` is a chain sampled from the
                   draft's own distribution, for chain speculative sampling
    verify         one target forward over [x, nodes] at slots P..P+N, RoPE
                   positions P + depth, attention = committed prefix + ancestors
    accept         greedy: the longest root-to-leaf path whose every token is the
                   target's argmax after its parent; the next token is the
                   argmax after the last accepted node. Sampling: `tree_accept`
                   (recursive rejection) or `speculative_accept` (chain, with q)
    commit         the accepted nodes' target K/V move to slots P+1..P+a
                   (`StaticKVCache.compact`); the draft drops its tree slots and
                   is reseeded from the accepted path's verify features

Capacity counts tree nodes: a round may verify N = min(total_tokens,
max_len - cur - 1) nodes (cur = tokens so far, anchor included), so its
commit (at most depth + 1 tokens) always fits; at 0 the round is plain
decoding. The draft's tree slots live past the committed prefix, in room the
draft cache reserves beyond max_len (MAX_TREE_DRAFT_SLOTS).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import Eagle3Error
from ..targets.decoder import slots_upto
from .chain import emit, record_round
from .profile import active
from .sampling import Sampler, speculative_accept, tree_accept

if TYPE_CHECKING:
    from ..speculator import Eagle3Speculator

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


# The fastest shape measured on the default model, eager, 2 CPU threads (README "Trees"):
# wider or deeper trees accept more (4x8x48: tau 5.06) but cost more than they gain here.
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


@dataclass
class DraftTree:
    """N drafted nodes under a root (node 0, the anchor); nodes are 1..N, parents before children.

    tokens (N,) target ids; parents (N,) node indices (0 = the root); depth (N+1,) with
    depth[0] = 0; mask (N+1, N+1) bool: row i marks node i and its ancestors;
    q (N, V) the draft probabilities each node was sampled from (sampled chains only).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    q: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def chain_tree(tokens: torch.Tensor, q: torch.Tensor | None = None) -> DraftTree:
    """A chain of k drafts (k,) as a tree: node i's parent is node i - 1."""
    k = tokens.shape[0]
    n = torch.arange(k + 1, device=tokens.device)
    return DraftTree(tokens, n[:-1], n, n[None, :] <= n[:, None], q)


class TreeDrafter:
    """Draft-side operations of a round: propose a tree or a sampled chain; reseed after verify."""

    def __init__(self, spec: Eagle3Speculator) -> None:
        self.spec = spec
        self.draft = spec.draft
        self.cache = spec.draft_cache
        self.length = 0  # committed draft slots

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, start: int, kv_len: int,
                rope_pos: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft forward of tokens (1, T) at slots start..start+T-1 -> (logits (T, Vd), h (1, T, H))."""
        T = tokens.shape[1]
        self.cache.claim(start, T)
        slots = slots_upto(start + T, tokens.device)[start:]
        logits, h = self.draft(tokens, features, slots, self.cache, kv_len=kv_len,
                               attn_mask=attn_mask, rope_pos=rope_pos)
        return logits[0], h

    def reseed(self, tokens: torch.Tensor, features: torch.Tensor,
               start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-force the accepted tokens (1, T) with their target features (1, T, H) at slots
        start.. ; returns the last row's draft logits (Vd,) and feature (1, 1, H)."""
        T = tokens.shape[1]
        self.cache.truncate(start)
        logits, h = self.forward(tokens, features, start, start + T)
        self.length = start + T
        return logits[-1], h[:, -1:]

    def draft_tree(self, root_logits: torch.Tensor, boundary: torch.Tensor, shape: TreeShape,
                   n_nodes: int) -> DraftTree:
        """The best `n_nodes` nodes of a dynamic tree under the root (see the module docstring)."""
        P = self.length
        depth = min(shape.depth, n_nodes)  # deeper levels could not be committed anyway
        scratch = shape.top_k * (depth - 1)
        self.cache.claim(P, scratch)
        tree = expand_tree(self.draft, self.cache, root_logits, boundary,
                           torch.tensor([P], device=root_logits.device),
                           slots_upto(P + scratch, root_logits.device), shape.top_k, depth, n_nodes)
        self.cache.truncate(P)  # the tree's draft slots are scratch
        return tree

    def sample_chain(self, root_logits: torch.Tensor, boundary: torch.Tensor, k: int,
                     sampler: Sampler) -> DraftTree:
        """k drafts, each sampled from the draft's distribution (same temperature/top-k/top-p as
        the target's); returns them as a chain tree with q in the target's vocabulary."""
        P = self.length
        V = self.spec.target.config.vocab_size
        logits, feature = root_logits[None], boundary
        target_ids = self.draft.to_target_ids(torch.arange(root_logits.shape[-1],
                                                           device=root_logits.device))  # (Vd,)
        drafts, qs = [], []
        for i in range(k):
            q_draft = sampler.probs(logits[-1])  # (Vd,)
            tok = target_ids[sampler.sample(q_draft)].view(1, 1)
            q = q_draft.new_zeros(V).index_add_(0, target_ids, q_draft)
            drafts.append(tok)
            qs.append(q)
            if i < k - 1:
                logits, feature = self.forward(tok, feature, P + i, P + i + 1)
        self.cache.truncate(P)
        return chain_tree(torch.cat(drafts, dim=1)[0], torch.stack(qs))


def expand_tree(draft: Any, cache: Any, root_logits: torch.Tensor, boundary: torch.Tensor,
                p0: torch.Tensor, key_slots: torch.Tensor, k: int, depth: int, n: int) -> DraftTree:
    """Draft a tree from the root's logits (Vd,) and feature (1, 1, H); keep the best n nodes.

    The draft cache holds the committed prefix, slots < p0 (1,); level l's k frontier nodes
    are written at slots p0 + (l-1)k .. (scratch), with RoPE position p0 + l - 1, and attend
    to the prefix and their ancestors. `key_slots` = arange(p0 + k(depth-1)). No host
    synchronisation and no control flow on tensor values (one compiled graph serves it).
    """
    device = root_logits.device
    scratch = k * (depth - 1)
    cols = key_slots[None, :] - p0  # (1, S): a slot's index in the scratch (< 0: committed)
    prefix = cols < 0
    in_scratch = (cols >= 0) & (cols < scratch)
    col_idx = cols.clamp(0, max(scratch - 1, 0))
    ar = torch.arange(k, device=device)
    scratch_ar = torch.arange(scratch, device=device)
    top = torch.log_softmax(root_logits.float(), -1).topk(k)
    to_target = draft.to_target_ids
    # Every scored candidate, level by level: token, cumulative log-prob, parent candidate.
    tokens, scores = [to_target(top.indices)], [top.values]
    parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
    levels = [torch.ones(k, dtype=torch.long, device=device)]
    front = ar  # the frontier's candidate indices
    front_tok, front_score = tokens[0], top.values
    front_feat = boundary.expand(1, k, boundary.shape[-1])  # (1, k, H)
    front_anc = torch.zeros(k, scratch, dtype=torch.bool, device=device)  # ancestors' slots
    n_cand = k
    for level in range(1, depth):
        own = scratch_ar[None, :] == ((level - 1) * k + ar)[:, None]  # (k, scratch)
        tree_mask = front_anc | own
        mask = prefix | (in_scratch & tree_mask.gather(1, col_idx.expand(k, -1)))  # (k, S)
        logits, h = draft(front_tok[None], front_feat, p0 + (level - 1) * k + ar, cache,
                          attn_mask=mask, rope_pos=(p0 + level - 1).expand(k), key_slots=key_slots)
        child = torch.log_softmax(logits[0].float(), -1).topk(k)  # (k, k)
        child_score = (front_score[:, None] + child.values).flatten()  # (k*k,)
        child_tok = to_target(child.indices).flatten()
        tokens.append(child_tok)
        scores.append(child_score)
        parents.append(front.repeat_interleave(k))
        levels.append(torch.full((k * k,), level + 1, dtype=torch.long, device=device))
        if level < depth - 1:
            best = child_score.topk(k).indices  # (k,) the next frontier
            par = best // k
            front, front_tok, front_score = n_cand + best, child_tok[best], child_score[best]
            front_feat, front_anc = h[:, par], tree_mask[par]
        n_cand += k * k
    return select_tree(torch.cat(tokens), torch.cat(scores), torch.cat(parents), torch.cat(levels),
                       n, depth)


def verify_tree(target: Any, cache: Any, anchor: torch.Tensor, tree: DraftTree, p0: torch.Tensor,
                key_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target forward over [anchor (1, 1), nodes] at slots p0.. with RoPE positions
    p0 + depth, each attending to the committed prefix and its ancestors. `key_slots` =
    arange(p0 + N + 1). Returns (logits (1, N+1, V), taps)."""
    T = tree.size + 1
    cols = key_slots[None, :] - p0  # (1, S): a slot's node index (< 0: committed)
    node = cols.clamp(0, T - 1)
    node_mask = tree.mask.gather(1, node.expand(T, -1))  # (T, S)
    mask = (cols < 0) | ((cols < T) & node_mask)
    tokens = torch.cat([anchor, tree.tokens[None]], dim=1)  # (1, T)
    slots = p0 + torch.arange(T, device=anchor.device)
    rope = p0 + tree.depth  # (T,)
    # Sliding windows compare positions: a node's key sits at its slot but has its depth's.
    key_pos = torch.where(cols[0] < 0, key_slots, rope[node[0]])  # (S,)
    return target.forward_logits_taps(tokens, slots, cache, key_slots=key_slots, attn_mask=mask,
                                      rope_pos=rope, key_pos=key_pos)


def select_tree(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor,
                levels: torch.Tensor, n: int, depth: int) -> DraftTree:
    """Keep the n best candidates (M,) by score as a tree.

    Candidates are listed level by level, so a parent precedes its children, and a
    child's cumulative log-probability never exceeds its parent's: a stable
    descending sort keeps a parent ahead of its children even on ties, so the top
    n are a connected tree. Sorted back into candidate order, parents come first.
    """
    keep = torch.sort(scores, descending=True, stable=True).indices[:n].sort().values  # (n,)
    node_of = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
    node_of[keep] = torch.arange(1, n + 1, device=tokens.device)
    par = parents[keep]
    tree_parents = torch.where(par >= 0, node_of[par.clamp_min(0)], 0)  # (n,) 0 = the root
    node_depth = torch.cat([levels.new_zeros(1), levels[keep]])  # (n+1,)
    up = torch.cat([tree_parents.new_zeros(1), tree_parents])  # (n+1,) the root is its own parent
    mask = torch.eye(n + 1, dtype=torch.bool, device=tokens.device)
    for _ in range(depth):  # each pass adds one more generation of ancestors (levels <= depth)
        mask = mask | mask[up]
    return DraftTree(tokens[keep], tree_parents, node_depth, mask)


def greedy_path(verify_ids: list[int], tokens: list[int], parents: list[int]) -> list[int]:
    """The longest root-to-leaf path (node indices, root excluded) whose every token is the
    target's greedy choice after its parent. Node j (1..N) has tokens[j-1], parents[j-1]."""
    path, node = [], 0
    for j, (tok, par) in enumerate(zip(tokens, parents, strict=True), start=1):
        if par == node and tok == verify_ids[node]:  # parents precede children: one pass
            path.append(j)
            node = j
    return path


Propose = Callable[[TreeDrafter, torch.Tensor, torch.Tensor, int], DraftTree]


@torch.no_grad()
def speculative_generate(spec: Eagle3Speculator, prompt_ids: list[int], max_new_tokens: int,
                         stop_ids: frozenset[int], stats: dict, propose: Propose, max_nodes: int,
                         depth: int, sampler: Sampler | None = None,
                         shape: TreeShape | None = None) -> list[int]:
    """Speculative decoding with one draft tree per round (a chain is a tree); fills `stats`.

    `propose(drafter, root_logits, boundary, n_nodes)` drafts at most `max_nodes` nodes at most
    `depth` deep. Greedy when `sampler` is None: token-identical to plain greedy decoding;
    else lossless in distribution (trees by recursive rejection; chains whose nodes carry q
    by speculative sampling). With compiled steps, greedy rounds of a full-size tree `shape`
    run as two graphs (reseed + tree draft, verify); rounds near the cache's end run eagerly.
    """
    target = spec.target  # a native target (the caller checked): it takes tree masks
    n = len(prompt_ids)
    max_len = spec.max_seq_len
    pos = slots_upto(max_len)
    spec.reset_caches()
    drafter = TreeDrafter(spec)
    prompt = torch.tensor([prompt_ids])
    stats["accepted_per_position"] = [0] * depth
    stats["drafted_per_position"] = [0] * depth
    stats["accept_len_hist"] = [0] * (depth + 1)
    prof = active()
    pick = (lambda lg: lg.argmax(-1)) if sampler is None else (
        lambda lg: sampler.sample(sampler.probs(lg)))
    compiled = spec.compiled if sampler is None and shape is not None else None

    prof.tic()
    logits, taps = target.forward_logits_taps(prompt, pos[:n], spec.target_cache, kv_len=n,
                                              last_only=True)
    out = [int(pick(logits[0, -1]))]
    stats["target_forwards"] += 1
    if max_new_tokens == 1 or out[-1] in stop_ids:
        prof.toc("prefill", syncs=1)
        return out
    anchor = torch.tensor([out[-1:]])  # (1, 1)
    root_logits, boundary = drafter.reseed(torch.cat([prompt[:, 1:], anchor], dim=1),
                                           spec._fuse(taps), 0)
    prof.toc("prefill", syncs=1)
    reseed = None  # (tokens (1, a+1), features (1, a+1, H), start): the last round's accepted path
    while True:
        P = n + len(out) - 1  # the anchor's position
        n_nodes = min(max_nodes, max_len - P - 2)  # the commit (<= depth + 1 tokens) must fit
        fused = compiled is not None and n_nodes == shape.total_tokens and (
            max_len - P - 2 >= shape.depth)  # full size: the graphs' static shapes
        prof.tic()
        tree = None
        if fused:
            tree = _compiled_draft(spec, drafter, compiled, shape, root_logits, boundary, reseed, P)
        elif n_nodes > 0:
            if reseed is not None:
                root_logits, boundary = drafter.reseed(*reseed)
            tree = propose(drafter, root_logits, boundary, n_nodes)
        prof.toc("draft")
        N = tree.size if tree is not None else 0
        p0 = pos[P:P + 1]
        if tree is None:
            logits, taps = target.forward_logits_taps(anchor, p0, spec.target_cache, kv_len=P + 1)
            feats = None
        elif fused:
            verify_ids, feats = compiled.tree_verify(anchor, tree, p0, P + N + 1)
            logits = None
        else:
            logits, taps = verify_tree(target, spec.target_cache, anchor, tree, p0,
                                       slots_upto(P + N + 1))
            feats = None
        stats["target_forwards"] += 1
        if tree is None:
            path, nxt = [], int(pick(logits[0, 0]))
        else:
            ids = verify_ids if fused else logits[0].argmax(-1)
            host = torch.cat([ids, tree.tokens, tree.parents, tree.depth[1:]]).tolist()  # one sync
            v, toks = host[:N + 1], host[N + 1:2 * N + 1]
            parents, depths = host[2 * N + 1:3 * N + 1], host[3 * N + 1:]
            if sampler is None:
                path = greedy_path(v, toks, parents)
                nxt = v[path[-1] if path else 0]
            elif tree.q is not None:
                a, nxt = speculative_accept(sampler, sampler.probs(logits[0]), tree.tokens, tree.q)
                path = list(range(1, a + 1))
            else:
                path, nxt = tree_accept(sampler, sampler.probs(logits[0]), toks, parents)
        prof.toc("verify", syncs=1)
        a = len(path)
        if path != list(range(1, a + 1)):  # accepted nodes' K/V to contiguous slots
            target.compact_cache(spec.target_cache, P + torch.tensor(path), P + 1)
        target.truncate_cache(spec.target_cache, P + a + 1)
        emitted = [toks[j - 1] for j in path] + [nxt]
        # Stats count what could be emitted: nodes past max_new_tokens are not.
        room = max_new_tokens - len(out) - 1
        if tree is not None and room > 0:
            record_round(stats, sum(d <= room for d in depths), min(a, room), min(max(depths), room))
        if emit(out, emitted, stop_ids, max_new_tokens):
            break
        anchor = torch.tensor([[nxt]])
        if tree is not None:  # the next round reseeds the draft from the accepted path
            rows = [0] + path
            f = feats[:, rows] if feats is not None else spec._fuse(taps[:, rows])  # (1, a+1, H)
            reseed = (torch.tensor([emitted]), f, P)
    return out


def _compiled_draft(spec: Eagle3Speculator, drafter: TreeDrafter, compiled: Any, shape: TreeShape,
                    root_logits: torch.Tensor, boundary: torch.Tensor, reseed: tuple | None,
                    P: int) -> DraftTree:
    """Reseed (if any) and draft a full-size tree in one compiled graph. The reseed runs over a
    fixed depth + 1 rows: rows past the accepted path repeat its last token and feature at
    slots the tree then overwrites (or never attends to)."""
    k, depth = shape.top_k, min(shape.depth, shape.total_tokens)  # as draft_tree expands it
    scratch = k * (depth - 1)
    if reseed is None:  # the first round: the prompt's reseed already ran (eagerly)
        drafter.cache.claim(P, scratch)
        tree = compiled.tree(root_logits, boundary, P, P + scratch, k, depth, shape.total_tokens)
    else:
        tokens, feats, start = reseed
        a = tokens.shape[1] - 1
        R = depth + 1
        tokens = torch.cat([tokens, tokens[:, -1:].expand(1, R - a - 1)], dim=1)
        feats = torch.cat([feats, feats[:, -1:].expand(1, R - a - 1, -1)], dim=1)
        kv_len = max(start + R, P + scratch)
        drafter.cache.truncate(start)
        drafter.cache.claim(start, kv_len - start)
        tree = compiled.reseed_tree(tokens, feats, start, a, P, kv_len, k, depth, shape.total_tokens)
    drafter.cache.truncate(P)
    drafter.length = P
    return tree
