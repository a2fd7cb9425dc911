"""`eagle3 inspect`: describe a target (checkpoint directory, GGUF file, model name) or a head."""

from __future__ import annotations

import os
from typing import Any

from ..errors import Eagle3Error
from ..targets.checkpoint import weight_files
from ..targets.config import parse_decoder_config, read_config_json
from ..targets.families import FAMILIES
from ..targets.protocol import default_taps

# Other spellings of the sizes in configs the native targets do not cover (GPT-2, T5-style, ...).
ALIASES = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_sequence_length",
                                "seq_length"),
}


def _lookup(raw: dict, key: str) -> Any:
    """`key` (or an alias) from the config, or from its nested `text_config`."""
    for cfg in (raw, raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}):
        for name in ALIASES.get(key, (key,)):
            if cfg.get(name) is not None:
                return cfg[name]
    return None


def _has_fc(path: str) -> bool:
    """An official head's config looks like a 1-layer Llama target's; only the head has `fc`."""
    import torch
    from safetensors import safe_open

    for f in weight_files(path):
        try:
            if f.endswith(".safetensors"):
                with safe_open(f, "pt") as st:
                    names = set(st.keys())
            else:
                names = set(torch.load(f, map_location="cpu", mmap=True, weights_only=True))
        except Exception:  # unreadable: let inspect_head report it as the head it claims to be
            return True
        if "fc.weight" in names or "model.fc.weight" in names:
            return True
    return False


def _check_headers(files: list[str]) -> None:
    """Read each safetensors header (not the tensors): a truncated or corrupt weight file is
    reported by inspect as it would be by a load."""
    from safetensors import safe_open

    for f in files:
        if not f.endswith(".safetensors"):
            continue
        try:
            with safe_open(f, "pt") as st:
                st.keys()
        except FileNotFoundError:
            raise Eagle3Error(f"weight file {f} is missing: the checkpoint is incomplete; "
                              "re-download or re-save it") from None
        except Exception as e:  # safetensors raises its own SafetensorError and OSError
            reason = (str(e).splitlines() or [type(e).__name__])[0][:120]
            raise Eagle3Error(f"cannot read {f} ({reason}): the file is truncated or corrupt; "
                              "re-download or re-save the checkpoint") from None


def inspect_head(path: str, raw: dict) -> dict[str, Any]:
    """Describe an EAGLE-3 head (reads its tensors for the embedding and d2t checks)."""
    from ..draft.formats import read_head, validate_head

    fmt, cfg, state = read_head(path)
    validate_head(cfg, state, path)
    n_params = sum(t.numel() for k, t in state.items() if k not in ("d2t", "t2d"))
    return {"path": path, "kind": "eagle3 head", "format": fmt,
            "architecture": (raw.get("architectures") or ["?"])[0],
            "hidden_size": cfg.hidden_size, "target_hidden_size": cfg.target_hidden_size,
            "intermediate_size": cfg.intermediate_size, "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
            "reduced_vocab": cfg.draft_vocab_size != cfg.vocab_size, "has_d2t": "d2t" in state,
            "taps": list(cfg.taps) if cfg.taps else "target default (2, L//2, L-3)",
            "embedding": "ships embed_tokens" if "embed_tokens.weight" in state
            else "none (uses the target's)",
            "rope_theta": cfg.rope.theta, "norm_before_residual": cfg.norm_before_residual,
            "norm_before_fc": cfg.norm_before_fc, "parameters": n_params}


def _native_info(info: dict, raw: dict, where: str) -> int:
    """Add the native decoder's sizes to `info`; return the layer count."""
    cfg = parse_decoder_config(raw, where=where)
    info.update(backend="native", layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, heads=cfg.num_attention_heads,
                kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                vocab_size=cfg.vocab_size, tied_embeddings=cfg.tie_word_embeddings,
                max_position_embeddings=cfg.max_position_embeddings,
                max_seq_len=cfg.max_seq_len,
                sliding_window=next((w for w in cfg.layer_windows if w), None))
    return cfg.num_hidden_layers


def _taps_info(L: int) -> list[int] | str:
    try:
        return list(default_taps(L))
    except Eagle3Error:
        return f"none (L={L} too small; choose taps explicitly)"


def inspect_gguf(path: str) -> dict[str, Any]:
    """Describe a GGUF target (metadata only: no tensor is dequantized)."""
    from collections import Counter

    from ..targets.gguf import read_gguf

    ckpt = read_gguf(path)
    meta = ckpt.metadata
    info: dict[str, Any] = {"path": path, "kind": "target", "format": "gguf",
                            "name": meta.get("general.name"), "architecture": ckpt.arch,
                            "model_type": ckpt.config["model_type"], "license": meta.get("general.license")}
    L = _native_info(info, ckpt.config, path)
    info["default_taps"] = _taps_info(L)
    info["quant_types"] = dict(Counter(t.tensor_type.name for t in ckpt.reader.tensors))
    info["weight_bytes"] = os.path.getsize(path)
    info["tokenizer"] = meta.get("tokenizer.ggml.model") or False
    info["chat_template"] = "tokenizer.chat_template" in meta
    info["bos_token_id"], info["eos_token_id"] = ckpt.config["bos_token_id"], ckpt.config["eos_token_id"]
    return info


def inspect_path(path: str) -> dict[str, Any]:
    """A flat description of the target or head at `path` (a directory, a .gguf file or a
    registered model name); a target's also names the kernel path this CPU runs it on."""
    info = _inspect_path(path)
    if info.get("kind") == "target":
        from ..kernels import isa

        info["kernel_isa"] = isa()
    return info


def _inspect_path(path: str) -> dict[str, Any]:
    from ..draft.formats import detect_format
    from ..targets.gguf import find_gguf
    from ..targets.named import resolve_target

    path = resolve_target(path)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return inspect_gguf(gguf_file)
    raw = read_config_json(path)
    try:
        is_head = detect_format(raw) != "official" or _has_fc(path)
    except Eagle3Error:
        is_head = False
    if is_head:
        return inspect_head(path, raw)
    info: dict[str, Any] = {"path": path, "kind": "target",
                            "architecture": (raw.get("architectures") or ["?"])[0],
                            "model_type": raw.get("model_type")}
    if raw.get("model_type") in FAMILIES:
        L = _native_info(info, raw, os.path.join(path, "config.json"))
    else:
        try:
            L = int(_lookup(raw, "num_hidden_layers") or 0)
        except (TypeError, ValueError):
            L = 0
        max_pos = _lookup(raw, "max_position_embeddings")
        info.update(backend="hf (transformers adapter)", layers=L,
                    hidden_size=_lookup(raw, "hidden_size"), vocab_size=_lookup(raw, "vocab_size"),
                    max_position_embeddings=max_pos,
                    max_seq_len=min(max_pos, 4096) if isinstance(max_pos, int) else 4096)
    info["default_taps"] = _taps_info(L)
    files = weight_files(path)
    _check_headers(files)
    info["weights"] = ", ".join(os.path.basename(f) for f in files)
    info["weight_bytes"] = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    info["tokenizer"] = os.path.isfile(os.path.join(path, "tokenizer.json"))
    return info
