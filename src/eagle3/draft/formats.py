"""EAGLE-3 head formats: official EAGLE release, SGLang/SpecForge, vLLM speculators.

All three carry the same tensors; they differ in config layout and weight
names (official/SGLang `midlayer.*`, speculators `layers.0.*`). Reading is
auto-detected; writing is explicit. Tap ids found in a config are used verbatim
in eagle3's convention (tap k = hidden state entering layer k). SGLang adds +1
to explicit ids when it captures them, so a head trained against SGLang's
capture may need its ids shifted; eagle3 never shifts silently, and warns when
measured acceptance collapses.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..errors import Eagle3Error, notice, wrong_values_as
from ..targets.checkpoint import read_state_dict
from ..targets.config import MAX_SIZE, RopeConfig, read_config_json, rope_from_dict
from .model import DraftConfig, Eagle3Draft

FORMATS = ("official", "sglang", "speculators")
SPECULATORS_ARCHS = ("Eagle3Speculator", "Eagle3DraftModel")
# Config keys carried through conversions as they are (DraftConfig.extra).
EXTRA_KEYS = ("speculators_config", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
              "target_model_type")
LAYER_EXTRA_KEYS = ("bos_token_id", "eos_token_id", "target_model_type")

# Tensors of the head, in the official naming, without the optional ones.
REQUIRED = ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
            "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
            "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
            "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight",
            "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
            "norm.weight", "lm_head.weight")


def detect_format(cfg: dict, where: str = "config.json") -> str:
    """'official' | 'sglang' | 'speculators' from a head's config, or a clear error."""
    archs = cfg.get("architectures") or []
    if (cfg.get("speculators_model_type") == "eagle3" or "transformer_layer_config" in cfg
            or any(a in SPECULATORS_ARCHS for a in archs)):
        return "speculators"
    if "LlamaForCausalLMEagle3" in archs:
        return "sglang"
    if cfg.get("model_type") == "llama" and cfg.get("num_hidden_layers") == 1:
        return "official"
    raise Eagle3Error(f"{where} is not an EAGLE-3 head (architectures {archs}, "
                      f"{cfg.get('num_hidden_layers')} layers): expected the official release, "
                      "SGLang (LlamaForCausalLMEagle3) or vLLM speculators format; pass a head "
                      "directory (or fix / re-download its config.json)")


def _positive(d: dict, key: str, where: str, default: int | None = None) -> int:
    """`d[key]` as a positive int (`default` for a missing/null value when given), or a clear error."""
    v = d.get(key)
    if v is None and default is not None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1 <= v <= MAX_SIZE or v != int(v):
        raise Eagle3Error(f"{where}: head config has {key}={v!r}, expected a positive integer; "
                          "the config is incomplete or corrupt (fix it or re-download the head)")
    return int(v)


def _number(d: dict, key: str, where: str, default: float) -> float:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise Eagle3Error(f"{where}: head config has {key}={v!r}, expected a positive number; fix it "
                          "or re-download the head")
    return float(v)


def _rope(layer: dict, where: str) -> RopeConfig:
    # Official heads carry no rope_theta: the draft's RoPE base is then 10000.
    theta = _number(layer, "rope_theta", where, 10000.0)
    rp = layer.get("rope_parameters")  # newer transformers: {rope_theta, rope_type, ...}
    if isinstance(rp, dict) and rp:
        return rope_from_dict(rp, _number(rp, "rope_theta", where, theta), where)
    return rope_from_dict(layer.get("rope_scaling"), theta, where)


def _taps(taps, where: str) -> tuple[int, ...] | None:
    if taps is None or taps == []:
        return None
    if not isinstance(taps, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in taps):
        raise Eagle3Error(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of layer "
                          f"indices, got {taps!r}; fix config.json")
    return tuple(taps)


def parse_head_config(cfg: dict, where: str = "config.json") -> tuple[str, DraftConfig]:
    """(format, DraftConfig) from a head's config.json dict."""
    with wrong_values_as(f"{where}: malformed head config", "fix it or re-download the head"):
        return _parse_head_config(cfg, where)


def _parse_head_config(cfg: dict, where: str) -> tuple[str, DraftConfig]:
    fmt = detect_format(cfg, where)
    if fmt == "speculators":
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise Eagle3Error(f"{where}: a speculators head needs a 'transformer_layer_config' object; "
                          "fix config.json or re-download the head")
        taps = cfg.get("eagle_aux_hidden_state_layer_ids")
    else:
        layer = cfg
        eagle_cfg = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
        taps = cfg.get("eagle_aux_hidden_state_layer_ids", eagle_cfg.get("eagle_aux_hidden_state_layer_ids"))
    H, heads, vocab, inter = (_positive(layer, k, where) for k in
                              ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size"))
    kv = _positive(layer, "num_key_value_heads", where, heads)
    head_dim = _positive(layer, "head_dim", where, max(H // heads, 1))
    draft_vocab = _positive(cfg, "draft_vocab_size", where, vocab)
    if _positive(layer, "num_hidden_layers", where, 1) != 1:
        raise Eagle3Error(f"{where}: EAGLE-3 heads have one decoder layer, this config says "
                          f"{layer.get('num_hidden_layers')}; fix config.json")
    if heads % kv or head_dim % 2:
        raise Eagle3Error(f"{where}: num_attention_heads {heads} must be a multiple of num_key_value_heads "
                          f"{kv} and head_dim {head_dim} even; the config is corrupt: fix it or "
                          "re-download the head")
    if draft_vocab > vocab:
        raise Eagle3Error(f"{where}: draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}; fix "
                          "config.json")
    if layer.get("hidden_act", "silu") not in ("silu", "swish"):
        raise Eagle3Error(f"{where}: draft activation '{layer.get('hidden_act')}' is not supported "
                          "(silu only)")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise Eagle3Error(f"{where}: draft heads with attention or MLP bias are not supported")
    # Speculators keeps the Llama-level keys (token ids, target_model_type) in the layer config.
    extra = {**{k: layer[k] for k in LAYER_EXTRA_KEYS if k in layer},
             **{k: cfg[k] for k in EXTRA_KEYS if k in cfg}}
    return fmt, DraftConfig(
        hidden_size=H, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=head_dim, vocab_size=vocab, draft_vocab_size=draft_vocab,
        target_hidden_size=_positive(cfg, "target_hidden_size", where, H),
        rms_norm_eps=_number(layer, "rms_norm_eps", where, 1e-6), rope=_rope(layer, where),
        max_position_embeddings=_positive(layer, "max_position_embeddings", where, 2048),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        norm_before_fc=bool(cfg.get("norm_before_fc", False)), taps=_taps(taps, where), extra=extra)


def _to_internal(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        k = k[len("model."):] if k.startswith("model.") else k
        k = "midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k
        out[k] = v
    return out


def read_head(path: str) -> tuple[str, DraftConfig, dict[str, torch.Tensor]]:
    """(format, config, tensors in official naming) of the head in `path`."""
    cfg = read_config_json(path)
    fmt, dcfg = parse_head_config(cfg, os.path.join(path, "config.json"))
    return fmt, dcfg, _to_internal(read_state_dict(path))


def validate_head(dcfg: DraftConfig, state: dict[str, torch.Tensor], where: str) -> list[str]:
    """Check tensors against the config; raise on anything that would load wrong. Returns unknown keys."""
    missing = [k for k in REQUIRED if k not in state]
    if dcfg.norm_before_fc and "input_norm.weight" not in state:
        missing.append("input_norm.weight")
    if missing:
        raise Eagle3Error(f"{where} lacks tensor(s) {', '.join(missing[:3])}: the head file is "
                          "incomplete or not an EAGLE-3 head; re-download or re-convert it")
    H, hd = dcfg.hidden_size, dcfg.head_dim
    q = state["midlayer.self_attn.q_proj.weight"]
    if q.shape[0] != dcfg.num_attention_heads * hd:
        raise Eagle3Error(f"{where}: q_proj has {q.shape[0]} rows but num_attention_heads "
                          f"{dcfg.num_attention_heads} x head_dim {hd} = {dcfg.num_attention_heads * hd}; "
                          "set head_dim in config.json to match the weights")
    expect = {"fc.weight": (H, dcfg.num_taps * dcfg.target_hidden_size),
              "midlayer.self_attn.q_proj.weight": (dcfg.num_attention_heads * hd, 2 * H),
              "midlayer.self_attn.k_proj.weight": (dcfg.num_key_value_heads * hd, 2 * H),
              "midlayer.self_attn.v_proj.weight": (dcfg.num_key_value_heads * hd, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, dcfg.num_attention_heads * hd),
              "midlayer.mlp.gate_proj.weight": (dcfg.intermediate_size, H),
              "midlayer.mlp.up_proj.weight": (dcfg.intermediate_size, H),
              "midlayer.mlp.down_proj.weight": (H, dcfg.intermediate_size),
              "lm_head.weight": (dcfg.draft_vocab_size, H),
              "embed_tokens.weight": (dcfg.vocab_size, H),
              "input_norm.weight": (dcfg.num_taps * dcfg.target_hidden_size,)}
    for name in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                 "midlayer.post_attention_layernorm.weight", "norm.weight"):
        expect[name] = (H,)
    if "input_norm.weight" in state and not dcfg.norm_before_fc:
        raise Eagle3Error(f"{where} carries input_norm.weight but its config does not set "
                          "norm_before_fc; set \"norm_before_fc\": true if the head was trained with it")
    for name, shape in expect.items():
        if name not in state:
            continue
        t = state[name]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise Eagle3Error(f"{where}: tensor {name} is not a floating-point tensor; the head file "
                              "is corrupt; re-download or re-convert it")
        if tuple(t.shape) != shape:
            raise Eagle3Error(f"{where}: tensor {name} has shape {tuple(t.shape)}, the "
                              f"config implies {shape}; the head's config and weights disagree "
                              "(fix config.json or re-download the head)")
    if dcfg.draft_vocab_size != dcfg.vocab_size and "d2t" not in state:
        raise Eagle3Error(f"{where}: a reduced vocabulary ({dcfg.draft_vocab_size} of {dcfg.vocab_size}) "
                          "needs a d2t table mapping draft ids to target ids; the head file lacks it "
                          "(fix config.json's vocabulary sizes or re-download the head)")
    if "d2t" in state:
        d2t = state["d2t"]
        if (not isinstance(d2t, torch.Tensor) or d2t.shape != (dcfg.draft_vocab_size,)
                or d2t.is_floating_point() or d2t.dtype == torch.bool):
            raise Eagle3Error(f"{where}: d2t must be an integer tensor of length "
                              f"{dcfg.draft_vocab_size}, got {getattr(d2t, 'dtype', type(d2t).__name__)} "
                              f"{tuple(getattr(d2t, 'shape', ()))}; re-download or re-convert the head")
        target_ids = torch.arange(dcfg.draft_vocab_size) + d2t.long()
        if target_ids.min() < 0 or target_ids.max() >= dcfg.vocab_size:
            raise Eagle3Error(f"{where}: d2t maps draft ids outside the target vocabulary "
                              f"(0..{dcfg.vocab_size - 1}); the table is corrupt or for another target: "
                              "re-download the head")
        if target_ids.unique().numel() != target_ids.numel():
            raise Eagle3Error(f"{where}: d2t maps two draft ids to the same target id "
                              "(not injective); the table is corrupt: re-download the head")
    t2d = state.get("t2d")
    if t2d is not None and (not isinstance(t2d, torch.Tensor) or tuple(t2d.shape) != (dcfg.vocab_size,)):
        raise Eagle3Error(f"{where}: t2d has shape {tuple(getattr(t2d, 'shape', ()))}, expected "
                          f"({dcfg.vocab_size},); re-download or re-convert the head")
    known = set(expect) | {"d2t", "t2d"}
    return [k for k in state if k not in known]


def build_head(dcfg: DraftConfig, state: dict[str, torch.Tensor], *, dtype: torch.dtype,
               max_len: int, where: str) -> Eagle3Draft:
    """Validate and load tensors into an `Eagle3Draft` (no embedding unless the file has one)."""
    unknown = validate_head(dcfg, state, where)
    if unknown:
        notice(f"{where}: ignoring unknown tensor(s) {', '.join(unknown[:3])}")
    with torch.device("meta"):
        head = Eagle3Draft(dcfg, max_len=max_len, with_embedding="embed_tokens.weight" in state)
    sd = {k: v.to(dtype) for k, v in state.items()
          if k not in unknown and k not in ("d2t", "t2d")}
    vocab = dcfg.vocab_size
    if "d2t" in state:
        sd["d2t"] = state["d2t"].long()
    else:
        sd["d2t"] = torch.zeros(dcfg.draft_vocab_size, dtype=torch.long)
    if "t2d" in state:
        sd["t2d"] = state["t2d"].bool()
    else:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(dcfg.draft_vocab_size) + sd["d2t"]] = True
        sd["t2d"] = t2d
    head.load_state_dict(sd, strict=True, assign=True)
    head.build_buffers(max_len)
    return head.eval().requires_grad_(False)


def load_head(path: str, *, dtype: torch.dtype = torch.float32,
              max_len: int = 4096) -> tuple[str, Eagle3Draft]:
    """Read, validate and build the head in `path`; returns (format, head)."""
    if not os.path.isdir(path):
        raise Eagle3Error(f"draft head '{path}' is not a directory: pass an EAGLE-3 head directory "
                          "(config.json + weights) or 'none'")
    fmt, dcfg, state = read_head(path)
    return fmt, build_head(dcfg, state, dtype=dtype, max_len=max_len, where=path)


# -- writing ----------------------------------------------------------------------------------

def _layer_config(dcfg: DraftConfig) -> dict[str, Any]:
    c: dict[str, Any] = {
        "model_type": "llama", "hidden_size": dcfg.hidden_size,
        "intermediate_size": dcfg.intermediate_size, "num_attention_heads": dcfg.num_attention_heads,
        "num_key_value_heads": dcfg.num_key_value_heads, "head_dim": dcfg.head_dim,
        "num_hidden_layers": 1, "max_position_embeddings": dcfg.max_position_embeddings,
        "rms_norm_eps": dcfg.rms_norm_eps, "vocab_size": dcfg.vocab_size, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    }
    r = dcfg.rope
    if r != RopeConfig():
        c["rope_theta"] = r.theta
        if r.rope_type != "default":
            c["rope_scaling"] = {"rope_type": r.rope_type, "factor": r.factor,
                                 "low_freq_factor": r.low_freq_factor,
                                 "high_freq_factor": r.high_freq_factor,
                                 "original_max_position_embeddings": r.original_max_position_embeddings}
    return c


def head_config_dict(dcfg: DraftConfig, fmt: str) -> dict[str, Any]:
    """config.json for `dcfg` in format `fmt`."""
    if fmt not in FORMATS:
        raise Eagle3Error(f"unknown head format '{fmt}'; use one of {', '.join(FORMATS)}")
    taps = list(dcfg.taps) if dcfg.taps else None
    if fmt == "speculators":
        spec_cfg = dcfg.extra.get("speculators_config") or {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": None, "architectures": []}}
        layer = _layer_config(dcfg)
        layer.update({k: dcfg.extra[k] for k in LAYER_EXTRA_KEYS if k in dcfg.extra})
        c = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
             "transformer_layer_config": layer,
             "draft_vocab_size": dcfg.draft_vocab_size,
             "norm_before_residual": dcfg.norm_before_residual, "norm_before_fc": dcfg.norm_before_fc,
             "target_hidden_size": dcfg.target_hidden_size,
             "eagle_aux_hidden_state_layer_ids": taps, "speculators_config": spec_cfg}
        for k in ("torch_dtype", "dtype"):
            if k in dcfg.extra:
                c[k] = dcfg.extra[k]
        return c
    if native_format(dcfg) != "official":
        raise Eagle3Error(f"this head uses norm_before_residual/norm_before_fc, which the {fmt} "
                          "format cannot express (other runtimes would load it wrong); convert "
                          "to speculators instead")
    c = _layer_config(dcfg)
    c["architectures"] = ["LlamaForCausalLM"] if fmt == "official" else ["LlamaForCausalLMEagle3"]
    c["draft_vocab_size"] = dcfg.draft_vocab_size
    if dcfg.target_hidden_size != dcfg.hidden_size:
        c["target_hidden_size"] = dcfg.target_hidden_size
    if taps and fmt == "sglang":
        c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": taps, "use_aux_hidden_state": True}
    elif taps:
        c["eagle_aux_hidden_state_layer_ids"] = taps
    for k in ("torch_dtype", "dtype", *LAYER_EXTRA_KEYS):
        if k in dcfg.extra:
            c[k] = dcfg.extra[k]
    return c


def head_tensors(dcfg: DraftConfig, state: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """Tensors named for `fmt` (d2t/t2d only for a reduced vocabulary)."""
    out = {}
    for k, v in state.items():
        if k in ("d2t", "t2d") and dcfg.draft_vocab_size == dcfg.vocab_size:
            continue
        if fmt == "speculators" and k.startswith("midlayer."):
            k = "layers.0." + k[len("midlayer."):]
        out[k] = v.contiguous()
    return out


def native_format(dcfg: DraftConfig) -> str:
    """The format a head trained here is written in: official, unless it needs what only the
    speculators format can express (norm_before_fc / norm_before_residual)."""
    return "speculators" if dcfg.norm_before_fc or dcfg.norm_before_residual else "official"


def write_head(path: str, dcfg: DraftConfig, state: dict[str, torch.Tensor], fmt: str) -> None:
    """Write config.json + model.safetensors for `fmt` into `path` (created; files replaced atomically)."""
    from safetensors.torch import save_file

    config = head_config_dict(dcfg, fmt)
    tensors = head_tensors(dcfg, state, fmt)
    try:
        os.makedirs(path, exist_ok=True)
        tmp = os.path.join(path, "model.safetensors.tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        with open(os.path.join(path, "config.json.tmp"), "w") as f:
            json.dump(config, f, indent=2)
        os.replace(tmp, os.path.join(path, "model.safetensors"))
        os.replace(os.path.join(path, "config.json.tmp"), os.path.join(path, "config.json"))
    except OSError as e:
        raise Eagle3Error(f"cannot write the head to {path} ({e.strerror}); choose a writable "
                          "directory") from None


def save_head(head: Eagle3Draft, path: str, fmt: str = "official", *,
              include_embedding: bool = False) -> None:
    """Save an `Eagle3Draft` in format `fmt` (the shared target embedding is left out by default)."""
    state = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    if not include_embedding:
        state.pop("embed_tokens.weight", None)
    write_head(path, head.config, state, fmt)


def convert_head(src: str, dst: str, fmt: str) -> str:
    """Convert the head in `src` to format `fmt` in `dst`, tensor for tensor. Returns the source format."""
    if fmt not in FORMATS:
        raise Eagle3Error(f"unknown head format '{fmt}'; use one of {', '.join(FORMATS)}")
    if not os.path.isdir(src):
        raise Eagle3Error(f"'{src}' is not a directory: pass an EAGLE-3 head directory")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise Eagle3Error("SRC and DST are the same directory; write the converted head elsewhere")
    src_fmt, dcfg, state = read_head(src)
    validate_head(dcfg, state, src)
    write_head(dst, dcfg, state, fmt)
    return src_fmt
