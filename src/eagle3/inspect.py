"""`eagle3 inspect`: describe a target checkpoint directory."""

from __future__ import annotations

import os
from typing import Any

from .errors import Eagle3Error
from .targets.checkpoint import weight_files
from .targets.config import NATIVE_FAMILIES, parse_decoder_config, read_config_json
from .targets.protocol import default_taps


def inspect_path(path: str) -> dict[str, Any]:
    """A flat description of the checkpoint at `path` (no weights are loaded)."""
    raw = read_config_json(path)
    info: dict[str, Any] = {"path": path, "kind": "target",
                            "architecture": (raw.get("architectures") or ["?"])[0],
                            "model_type": raw.get("model_type")}
    if raw.get("model_type") in NATIVE_FAMILIES:
        cfg = parse_decoder_config(raw, where=os.path.join(path, "config.json"))
        info.update(backend="native", layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                    intermediate_size=cfg.intermediate_size, heads=cfg.num_attention_heads,
                    kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                    vocab_size=cfg.vocab_size, tied_embeddings=cfg.tie_word_embeddings,
                    max_position_embeddings=cfg.max_position_embeddings,
                    max_seq_len=cfg.max_seq_len,
                    sliding_window=next((w for w in cfg.layer_windows if w), None))
        L = cfg.num_hidden_layers
    else:
        L = int(raw.get("num_hidden_layers") or 0)
        info.update(backend="hf (transformers adapter)", layers=L,
                    hidden_size=raw.get("hidden_size"), vocab_size=raw.get("vocab_size"),
                    max_position_embeddings=raw.get("max_position_embeddings"))
    try:
        info["default_taps"] = list(default_taps(L))
    except Eagle3Error:
        info["default_taps"] = f"none (L={L} too small; choose taps explicitly)"
    files = weight_files(path)
    info["weights"] = ", ".join(os.path.basename(f) for f in files)
    info["weight_bytes"] = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    info["tokenizer"] = os.path.isfile(os.path.join(path, "tokenizer.json"))
    return info
