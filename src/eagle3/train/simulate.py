"""Simulated acceptance: what greedy chains of K drafts would accept, from the head's
training-time-test unroll on held-out sequences, without decoding.

Under TTT (`ttt.unroll`) step i of row t reads x_{t+1+i}, the token the sequence holds;
at inference it reads the head's own previous draft. The two are the same while every
earlier draft was right, the only case in which acceptance depends on step i. So on text
the target itself produced greedily (regenerated data), the share of rows whose first k
drafts all equal the next tokens is what a chain accepts at depth k, and a chain of K
drafts accepts tau(K) = 1 + sum_{k<=K} share_k tokens per round.

That counts every position alike. A decode does not: its rounds start where the last one
stopped, right after a rejection (a bonus token), where drafting is hardest. `walked_rounds`
walks each response round by round as greedy `generate` does, from the same runs, so its
`walked_tau` is the tau a real greedy decode of these responses measures.
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
    return depth_hits(*chain_runs(head, tokens, mask, taps, max_k), max_k)


def depth_hits(runs: torch.Tensor, room: torch.Tensor, max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`chain_hits` from `chain_runs`' runs and room (B, R)."""
    k = torch.arange(1, max_k + 1, device=runs.device)[:, None, None]
    return ((runs[None] >= k).flatten(1).sum(1).float().cpu(),
            (room[None] >= k).flatten(1).sum(1).float().cpu())


def simulated_tau(hits: torch.Tensor, rows: torch.Tensor) -> list[float]:
    """[tau(1), .., tau(K)] from summed `chain_hits`: 1 + the shares accepted at depths 1..K."""
    share = (hits / rows.clamp_min(1)).tolist()
    return [round(1 + sum(share[:k]), 4) for k in range(1, len(share) + 1)]


def walked_rounds(runs: torch.Tensor, mask: torch.Tensor, max_k: int) -> torch.Tensor:
    """(max_k, 2): per K = 1..max_k, [drafting rounds, accepted drafts] when greedy chains of K
    decode each row's response as `generate` does. runs (B, R = T-1) from `chain_runs`; mask
    (B, T) marks the response, whose first token (the prompt's forward's) anchors the first
    round. A round anchored on x_p with n response tokens after it drafts min(K, n - 1) (the
    last token is the bonus one; at n = 1 the step is a plain one, no drafting round), accepts
    the first of them up to the first wrong one, and the next round anchors past the accepted
    drafts and the bonus token."""
    out = torch.zeros(max_k, 2, dtype=torch.long)
    for b in range(runs.shape[0]):
        resp = mask[b].nonzero().flatten().tolist()
        if not resp:
            continue
        first, last = resp[0], resp[-1]
        row = runs[b].tolist()
        for k in range(1, max_k + 1):
            p = first
            while last - p >= 2:
                accepted = min(row[p - 1], k, last - p - 1)  # row p-1 anchors on x_p
                out[k - 1, 0] += 1
                out[k - 1, 1] += accepted
                p += accepted + 1
    return out


def walked_tau(counts: torch.Tensor) -> list[float]:
    """[tau(1), .., tau(K)] from summed `walked_rounds`: 1 + accepted drafts per round."""
    return [round(1 + a / max(r, 1), 4) for r, a in counts.tolist()]
