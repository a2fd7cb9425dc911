"""Targets: the `TapTarget` protocol, the `TARGETS` registry built from the table of model
families (`targets.families`), checkpoint loading (`targets.load`: native decoder, GGUF file or
the transformers adapter) and `prepare_loaded` (a loaded target made ready to decode)."""

from __future__ import annotations

from .config import NATIVE_FAMILIES, DecoderConfig
from .decoder import NativeTarget
from .families import FAMILIES, Family
from .hf import HFTarget
from .load import (
    TARGETS,
    TargetSpec,
    forward_bounds,
    load_gguf,
    load_hf,
    load_native,
    load_target,
    open_target,
    read_gguf_target,
    register_family,
    resolve_dtype,
    target_path,
)
from .named import MODELS, resolve_target
from .prepare import prepare_loaded
from .protocol import TapTarget, TargetConfig, default_taps, validate_taps

__all__ = ["TARGETS", "TargetSpec", "TapTarget", "TargetConfig", "NativeTarget", "HFTarget",
           "DecoderConfig", "load_target", "load_native", "load_hf", "default_taps",
           "validate_taps", "NATIVE_FAMILIES", "FAMILIES", "Family", "register_family",
           "forward_bounds", "prepare_loaded", "MODELS", "resolve_target", "load_gguf",
           "resolve_dtype", "target_path", "open_target", "read_gguf_target"]
