"""`prepare_loaded`: a freshly loaded target (and its attached head) made ready to decode, in
one call.

What happens between loading and decoding depends on the target's kind and on the weight
format, in an order that matters: the head is attached first (`draft.attach_head`, by the
caller, while both share the CPU table), both move to the device, then a native target takes
its format (and the KV-cache dtype that goes with it), and a GGUF file's codes replace its
float32 embedding table once the LM head holds them. `eagle3.load` calls this one name instead
of reaching into each step.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import Eagle3Error
from ..kernels import WeightFormat, prepare_target
from .decoder import NativeTarget
from .gguf import GGUFCodes, check_built
from .protocol import TapTarget


def prepare_loaded(target: TapTarget, fmt: WeightFormat, codes: GGUFCodes | None = None,
                   head: nn.Module | None = None, *, codes_only: bool = False,
                   device: torch.device | None = None) -> WeightFormat:
    """Move the target and its attached `head` to `device`, and put a native target
    in `fmt` (settled: 'auto' becomes the file's codes when `codes_only` took them and they are
    stored quantized). Returns the format in force. `codes` / `codes_only`: what `open_target`
    returned and was asked for. A transformers target takes no format: naming one is an error."""
    if device is not None and device.type != "cpu":
        target.to(device)
        if head is not None:
            head.to(device)
    if not isinstance(target, NativeTarget):
        if fmt.named and fmt.fmt is not None:
            raise Eagle3Error("quantize needs the native backend (this target runs through "
                              "transformers); use backend='native' or 'auto'")
        return fmt
    # 'auto': a quantized GGUF's own codes; a float GGUF or a safetensors checkpoint: float32
    fmt = fmt.settle(codes_only and codes is not None and codes.stored_quantized)
    prepare_target(target, fmt, head, codes.layers() if codes is not None else None)
    target.kv_dtype = fmt.kv_dtype(target.exact)
    if codes_only:
        target.embed_from_codes(head)  # a tied Q8_0 / Q4 table: no float32 copy
        check_built(target)
    return fmt
