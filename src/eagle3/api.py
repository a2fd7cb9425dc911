"""`eagle3.load`: the one-call entry point (DESIGN §4)."""

from __future__ import annotations

import os

import torch

from .errors import Eagle3Error
from .speculator import Eagle3Speculator
from .targets import load_target
from .tokenizer import load_tokenizer


def load(target: str, draft: str | None = None, *, dtype: torch.dtype | str | None = None,
         backend: str = "auto", max_seq_len: int | None = None) -> Eagle3Speculator:
    """Load a target (checkpoint dir, or 'default') and an optional EAGLE-3 head.

    draft: a head directory; None (the default head for 'default', else no
    speculation); or 'none' (plain decoding). backend: 'auto' | 'native' | 'hf'.
    """
    if not isinstance(target, str) or not target:
        raise Eagle3Error("target must be a checkpoint directory or 'default'")
    tgt = load_target(target, dtype=dtype, backend=backend, max_seq_len=max_seq_len)
    from .default import default_target_dir

    tdir = default_target_dir() if target == "default" else target
    tokenizer = load_tokenizer(tdir) if os.path.isdir(tdir) else None
    if draft is None or draft == "none":
        return Eagle3Speculator(tgt, None, tokenizer)
    raise Eagle3Error("EAGLE-3 draft heads are not supported yet; pass draft='none'")
