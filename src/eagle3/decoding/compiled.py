"""`torch.compile`d decoding steps: the target's verify/decode forward and the draft step.

On a small CPU eager PyTorch spends most of a decoding step dispatching ~50
small ops per layer; inductor fuses the elementwise work into a few C++ loops
around the GEMMs. (Max-autotune's C++ GEMM templates were measured slower for
the 1-token forward here, so they are not used.)

Shapes: the number of tokens T stays static (one graph per T: decode 1, verify
K+1, draft step 1, draft rebuild K+1); the attended cache length is dynamic,
carried by the length of `key_slots` (= arange(kv_len)), so a graph serves
every position. The caches are read from the speculator, as in eager mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..targets.decoder import slots_upto

if TYPE_CHECKING:
    from ..speculator import Eagle3Speculator

# One graph per (step, T, flags): up to ~30 with auto K. Past dynamo's default limit of 8,
# a fullgraph compile raises in the middle of a generation.
RECOMPILE_LIMIT = 256


class CompiledSteps:
    """Compiled target and draft steps over `spec`'s caches."""

    def __init__(self, spec: Eagle3Speculator) -> None:
        from ..errors import Eagle3Error
        from ..targets.decoder import NativeTarget

        if not isinstance(spec.target, NativeTarget):
            raise Eagle3Error("compile needs the native backend (this target runs through "
                              "transformers); load with backend='native' or drop compile")
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    RECOMPILE_LIMIT)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * RECOMPILE_LIMIT)
        self.spec = spec
        self._target = torch.compile(self._target_step, fullgraph=True)
        self._draft = torch.compile(self._draft_step, fullgraph=True)
        self._chain = torch.compile(self._chain_steps, fullgraph=True)
        self._rebuild_chain = torch.compile(self._rebuild_chain_steps, fullgraph=True)
        self._tree = torch.compile(self._tree_steps, fullgraph=True)
        self._reseed_tree = torch.compile(self._reseed_tree_steps, fullgraph=True)
        self._tree_verify = torch.compile(self._tree_verify_step, fullgraph=True)

    # The functions inductor compiles: tensors in, tensors out, caches written in place.
    def _target_step(self, tokens: torch.Tensor, input_pos: torch.Tensor, key_slots: torch.Tensor,
                     with_taps: bool, last_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        spec = self.spec
        logits, taps = spec.target.forward_logits_taps(tokens, input_pos, spec.target_cache,
                                                       key_slots=key_slots, last_only=last_only,
                                                       with_taps=with_taps)
        return logits.argmax(-1), spec._fuse(taps)

    def _draft_step(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor,
                    key_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        draft = self.spec.draft
        logits, h = draft(tokens, feature, input_pos, self.spec.draft_cache, key_slots=key_slots)
        return draft.to_target_ids(logits.argmax(-1)), h

    def _chain_steps(self, first: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
                     key_slots: torch.Tensor) -> torch.Tensor:
        """`first` (1, 1) plus one draft step per slot in `positions` (k-1,) -> drafts (1, k)."""
        drafts = [first]
        for i in range(positions.shape[0]):  # unrolled: k is static
            ids, feature = self._draft_step(drafts[-1], feature, positions[i:i + 1], key_slots)
            drafts.append(ids)
        return torch.cat(drafts, dim=1)

    def _rebuild_chain_steps(self, seed: torch.Tensor, seed_feature: torch.Tensor,
                             seed_pos: torch.Tensor, used: torch.Tensor, positions: torch.Tensor,
                             key_slots: torch.Tensor) -> torch.Tensor:
        """Teacher-force seed (1, T) at `seed_pos`; the row `used` (1,) starts the chain."""
        ids, h = self._draft_step(seed, seed_feature, seed_pos, key_slots)
        return self._chain_steps(ids.index_select(1, used), h.index_select(1, used), positions,
                                 key_slots)

    def _tree_steps(self, root_logits: torch.Tensor, boundary: torch.Tensor, p0: torch.Tensor,
                    key_slots: torch.Tensor, k: int, depth: int, n: int) -> tuple[torch.Tensor, ...]:
        """`decoding.tree.expand_tree` over the draft cache: (tokens, parents, depth, mask)."""
        from .tree import expand_tree

        t = expand_tree(self.spec.draft, self.spec.draft_cache, root_logits, boundary, p0, key_slots,
                        k, depth, n)
        return t.tokens, t.parents, t.depth, t.mask

    def _reseed_tree_steps(self, seed: torch.Tensor, seed_feature: torch.Tensor,
                           seed_pos: torch.Tensor, used: torch.Tensor, p0: torch.Tensor,
                           key_slots: torch.Tensor, k: int, depth: int,
                           n: int) -> tuple[torch.Tensor, ...]:
        """Teacher-force seed (1, R) at `seed_pos`; row `used` (1,) is the tree's root."""
        draft = self.spec.draft
        logits, h = draft(seed, seed_feature, seed_pos, self.spec.draft_cache, key_slots=key_slots)
        return self._tree_steps(logits[0].index_select(0, used)[0], h.index_select(1, used), p0,
                                key_slots, k, depth, n)

    def _tree_verify_step(self, anchor: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor,
                          mask: torch.Tensor, p0: torch.Tensor,
                          key_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        from .tree import DraftTree, verify_tree

        spec = self.spec
        tree = DraftTree(tokens, tokens, depth, mask)
        logits, taps = verify_tree(spec.target, spec.target_cache, anchor, tree, p0, key_slots)
        return logits[0].argmax(-1), spec._fuse(taps)

    def tree(self, root_logits: torch.Tensor, boundary: torch.Tensor, P: int, kv_len: int, k: int,
             depth: int, n: int) -> Any:
        from .tree import DraftTree

        dev = root_logits.device
        return DraftTree(*self._tree(_fresh(root_logits), _fresh(boundary),
                                     torch.tensor([P], device=dev), _dynamic_slots(kv_len, dev),
                                     k, depth, n))

    def reseed_tree(self, seed: torch.Tensor, seed_feature: torch.Tensor, start: int, used: int,
                    P: int, kv_len: int, k: int, depth: int, n: int) -> Any:
        from .tree import DraftTree

        dev = seed.device
        R = seed.shape[1]
        return DraftTree(*self._reseed_tree(
            _fresh(seed), _fresh(seed_feature), torch.arange(start, start + R, device=dev),
            torch.tensor([used], device=dev), torch.tensor([P], device=dev),
            _dynamic_slots(kv_len, dev), k, depth, n))

    def tree_verify(self, anchor: torch.Tensor, tree: Any, p0: torch.Tensor,
                    kv_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy ids (N+1,) after each node and fused features (1, N+1, H)."""
        return self._tree_verify(_fresh(anchor), _fresh(tree.tokens), _fresh(tree.depth),
                                 _fresh(tree.mask), _fresh(p0), _dynamic_slots(kv_len, anchor.device))

    def chain(self, first: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
              kv_len: int) -> torch.Tensor:
        return self._chain(_fresh(first), _fresh(feature), _fresh(positions),
                           _dynamic_slots(kv_len, first.device))

    def rebuild_chain(self, seed: torch.Tensor, seed_feature: torch.Tensor, seed_pos: torch.Tensor,
                      used: int, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        return self._rebuild_chain(_fresh(seed), _fresh(seed_feature), _fresh(seed_pos),
                                   torch.tensor([used], device=seed.device), _fresh(positions),
                                   _dynamic_slots(kv_len, seed.device))

    def target(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int, with_taps: bool,
               last_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._target(_fresh(tokens), _fresh(input_pos), _dynamic_slots(kv_len, tokens.device),
                            with_taps, last_only)

    def draft(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor,
              kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._draft(_fresh(tokens), _fresh(feature), _fresh(input_pos),
                           _dynamic_slots(kv_len, tokens.device))


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A dense copy: slices of one buffer differ in strides and offsets, and each difference
    would fail a guard and compile the step again."""
    return t.clone(memory_format=torch.contiguous_format)


def _dynamic_slots(kv_len: int, device: torch.device) -> torch.Tensor:
    slots = slots_upto(kv_len, device)
    torch._dynamo.maybe_mark_dynamic(slots, 0)
    return slots
