"""Weight formats for linear layers and the small-M, row-invariant kernels that run them:
`formats` (the formats, their packing and exact PyTorch arithmetic), `build` (the C++
extension and its instruction-set paths) and `steps` (fused steps, `prepare_target`)."""

from .build import (
    cpu_name,
    isa,
    isa_paths,
    kernel_available,
    kernel_status,
    use_isa,
)
from .steps import (
    argmax,
    fused_step_ok,
    prepare_target,
    row_invariant_attention,
    to_stock_layers,
    top_p_cut,
    use_fused_steps,
    weight_bytes,
)
from .weight_formats import (
    BLOCK,
    FMT_ID,
    FORMATS,
    QUANTIZE_CHOICES,
    QLinear,
    WeightFormat,
    check_shape,
    exact_linear,
    pack_codes,
    pack_scales,
    parse_quantize,
    project,
    quantize_int4,
    quantize_int8,
    quantize_model,
    quantize_rows,
    reference_linear,
    unpack_codes,
    unpack_scales,
)

__all__ = ["BLOCK", "FMT_ID", "FORMATS", "QUANTIZE_CHOICES", "QLinear", "WeightFormat", "argmax",
           "check_shape", "cpu_name", "exact_linear", "fused_step_ok", "isa",
           "isa_paths", "kernel_available", "kernel_status", "pack_codes", "pack_scales",
           "parse_quantize", "prepare_target", "project", "quantize_int4", "quantize_int8",
           "quantize_model", "quantize_rows", "reference_linear", "row_invariant_attention",
           "to_stock_layers", "top_p_cut", "unpack_codes", "unpack_scales", "use_fused_steps", "use_isa",
           "weight_bytes"]
