"""Peers on the same target weights: transformers `generate` greedy, prompt lookup, assisted.

transformers is optional: `available()` says whether the peers can run.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import torch

from ..errors import Eagle3Error
from .harness import Arm, Sample

PEERS = ("hf", "lookup", "assisted")
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value


def available() -> bool:
    """Whether transformers is installed."""
    return importlib.util.find_spec("transformers") is not None


def load_model(path: str, dtype: torch.dtype, device: torch.device, what: str) -> Any:
    """A transformers causal LM from checkpoint dir `path`, a GGUF file (transformers' GGUF
    loader dequantizes it) or a registered model name (eval mode)."""
    import os

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ..targets.gguf import find_gguf
    from ..targets.named import resolve_target

    hf_logging.set_verbosity_error()  # keep the bench output readable
    hf_logging.disable_progress_bar()
    path = resolve_target(path)
    gguf_file = find_gguf(path)
    kw = {}
    if gguf_file is not None:
        path, kw = os.path.dirname(os.path.abspath(gguf_file)), {"gguf_file": os.path.basename(gguf_file)}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    except Exception as e:  # transformers raises many unrelated types here
        reason = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise Eagle3Error(f"transformers could not load the {what} {path} ({reason}); pass a "
                          "Hugging Face checkpoint directory") from None
    return model.to(device).eval()


def peer_arms(names: list[str], model: Any, max_new_tokens: int, eos_ids: tuple[int, ...],
              assistant: Any = None) -> dict[str, Arm]:
    """Arms running transformers `generate` (greedy) on `model`, one per peer name."""
    extra = {"hf": {}, "lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS},
             "assisted": {"assistant_model": assistant}}
    eos = list(eos_ids) or None  # None: no stop token, like our engine with no EOS ids

    def arm(name: str) -> Arm:
        @torch.no_grad()
        def run(ids: list[int]) -> Sample:
            x = torch.tensor([ids], device=model.device)
            t0 = time.perf_counter()
            try:
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                     do_sample=False, eos_token_id=eos, pad_token_id=(eos or [0])[0],
                                     **extra[name])
            except Exception as e:  # e.g. an assistant with another vocabulary
                reason = (str(e).splitlines() or [type(e).__name__])[0][:160]
                raise Eagle3Error(f"transformers generate failed for peer '{name}' ({reason}); an "
                                  "assistant must share the target's tokenizer") from None
            tokens = out[0, len(ids):].tolist()
            return Sample(tokens, time.perf_counter() - t0)
        return run

    return {name: arm(name) for name in names}
