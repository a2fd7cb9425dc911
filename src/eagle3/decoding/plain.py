"""Plain greedy decoding: the reference every speculative path must reproduce."""

from __future__ import annotations

import torch

from ..targets.protocol import TapTarget
from .profile import active


@torch.no_grad()
def plain_greedy(target: TapTarget, prompt_ids: list[int], max_new_tokens: int,
                 stop_ids: frozenset[int]) -> tuple[list[int], int]:
    """Greedy-decode up to `max_new_tokens` tokens; returns (new tokens, target forwards).

    Stops after the first token in `stop_ids` (which is included). The caller
    has checked that prompt + max_new_tokens fits the target's cache. One host
    synchronisation per token (`int(tok)`); see `decoding.profile` for profiling.
    """
    prof = active()
    prof.tic()
    n = len(prompt_ids)
    cache = target.new_cache(1, n + max_new_tokens)
    pos = torch.arange(n + max_new_tokens)
    logits, _ = target.forward_logits_taps(torch.tensor([prompt_ids]), pos[:n], cache, kv_len=n,
                                           last_only=True, with_taps=False)
    tok = logits[0, -1].argmax()
    out = [int(tok)]
    forwards = 1
    prof.toc("prefill", syncs=1)
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        p = n + len(out) - 1
        logits, _ = target.forward_logits_taps(tok.view(1, 1), pos[p:p + 1], cache, kv_len=p + 1,
                                               last_only=True, with_taps=False)
        tok = logits[0, -1].argmax()
        out.append(int(tok))
        forwards += 1
        prof.toc("verify", syncs=1)
    return out, forwards
