"""The native decoder's model families, in one table.

Everything that makes one family differ from another lives in its `Family` value: the
Hugging Face `model_type` it answers to, its GGUF `general.architecture`, the block flags the
decoder reads (Gemma's norms, q/k norms, biases, soft-capping), which layers slide when the
config does not list `layer_types`, and the config.json keys its GGUF metadata stands for.
`config.parse_decoder_config`, `gguf.read_gguf` / `gguf.state_dict` and the `TARGETS` registry
(`load.py`) all read this table, so a new family is one `Family` value plus one line in
`FAMILIES` below (or `register_family` at run time), never a branch elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (config.json dict, layer count) -> each layer's "full_attention" / "sliding_attention"
LayerTypes = Callable[[dict, int], list[str]]
# (GGUF metadata getter for `<arch>.<key>`, the config.json keys read so far) -> extra keys
GGUFConfig = Callable[[Callable[..., Any], dict], dict]


def full_attention(cfg: dict, n_layers: int) -> list[str]:
    """Every layer attends to the whole cache (Llama, and any family without windows)."""
    return ["full_attention"] * n_layers


def no_gguf_keys(get: Callable[..., Any], cfg: dict) -> dict:
    """A family whose GGUF metadata needs no keys beyond the common ones."""
    return {}


@dataclass(frozen=True)
class Family:
    """One decoder family: what `parse_decoder_config`, the GGUF reader and `TARGETS` need to
    know about it (the decoder itself only reads the resulting `DecoderConfig` flags)."""

    model_type: str  # config.json `model_type`
    description: str  # its `TARGETS` entry's description
    gguf_arch: str | None = None  # GGUF `general.architecture`; None: no GGUF loading
    gemma: bool = False  # (1+w) norms, sqrt(H)-scaled embeddings, sandwich norms, GeGLU
    qk_norm: bool = False  # RMSNorm over head_dim on q and k
    qkv_bias: bool = False  # q/k/v always biased, o never, whatever attention_bias says (Qwen2)
    attn_softcap: bool = False  # reads attn_logit_softcapping
    local_rope_key: str | None = None  # older configs: sliding layers' own RoPE base (Gemma 3)
    layer_types: LayerTypes = full_attention  # when config.json lists no layer_types
    gguf_permuted_qk: bool = False  # llama.cpp stored q/k rows with the RoPE halves interleaved
    gguf_config: GGUFConfig = no_gguf_keys  # family-specific config.json keys from GGUF metadata
    max_forward_len: int = 4096  # the cache (and longest forward) when the caller names none
    min_forward_len: int = 1


# -- sliding windows when config.json lists no layer_types ------------------------------------------

def _mistral_layers(cfg: dict, n_layers: int) -> list[str]:
    """Mistral: every layer slides when the config sets a window."""
    return ["sliding_attention"] * n_layers if cfg.get("sliding_window") else full_attention(cfg, n_layers)


def _qwen_layers(cfg: dict, n_layers: int) -> list[str]:
    """Qwen2/3: with use_sliding_window, layers from max_window_layers on slide."""
    if not cfg.get("use_sliding_window"):
        return full_attention(cfg, n_layers)
    first = int(cfg.get("max_window_layers", n_layers))
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]


def _gemma2_layers(cfg: dict, n_layers: int) -> list[str]:
    """Gemma 2: even layers slide, odd layers are global."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]


def _gemma3_layers(cfg: dict, n_layers: int) -> list[str]:
    """Gemma 3: every `sliding_window_pattern`-th layer is global, the rest slide."""
    pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]


# -- GGUF metadata -> config.json keys ----------------------------------------------------------------

def _qwen2_gguf(get: Callable[..., Any], cfg: dict) -> dict:
    """The native Qwen2 layout always has q/k/v bias; GGUF says nothing about it."""
    return {"attention_bias": False}


def _gemma_gguf(cfg: dict, layers_27b: int) -> dict:
    """Gemma's activation and query scale: llama.cpp scales q by 1/sqrt(head_dim), except the
    27B models (1/sqrt(H/heads)), which it recognises by their layer count."""
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    is_27b = cfg["num_hidden_layers"] == layers_27b
    return {"hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": H // heads if is_27b else cfg["head_dim"]}


def _gemma2_gguf(get: Callable[..., Any], cfg: dict) -> dict:
    return {**_gemma_gguf(cfg, 46), "attn_logit_softcapping": get("attn_logit_softcapping"),
            "final_logit_softcapping": get("final_logit_softcapping")}


def _gemma3_gguf(get: Callable[..., Any], cfg: dict) -> dict:
    """Without these keys llama.cpp runs Gemma 3's local layers at RoPE base 10000 and makes
    every 6th layer global."""
    out = {**_gemma_gguf(cfg, 62), "rope_local_base_freq": float(get("rope.freq_base_swa", 10000.0))}
    pattern = get("attention.sliding_window_pattern", 6) or 6
    if isinstance(pattern, list):  # per layer: True = sliding
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        out["sliding_window_pattern"] = int(pattern)
    return out


# -- the table ------------------------------------------------------------------------------------------

LLAMA = Family("llama", "Llama 2/3/3.1 (rope_scaling none, linear, llama3)", "llama",
               gguf_permuted_qk=True)
MISTRAL = Family("mistral", "Mistral (sliding window)", "mistral", layer_types=_mistral_layers,
                 gguf_permuted_qk=True)
QWEN2 = Family("qwen2", "Qwen2 / Qwen2.5 (q/k/v bias)", "qwen2", qkv_bias=True,
               layer_types=_qwen_layers, gguf_config=_qwen2_gguf)
QWEN3 = Family("qwen3", "Qwen3 (q/k RMSNorm)", "qwen3", qk_norm=True, layer_types=_qwen_layers)
GEMMA2 = Family("gemma2", "Gemma 2 (soft-capping, sliding window)", "gemma2", gemma=True,
                attn_softcap=True, layer_types=_gemma2_layers, gguf_config=_gemma2_gguf)
GEMMA3 = Family("gemma3_text", "Gemma 3 text (q/k norm, local/global RoPE)", "gemma3", gemma=True,
                qk_norm=True, local_rope_key="rope_local_base_freq", layer_types=_gemma3_layers,
                gguf_config=_gemma3_gguf)

# model_type -> Family: every family the native decoder loads. A new family: one line here.
FAMILIES: dict[str, Family] = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3)}


def gguf_families() -> dict[str, Family]:
    """GGUF `general.architecture` -> Family, for the families that load from GGUF files."""
    return {f.gguf_arch: f for f in FAMILIES.values() if f.gguf_arch}
