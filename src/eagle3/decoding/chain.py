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

Host synchronisations: one at prefill (`int(tok)`), one per round (the verify
ids and the drafts in one `.tolist()`). Inside `decoding.profile.profiling()` the
runner counts them and times its phases (draft / verify / prefill).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..targets.decoder import slots_upto
from .autok import REPICK_EVERY
from .profile import active

if TYPE_CHECKING:
    from ..speculator import Eagle3Speculator
    from .autok import AutoK


def record_round(stats: dict, drafted: int, accepted: int, deepest: int) -> None:
    """Count one verify round: `drafted` emittable draft tokens, `accepted` of them accepted,
    drafts reaching position `deepest` (the chain's length; a tree's depth)."""
    stats["rounds"] += 1
    stats["draft_tokens"] += drafted
    stats["accepted_tokens"] += accepted
    stats["accept_len_hist"][accepted] += 1
    for i in range(accepted):
        stats["accepted_per_position"][i] += 1
    for i in range(deepest):
        stats["drafted_per_position"][i] += 1


def emit(out: list[int], tokens: list[int], stop_ids: frozenset[int], max_new_tokens: int) -> bool:
    """Append `tokens` to `out` up to the first stop id or max_new_tokens; True when done."""
    for t in tokens:
        out.append(t)
        if t in stop_ids or len(out) == max_new_tokens:
            return True
    return False


def granted_drafts(k: int, cur_len: int, max_len: int) -> int:
    """Draft tokens a round may verify: a round that drafts k may commit k+1 tokens."""
    return max(0, min(k, max_len - cur_len - 1))


class ChainDrafter:
    """Draft-side operations over `Eagle3Speculator.draft_decode` and the draft cache.

    With compiled steps (`spec.compile()`), `chain_after_verify` runs the rebuild and the
    next chain as one compiled graph (`CompiledSteps.rebuild_chain`): one call per round.
    """

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

    def prefill_prompt(self, tokens: torch.Tensor,
                       features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rebuild_after_verify over the whole prompt at slot 0 (always eager: one shape per prompt)."""
        T = tokens.shape[1]
        ids, h = self.spec._draft(tokens, features, self.pos[:T], T, compiled=False)
        self.length = T
        return ids[:, -1:], h[:, -1:]

    def draft_chain(self, first: torch.Tensor, feature: torch.Tensor, k: int) -> torch.Tensor:
        """k draft tokens (1, k): `first` plus k-1 steps, each fed the previous step's feature."""
        p = self.length
        compiled = self.spec.compiled
        if compiled is not None:
            if k == 1:
                return first
            self.spec.draft_cache.claim(p, k - 1)
            return compiled.chain(first, feature, self.pos[p:p + k - 1], p + k - 1)
        drafts = [first]
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

    def chain_after_verify(self, drafts: torch.Tensor, a: int, anchor: torch.Tensor,
                           vfeat: torch.Tensor, start: int, k: int,
                           rows: int | None = None) -> torch.Tensor:
        """rebuild_after_verify over [d1..da, anchor] at `start`, then chain_round of k drafts.

        Compiled, the rebuild runs over a fixed number of `rows` (default: the verify's
        k_prev + 1): the rows after the anchor are padding whose slots lie past the
        committed length, so causal attention never reads them and the chain's steps
        overwrite them.
        """
        compiled = self.spec.compiled
        if compiled is None:
            first, boundary = self.rebuild_after_verify(torch.cat([drafts[:, :a], anchor], dim=1),
                                                        vfeat[:, :a + 1], start)
            return self.chain_round(first, boundary, k)
        T = min(rows or vfeat.shape[1], self.spec.max_seq_len - start)  # fewer at the end
        seed = torch.cat([drafts[:, :a], anchor.expand(1, T - a)], dim=1)  # (1, T)
        if vfeat.shape[1] < T:
            vfeat = torch.cat([vfeat, vfeat[:, -1:].expand(1, T - vfeat.shape[1], -1)], dim=1)
        p = start + a + 1  # the first chain step's slot
        kv_len = max(start + T, p + k - 1)
        self.spec.draft_cache.claim(start, kv_len - start)
        out = compiled.rebuild_chain(seed, vfeat, self.pos[start:start + T], a,
                                     self.pos[p:p + k - 1], kv_len)
        self.length = p
        self.spec.draft_cache.truncate(p)
        return out


@torch.no_grad()
def chain_generate(spec: Eagle3Speculator, prompt_ids: list[int], max_new_tokens: int,
                   k_max: int | None, stop_ids: frozenset[int], stats: dict,
                   auto: AutoK | None = None) -> list[int]:
    """Speculative greedy decoding with chain drafts of up to `k_max` tokens; fills `stats`.

    k_max None: `auto` picks K at the start and every `REPICK_EVERY` rounds, and
    records each round's acceptance (its own rounds only: explicit K's don't feed it).
    """
    k_choice, automatic = k_max, k_max is None
    if automatic:
        assert auto is not None, "automatic K needs an AutoK"
        k_max, k_choice = auto.max_k, auto.choose()
    stats["num_draft_tokens"] = k_choice
    n = len(prompt_ids)
    max_len = spec.max_seq_len
    pos = slots_upto(max_len)
    spec.reset_caches()
    drafter = ChainDrafter(spec, pos)
    prompt = torch.tensor([prompt_ids])
    stats["accepted_per_position"] = [0] * k_max
    stats["drafted_per_position"] = [0] * k_max  # rounds near the end draft fewer
    stats["accept_len_hist"] = [0] * (k_max + 1)
    prof = active()  # times phases and counts host syncs inside `profiling()`; else no-ops
    # Compiled steps keep k fixed (one shape) until the cache's end; tokens past
    # max_new_tokens are then verified and dropped (and left out of the stats). Under
    # auto, the compiled rebuild always has k_max + 1 rows: one graph per next k.
    fixed_shapes = spec.compiled is not None
    rebuild_rows = k_max + 1 if fixed_shapes and automatic else None

    def granted(cur: int, emitted: int) -> int:
        k = granted_drafts(k_choice, cur, max_len)
        return k if fixed_shapes else min(k, max_new_tokens - emitted - 1)

    prof.tic()
    tok, feat = spec.prefill(prompt, pos[:n], kv_len=n)  # (1,), (1, n, H)
    out = [int(tok)]
    stats["target_forwards"] += 1
    if max_new_tokens == 1 or out[-1] in stop_ids:
        prof.toc("prefill", syncs=1)
        return out
    anchor = tok.view(1, 1)
    first, boundary = drafter.prefill_prompt(torch.cat([prompt[:, 1:], anchor], dim=1), feat)
    prof.toc("prefill", first, syncs=1)
    cur = n + 1  # tokens so far, the anchor included
    k = granted(cur, len(out))
    prof.tic()
    drafts = drafter.chain_round(first, boundary, k) if k > 0 else anchor[:, :0]
    prof.toc("draft", drafts)
    while True:
        verify_ids, vfeat = spec.target_verify(torch.cat([anchor, drafts], dim=1),
                                               pos[cur - 1:cur + k], kv_len=cur + k)
        stats["target_forwards"] += 1
        vd = torch.cat([verify_ids, drafts], dim=1)[0].tolist()  # one host sync per round
        v, d = vd[:k + 1], vd[k + 1:]
        prof.toc("verify", syncs=1)
        a = 0
        while a < k and d[a] == v[a]:
            a += 1
        spec.target.truncate_cache(spec.target_cache, cur + a)
        if automatic and k > 0:
            auto.record(k, a)
        # Stats count what could be emitted: drafts past max_new_tokens (fixed shapes) are not.
        k_used = min(k, max_new_tokens - len(out) - 1)
        a_used = min(a, k_used)
        if k_used > 0:
            record_round(stats, k_used, a_used, k_used)
            if automatic and stats["rounds"] % REPICK_EVERY == 0:
                k_choice = stats["num_draft_tokens"] = auto.choose()
        if emit(out, d[:a] + [v[a]], stop_ids, max_new_tokens):
            break
        anchor = verify_ids[:, a:a + 1]
        start, cur = cur - 1, cur + a + 1
        k_next = granted(cur, len(out))
        prof.tic()
        if k_next > 0:  # once no draft is granted none ever is again: the draft cache can stop
            drafts = drafter.chain_after_verify(drafts, a, anchor, vfeat, start, k_next, rebuild_rows)
        else:
            drafts = anchor[:, :0]
        k = k_next
        prof.toc("draft", drafts)
    return out
