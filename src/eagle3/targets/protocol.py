"""The `TapTarget` protocol: what the speculator needs from a target model.

A target is a causal LM that, besides logits, returns "taps": the residual
stream entering chosen decoder layers. Tap k is transformers'
`output_hidden_states[k]` (k=0: the embedding output; k=L: the final, normed
hidden state). The draft head fuses three taps into its feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import Eagle3Error


@dataclass
class TargetConfig:
    """The sizes every target exposes (native targets use the richer `DecoderConfig`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_seq_len: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    architecture: str = ""


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default taps `(2, L//2, L-3)`; raises when they collide for small L."""
    taps = (2, num_layers // 2, num_layers - 3)
    if not (0 <= taps[0] < taps[1] < taps[2] <= num_layers):
        raise Eagle3Error(f"the default taps (2, L//2, L-3) = {taps} are not distinct and ascending "
                          f"for a {num_layers}-layer target; choose taps explicitly "
                          "(e.g. --taps 1,2,3, or taps=(1, 2, 3) in eagle3.load / attach_head)")
    return taps


def validate_taps(taps: Any, num_layers: int) -> tuple[int, ...]:
    """Return `taps` as a tuple of ints, or raise if not unique, ascending and in 0..L."""
    try:
        taps = tuple(int(t) for t in taps)
    except (TypeError, ValueError):
        raise Eagle3Error(f"taps must be a sequence of layer indices, got {taps!r}") from None
    if not taps:
        raise Eagle3Error("taps must name at least one layer")
    if any(t < 0 or t > num_layers for t in taps):
        raise Eagle3Error(f"taps {taps} out of range: each must be in 0..{num_layers} "
                          f"(0 = embeddings, {num_layers} = final normed hidden state)")
    if any(a >= b for a, b in zip(taps[:-1], taps[1:], strict=True)):
        raise Eagle3Error(f"taps {taps} must be unique and ascending (low, mid, high)")
    return taps


class TapLayers:
    """`tap_layers` for a target class with a `config.num_hidden_layers`: the layers whose
    inputs it taps, validated when set, and the default (2, L//2, L-3) resolved on first read
    so that small targets load before taps are chosen. Written once for the native and
    transformers targets."""

    _taps: tuple[int, ...] = ()

    @property
    def tap_layers(self) -> tuple[int, ...]:
        if not self._taps:
            self._taps = default_taps(self.config.num_hidden_layers)
        return self._taps

    @tap_layers.setter
    def tap_layers(self, layers: Any) -> None:
        self._taps = validate_taps(layers, self.config.num_hidden_layers)


@runtime_checkable
class TapTarget(Protocol):
    """A causal LM that returns logits and concatenated taps.

    `forward_logits_taps(tokens (B,T), input_pos (T,), cache, *, kv_len=None,
    attn_mask=None, rope_pos=None, last_only=False, with_taps=True, prefill=False)` returns
    `(logits (B,T|1,V), taps (B,T,n_taps*H) or None)`. `input_pos` are the cache
    slots written (== RoPE positions unless `rope_pos` is given); `kv_len` bounds
    the slots attended to (an eager speed-up; None = the whole cache);
    `attn_mask` (T, kv_len) bool replaces the causal mask (tree verification);
    `key_pos` (kv_len,) gives the cached keys' positions for sliding windows when
    they differ from their slots (tree nodes); `prefill` marks a prompt's forward, which
    need not be row-invariant (it is the same call in plain and speculative decoding), so
    it may take faster stock kernels. Tree verification also needs
    `compact_cache(cache, src_slots, dst_start)`; targets without it run chains.
    `new_cache(batch_size, max_len)` returns a cache with `claim(start, n)` (the slot
    checks) and `truncate(length)` (a rollback).
    """

    config: Any

    @property
    def tap_layers(self) -> tuple[int, ...]: ...

    @tap_layers.setter
    def tap_layers(self, layers: Any) -> None: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def forward_logits_taps(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: Any,
                            **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> Any: ...

