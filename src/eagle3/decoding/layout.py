"""Where a forward's tokens go and what they see: `Layout`, the one description of chains, trees,
sampled chains, ragged batches and sliding windows that the round hands every runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..targets.cache import slots_upto


@dataclass
class Layout:
    """T tokens per row written at positions `starts[b] + offsets` (0..T-1 without a region).

    region (B, T, R) bool: which of the row's positions starts[b] .. starts[b]+R-1 each
    query sees (besides every position before starts[b]); None = causal over the T
    tokens themselves (R = T). rope (B, T): RoPE positions relative to starts (None =
    offsets). region_pos (B, R): the relative RoPE positions of the region's keys, for
    sliding windows (None = 0..R-1). counts: valid tokens per row (None = all T); the
    rest are padding whose outputs are ignored.
    """

    starts: list[int]
    offsets: torch.Tensor  # (T,)
    region: torch.Tensor | None = None
    rope: torch.Tensor | None = None
    region_pos: torch.Tensor | None = None
    counts: list[int] | None = None

    @property
    def span(self) -> int:
        """R: how many positions from each row's start this forward may touch."""
        if self.region is not None:
            return self.region.shape[-1]
        return self.offsets.shape[0]  # causal layouts write offsets 0..T-1

    @property
    def causal(self) -> bool:
        return self.region is None and self.rope is None


def causal_layout(starts: list[int], T: int, counts: list[int] | None = None,
                  device: torch.device | str = "cpu") -> Layout:
    """T consecutive tokens per row from its start (prefill, chain verify, catch-up, chain step)."""
    return Layout(starts, slots_upto(T, device), counts=counts)
