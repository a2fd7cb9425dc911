"""`HFTarget`: the `TapTarget` protocol over any transformers causal LM.

Slower than the native targets, but it loads whatever `AutoModelForCausalLM`
loads. Taps come from `output_hidden_states`; rewinding crops the
`DynamicCache`. Writes must extend the cache contiguously; a write that starts
before the cached length first crops back to it (the static cache's overwrite
semantics).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import Eagle3Error
from .protocol import TapLayers, TargetConfig


class HFCache:
    """A transformers `DynamicCache` plus the capacity the speculator plans with."""

    def __init__(self, model: Any, batch_size: int, max_len: int) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=model.config)
        try:
            from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
        except ImportError:  # transformers 4.x: every layer keeps every position already
            pass
        else:
            # A sliding-window layer keeps only its last window-1 positions, so it cannot be
            # rewound past them: keep every position (the model's mask still applies the window).
            self.cache.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer)
                                 else layer for layer in self.cache.layers]
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0

    def truncate(self, length: int) -> None:
        crop_cache(self.cache, length)
        self.length = min(self.length, length)


def crop_cache(cache: Any, length: int) -> None:
    """Crop a transformers cache to its first `length` positions.

    A negative count (tokens to remove) means the same on transformers 4.x and 5.x;
    5.x rejects the older positive "new length" form.
    """
    cached = cache.get_seq_length()
    if cached > length:
        cache.crop(length - cached)


class HFTarget(TapLayers):
    """Wraps a loaded `transformers` causal LM (eval mode, no grad)."""

    def __init__(self, model: Any, max_seq_len: int | None = None,
                 taps: tuple[int, ...] | None = None) -> None:
        model.eval()
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        eos = getattr(model.generation_config, "eos_token_id", None) if getattr(
            model, "generation_config", None) is not None else None
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        max_pos = int(getattr(cfg, "max_position_embeddings", None) or 4096)
        self.model = model
        self.config = TargetConfig(
            model_type=str(cfg.model_type), vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size), num_hidden_layers=int(cfg.num_hidden_layers),
            max_seq_len=min(max_pos, max_seq_len) if max_seq_len else min(max_pos, 4096),
            eos_token_ids=tuple(int(e) for e in eos_ids), bos_token_id=getattr(cfg, "bos_token_id", None),
            architecture=(getattr(cfg, "architectures", None) or [""])[0])
        if taps is not None:
            self.tap_layers = taps

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(tokens)

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> HFCache:
        return HFCache(self.model, batch_size, max_len or self.config.max_seq_len)

    @torch.no_grad()
    def forward_logits_taps(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: HFCache,
                            *, kv_len: int | None = None, attn_mask: torch.Tensor | None = None,
                            rope_pos: torch.Tensor | None = None, last_only: bool = False,
                            with_taps: bool = True, taps: tuple[int, ...] | None = None,
                            prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if attn_mask is not None:
            raise Eagle3Error("the transformers adapter does not take a custom attention mask "
                              "(tree verification); use a native target")
        start = int(input_pos[0])
        if start < cache.cache.get_seq_length():
            crop_cache(cache.cache, start)
        elif start > cache.cache.get_seq_length():
            raise Eagle3Error(f"HF cache holds {cache.cache.get_seq_length()} positions; cannot "
                              f"write at {start} (writes must be contiguous)")
        B = tokens.shape[0]
        pos = (input_pos if rope_pos is None else rope_pos)[None].expand(B, -1)
        out = self.model(input_ids=tokens, position_ids=pos, cache_position=input_pos,
                         past_key_values=cache.cache, use_cache=True,
                         output_hidden_states=with_taps, logits_to_keep=1 if last_only else 0)
        cache.length = cache.cache.get_seq_length()
        if with_taps:
            return out.logits, torch.cat([out.hidden_states[k] for k in taps or self.tap_layers], dim=-1)
        return out.logits, None

    forward = forward_logits_taps
    __call__ = forward_logits_taps
