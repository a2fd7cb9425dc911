"""The KV cache inside an exported program: buffers in ExecuTorch's layout, its kernels.

Eager and compiled decoding use `cache.StaticKVCache` (B, n_kv, S, hd) and SDPA over a
mask. An exported program instead keeps (B, S, n_kv, hd) buffers, mutated in place
by `llama::update_cache`, and attends with `llama::custom_sdpa`, which is causal from
`start_pos` and reads only slots 0..start_pos+T-1: the cost of a step grows with the
sequence, not with the cache's size, and no mask is built. Both kernels ship with the
`executorch` wheel (`executorch.extension.llm.custom_ops`), with ATen implementations
for tracing and for running the module eagerly.

Positions must be contiguous (start_pos, start_pos+1, ...): prefill, decode, chain
verify and draft steps are; a tree's verify is not, so trees are not exported.
"""

from __future__ import annotations

import torch
from torch import nn


def load_custom_ops() -> None:
    """Register the llama:: kernels (ATen + ExecuTorch runtime); raises ImportError without executorch."""
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401


class ExportKVCache(nn.Module):
    """Per-layer K/V buffers (1, S, n_kv, hd) and their `attend` (the caches' one attention entry)."""

    def __init__(self, n_layers: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        load_custom_ops()
        self.n_layers, self.max_len = n_layers, max_len
        shape = (1, max_len, n_kv_heads, head_dim)
        for i in range(n_layers):
            # persistent=False: state, not weights (zeros at load; the runner overwrites before reading)
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=dtype), persistent=False)
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=dtype), persistent=False)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               input_pos: torch.Tensor, mask: torch.Tensor, kv_len: int, scale: float,
               softcap: float | None = None, stock: bool = False) -> torch.Tensor:
        """q (B, nh, T, hd), k/v (B, n_kv, T, hd) after RoPE, at positions input_pos[0].. -> (B, T, nh*hd).

        Causal from input_pos[0] by construction: `mask` and `kv_len` are not needed (export
        refuses the trees, windows and soft-capping they would express)."""
        B, nh, T, hd = q.shape
        start = input_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + T <= self.max_len)
        keys, values = getattr(self, f"k{layer}"), getattr(self, f"v{layer}")
        torch.ops.llama.update_cache(k.transpose(1, 2).contiguous(), keys, start)
        torch.ops.llama.update_cache(v.transpose(1, 2).contiguous(), values, start)
        out = torch.ops.llama.custom_sdpa(q.transpose(1, 2).contiguous(), keys, values, start,
                                          None, 0.0, True, scale)  # (B, T, nh, hd)
        return out.reshape(B, T, nh * hd)
