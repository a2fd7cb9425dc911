"""Weight formats for linear layers and the small-M kernels that run them.

A `QLinear` holds its weight in one of `FORMATS`:
- ``float32``: as stored, (N, K).
- ``bfloat16``: weights rounded to bf16, (N, K); activations stay float32.
- ``int8``: GGUF Q8_0: signed codes, one fp16 scale per block of 32 inputs; w = code * scale.
- ``int4``: GGUF Q4_1: codes 0..15 with an fp16 scale and offset per block of 32;
  w = code * scale + offset. Without offsets it is GGUF Q4_0: w = (code - 8) * scale.
  (`quantize` with a group of 64, 96, ... repeats a group's scale over its blocks.)

The packed formats multiply int8 activations (quantized per row, per block of 32, from that
row alone) by the weight codes in integers: a block's sum is exact in int32, so it is the
same in any order and on any instruction set, and only a short fp32 epilogue in a fixed block
order remains (`kernels.cpp` says how; `exact_linear` is the same arithmetic in PyTorch, bit
for bit). The float formats sum in 16 lanes with a fixed reduction tree. Either way each row
of x is computed independently of how many rows share the call, so `target_verify` over
K+1 rows gives each row the bits a 1-row `decode` gives, and each weight block is read once
per call whatever the number of rows (weight-stationary).

The kernels are a C++ extension built on first use for any x86-64 CPU (under a minute, cached
by `torch.utils.cpp_extension` under ~/.cache/torch_extensions). At run time they take the best
instruction-set path the CPU has: ``avx512`` (AVX-512 VNNI), ``avxvnni`` (AVX2 with 256-bit
VNNI: Alder Lake and later client CPUs), ``avx2`` (AVX2 + FMA + F16C) or ``scalar``; every path
gives the same bits. `EAGLE3_ISA=scalar|avx2|avxvnni|avx512` forces one
(for tests and comparisons); `isa()` names the one in use. Elsewhere (another architecture,
CUDA tensors) `reference_linear` computes the same formulas in PyTorch one row at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import Eagle3Error
from .build import kernel_available

FORMATS = ("float32", "bfloat16", "int8", "int4")
QUANTIZE_CHOICES = ("int8", "int4")
FMT_ID = {name: i for i, name in enumerate(FORMATS)}
BLOCK = 32  # inputs per scale in the packed formats (GGUF's block)
_EMPTY = torch.empty(0)


# -- packing ----------------------------------------------------------------------------

def pack_codes(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """(N, K) codes -> the kernel's tiles, flat uint8: per 16 columns and block of 32 inputs,
    int8: [quad 0..7][column][4 inputs]; int4 (codes 0..15): [p 0..3][column][4 bytes], the
    low nibble input 4p + j, the high nibble input 16 + 4p + j."""
    N, K = codes.shape
    if fmt == "int8":
        t = codes.to(torch.int8).view(torch.uint8).reshape(N // 16, 16, K // 32, 8, 4)
        return t.permute(0, 2, 3, 1, 4).contiguous().reshape(-1)
    c = codes.to(torch.uint8).reshape(N // 16, 16, K // 32, 2, 4, 4)  # (.., half, p, j)
    t = c[..., 0, :, :] | (c[..., 1, :, :] << 4)  # (N/16, 16, nb, p, j)
    return t.permute(0, 2, 3, 1, 4).contiguous().reshape(-1)


def unpack_codes(packed: torch.Tensor, N: int, K: int, fmt: str) -> torch.Tensor:
    """Inverse of `pack_codes`: (N, K) int8 codes (int8) or uint8 codes 0..15 (int4)."""
    if fmt == "int8":
        t = packed.view(torch.uint8).reshape(N // 16, K // 32, 8, 16, 4).permute(0, 3, 1, 2, 4)
        return t.reshape(N, K).view(torch.int8)
    t = packed.reshape(N // 16, K // 32, 4, 16, 4).permute(0, 3, 1, 2, 4)  # (N/16, 16, nb, p, j)
    return torch.stack([t & 15, t >> 4], dim=3).reshape(N, K)


def pack_scales(s: torch.Tensor) -> torch.Tensor:
    """(N, K/32) per-block scales -> (N/16, K/32, 16) float16, the kernel's order."""
    N, nb = s.shape
    return s.to(torch.float16).reshape(N // 16, 16, nb).permute(0, 2, 1).contiguous()


def unpack_scales(s: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_scales`: (N, K/32) float32."""
    n16, nb, _ = s.shape
    return s.float().permute(0, 2, 1).reshape(n16 * 16, nb)


def quantize_int8(w: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 (Q8_0 for groups of 32): (N, K) -> codes (N, K) int8, scales (N, K/G)
    (fp16 values, as the format stores them; the codes are rounded with those)."""
    N, K = w.shape
    wg = w.float().reshape(N, K // group, group)
    scale = (wg.abs().amax(-1) / 127).half().float()
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round(wg * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(N, K), scale


def quantize_int4(w: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, ...]:
    """Asymmetric int4 (Q4_1 for groups of 32; min / max per group): (N, K) -> codes (N, K)
    uint8, scales, offsets (fp16 values; the codes are rounded with them)."""
    N, K = w.shape
    wg = w.float().reshape(N, K // group, group)
    lo, hi = wg.amin(-1).half().float(), wg.amax(-1)
    scale = ((hi - lo) / 15).half().float()
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round((wg - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.reshape(N, K), scale, lo


def check_shape(N: int, K: int, fmt: str, group: int | None) -> None:
    """One-line errors for weights a format cannot hold (float32 and bfloat16 hold any)."""
    if fmt in ("float32", "bfloat16"):
        return
    if K % BLOCK:
        raise Eagle3Error(f"{fmt} weights need in_features divisible by 32 (got {K}); "
                          "keep this model in float32")
    if N % 16:
        raise Eagle3Error(f"{fmt} weights need out_features divisible by 16 (got {N}); "
                          "keep this model in float32")
    if group is not None and (group % BLOCK or K % group):
        raise Eagle3Error(f"group size {group} must be a multiple of 32 dividing in_features "
                          f"{K}; choose 32 or 64")


class QLinear(nn.Module):
    """A bias-optional linear layer whose weight lives in one of `FORMATS`.

    Inputs and outputs are float32; `forward` takes (..., K) and returns (..., N).
    Buffers: ``w`` (float32 / bfloat16: (N, K); int8 / int4: `pack_codes` tiles), ``scale``
    and ``offset`` ((N/16, K/32, 16) float16 per block; empty where the format has none).
    """

    def __init__(self, fmt: str, in_features: int, out_features: int, w: torch.Tensor,
                 scale: torch.Tensor | None = None, offset: torch.Tensor | None = None,
                 group: int | None = None, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        check_shape(out_features, in_features, fmt, group)
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.group = group or in_features
        self.register_buffer("w", w)
        self.register_buffer("scale", scale if scale is not None else _EMPTY.clone())
        self.register_buffer("offset", offset if offset is not None else _EMPTY.clone())
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @classmethod
    def from_codes(cls, fmt: str, codes: torch.Tensor, scale: torch.Tensor | None = None,
                   offset: torch.Tensor | None = None, bias: torch.Tensor | None = None
                   ) -> QLinear:
        """Pack (N, K) codes (int8 / int4) or weights (float32 / bfloat16) with per-group
        (N, K/G) scales and offsets (G a multiple of 32; values rounded to fp16, exact for
        GGUF's own). int4 without offsets is Q4_0: w = (code - 8) * scale. The one place a
        layout is written."""
        N, K = codes.shape
        group = None if scale is None else K // scale.shape[1]
        check_shape(N, K, fmt, group)
        if fmt in ("float32", "bfloat16"):
            w = codes.to(torch.float32 if fmt == "float32" else torch.bfloat16).contiguous()
            return cls(fmt, K, N, w, None, None, None, bias)
        if scale is None:
            raise Eagle3Error(f"{fmt} codes need their scales")
        per_block = lambda s: None if s is None else pack_scales(  # noqa: E731
            s.float().repeat_interleave(group // BLOCK, dim=1))
        return cls(fmt, K, N, pack_codes(codes, fmt), per_block(scale), per_block(offset), group, bias)

    @classmethod
    def quantize(cls, linear: nn.Linear, fmt: str, group: int | None = None) -> QLinear:
        """Convert an `nn.Linear` to `fmt` (groups of 32 inputs unless `group` says more)."""
        w = linear.weight.detach().float()
        b = None if linear.bias is None else linear.bias.detach()
        N, K = w.shape
        if fmt in ("float32", "bfloat16"):
            return cls.from_codes(fmt, w, bias=b)
        group = group or BLOCK
        check_shape(N, K, fmt, group)
        if fmt == "int8":
            codes, scale = quantize_int8(w, group)
            return cls.from_codes(fmt, codes, scale, bias=b)
        codes, scale, offset = quantize_int4(w, group)
        return cls.from_codes(fmt, codes, scale, offset, bias=b)

    def codes(self) -> torch.Tensor:
        """The (N, K) integer codes of a packed format (int8, or 0..15 for int4)."""
        return unpack_codes(self.w, self.out_features, self.in_features, self.fmt)

    def dequantized(self) -> torch.Tensor:
        """The weight (N, K) in fp32, as the format's formula defines it."""
        N, K = self.out_features, self.in_features
        if self.fmt in ("float32", "bfloat16"):
            return self.w.float()
        codes = self.codes().float().reshape(N, K // BLOCK, BLOCK)
        offset = unpack_scales(self.offset) if self.offset.numel() else None
        return self._blocks(codes, unpack_scales(self.scale), offset).reshape(N, K)

    def _blocks(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        """The format's formula on float codes (.., nb, 32) with scales d and offsets m (.., nb)."""
        if self.fmt == "int8":
            return codes * d[..., None]
        if m is not None:
            return codes * d[..., None] + m[..., None]
        return (codes - 8) * d[..., None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (n,) of the weight, (n, K) float32, dequantized as `dequantized()` does
        (the same values), read from the packed tiles: a tied LM head serves the token lookup
        from its codes, with no float32 copy of the table."""
        N, K = self.out_features, self.in_features
        if self.fmt in ("float32", "bfloat16"):
            return self.w[ids].float()
        n, nb = ids.shape[0], K // BLOCK
        g, c = ids // 16, ids % 16
        if self.fmt == "int8":  # tiles (N/16, nb, quad, column, 4)
            codes = self.w.view(torch.int8).reshape(N // 16, nb, 8, 16, 4)[g, :, :, c, :]
            codes = codes.reshape(n, nb, BLOCK).float()  # (n, nb, 8, 4): inputs in order
        else:  # tiles (N/16, nb, p, column, 4): low nibble input 4p + j, high 16 + 4p + j
            t = self.w.reshape(N // 16, nb, 4, 16, 4)[g, :, :, c, :]  # (n, nb, 4, 4)
            codes = torch.stack([t & 15, t >> 4], dim=2).reshape(n, nb, BLOCK).float()
        m = self.offset[g, :, c].float() if self.offset.numel() else None  # (n, nb)
        return self._blocks(codes, self.scale[g, :, c].float(), m).reshape(n, K)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.scale, self.offset))

    def forward(self, x: torch.Tensor, stock: bool = False) -> torch.Tensor:
        """x (..., K) -> (..., N). `stock`: a float32 layer may run PyTorch's own matmul (a
        prompt's forward: faster for many rows, and row invariance is needed only between a
        verify and a 1-row decode; the prompt's forward is the same call in plain and
        speculative decoding, so it may sum as it likes)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # (M, K)
        if self.fmt == "float32" and stock:
            y = torch.nn.functional.linear(x2, self.w)
        elif x2.device.type == "cpu" and kernel_available():
            y = torch.ops.eagle3.wlinear(x2, self.w, self.scale, self.offset, FMT_ID[self.fmt],
                                         BLOCK, self.out_features)
        else:
            y = reference_linear(self, x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        g = "" if self.group == self.in_features else f", group={self.group}"
        return f"{self.fmt}, in={self.in_features}, out={self.out_features}{g}"


def project(layer: nn.Module, x: torch.Tensor, stock: bool = False) -> torch.Tensor:
    """`layer(x)` for a `QLinear` or a stock `nn.Linear`; `stock` as `QLinear.forward` takes it."""
    return layer(x, stock) if stock and isinstance(layer, QLinear) else layer(x)


def reference_linear(layer: QLinear, x: torch.Tensor) -> torch.Tensor:
    """The format's formula in PyTorch, row-invariant: the packed formats exactly as the
    kernels compute them (`exact_linear`); float formats one row at a time (equal to the
    kernels only to rounding)."""
    if layer.fmt in QUANTIZE_CHOICES:
        return exact_linear(layer, x)
    w = layer.dequantized().to(x.device)
    return torch.cat([x[i:i + 1] @ w.t() for i in range(x.shape[0])]) if x.shape[0] else x @ w.t()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of x (M, K) as int8 codes per block of 32, from that row alone: codes
    (M, K/32, 32) (float64 holding integers), scales xd (M, K/32) fp32 and code sums xs."""
    M, K = x.shape
    xb = x.float().reshape(M, K // BLOCK, BLOCK)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d != 0, torch.ones_like(d) / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return q.double(), d, q.sum(-1)


def exact_linear(layer: QLinear, x: torch.Tensor) -> torch.Tensor:
    """A packed layer's output, written in plain PyTorch with the kernels' arithmetic: exact
    integer block sums (float64 holds them exactly), then per block in order, in fp32 with one
    rounding per operation, acc = acc + (d * xd) * isum [+ m * (xd * xs)]. Equal to every
    kernel path bit for bit."""
    N, K = layer.out_features, layer.in_features
    nb = K // BLOCK
    q, xd, xs = quantize_rows(x)  # (M, nb, 32), (M, nb), (M, nb)
    codes = layer.codes().to(x.device).double().reshape(N, nb, BLOCK)
    isum = torch.einsum("mbk,nbk->mnb", q, codes)  # (M, N, nb), exact integers
    if layer.fmt == "int4" and not layer.offset.numel():
        isum = isum - 8 * xs.double()[:, None, :]  # Q4_0's zero point
    d = unpack_scales(layer.scale).to(x.device)  # (N, nb)
    m = unpack_scales(layer.offset).to(x.device) if layer.offset.numel() else None
    xsd = xd * xs
    acc = torch.zeros(x.shape[0], N, device=x.device)
    for b in range(nb):
        acc = acc + (d[None, :, b] * xd[:, None, b]) * isum[:, :, b].float()
        if m is not None:
            acc = acc + m[None, :, b] * xsd[:, None, b]
    return acc


def parse_quantize(spec: str | None) -> tuple[str, int | None] | None:
    """'int8' | 'int4' | 'bf16' | 'float32', optionally '-gN' (group size) -> (format, group);
    'gguf' -> ('gguf', 32): each layer in the format nearest its GGUF type."""
    if spec in (None, "", "none", "auto"):  # "auto": `WeightFormat.settle`
        return None
    if spec == "gguf":
        return "gguf", 32
    name, _, g = str(spec).partition("-g")
    fmt = {"bf16": "bfloat16", "fp32": "float32"}.get(name, name)
    if fmt not in FORMATS or (g and (fmt not in QUANTIZE_CHOICES or not g.isdigit())):
        raise Eagle3Error(f"quantize must be one of auto, none, fp32, bf16, int8, int4, gguf (int8/int4 "
                          f"may add a group size, e.g. int4-g64), got {spec!r}")
    group = int(g) if g else (BLOCK if fmt in QUANTIZE_CHOICES else None)
    if group is not None and (group < 32 or group % 32):
        raise Eagle3Error(f"quantize {spec!r}: the group size must be a multiple of 32")
    return fmt, group


@dataclass(frozen=True)
class WeightFormat:
    """What `quantize` asks of a native target, parsed once (`WeightFormat.parse`) and passed on
    as this value. `fmt`: 'float32', 'bfloat16', 'int8', 'int4', 'gguf' (a GGUF file's codes) or
    None (stock PyTorch layers); `group` the inputs per scale; `named`: the caller asked for
    this format (it must apply, or fail with a one-line error) rather than taking the default
    (float32 where the row-invariant kernels run, stock layers elsewhere); `auto`: the fastest
    exact format, settled once the file is read (`settle`). `spec` is what the caller wrote."""

    fmt: str | None
    group: int | None = None
    named: bool = False
    auto: bool = False
    spec: str | None = None

    @classmethod
    def parse(cls, spec: str | WeightFormat | None) -> WeightFormat:
        if isinstance(spec, WeightFormat):
            return spec
        if spec == "none":
            return cls(None, None, True, spec=spec)
        if spec == "auto":
            return cls("float32", None, False, True, spec)
        parsed = parse_quantize(spec)  # one-line error for a bad name
        return cls("float32", None, False, spec=spec) if parsed is None else cls(*parsed, True, spec=spec)

    def takes_codes(self, float_cpu_target: bool) -> bool:
        """Whether a GGUF file's own codes will be used (then its quantized layers are never
        built in float32): 'gguf', or 'auto' for a float32 CPU target where the kernels run."""
        return self.fmt == "gguf" or (self.auto and float_cpu_target and kernel_available())

    def settle(self, stored_quantized: bool) -> WeightFormat:
        """'auto' once the target is loaded: its file's codes when stored quantized (and taken),
        else the default; any other format as it is."""
        if not self.auto:
            return self
        return WeightFormat("gguf", 32, True, spec="gguf") if stored_quantized else WeightFormat(
            "float32", spec=self.spec)

    def kv_dtype(self, exact: bool) -> torch.dtype | None:
        """The KV cache's dtype that goes with this format on a target whose kernels are
        row-invariant (`exact`): bf16 with packed weights, half the cache's bytes (faster past
        ~1k positions) for an error ~10x below int8 activations' (docs/weight-formats.md, "KV
        cache in bf16"); None (the weights' dtype) for float weights and stock layers."""
        return torch.bfloat16 if exact and self.fmt in ("int8", "int4", "gguf") else None

    @property
    def name(self) -> str | None:
        """The format as a target reports it (`weight_format`): e.g. 'int4-g32', 'gguf'."""
        if self.fmt in QUANTIZE_CHOICES and self.group is not None:
            return f"{self.fmt}-g{self.group}"
        return self.fmt


@torch.no_grad()
def quantize_model(model: nn.Module, fmt: str, group: int | None = None,
                   layer: Callable[[str, nn.Linear], QLinear | None] | None = None) -> dict[str, int]:
    """Replace every `nn.Linear` of `model` by a `QLinear` in `fmt`, in place.

    A layer whose shape the format cannot hold (in_features not a multiple of 32 or of
    `group`, out_features not a multiple of 16) becomes a float32 `QLinear` instead, so
    every layer stays row-invariant. A tied LM head keeps the embedding table it shares
    (the lookup reads a few rows; the LM head reads all of them).
    `layer(path, linear)` may build a layer itself (e.g. from a file's codes; None: the
    default). Returns {"converted": n, "float32": m (layers the format could not hold),
    "bytes": the weight bytes of all converted layers}.
    """
    counts = {"converted": 0, "float32": 0, "bytes": 0}
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            made = layer(f"{path}.{name}" if path else name, child) if layer is not None else None
            if made is not None:
                setattr(parent, name, made.to(child.weight.device))
                counts["converted"] += 1
                counts["bytes"] += made.nbytes
                continue
            N, K = child.weight.shape
            g = (group or BLOCK) if fmt in QUANTIZE_CHOICES else group
            layer_fmt = fmt
            try:
                check_shape(N, K, fmt, g)
            except Eagle3Error:
                layer_fmt = "float32"
                counts["float32"] += 1
            q = QLinear.quantize(child, layer_fmt, g if layer_fmt != "float32" else None)
            q = q.to(child.weight.device)
            setattr(parent, name, q)
            counts["converted"] += 1
            counts["bytes"] += q.nbytes
    return counts
