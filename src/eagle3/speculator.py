"""`Eagle3Speculator`: a target plus (optionally) an EAGLE-3 draft head.

`generate` is the user-facing entry point. Without a draft head it runs plain
greedy decoding, the reference every speculative path reproduces.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .decoding.plain import plain_greedy
from .errors import Eagle3Error
from .targets.protocol import TapTarget


@dataclass
class GenerationResult:
    """Generated token ids (prompt excluded) and vLLM-compatible speculation stats."""

    token_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)


def empty_stats() -> dict[str, Any]:
    return {"rounds": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": [],
            "mean_accept_len": 1.0, "accept_len_hist": [], "target_forwards": 0, "seconds": 0.0}


def check_request(prompt_ids: Any, max_new_tokens: Any, vocab_size: int, max_len: int) -> list[int]:
    """Validate a request at admission; return the prompt as a list of ints."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.flatten().tolist()
    try:
        ids = [int(t) for t in prompt_ids]
    except (TypeError, ValueError):
        raise Eagle3Error("prompt_ids must be a sequence of integer token ids") from None
    if not ids:
        raise Eagle3Error("the prompt is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise Eagle3Error(f"token id {bad[0]} is outside the target's vocabulary (0..{vocab_size - 1}); "
                          "check the tokenizer matches the target")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise Eagle3Error(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if len(ids) + max_new_tokens > max_len:
        raise Eagle3Error(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                          f"target's max_seq_len {max_len}; shorten the prompt, lower "
                          "max_new_tokens or load with a larger max_seq_len")
    return ids


class Eagle3Speculator:
    """A target (`TapTarget`) and an optional EAGLE-3 draft head."""

    def __init__(self, target: TapTarget, draft: Any = None, tokenizer: Any = None) -> None:
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer

    @property
    def max_seq_len(self) -> int:
        return self.target.config.max_seq_len

    def generate(self, prompt_ids: Any, max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 num_draft_tokens: int | None = None, tree: Any = None,
                 stop_token_ids: Any = None) -> GenerationResult:
        """Generate up to `max_new_tokens` tokens after `prompt_ids`.

        Greedy unless `temperature > 0`. Generation stops after the first token
        in `stop_token_ids` (default: the target's EOS ids; `[]` never stops).
        """
        cfg = self.target.config
        ids = check_request(prompt_ids, max_new_tokens, cfg.vocab_size, cfg.max_seq_len)
        if temperature != 0.0:
            raise Eagle3Error("sampling (temperature > 0) is not implemented yet; use temperature=0")
        stop = frozenset(cfg.eos_token_ids if stop_token_ids is None else stop_token_ids)
        stats = empty_stats()
        t0 = time.perf_counter()
        tokens, forwards = plain_greedy(self.target, ids, max_new_tokens, stop)
        stats["target_forwards"] = forwards
        stats["seconds"] = time.perf_counter() - t0
        return GenerationResult(tokens, stats)
