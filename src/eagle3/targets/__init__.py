"""Targets: the `TapTarget` protocol, the `TARGETS` registry and checkpoint loading
(`targets.load`: native decoder, GGUF file or the transformers adapter)."""

from __future__ import annotations

from .config import NATIVE_FAMILIES, DecoderConfig
from .decoder import NativeTarget
from .hf import HFTarget
from .load import (
    TARGETS,
    TargetSpec,
    load_gguf,
    load_hf,
    load_native,
    load_target,
    open_target,
    read_gguf_target,
    resolve_dtype,
    target_path,
)
from .named import MODELS, resolve_target
from .protocol import TapTarget, TargetConfig, default_taps, validate_taps

__all__ = ["TARGETS", "TargetSpec", "TapTarget", "TargetConfig", "NativeTarget", "HFTarget",
           "DecoderConfig", "load_target", "load_native", "load_hf", "default_taps",
           "validate_taps", "NATIVE_FAMILIES", "MODELS", "resolve_target", "load_gguf",
           "resolve_dtype", "target_path", "open_target", "read_gguf_target"]
