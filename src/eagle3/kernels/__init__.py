"""Weight formats for linear layers and the small-M kernel that runs them.

A `QLinear` holds its weight in one of `FORMATS`:
- ``float32``: as stored; run by an AVX-512 FMA kernel.
- ``bfloat16``: weights rounded to bf16.
- ``int8``: signed codes with one fp32 scale per group of `group` inputs (``group=None``:
  one per output channel); w = code * scale. GGUF Q8_0 is int8 with groups of 32.
- ``int4``: codes 0..15 with an fp32 scale and offset per group; w = code * scale + offset.
  GGUF Q4_0 (offset = -8 scale) and Q4_1 load into it as they are.

The three packed formats run on AMX with bf16 activations (`wlinear.cpp` says why and
how). Every format computes each row of x independently of how many rows are in the call,
so `target_verify` over K+1 rows gives each row the bits a 1-row `decode` gives, and
verifying 8 rows streams the weights once, as one row does.

The kernel is a C++ extension compiled on first use (about 10 s, cached by
`torch.utils.cpp_extension` under ~/.cache/torch_extensions). Where it cannot run (no
AVX-512 or AMX, no compiler, not a CPU tensor), `reference_linear` computes the same
formulas in PyTorch one row at a time: row-invariant too, slower, and equal to the kernel
only to rounding.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import Eagle3Error

FORMATS = ("float32", "bfloat16", "int8", "int4")
QUANTIZE_CHOICES = ("int8", "int4")
FMT_ID = {name: i for i, name in enumerate(FORMATS)}
DEFAULT_INT4_GROUP = 32
_SOURCE = Path(__file__).with_name("wlinear.cpp")
_EMPTY = torch.empty(0)


_STATUS: str | None = None
_PREFILL = threading.local()  # `prefill_matmuls()` is active in this thread


@contextlib.contextmanager
def prefill_matmuls() -> Iterator[None]:
    """Within: float32 layers and attention use PyTorch's stock kernels (faster for a prompt's
    many rows). Row invariance is needed only between a verify and a 1-row decode; a prompt's
    forward is the same call in plain and speculative decoding, so it may sum as it likes."""
    before = getattr(_PREFILL, "on", False)
    _PREFILL.on = True
    try:
        yield
    finally:
        _PREFILL.on = before


def in_prefill() -> bool:
    return getattr(_PREFILL, "on", False) and not torch.compiler.is_compiling()


def kernel_available() -> bool:
    """Whether the compiled kernels run here (built on the first call)."""
    return (_STATUS if _STATUS is not None else kernel_status()) == ""


def kernel_status() -> str:
    """'' when the compiled kernels (fp32 and AMX formats, attention) run here, else why not."""
    global _STATUS
    if _STATUS is None:
        _STATUS = _build()
    return _STATUS


def _build() -> str:
    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    missing = [f for f in ("avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile")
               if f not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    try:
        from torch.utils.cpp_extension import load
        load(name="eagle3_wlinear", sources=[str(_SOURCE)], is_python_module=False,
             extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
                           "-mavx512dq", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mfma"],
             extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no headers: fall back, and say why
        return f"the kernel did not build ({str(e).splitlines()[0][:120]})"
    if not torch.ops.eagle3.amx_available():
        return "the OS did not grant AMX tile state"
    torch.library.register_fake("eagle3::wlinear")(_wlinear_fake)
    torch.library.register_fake("eagle3::attention")(_attention_fake)
    return ""


# -- packing ----------------------------------------------------------------------------

def tile_order(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes -> (N/16, K/32, 16, 16, 2): tiles of input pairs x columns (AMX's B)."""
    N, K = codes.shape
    return codes.reshape(N // 16, 16, K // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N*K/2,) bytes: per tile, word l of run j holds rows 4j..4j+3
    of lane l, one nibble each (the order `expand_int4` in wlinear.cpp reads)."""
    t = tile_order(codes.to(torch.int32)).reshape(codes.shape[0] // 16, -1, 4, 4, 32)
    words = t[:, :, :, 0] | (t[:, :, :, 1] << 4) | (t[:, :, :, 2] << 8) | (t[:, :, :, 3] << 12)
    return words.to(torch.int16).contiguous().view(torch.uint8).reshape(-1)


def unpack_int4(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """Inverse of `pack_int4`: (N, K) uint8 codes."""
    words = packed.view(torch.int16).to(torch.int32).reshape(N // 16, K // 32, 4, 1, 32) & 0xFFFF
    t = torch.cat([(words >> (4 * i)) & 15 for i in range(4)], dim=3)  # (N/16, T, 4, 4, 32)
    t = t.reshape(N // 16, K // 32, 16, 16, 2)
    return t.permute(0, 3, 1, 2, 4).reshape(N, K).to(torch.uint8)


def quantize_int8(w: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: (N, K) fp32 -> codes (N, K) int8, scales (N, K/G) (G = K when None)."""
    N, K = w.shape
    G = group or K
    wg = w.float().reshape(N, K // G, G)
    scale = wg.abs().amax(-1).clamp(min=1e-12) / 127
    codes = torch.round(wg / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(N, K), scale


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric int4 (min / max per group): (N, K) -> codes (N, K) uint8, scales, offsets."""
    N, K = w.shape
    wg = w.float().reshape(N, K // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    codes = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.reshape(N, K), scale, lo


def check_shape(N: int, K: int, fmt: str, group: int | None) -> None:
    """One-line errors for weights a format cannot hold (float32 holds any)."""
    if fmt == "float32":
        return
    if K % 32:
        raise Eagle3Error(f"{fmt} weights need in_features divisible by 32 (got {K}); "
                          "keep this model in float32")
    if N % 16:
        raise Eagle3Error(f"{fmt} weights need out_features divisible by 16 (got {N}); "
                          "keep this model in float32")
    if group is not None and (group % 32 or K % group):
        raise Eagle3Error(f"group size {group} must be a multiple of 32 dividing in_features "
                          f"{K}; choose 32 or 64")


class QLinear(nn.Module):
    """A bias-optional linear layer whose weight lives in one of `FORMATS`.

    Inputs and outputs are float32; `forward` takes (..., K) and returns (..., N).
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
        (N, K/G) scales and offsets: the one place a layout is written."""
        N, K = codes.shape
        group = None if scale is None else K // scale.shape[1]
        check_shape(N, K, fmt, group)
        t = lambda s: None if s is None else s.float().t().contiguous()  # noqa: E731 (K/G, N)
        if fmt == "float32":
            w = codes.float().contiguous()
        elif fmt == "bfloat16":
            w = tile_order(codes.to(torch.bfloat16).view(torch.int16)).reshape(-1)
        elif fmt == "int8":
            w = tile_order(codes.to(torch.int8)).reshape(-1)
        else:
            w = pack_int4(codes)
        return cls(fmt, K, N, w, t(scale), t(offset), group, bias)

    @classmethod
    def quantize(cls, linear: nn.Linear, fmt: str, group: int | None = None) -> QLinear:
        """Convert an `nn.Linear` to `fmt` (int4 groups default to 32; int8 per channel)."""
        w = linear.weight.detach().float()
        b = None if linear.bias is None else linear.bias.detach()
        N, K = w.shape
        if fmt in ("float32", "bfloat16"):
            return cls.from_codes(fmt, w, bias=b)
        check_shape(N, K, fmt, group)
        if fmt == "int8":
            codes, scale = quantize_int8(w, group)
            return cls.from_codes(fmt, codes, scale, bias=b)
        codes, scale, offset = quantize_int4(w, group or DEFAULT_INT4_GROUP)
        return cls.from_codes(fmt, codes, scale, offset, bias=b)

    def dequantized(self) -> torch.Tensor:
        """The weight (N, K) in fp32, as the format's formula defines it."""
        N, K, G = self.out_features, self.in_features, self.group
        if self.fmt == "float32":
            return self.w
        if self.fmt == "int4":
            codes = unpack_int4(self.w, N, K).float()
        else:
            t = self.w.view(torch.bfloat16) if self.fmt == "bfloat16" else self.w
            codes = t.reshape(N // 16, K // 32, 16, 16, 2).permute(0, 3, 1, 2, 4)
            codes = codes.reshape(N, K).float()
        if self.fmt == "bfloat16":
            return codes
        w = codes.reshape(N, K // G, G) * self.scale.t()[..., None]
        if self.fmt == "int4":
            w = w + self.offset.t()[..., None]
        return w.reshape(N, K)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.scale, self.offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # (M, K)
        if self.fmt == "float32" and in_prefill():
            y = torch.nn.functional.linear(x2, self.w)
        elif x2.device.type == "cpu" and kernel_available():
            y = torch.ops.eagle3.wlinear(x2, self.w, self.scale, self.offset, FMT_ID[self.fmt],
                                         self.group, self.out_features)
        else:
            y = reference_linear(self, x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        g = "" if self.group == self.in_features else f", group={self.group}"
        return f"{self.fmt}, in={self.in_features}, out={self.out_features}{g}"


def reference_linear(layer: QLinear, x: torch.Tensor) -> torch.Tensor:
    """The format's formula in PyTorch, one row at a time (row-invariant, not fast)."""
    w = layer.dequantized().to(x.device)
    if layer.fmt == "float32":
        return torch.cat([x[i:i + 1] @ w.t() for i in range(x.shape[0])]) if x.shape[0] else x @ w.t()
    xb = x.to(torch.bfloat16).float()  # the kernel's bf16 activations
    return torch.cat([xb[i:i + 1] @ w.t() for i in range(x.shape[0])]) if x.shape[0] else xb @ w.t()


def _wlinear_fake(x, w, scale, offset, fmt, group, N):  # shapes for torch.compile
    return x.new_empty(x.shape[0], N)


def _attention_fake(q, k, v, mask, scale, softcap):
    B, nh, T, hd = q.shape
    return q.new_empty(B, T, nh * hd)


def parse_quantize(spec: str | None) -> tuple[str, int | None] | None:
    """'int8' | 'int4' | 'bf16' | 'float32', optionally '-gN' (group size) -> (format, group);
    'gguf' -> ('gguf', 32): each layer in the format nearest its GGUF type."""
    if spec in (None, "", "none", "auto"):  # "auto" is resolved by `eagle3.load`
        return None
    if spec == "gguf":
        return "gguf", 32
    name, _, g = str(spec).partition("-g")
    fmt = {"bf16": "bfloat16", "fp32": "float32"}.get(name, name)
    if fmt not in FORMATS or (g and (fmt not in QUANTIZE_CHOICES or not g.isdigit())):
        raise Eagle3Error(f"quantize must be one of auto, none, fp32, bf16, int8, int4, gguf (int8/int4 "
                          f"may add a group size, e.g. int4-g64), got {spec!r}")
    group = int(g) if g else (DEFAULT_INT4_GROUP if fmt == "int4" else None)
    if group is not None and (group < 32 or group % 32):
        raise Eagle3Error(f"quantize {spec!r}: the group size must be a multiple of 32")
    return fmt, group


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
            g = (group or DEFAULT_INT4_GROUP) if fmt == "int4" else group
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


def row_invariant_attention(q: torch.Tensor) -> bool:
    """Whether `attention` (the kernel) should take this query: fp32 on a CPU with the kernel,
    outside a prompt's forward (`prefill_matmuls`)."""
    return (q.dtype == torch.float32 and q.device.type == "cpu" and kernel_available()
            and not in_prefill())


def weight_bytes(*modules: nn.Module | None) -> int:
    """Bytes of the distinct tensors (parameters and buffers) the modules hold: a storage shared
    by several (a tied LM head, the head borrowing the target's embedding table) counts once."""
    seen: dict[int, int] = {}
    for m in modules:
        if m is None:
            continue
        for t in (*m.parameters(), *m.buffers()):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def prepare_target(target: nn.Module, quantize: str | None, draft: nn.Module | None = None,
                   layer: Callable[[str, nn.Linear], QLinear] | None = None) -> str | None:
    """Put a native target's linear layers (and a head's, when quantized) into a weight format.

    quantize: None = float32 weights through the row-invariant kernels where they run here
    (stock PyTorch elsewhere); 'none' = stock PyTorch layers (not row-invariant; export
    and training use them); 'fp32' | 'bf16' | 'int8' | 'int4' (optionally '-gN'); 'gguf' with
    `layer` building each layer from a GGUF file's codes (`targets.gguf.gguf_layers`).
    Returns the format in use, or None for stock layers.
    """
    if quantize == "none":
        return None
    parsed = parse_quantize(quantize) or ("float32", None)
    fmt, group = parsed
    if fmt == "gguf" and layer is None:
        raise Eagle3Error("quantize='gguf' keeps a GGUF file's codes: the target must be a .gguf "
                          "file; use int4 or int8 for other checkpoints")
    dev = target.embedding_weight.device
    if target.embedding_weight.dtype != torch.float32:
        if quantize is None:
            return None
        raise Eagle3Error(f"quantize={quantize!r} takes a float32 target; drop dtype (the "
                          "activations stay float32, the weights take the format)")
    if dev.type != "cpu" or not kernel_available():
        if quantize is None:
            return None  # stock layers: the format's formulas would only be slower here
    if fmt == "gguf":
        quantize_model(target, "float32", None, layer)
    else:
        quantize_model(target, fmt, group)
    target.exact = dev.type == "cpu" and kernel_available()
    target.weight_format = fmt if group is None or fmt not in QUANTIZE_CHOICES else f"{fmt}-g{group}"
    if draft is not None and fmt != "float32":  # the head only proposes: speed, not exactness
        quantize_model(draft, "int4" if fmt == "gguf" else fmt, group)
    return target.weight_format


@torch.no_grad()
def to_stock_layers(model: nn.Module) -> None:
    """Turn float32 `QLinear`s back into `nn.Linear`s sharing their weights (for torch.export,
    which lowers stock layers); packed formats cannot be turned back."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, QLinear):
                continue
            if child.fmt != "float32":
                raise Eagle3Error(f"this model's weights are {child.fmt} (quantize=...); export "
                                  "quantizes on its own: load without quantize")
            lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                            device="meta")
            lin.weight = nn.Parameter(child.w, requires_grad=False)
            if child.bias is not None:
                lin.bias = nn.Parameter(child.bias.detach(), requires_grad=False)
            setattr(parent, name, lin)
    if hasattr(model, "exact"):
        model.exact, model.weight_format = False, None
