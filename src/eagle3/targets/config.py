"""Parse a Hugging Face `config.json` into the native decoder's config.

Handles both the older layout (`rope_theta`, `rope_scaling`,
`rope_local_base_freq`) and transformers 5's `rope_parameters` (flat, or keyed
by layer type for Gemma 3). Anything the native decoder cannot honour raises
`Eagle3Error` rather than loading wrong; `load_target` then suggests the
transformers adapter.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from ..errors import Eagle3Error, NotNative, wrong_values_as
from .families import FAMILIES, Family

# model_type -> `families.Family`: every family the native decoder loads (the old name).
NATIVE_FAMILIES = FAMILIES

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class DecoderConfig:
    """Everything the native decoder needs; one instance per checkpoint."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v only
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k
    gemma: bool = False  # (1+w) norms, sqrt(H)-scaled embeddings, sandwich norms, GeGLU
    act: str = "silu"  # silu | gelu_tanh
    attn_scale: float = 0.0  # multiplier on q.k; 0 -> head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Per layer: sliding window size (None = full attention) and RoPE config.
    layer_windows: tuple[int | None, ...] = ()
    layer_rope: tuple[RopeConfig, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    architecture: str = ""
    max_seq_len: int = 0  # KV cache size; <= max_position_embeddings
    extra: dict = field(default_factory=dict)


def read_config_json(path: str) -> dict:
    """Read `path/config.json` with one-line errors for the usual mistakes."""
    if not os.path.isdir(path):
        raise Eagle3Error(f"target '{path}' is not a directory: pass a Hugging Face checkpoint "
                          "directory (config.json + weights), or 'default'")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise Eagle3Error(f"{cfg_path} is missing: a checkpoint directory needs config.json "
                          "(save the model with save_pretrained)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Eagle3Error(f"{cfg_path} is not valid JSON ({e}); re-save the checkpoint") from None
    if not isinstance(cfg, dict):
        raise Eagle3Error(f"{cfg_path} must hold a JSON object, not {type(cfg).__name__}; fix or "
                          "re-download it")
    archs = cfg.get("architectures")
    if not isinstance(cfg.get("model_type", ""), str) or not (
            archs is None or isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise Eagle3Error(f"{cfg_path}: model_type must be a string and architectures a list of "
                          "strings; the file is corrupt (fix or re-download it)")
    return cfg


def rope_from_dict(d: dict | None, theta: float, where: str) -> RopeConfig:
    """A RopeConfig from a checkpoint's rope_scaling / rope_parameters dict (None: plain RoPE)."""
    if not d:
        rope = RopeConfig(theta=float(theta))
        _check_rope(rope, where)
        return rope
    rope_type = d.get("rope_type", d.get("type", "default")) or "default"
    theta = float(d.get("rope_theta", theta))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotNative(f"{where}: rope type '{rope_type}' is not supported natively "
                          f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)}); load with backend='hf'")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotNative(f"{where}: partial rotary embeddings are not supported natively; "
                          "load with backend='hf'")
    rope = RopeConfig(
        theta=theta, rope_type=rope_type, factor=float(d.get("factor", 1.0)),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)))
    _check_rope(rope, where)
    return rope


def _check_rope(rope: RopeConfig, where: str) -> None:
    """Values the RoPE tables divide by: a corrupt config fails here, not at load time."""
    positive = (rope.theta, rope.factor, rope.low_freq_factor, rope.high_freq_factor,
                rope.original_max_position_embeddings)
    if not all(math.isfinite(v) and v > 0 for v in positive) or (
            rope.rope_type == "llama3" and rope.low_freq_factor == rope.high_freq_factor):
        raise Eagle3Error(f"{where}: RoPE parameters {rope} are out of range (positive, finite, "
                          "distinct llama3 frequency factors); fix config.json")


def _need(cfg: dict, key: str, where: str):
    if key not in cfg or cfg[key] is None:
        raise Eagle3Error(f"{where}: config.json lacks '{key}'; the checkpoint's config is incomplete "
                          "(fix it or re-download the checkpoint)")
    return cfg[key]


# Sizes beyond these are corrupt configs, not models: refused before anything is allocated.
MAX_SIZE = 2**31 - 1
MAX_LAYERS = 10_000


def _size(cfg: dict, key: str, where: str, default: int | None = None, limit: int = MAX_SIZE) -> int:
    """`cfg[key]` as an int in 1..limit; `default` (when given) stands in for a missing/null/0 value."""
    value = cfg.get(key)
    if value in (None, 0) and default is not None:
        return default
    value = _need(cfg, key, where)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise Eagle3Error(f"{where}: '{key}' must be an integer in 1..{limit}, got {value!r}; "
                          "fix config.json")
    return value


def _layer_types(cfg: dict, family: Family, n_layers: int, where: str) -> list[str]:
    """Each layer's attention kind: config.json's `layer_types` when listed, else the family's rule."""
    types = cfg.get("layer_types")
    if types:
        kinds = ("full_attention", "sliding_attention")
        if not isinstance(types, list) or len(types) != n_layers or any(t not in kinds for t in types):
            raise Eagle3Error(f"{where}: layer_types must list {n_layers} entries of {' / '.join(kinds)}, "
                              f"got {str(types)[:60]}; fix config.json")
        return list(types)
    return family.layer_types(cfg, n_layers)


def parse_decoder_config(cfg: dict, where: str = "config.json",
                         max_seq_len: int | None = None) -> DecoderConfig:
    """Map a HF config dict to `DecoderConfig`, or raise `Eagle3Error`."""
    with wrong_values_as(f"{where}: malformed config.json", "fix or re-save the checkpoint's config"):
        return _parse_decoder_config(cfg, where, max_seq_len)


def _parse_decoder_config(cfg: dict, where: str, max_seq_len: int | None) -> DecoderConfig:
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        supported = ", ".join(sorted(FAMILIES))
        raise NotNative(f"{where}: model_type '{model_type}' has no native target (supported: "
                          f"{supported}); load it through the transformers adapter with "
                          "backend='hf' (--backend hf)")
    family = FAMILIES[model_type]
    gemma = family.gemma
    H = _size(cfg, "hidden_size", where)
    n_heads = _size(cfg, "num_attention_heads", where)
    n_kv = _size(cfg, "num_key_value_heads", where, default=n_heads)
    head_dim = _size(cfg, "head_dim", where, default=max(H // n_heads, 1))
    n_layers = _size(cfg, "num_hidden_layers", where, limit=MAX_LAYERS)
    if n_heads % n_kv:
        raise Eagle3Error(f"{where}: num_attention_heads {n_heads} is not a multiple of "
                          f"num_key_value_heads {n_kv}; fix config.json")
    max_pos = _size(cfg, "max_position_embeddings", where, default=4096)

    # RoPE: transformers 5 `rope_parameters` or the older top-level keys.
    types = _layer_types(cfg, family, n_layers, where)
    rp = cfg.get("rope_parameters")
    base = float(cfg.get("rope_theta", 10000.0))
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        ropes = {t: rope_from_dict(rp.get(t) or rp.get("full_attention"), base, where)
                 for t in set(types)}
    elif isinstance(rp, dict) and rp:
        ropes = {t: rope_from_dict(rp, base, where) for t in set(types)}
    else:
        scaling = cfg.get("rope_scaling")
        global_rope = rope_from_dict(scaling, base, where)
        ropes = {t: global_rope for t in set(types)}
        if family.local_rope_key and "sliding_attention" in ropes:
            local = float(cfg.get(family.local_rope_key, 10000.0))
            ropes["sliding_attention"] = RopeConfig(theta=local)
            _check_rope(ropes["sliding_attention"], where)

    window = cfg.get("sliding_window")
    if window is not None and any(t == "sliding_attention" for t in types):
        window = _size(cfg, "sliding_window", where, default=0) or None
    windows = tuple(int(window) if (t == "sliding_attention" and window) else None for t in types)

    if gemma:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        scale = float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5
    else:
        act = cfg.get("hidden_act", "silu")
        scale = head_dim ** -0.5
    act_map = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_tanh": "gelu_tanh"}
    if act not in act_map:
        raise NotNative(f"{where}: activation '{act}' is not supported natively; "
                          "load with backend='hf'")

    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    seq = min(max_pos, max_seq_len or family.max_forward_len)
    return DecoderConfig(
        model_type=model_type, vocab_size=_size(cfg, "vocab_size", where), hidden_size=H,
        intermediate_size=_size(cfg, "intermediate_size", where),
        num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv,
        head_dim=head_dim, max_position_embeddings=max_pos,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        qkv_bias=family.qkv_bias or bool(cfg.get("attention_bias", False)),
        o_bias=not family.qkv_bias and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family.qk_norm, gemma=gemma, act=act_map[act],
        attn_scale=scale,
        attn_softcap=cfg.get("attn_logit_softcapping") if family.attn_softcap else None,
        final_softcap=cfg.get("final_logit_softcapping"),
        layer_windows=windows, layer_rope=tuple(ropes[t] for t in types),
        eos_token_ids=tuple(int(e) for e in eos_ids), bos_token_id=cfg.get("bos_token_id"),
        architecture=(cfg.get("architectures") or [""])[0], max_seq_len=seq)


def rope_inv_freq(rope: RopeConfig, head_dim: int):
    """Inverse frequencies (head_dim/2,) in float32, with linear / llama3 scaling."""
    import torch

    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv
