"""The shifted chain runner: one target forward per round, lossless against plain greedy.

Alignment (DESIGN §2): the target feature at position t is paired with token
t+1 at draft slot t, and the draft output there predicts token t+2. A round
with anchor `x` at position p (emitted, not yet in the target cache):

    draft_chain       d1 comes from the last reseed; k-1 draft steps give d2..dk
    target_verify     [x, d1..dk] at p..p+k -> verify_ids (k+1), features (k+1)
    accept            a = leading matches d_{i+1} == verify_ids[i]; emit d1..da, c = verify_ids[a]
    rewind            target cache keeps p..p+a; the speculative draft slots are dropped
    rebuild_after_verify  draft slots p..p+a <- tokens [d1..da, c] with features f_p..f_{p+a};
                      its last output is the next round's d1, its feature the new boundary

The corrected/bonus token `c` never gets a target forward of its own: it is
the next round's anchor. The drafter keeps pegainfer's vocabulary
(prefill_prompt / draft_chain / chain_round / rebuild_after_verify).

Host synchronisations: one at prefill (`int(tok)`), two per round (the verify
ids and the drafts `.tolist()`). Inside `decoding.profile.profiling()` the
runner counts them and times its phases (draft / verify / prefill).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .profile import active

if TYPE_CHECKING:
    from ..speculator import Eagle3Speculator


def granted_drafts(k: int, cur_len: int, max_len: int) -> int:
    """Draft tokens a round may verify: a round that drafts k may commit k+1 tokens."""
    return max(0, min(k, max_len - cur_len - 1))


class ChainDrafter:
    """Draft-side operations over `Eagle3Speculator.draft_decode` and the draft cache."""

    def __init__(self, spec: Eagle3Speculator, pos: torch.Tensor) -> None:
        self.spec = spec
        self.pos = pos  # (max_len,) arange, sliced to avoid per-step allocation
        self.length = 0  # committed draft slots

    def rebuild_after_verify(self, tokens: torch.Tensor, features: torch.Tensor,
                             start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-force tokens (1, T) with target features (1, T, H) at slots start..start+T-1.

        Returns the next draft token (1, 1) (target ids) and the boundary feature (1, 1, H).
        """
        T = tokens.shape[1]
        ids, h = self.spec.draft_decode(tokens, features, self.pos[start:start + T], kv_len=start + T)
        self.length = start + T
        return ids[:, -1:], h[:, -1:]

    prefill_prompt = rebuild_after_verify  # the same operation over the prompt, at slot 0

    def draft_chain(self, first: torch.Tensor, feature: torch.Tensor, k: int) -> torch.Tensor:
        """k draft tokens (1, k): `first` plus k-1 steps, each fed the previous step's feature."""
        drafts = [first]
        p = self.length
        for i in range(k - 1):
            ids, feature = self.spec.draft_decode(drafts[-1], feature, self.pos[p + i:p + i + 1],
                                                  kv_len=p + i + 1)
            drafts.append(ids)
        return torch.cat(drafts, dim=1)

    def chain_round(self, first: torch.Tensor, feature: torch.Tensor, k: int) -> torch.Tensor:
        """draft_chain, then rewind the speculative draft slots: only the returned span changes."""
        drafts = self.draft_chain(first, feature, k)
        self.spec.draft_cache.truncate(self.length)
        return drafts


@torch.no_grad()
def chain_generate(spec: Eagle3Speculator, prompt_ids: list[int], max_new_tokens: int, k_max: int,
                   stop_ids: frozenset[int], stats: dict) -> list[int]:
    """Speculative greedy decoding with chain drafts of up to `k_max` tokens; fills `stats`."""
    n = len(prompt_ids)
    max_len = spec.max_seq_len
    pos = torch.arange(max_len)
    spec.reset_caches()
    drafter = ChainDrafter(spec, pos)
    prompt = torch.tensor([prompt_ids])
    per_pos = stats["accepted_per_position"] = [0] * k_max
    drafted = stats["drafted_per_position"] = [0] * k_max  # rounds near the end draft fewer
    hist = stats["accept_len_hist"] = [0] * (k_max + 1)
    prof = active()  # times phases and counts host syncs inside `profiling()`; else no-ops

    prof.tic()
    tok, feat = spec.prefill(prompt, pos[:n], kv_len=n)  # (1,), (1, n, H)
    out = [int(tok)]
    stats["target_forwards"] += 1
    if max_new_tokens == 1 or out[-1] in stop_ids:
        prof.toc("prefill", syncs=1)
        return out
    anchor = tok.view(1, 1)
    first, boundary = drafter.prefill_prompt(torch.cat([prompt[:, 1:], anchor], dim=1), feat, 0)
    prof.toc("prefill", first, syncs=1)
    cur = n + 1  # tokens so far, the anchor included
    while True:
        k = min(granted_drafts(k_max, cur, max_len), max_new_tokens - len(out) - 1)
        prof.tic()
        drafts = drafter.chain_round(first, boundary, k) if k > 0 else anchor[:, :0]
        prof.toc("draft", drafts)
        verify_ids, vfeat = spec.target_verify(torch.cat([anchor, drafts], dim=1),
                                               pos[cur - 1:cur + k], kv_len=cur + k)
        stats["target_forwards"] += 1
        v, d = verify_ids[0].tolist(), drafts[0].tolist()
        prof.toc("verify", syncs=2)
        a = 0
        while a < k and d[a] == v[a]:
            a += 1
        spec.target.truncate_cache(spec.target_cache, cur + a)
        if k > 0:
            stats["rounds"] += 1
            stats["draft_tokens"] += k
            stats["accepted_tokens"] += a
            hist[a] += 1
            for i in range(a):
                per_pos[i] += 1
            for i in range(k):
                drafted[i] += 1
        for t in d[:a] + [v[a]]:
            out.append(t)
            if t in stop_ids or len(out) == max_new_tokens:
                break
        if out[-1] in stop_ids or len(out) >= max_new_tokens:
            break
        anchor = verify_ids[:, a:a + 1]
        prof.tic()
        first, boundary = drafter.rebuild_after_verify(torch.cat([drafts[:, :a], anchor], dim=1),
                                                       vfeat[:, :a + 1], cur - 1)
        prof.toc("draft", first)
        cur += a + 1
    return out
