"""`eagle3.load`: the one-call entry point (DESIGN §4)."""

from __future__ import annotations

import os

import torch

from .errors import Eagle3Error
from .speculator import Eagle3Speculator
from .targets import load_target, resolve_dtype
from .tokenizer import load_tokenizer


def load(target: str, draft: str | None = None, *, dtype: torch.dtype | str | None = None,
         backend: str = "auto", max_seq_len: int | None = None, taps=None,
         compile: bool = False) -> Eagle3Speculator:
    """Load a target (checkpoint dir, or 'default') and an optional EAGLE-3 head.

    draft: a head directory; None (the default head for 'default', else no
    speculation); or 'none' (plain decoding). backend: 'auto' | 'native' | 'hf'.
    taps: target layers feeding the head (default: the head config's ids, else
    (2, L//2, L-3)); tap k = hidden state entering layer k. compile: run the
    decode / verify / draft steps through torch.compile (`Eagle3Speculator.compile`;
    native backend only).
    """
    from .default import default_head_dir, default_target_dir
    from .draft import attach_head, load_head

    if not isinstance(target, str) or not target:
        raise Eagle3Error("target must be a checkpoint directory or 'default'")
    if draft is not None and not isinstance(draft, str):
        raise Eagle3Error("draft must be a head directory, 'none' or None")
    if compile and backend == "hf":
        raise Eagle3Error("compile needs the native backend (backend='hf' runs the target through "
                          "transformers); use backend='native' or 'auto', or drop compile")
    if draft is None and target == "default":
        draft = default_head_dir()
    head = None
    if draft not in (None, "none"):
        if not os.path.isdir(draft):
            raise Eagle3Error(f"draft head '{draft}' is not a directory: pass an EAGLE-3 head "
                              "directory (config.json + weights) or 'none'")
        if not os.path.isfile(os.path.join(draft, "config.json")):
            raise Eagle3Error(f"draft head {draft} has no config.json: pass an EAGLE-3 head "
                              "directory (official, SGLang or speculators format) or 'none'")
    tgt = load_target(target, dtype=dtype, backend=backend, max_seq_len=max_seq_len)
    if draft not in (None, "none"):
        _, head = load_head(draft, dtype=resolve_dtype(dtype), max_len=tgt.config.max_seq_len)
        attach_head(head, tgt, where=f"head {draft}", taps=taps)
    tdir = default_target_dir() if target == "default" else target
    spec = Eagle3Speculator(tgt, head, load_tokenizer(tdir))
    return spec.compile() if compile else spec
