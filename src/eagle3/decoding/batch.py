"""Batched greedy decoding of equal-length prompts (training-data regeneration)."""

from __future__ import annotations

import torch

from ..targets.protocol import TapTarget


@torch.no_grad()
def batched_greedy(target: TapTarget, prompts: torch.Tensor, max_new_tokens: int, *,
                   temperature: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Continuations (B, max_new_tokens) of prompts (B, T), all the same length.

    Greedy unless `temperature > 0` (then sampled with `generator`). No early
    stop: the caller masks what follows an EOS. Row b equals plain greedy
    decoding of prompts[b] (the batch rows never interact).
    """

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    B, T = prompts.shape
    cache = target.new_cache(B, T + max_new_tokens)
    pos = torch.arange(T + max_new_tokens)
    logits, _ = target.forward_logits_taps(prompts, pos[:T], cache, kv_len=T, last_only=True,
                                           with_taps=False)
    out = [pick(logits[:, -1])]
    for i in range(max_new_tokens - 1):
        p = T + i
        logits, _ = target.forward_logits_taps(out[-1][:, None], pos[p:p + 1], cache, kv_len=p + 1,
                                               last_only=True, with_taps=False)
        out.append(pick(logits[:, -1]))
    return torch.stack(out, dim=1)
