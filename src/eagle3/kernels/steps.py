"""Where the fused C++ steps may run, and putting a model's layers into a weight format
(`prepare_target`) or back into stock PyTorch layers (`to_stock_layers`, for export)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..errors import Eagle3Error
from .build import kernel_available
from .weight_formats import QLinear, WeightFormat, quantize_model


def fused_step_ok(*ts: torch.Tensor) -> bool:
    """Whether the fused elementwise kernels (`eagle3::rms_norm`, `rope_`, `silu_mul`) may take
    these tensors: float32 CPU tensors where the kernels run, outside torch.compile / export
    (inductor fuses these steps itself) and outside autograd (the kernels have no backward).
    One op instead of 3-8 small ones saves a step the per-op overhead of each (docs/weight-formats.md)."""
    if torch.compiler.is_compiling() or not kernel_available():
        return False
    grad = torch.is_grad_enabled()
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and not (grad and t.requires_grad)
               for t in ts)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)`: the first maximum of each row, a NaN counting as the maximum. One C++
    pass where the kernels run (aten's reduction is several passes over the vocabulary)."""
    if fused_step_ok(x) and x.dim() and x.numel():  # export / compile: never the C++ op
        return torch.ops.eagle3.argmax(x)
    return x.argmax(-1)


def top_p_cut(scores: torch.Tensor, probs: torch.Tensor, top_p: float) -> bool:
    """Set the tokens top-p drops to -inf in `scores` (contiguous, changed in place; `probs`
    their softmax) by one C++ op (`eagle3::top_p_`, no sort of the vocabulary) where the kernels
    run; False elsewhere, `scores` untouched (the caller then applies
    `decoding.sampling.nucleus`: the same rule, the same tokens)."""
    if fused_step_ok(scores, probs) and scores.dim() and scores.numel() and scores.is_contiguous():
        torch.ops.eagle3.top_p_(scores, probs, top_p)
        return True
    return False


def use_fused_steps(*models: nn.Module | None, on: bool = True) -> None:
    """Let the models' norms and SwiGLU MLPs (modules with a `fused` flag) run as one C++ op
    each. Set on the row-invariant path (`prepare_target`); stock models keep PyTorch's ops,
    which transformers is checked against to 1e-4. RoPE always runs fused where it may: its
    kernel computes PyTorch's own bits."""
    for model in models:
        for m in model.modules() if model is not None else ():
            if hasattr(m, "fused") and isinstance(m.fused, bool):
                m.fused = on


def row_invariant_attention(q: torch.Tensor, keys: torch.Tensor | None = None) -> bool:
    """Whether `attention` (the kernel) can take this query (and keys): fp32 or bf16 on a CPU
    with the kernel (a bf16 query runs in fp32, which holds it exactly; keys fp32 or bf16)."""
    return (q.dtype in (torch.float32, torch.bfloat16) and q.device.type == "cpu"
            and (keys is None or keys.dtype in (torch.float32, torch.bfloat16)) and kernel_available())


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


def prepare_target(target: nn.Module, quantize: str | WeightFormat | None,
                   draft: nn.Module | None = None,
                   layer: Callable[[str, nn.Linear], QLinear] | None = None) -> str | None:
    """Put a native target's linear layers (and a head's, when quantized) into a weight format.

    quantize (a name or a parsed `WeightFormat`): None = float32 weights through the
    row-invariant kernels where they run here (stock PyTorch elsewhere); 'none' = stock PyTorch
    layers (not row-invariant; export and training use them); 'fp32' | 'bf16' | 'int8' | 'int4'
    (optionally '-gN'); 'gguf' with `layer` building each layer from a GGUF file's codes
    (`targets.gguf.GGUFCodes.layers`). Returns the format in use, or None for stock layers.
    The KV cache's dtype goes with the format (`WeightFormat.kv_dtype`), set by the loader.
    """
    wf = WeightFormat.parse(quantize)
    if wf.auto:
        raise Eagle3Error("quantize='auto' is settled by eagle3.load (it reads the file first); pass "
                          "a format")
    if wf.fmt is None:
        return None
    if wf.fmt == "gguf" and layer is None:
        raise Eagle3Error("quantize='gguf' keeps a GGUF file's codes: the target must be a .gguf "
                          "file; use int4 or int8 for other checkpoints")
    dev = target.embedding_weight.device
    if target.embedding_weight.dtype != torch.float32:
        if not wf.named:
            return None
        raise Eagle3Error(f"quantize={wf.spec!r} takes a float32 target; drop dtype (the "
                          "activations stay float32, the weights take the format)")
    if (dev.type != "cpu" or not kernel_available()) and not wf.named:
        return None  # stock layers: the format's formulas would only be slower here
    if wf.fmt == "gguf":
        quantize_model(target, "float32", None, layer)
    else:
        quantize_model(target, wf.fmt, wf.group)
    target.exact = dev.type == "cpu" and kernel_available()
    use_fused_steps(target, draft, on=target.exact)
    target.weight_format = wf.name
    if draft is not None:  # the head only proposes: speed, not exactness (float32 stays float32)
        quantize_model(draft, "int4" if wf.fmt == "gguf" else wf.fmt, wf.group)
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
    if hasattr(model, "kv_dtype"):
        model.kv_dtype = None
    use_fused_steps(model, on=False)
