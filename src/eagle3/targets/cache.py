"""Static, preallocated key/value cache, the attention over it, and the slot table.

One tensor pair for all layers, batch dimension kept, slot index == token
position. Writing is an in-place `index_copy_` at the given positions, so the
same code runs eagerly and under `torch.export`. Rewinding (truncate) needs no
data movement: attention masks by position, so slots past the current length
are never read, and the next write simply overwrites them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import Eagle3Error
from ..kernels import row_invariant_attention

_SLOTS: dict[torch.device, torch.Tensor] = {}


def slots_upto(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """arange(n) as a slice of a shared table: no allocation per decoding step."""
    device = torch.device(device)
    table = _SLOTS.get(device)
    if table is None or table.shape[0] < n:
        table = _SLOTS[device] = torch.arange(max(n, 4096), device=device)
    return table[:n]


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float, softcap: float | None = None, exact: bool = False,
                     stock: bool = False) -> torch.Tensor:
    """q (B, nh, T, hd) over keys/values (B, nkv, S, hd) where `mask` (.., T, S) is True -> (B, T, nh*hd).

    `exact`: compute each query row on its own (`kernels.attention`, where it runs), so a
    row's result does not depend on how many rows share the call; SDPA's does. bf16 queries
    take that kernel too (in fp32, rounded back), exact or not: PyTorch's bf16 SDPA runs a
    matrix-vector product per decoded row, far slower on a CPU without AMX (docs/training.md).
    `stock`: SDPA whatever the rest says (a prompt's forward: many rows, where SDPA's matrix
    products pay).
    """
    B, nh, T, hd = q.shape
    nkv = keys.shape[1]
    if not stock and (exact or q.dtype == torch.bfloat16) and row_invariant_attention(q, keys):
        m = mask.reshape(-1, T, mask.shape[-1]).expand(B, T, mask.shape[-1])  # (B, T, S)
        return torch.ops.eagle3.attention(q.float(), keys, values, m, scale, softcap or 0.0).to(q.dtype)
    if keys.dtype != q.dtype:  # a bf16 cache under float32 queries (a prompt's stock kernels)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    if softcap is None:
        # enable_gqa: grouped heads without copying K/V (faster here than folding the groups
        # into rows, and its output views stay exportable with a dynamic T).
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=nh != nkv)  # (B, nh, T, hd)
    else:
        # Soft-capping needs the scores: fold each KV group's query heads into the row axis.
        g = nh // nkv
        scores = (q.reshape(B, nkv, g * T, hd) @ keys.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask.repeat(*[1] * (mask.dim() - 2), g, 1), float("-inf"))
        out = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ values
        out = out.reshape(B, nh, T, hd)
    return out.transpose(1, 2).reshape(B, T, nh * hd)


class SlotBook:
    """Host-side bookkeeping of a cache's filled slots (`length` of `max_len`), with no data:
    what eager callers check writes against. An exported program's caches live inside the
    program; the runtime keeps a SlotBook per cache to check its calls the same way."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0  # number of committed positions

    def claim(self, start: int, n: int) -> None:
        """Check (host side) that writing slots start..start+n-1 keeps the cache contiguous.

        Writes must extend the filled prefix or overwrite part of it (a rollback,
        which forgets everything after the write); a gap is rejected.
        """
        if start < 0 or start + n > self.max_len:
            raise Eagle3Error(f"cache write at slots {start}..{start + n - 1} is outside the cache's "
                              f"{self.max_len} slots")
        if start > self.length:
            raise Eagle3Error(f"cache write at slot {start} would leave a gap: only {self.length} slots "
                              "are filled; writes must be contiguous from slot 0 (rewind with truncate)")
        self.length = start + n

    def truncate(self, length: int) -> None:
        """Forget every position >= `length` (the data stays; masks hide it)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cannot truncate a cache of {self.max_len} slots to {length}")
        self.length = min(self.length, length)


class StaticKVCache(SlotBook):
    """K/V for `n_layers` layers: `k[layer]`, `v[layer]` are (B, n_kv, S, hd).

    One tensor per layer rather than one (L, ...) tensor: under `torch.compile`
    an in-place write into a view of a larger input makes inductor copy the
    whole input back every call; a write into a whole input stays in place.
    """

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", exact: bool = False) -> None:
        self.exact = exact  # row-invariant attention (see `masked_attention`)
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        super().__init__(max_len)

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv, T, hd) at slots `input_pos` (T,) (rounded to the cache's dtype);
        return the layer's full K, V."""
        self.k[layer].index_copy_(2, input_pos, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, input_pos, v.to(self.v[layer].dtype))
        return self.k[layer], self.v[layer]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               input_pos: torch.Tensor, mask: torch.Tensor, kv_len: int, scale: float,
               softcap: float | None = None, stock: bool = False) -> torch.Tensor:
        """Write k, v at `input_pos`; attend q over slots [0, kv_len) under `mask` (T, kv_len).
        `stock`: SDPA even on a row-invariant cache (a prompt's forward)."""
        keys, values = self.update(layer, input_pos, k, v)
        return masked_attention(q, keys[:, :, :kv_len], values[:, :, :kv_len], mask, scale, softcap,
                                self.exact, stock)

    def compact(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """Move the K/V at `src_slots` (N,) to contiguous slots dst_start..dst_start+N-1."""
        n = src_slots.numel()
        dst = torch.arange(dst_start, dst_start + n, device=src_slots.device)
        for layer_kv in (*self.k, *self.v):
            layer_kv.index_copy_(2, dst, layer_kv.index_select(2, src_slots))
