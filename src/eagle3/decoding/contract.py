"""The four methods of ExecuTorch's `Eagle3Speculator` contract, written once.

`SpeculatorMethods` is both the eager reference and what `eagle3 export` lowers: an
`Eagle3Speculator` calls it on its backend's caches (after booking the slots), and
`export.program.SpeculatorProgram` is this module over export caches, so `torch.export`
traces these same lines. An exported program's runtime (`export.runtime.LoweredMethods`)
answers the same four calls from the lowered graphs.

    prefill(tokens, input_pos)               -> (token (B,), feature (B, T, H))
    target_verify(tokens, input_pos)         -> (verify_ids (B, T), feature (B, T, H))
    draft_decode(tokens, feature, input_pos) -> (target_ids (B, T), next_feature (B, T, H))
    decode(tokens, input_pos)                -> (token (B,), feature (B, 1, H))

Features are the fused H-wide draft features `fc(taps)` (None without a head). `kv_len` (a
Python int) bounds attention to the live slots, an eager speed-up; without it the whole cache
is masked by position (what the exported graphs do).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..kernels import argmax

CONTRACT_METHODS = ("prefill", "target_verify", "draft_decode", "decode")


class SpeculatorMethods(nn.Module):
    """A target, an optional head (with its taps) and their two caches, read and written in place."""

    def __init__(self, target: Any, draft: Any, taps: tuple[int, ...] | None, target_cache: Any,
                 draft_cache: Any) -> None:
        super().__init__()
        self.target, self.draft = target, draft
        self.taps = tuple(taps) if taps is not None else None
        self.target_cache, self.draft_cache = target_cache, draft_cache

    def _target(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int | None,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, taps = self.target.forward_logits_taps(
            tokens, input_pos, self.target_cache, kv_len=kv_len, last_only=last_only,
            with_taps=self.draft is not None, taps=self.taps)
        return argmax(logits), (self.draft.fuse(taps) if taps is not None else None)

    def prefill(self, tokens: torch.Tensor, input_pos: torch.Tensor,
                kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target forward over the prompt: next greedy token (B,) and features (B, T, H)."""
        ids, feature = self._target(tokens, input_pos, kv_len, last_only=True)
        return ids[:, -1], feature

    def target_verify(self, tokens: torch.Tensor, input_pos: torch.Tensor,
                      kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target forward over [anchor, drafts]: verify_ids[i] = greedy token after token i."""
        return self._target(tokens, input_pos, kv_len)

    def draft_decode(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor,
                     kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft forward: T>1 seeds the draft cache, T=1 steps. Returns target ids and next features."""
        logits, h = self.draft(tokens, feature, input_pos, self.draft_cache, kv_len=kv_len)
        return self.draft.to_target_ids(argmax(logits)), h

    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor,
               kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One plain target step: next greedy token (B,) and its feature (None without a head)."""
        ids, feature = self._target(tokens, input_pos, kv_len, last_only=True)
        return ids[:, -1], feature
