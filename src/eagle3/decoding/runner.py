"""What a speculative round needs from the models, and the batch-1 runner behind `generate`.

A round (`decoding.round`) asks a runner for drafts, one forward and one cache edit:

    draft_chain(rows, k, counts) / draft_tree(rows, shape, counts)
                                                  -> a `Proposal` per group of rows (catch-up
                                                     included; `decoding.drafting.EagerDrafting`
                                                     builds both on the runner's `draft`, a lone
                                                     greedy chain on its `one_op_chain` where
                                                     it has one)
    target(seqs, tokens (B, T), layout)           -> logits (B, T|1, V), taps (B, T, F) | None
    features(taps (..., F))                       -> the draft's input features (..., H)
    draft(seqs, tokens (B, T), feats, layout)      -> draft logits (B, T, Vd), next features (B, T, H)
    compact(seq, src positions, dst)              -> the target K/V of an accepted tree path moved
                                                     to contiguous positions

A round keeps the taps of the rows it accepts and turns them into features at the next
catch-up, all of a row's backlog in one `features` call: rows a round rejects, and the rounds
that decode plainly, never pay for the head's fc (on the row-invariant kernels the bits are
those of a call per round; elsewhere the last bits may differ, which changes what is accepted,
never the output).

How a runner runs them is its own affair: a compiled `StaticRunner` fuses a greedy
chain (catch-up included) or a tree into one graph where the shapes allow and keeps one
graph per K, and the round never knows.

`decoding.layout.Layout` says where each row's T tokens go and what they may see, in
positions of that row's own sequence, so one description serves a chain, a tree, a
sampled chain, a ragged batch and a sliding-window target. Rewinding is bookkeeping the
round keeps (each sequence's `target_len` / `draft_len`): attention only reads
positions below a query's, and later writes overwrite the rest.

Runners: `StaticRunner` (one sequence, the preallocated `cache.StaticKVCache`s;
`compile()` swaps its step and drafting functions for `torch.compile`d ones), the engine's
`engine.paged.PagedRunner` (many sequences over a page pool) and the exported
program's `export.runtime.ProgramRunner`. Every tensor a runner builds lives on
its `device`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch

from ..errors import Eagle3Error
from ..targets.cache import slots_upto
from .drafting import EagerDrafting, backlog, caught_up, chain_steps, draft_chain_proposal, draft_tree
from .layout import Layout, causal_layout
from .tree import TreeShape, chain_proposal
from .types import Proposal, SequenceState

# One compiled graph per (step, T, flags); dynamo's default limit (8) would make a
# fullgraph compile raise in the middle of a generation.
RECOMPILE_LIMIT = 256


class Runner(Protocol):
    """The models and caches a round runs on (see the module docstring)."""

    device: torch.device
    max_len: int
    has_draft: bool

    def draft_chain(self, rows: list[Any], k: int, counts: list[int]) -> Proposal: ...

    def draft_tree(self, rows: list[Any], shape: TreeShape, counts: list[int]) -> Proposal: ...

    def warm(self, max_k: int, start: int) -> None: ...

    def one_op_chain(self, tokens: torch.Tensor, feats: torch.Tensor, start: int,
                     k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None: ...

    def one_op_tree(self, tokens: torch.Tensor, feats: torch.Tensor, start: int, top_k: int,
                    depth: int, n: int, max_rope: int) -> tuple[torch.Tensor, ...] | None: ...

    def target(self, seqs: list[Any], tokens: torch.Tensor, layout: Layout, *,
               with_features: bool = True, last_only: bool = False,
               prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def features(self, taps: torch.Tensor) -> torch.Tensor: ...

    def draft(self, seqs: list[Any], tokens: torch.Tensor, features: torch.Tensor,
              layout: Layout) -> tuple[torch.Tensor, torch.Tensor]: ...

    def compact(self, seq: Any, src: list[int], dst: int) -> None: ...

    def reserve(self, seq: Any, n_positions: int) -> None: ...

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...

    def probe_rows(self, B: int, positions: int) -> AbstractContextManager[list[SequenceState] | None]:
        """B stand-in sequences with room for `positions` positions, for timing the forwards
        (`costs.RoundCosts.measure`); None when the runner has no room for them. Released on exit."""
        ...


@contextmanager
def one_row(B: int, positions: int) -> Iterator[list[SequenceState] | None]:
    """`probe_rows` for a runner of one preallocated sequence: a single row, B = 1 only."""
    yield [SequenceState("probe", [0], 1, frozenset())] if B == 1 else None


def region_mask(layout: Layout, T: int, device: torch.device) -> torch.Tensor:
    """(B, T, R) region mask, causal when the layout has none."""
    if layout.region is not None:
        return layout.region
    ar = slots_upto(T, device)
    return (ar[None, :] <= ar[:, None])[None].expand(len(layout.starts), T, T)


class StaticRunner(EagerDrafting):
    """One sequence on a target and head with preallocated static caches (batch 1).

    The target cache holds max_seq_len positions; the draft cache has room past it for a
    tree's scratch nodes (`scratch` slots), allocated once so compiled steps keep their shapes.
    """

    def __init__(self, target: Any, draft: Any = None, taps: tuple[int, ...] | None = None,
                 scratch: int = 0) -> None:
        self.target_model, self.draft_model, self.taps = target, draft, taps
        self.max_len = target.config.max_seq_len
        w = getattr(target, "embedding_weight", None)
        self.device = w.device if w is not None else torch.device("cpu")
        self.has_draft = draft is not None
        self.vocab_size = target.config.vocab_size
        self.target_cache = target.new_cache(1, self.max_len)
        self.draft_cache = draft.new_cache(1, self.max_len + scratch) if draft is not None else None
        self._target_step = self._eager_target
        self._draft_step = self._eager_draft
        self.compiled = False
        self._fused_chain: Any = None  # compile(): catch-up + a greedy chain as one graph

    # -- the two step functions (swapped by compile) --------------------------------------------
    def _eager_target(self, tokens: torch.Tensor, slots: torch.Tensor, key_slots: torch.Tensor,
                      mask: torch.Tensor | None, rope_pos: torch.Tensor | None,
                      key_pos: torch.Tensor | None, with_features: bool, last_only: bool,
                      prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        kwargs: dict[str, Any] = {"kv_len": key_slots.shape[0], "last_only": last_only,
                                  "with_taps": with_features and self.has_draft}
        if prefill:
            kwargs["prefill"] = True
        if self.taps is not None:
            kwargs["taps"] = self.taps
        if mask is not None:  # a tree: the transformers adapter never gets here
            kwargs.update(key_slots=key_slots, attn_mask=mask, rope_pos=rope_pos, key_pos=key_pos)
        elif self.compiled:
            kwargs["key_slots"] = key_slots
        return self.target_model.forward_logits_taps(tokens, slots, self.target_cache, **kwargs)

    def features(self, taps: torch.Tensor) -> torch.Tensor:
        return self.draft_model.fuse(taps)

    def _eager_draft(self, tokens: torch.Tensor, features: torch.Tensor, slots: torch.Tensor,
                     key_slots: torch.Tensor, mask: torch.Tensor | None,
                     rope_pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.draft_model(tokens, features, slots, self.draft_cache, key_slots=key_slots,
                                attn_mask=mask, rope_pos=rope_pos)

    def compile(self) -> StaticRunner:
        """Run both steps through `torch.compile` (fullgraph; one graph per T and flags, the
        attended length dynamic). Native targets only."""
        from ..targets.decoder import NativeTarget

        if not isinstance(self.target_model, NativeTarget):
            raise Eagle3Error("compile needs the native backend (this target runs through "
                              "transformers); load with backend='native' or drop compile")
        cfg = torch._dynamo.config
        cfg.cache_size_limit = max(cfg.cache_size_limit, RECOMPILE_LIMIT)
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 4 * RECOMPILE_LIMIT)
        target = torch.compile(self._eager_target, fullgraph=True)
        draft = torch.compile(self._eager_draft, fullgraph=True)
        chain = torch.compile(self._chain_steps, fullgraph=True)
        tree = torch.compile(self._tree_steps, fullgraph=True)
        self.compiled = True
        self._target_step = lambda *a: target(*_dense(a[:6], {2: 0, 3: 1, 5: 0}), *a[6:])
        self._draft_step = lambda *a: draft(*_dense(a, {3: 0, 4: 1}))
        # The catch-up width R (tokens, feats, seed slots) follows the last round's acceptance:
        # dynamic, so each K keeps one graph for R >= 2 (R = 1 is specialized apart).
        self._fused_chain = lambda tokens, feats, start, used, k: chain(*_dense(
            self._chain_args(tokens, feats, start, used, k), {0: 1, 1: 1, 2: 0, 3: 0}))

        def fused_tree(root: torch.Tensor, boundary: torch.Tensor, start: int, k: int, depth: int,
                       n: int) -> tuple[torch.Tensor, ...]:
            key_slots = slots_upto(start + k * (depth - 1), self.device)
            p0 = torch.tensor([start], device=self.device)
            return tree(*_dense((root, boundary, p0, key_slots), {3: 0}), k, depth, n)

        self.draft_chain = self._compiled_chain
        self.draft_tree = lambda rows, shape, counts: draft_tree(self, rows, shape, counts, fused_tree)
        return self

    def _compiled_chain(self, rows: list[Any], k: int, counts: list[int]) -> Proposal:
        """A lone greedy row that has drafted before: its catch-up and a chain of K as one graph
        (one per K: the catch-up runs over at least K + 1 rows, `backlog`'s padding, whatever the
        last round accepted; the chain drafts all K though it may verify fewer near
        max_new_tokens). Anything else, a prompt's catch-up included, drafts eagerly."""
        s = rows[0]
        if len(rows) > 1 or s.sampler is not None or not s.pending_ids or s.draft_len == 0:
            return draft_chain_proposal(self, rows, counts)
        n = len(s.pending_ids)
        if s.draft_len + n + k - 1 > self.max_len:  # K steps would pass the cache's end
            k = counts[0]
        tokens, feats, caught = backlog(self, [s], max(n, min(k + 1, self.max_len - s.draft_len)))
        drafts, root, boundary = self._fused_chain(tokens, feats, s.draft_len, n - 1, k)
        caught_up([s], root[None], boundary[None], caught)
        return Proposal(*chain_proposal(drafts[:, :counts[0]]), q=[None], counts=counts, tree=False)

    def _tree_steps(self, root: torch.Tensor, boundary: torch.Tensor, p0: torch.Tensor,
                    key_slots: torch.Tensor, k: int, depth: int, n: int) -> tuple[torch.Tensor, ...]:
        """`decoding.tree.expand_tree` for one row at position p0 (a tensor: no graph per
        position), its levels' masks built here over `key_slots` = arange(p0 + scratch)."""
        from .tree import expand_tree

        cols = key_slots - p0  # (S,) a key's offset from the row's start (< 0: committed)

        def step(tokens: torch.Tensor, feats: torch.Tensor, layout: Layout):
            region = layout.region[0]  # (k, R)
            R = region.shape[-1]
            seen = region.gather(1, cols.clamp(0, R - 1).expand(region.shape[0], -1))
            mask = (cols < 0) | (seen & (cols >= 0) & (cols < R))  # (k, S)
            return self.draft_model(tokens, feats, p0 + layout.offsets, self.draft_cache,
                                    key_slots=key_slots, attn_mask=mask, rope_pos=p0 + layout.rope[0])

        return expand_tree(step, self.draft_model.to_target_ids, root, boundary, [0], k, depth, n)

    @torch.no_grad()
    def warm(self, max_k: int, start: int) -> None:
        """Compiled: build every graph a round of up to `max_k` chain drafts uses now (verify and
        draft forwards over 1..max_k + 1 tokens, the fused chain of every K), at positions from
        `start` > 0 (scratch: the next prefill overwrites them), so a generation that switches K
        never compiles. Eager: nothing to build."""
        if not self.compiled:
            return
        probe = [None]
        for T in range(1, (max_k + 1 if self.has_draft else 1) + 1):
            tokens = torch.zeros(1, T, dtype=torch.long, device=self.device)
            layout = causal_layout([start], T, device=self.device)
            _, taps = self.target(probe, tokens, layout, with_features=self.has_draft)
            if self.has_draft:
                self.draft(probe, tokens, self.features(taps), layout)
        if self.has_draft:
            H = self.draft_model.config.hidden_size
            feats = torch.zeros(1, max_k + 1, H, dtype=self.draft_model.dtype, device=self.device)
            tokens = torch.zeros(1, max_k + 1, dtype=torch.long, device=self.device)
            for k in range(1, max_k + 1):
                for R in (1, k + 1):  # both graphs a K may need (see `compile`)
                    self._fused_chain(tokens[:, :R], feats[:, :R], start, 0, k)

    def _chain_args(self, tokens: torch.Tensor, feats: torch.Tensor, start: int, used: int,
                    k: int) -> tuple[torch.Tensor, ...]:
        R, dev = tokens.shape[1], self.device
        p = start + used + 1  # the first chain step's position
        key_slots = slots_upto(max(start + R, p + k - 1), dev)
        return (tokens, feats, key_slots[start:start + R], key_slots,
                torch.tensor([used], device=dev), slots_upto(p + k - 1, dev)[p:])

    def _chain_steps(self, tokens: torch.Tensor, feats: torch.Tensor, seed_slots: torch.Tensor,
                     key_slots: torch.Tensor, used: torch.Tensor,
                     step_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Catch up tokens (1, R) with features at `seed_slots`; from row `used` (the last real
        one; later rows are padding that the steps overwrite, causal attention never reading
        them first) draft greedily one token per step slot and one more (`chain_steps`).
        Returns drafts (1, k) in target ids, the root logits (Vd,) and its feature (H,)."""
        draft = self.draft_model
        logits, h = draft(tokens, feats, seed_slots, self.draft_cache, key_slots=key_slots)
        root, feat = logits.index_select(1, used)[:, 0], h.index_select(1, used)  # (1, Vd), (1, 1, H)

        def step(i: int, tok: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out, feat = draft(tok[:, None], feat, step_slots[i:i + 1], self.draft_cache, key_slots=key_slots)
            return out[:, 0], feat

        drafts = chain_steps(step, draft.to_target_ids, root, feat, step_slots.shape[0] + 1)
        return drafts, root[0], feat[0, 0]

    def one_op_chain(self, tokens: torch.Tensor, feats: torch.Tensor, start: int,
                     k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The head's `greedy_chain` on this runner's draft cache (eager runners only: a compiled
        runner fuses its own graphs)."""
        if self.compiled:
            return None
        return self.draft_model.greedy_chain(tokens, feats, start, k, self.draft_cache)

    def one_op_tree(self, tokens: torch.Tensor, feats: torch.Tensor, start: int, top_k: int,
                    depth: int, n: int, max_rope: int) -> tuple[torch.Tensor, ...] | None:
        """The head's `greedy_tree` on this runner's draft cache (eager runners only)."""
        if self.compiled:
            return None
        return self.draft_model.greedy_tree(tokens, feats, start, top_k, depth, n, max_rope,
                                            self.draft_cache)

    # -- the Runner protocol -------------------------------------------------------------------
    def _place(self, layout: Layout, T: int) -> tuple[torch.Tensor, ...]:
        """slots (T,), key_slots (S,), mask (T, S) | None, rope (T,) | None, key_pos (S,) | None."""
        start, dev = layout.starts[0], self.device
        S = start + layout.span
        key_slots = slots_upto(S, dev)
        if layout.causal:  # slots start..S-1: a view, no arithmetic per step
            return key_slots[start:], key_slots, None, None, None
        slots = start + layout.offsets
        region = region_mask(layout, T, dev)[0]  # (T, R)
        mask = torch.cat([region.new_ones(T, start), region], dim=1)
        rope = start + (layout.offsets if layout.rope is None else layout.rope[0])
        key_pos = None
        if layout.region_pos is not None:
            key_pos = torch.cat([slots_upto(start, dev), start + layout.region_pos[0]])
        return slots, key_slots, mask, rope, key_pos

    def target(self, seqs: list[Any], tokens: torch.Tensor, layout: Layout, *,
               with_features: bool = True, last_only: bool = False,
               prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = tokens.shape[1]
        # A prompt's forward (last_only over T > 1) stays eager: one graph per prompt length
        # would recompile for every new prompt.
        if prefill or (last_only and T > 1):
            return self._eager_target(tokens, *self._place(layout, T), with_features, last_only,
                                      prefill)
        return self._target_step(tokens, *self._place(layout, T), with_features, last_only)

    def draft(self, seqs: list[Any], tokens: torch.Tensor, features: torch.Tensor,
              layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        slots, key_slots, mask, rope, _ = self._place(layout, tokens.shape[1])
        # A prompt's catch-up (the draft's first forward) stays eager: one graph per prompt length
        step = self._eager_draft if layout.starts[0] == 0 else self._draft_step
        return step(tokens, features, slots, key_slots, mask, rope)

    def compact(self, seq: Any, src: list[int], dst: int) -> None:
        self.target_model.compact_cache(self.target_cache, torch.tensor(src, device=self.device), dst)

    def reserve(self, seq: Any, n_positions: int) -> None:
        pass  # preallocated

    def probe_rows(self, B: int, positions: int) -> AbstractContextManager[list[SequenceState] | None]:
        return one_row(B, positions)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_model.to_target_ids(draft_ids)

    @property
    def supports_trees(self) -> bool:
        return hasattr(self.target_model, "compact_cache")


def _dense(tensors: tuple, dynamic: dict[int, int]) -> list:
    """Dense copies, the attended-length axis (argument index -> dim) marked dynamic: slices of
    one buffer differ in strides and offsets, and each difference would fail a guard and
    compile the step again; one graph then serves every cache length."""
    out = []
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            t = t.clone(memory_format=torch.contiguous_format)
            if i in dynamic:
                torch._dynamo.maybe_mark_dynamic(t, dynamic[i])
        out.append(t)
    return out
