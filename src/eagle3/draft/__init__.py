"""The EAGLE-3 draft head, its formats, and attaching it to a target."""

from __future__ import annotations

from ..errors import Eagle3Error
from ..targets.decoder import table_embedding
from ..targets.protocol import TapTarget, default_taps, validate_taps
from .formats import FORMATS, convert_head, detect_format, load_head, parse_head_config, save_head
from .model import DraftConfig, Eagle3Draft

__all__ = ["DraftConfig", "Eagle3Draft", "FORMATS", "attach_head", "convert_head", "detect_format",
           "load_head", "parse_head_config", "save_head"]


def attach_head(head: Eagle3Draft, target: TapTarget, where: str = "draft head",
                taps=None) -> tuple[int, ...]:
    """Check `head` fits `target`, resolve the head's taps and share the target's embedding if needed.

    Taps: `taps` if given, else the head config's, else the target's default (2, L//2, L-3);
    they are the head's (`head.tap_layers`, returned), and the target is left as it was, so
    several heads may share one target.
    """
    cfg, tcfg = head.config, target.config
    if cfg.vocab_size != tcfg.vocab_size:
        raise Eagle3Error(f"{where} was made for a vocabulary of {cfg.vocab_size} tokens, the target has "
                          f"{tcfg.vocab_size}: this head belongs to a different target; use the head "
                          "made for it")
    if cfg.target_hidden_size != tcfg.hidden_size:
        raise Eagle3Error(f"{where} expects target hidden size {cfg.target_hidden_size}, the target has "
                          f"{tcfg.hidden_size}: this head belongs to a different target; use the head "
                          "made for it")
    if not taps and cfg.taps:
        try:
            taps = validate_taps(cfg.taps, tcfg.num_hidden_layers)
        except Eagle3Error as e:  # name the file the bad ids came from
            raise Eagle3Error(f"{where}: the config's eagle_aux_hidden_state_layer_ids do not fit the "
                              f"target ({e}); fix the head's config.json or pass taps") from None
    taps = validate_taps(taps or default_taps(tcfg.num_hidden_layers), tcfg.num_hidden_layers)
    if len(taps) != cfg.num_taps:
        raise Eagle3Error(f"{where}: fc takes {cfg.num_taps} taps but the config names {len(taps)}")
    head.tap_layers = taps
    if head.embed_tokens is None:
        shared = getattr(target, "shared_embedding", None)  # a native target's (maybe its codes)
        emb = shared() if shared is not None else table_embedding(target.embedding_weight)
        if (emb.num_embeddings, emb.embedding_dim) != (cfg.vocab_size, cfg.hidden_size):
            raise Eagle3Error(f"{where} ships no embed_tokens and the target's embedding table is "
                              f"{(emb.num_embeddings, emb.embedding_dim)}, not ({cfg.vocab_size}, "
                              f"{cfg.hidden_size}); this head needs its own embedding (or belongs "
                              "to another target)")
        head.embed_tokens = emb
    if head.embed_tokens.weight.dtype != head.dtype:
        raise Eagle3Error(f"{where}: embedding dtype {head.embed_tokens.weight.dtype} differs from the "
                          f"head's {head.dtype}; load target and head with the same dtype")
    return taps
