"""Simulated acceptance: what greedy chains of K drafts would accept, from the head's
training-time-test unroll on held-out sequences, without decoding.

Under TTT (`ttt.unroll`) step i of row t reads x_{t+1+i}, the token the sequence holds;
at inference it reads the head's own previous draft. The two are the same while every
earlier draft was right, the only case in which acceptance depends on step i. So on text
the target itself produced greedily (regenerated data), the share of rows whose first k
drafts all equal the next tokens is what a chain accepts at depth k, and a chain of K
drafts accepts tau(K) = 1 + sum_{k<=K} share_k tokens per round.
"""

from __future__ import annotations

import torch

from ..draft.model import Eagle3Draft
from .ttt import ttt_drafts


@torch.no_grad()
def chain_runs(head: Eagle3Draft, tokens: torch.Tensor, mask: torch.Tensor, taps: torch.Tensor,
               max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row t (B, R = T-1): `runs`, how many of a chain's first max_k drafts after the anchor
    x_{t+1} are right in a row, and `room`, how many of the next max_k tokens x_{t+2..} carry loss
    (response tokens) in a row; runs <= room. tokens (B, T), mask (B, T), taps (B, T, n*Ht): the
    target's, over `tokens`."""
    B, T = tokens.shape
    R = T - 1
    drafts = head.to_target_ids(ttt_drafts(head, tokens, taps, max_k))  # (K, B, R): x_{t+2+i}
    t = torch.arange(R, device=tokens.device)
    runs = torch.zeros(B, R, dtype=torch.long, device=tokens.device)
    room = torch.zeros_like(runs)
    right = torch.ones(B, R, dtype=torch.bool, device=tokens.device)
    counted = torch.ones(B, R, dtype=torch.bool, device=tokens.device)
    for i in range(max_k):
        at = (t + 2 + i).clamp_max(T - 1)  # (R,)
        counted &= (t + 2 + i < T)[None, :] & mask[:, at]
        right &= counted & (drafts[i] == tokens[:, at])
        room += counted
        runs += right
    return runs, room


def chain_hits(head: Eagle3Draft, tokens: torch.Tensor, mask: torch.Tensor, taps: torch.Tensor,
               max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits (max_k,), rows (max_k,)) for one batch: rows[k-1] counts the rows whose next k
    tokens all carry loss (response tokens), hits[k-1] those of them whose first k drafts are
    all right (`chain_runs`)."""
    runs, room = chain_runs(head, tokens, mask, taps, max_k)
    k = torch.arange(1, max_k + 1, device=runs.device)[:, None, None]
    return ((runs[None] >= k).flatten(1).sum(1).float().cpu(),
            (room[None] >= k).flatten(1).sum(1).float().cpu())


def simulated_tau(hits: torch.Tensor, rows: torch.Tensor) -> list[float]:
    """[tau(1), .., tau(K)] from summed `chain_hits`: 1 + the shares accepted at depths 1..K."""
    share = (hits / rows.clamp_min(1)).tolist()
    return [round(1 + sum(share[:k]), 4) for k in range(1, len(share) + 1)]
