"""Plain greedy decoding: the reference every speculative path must reproduce."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..targets.decoder import slots_upto
from ..targets.protocol import TapTarget
from .profile import active

Step = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
Pick = Callable[[torch.Tensor], torch.Tensor]


def argmax_pick(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice: logits (B, 1, V) -> tokens (B, 1)."""
    return logits.argmax(-1)


@torch.no_grad()
def plain_greedy(target: TapTarget, prompt_ids: list[int], max_new_tokens: int,
                 stop_ids: frozenset[int], *, cache: Any = None,
                 step: Step | None = None, prefill: Step | None = None,
                 pick: Pick = argmax_pick) -> tuple[list[int], int]:
    """Greedy-decode up to `max_new_tokens` tokens; returns (new tokens, target forwards).

    `pick(logits (1, 1, V)) -> token (1, 1)` replaces the greedy choice (sampling).

    Stops after the first token in `stop_ids` (which is included). The caller
    has checked that prompt + max_new_tokens fits the target's cache. `cache`
    (default: a fresh one) is overwritten from slot 0; `step(token (1, 1),
    input_pos (1,), kv_len) -> next token (1, 1)` replaces the eager one-token
    forward (a compiled one); `prefill(prompt (1, n), input_pos (n,), n) -> token (1, 1)` the
    prompt's forward (another backend's). One host synchronisation per token (`int(tok)`);
    see `decoding.profile` for profiling.
    """
    prof = active()
    prof.tic()
    n = len(prompt_ids)
    if cache is None:
        cache = target.new_cache(1, n + max_new_tokens)
    if step is None:
        def step(tok: torch.Tensor, input_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
            logits, _ = target.forward_logits_taps(tok, input_pos, cache, kv_len=kv_len,
                                                   last_only=True, with_taps=False)
            return pick(logits[:, -1:])
    pos = slots_upto(n + max_new_tokens)
    if prefill is None:
        logits, _ = target.forward_logits_taps(torch.tensor([prompt_ids]), pos[:n], cache, kv_len=n,
                                               last_only=True, with_taps=False)
        tok = pick(logits[:, -1:])  # (1, 1)
    else:
        tok = prefill(torch.tensor([prompt_ids]), pos[:n], n)
    out = [int(tok)]
    forwards = 1
    prof.toc("prefill", syncs=1)
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        p = n + len(out) - 1
        tok = step(tok, pos[p:p + 1], p + 1)
        out.append(int(tok))
        forwards += 1
        prof.toc("verify", syncs=1)
    return out, forwards
