"""One speculative round over a batch of requests: the engine's transaction.

    plan_drafts    DraftPlan    which requests draft, K (the same for the batch)
    draft          DraftResult  each row's K drafts (d1 from its last catch-up, K-1 batched steps)
    plan_verify    VerifyPlan   [anchor, d1..dK] per row at its own position
    verify         VerifyResult one batched target forward: logits, taps
    commit         per row: accept a prefix (greedy: leading matches; sampling rows: plain), emit,
                   advance the target length past the accepted tokens (the rejected tail is rolled
                   back by not advancing: its slots are overwritten later), queue the accepted
                   tokens and their taps for the draft's next catch-up

The draft catch-up (`catch_up`) teacher-forces each row's pending tokens with their
target features into the draft cache (pegainfer's rebuild_after_verify); its last
output is the next round's d1. K = 0 is a plain batched decoding step. Every tensor
keeps the batch dimension; rows are ragged only in how many of their tokens count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decoding.chain import emit
from ..targets.decoder import slots_upto
from .kv import PagedKV, PagePool, batch_layout, read_table
from .request import Request


class BatchRunner:
    """Batched target and draft forwards over the engine's page pool."""

    def __init__(self, spec, pool: PagePool, speculate: bool) -> None:
        self.spec, self.pool = spec, pool
        self.target, self.draft = spec.target, (spec.draft if speculate else None)
        cfg = self.target.config
        w = self.target.embedding_weight
        self.max_len = cfg.max_seq_len
        self.tkv = PagedKV(cfg.num_hidden_layers, pool.total_tokens, cfg.num_key_value_heads,
                           cfg.head_dim, dtype=w.dtype, device=w.device)
        self._table, self._table_key = None, None
        self.dkv = None
        if self.draft is not None:
            dc = self.draft.config
            self.dkv = PagedKV(1, pool.total_tokens, dc.num_key_value_heads, dc.head_dim,
                               dtype=self.draft.fc.weight.dtype, device=w.device)

    def layout(self, rids: list[str], starts: list[int], counts: list[int] | None, T: int):
        """`batch_layout` over a read table cached until the rows or their pages change."""
        key = (tuple(rids), self.pool.version)
        if self._table_key != key:
            self._table, self._table_key = read_table(self.pool, rids), key
        return batch_layout(self._table, self.pool.trash, starts, counts, T, self.max_len)

    @torch.no_grad()
    def target_forward(self, rids: list[str], starts: list[int], tokens: torch.Tensor,
                       counts: list[int] | None = None,
                       last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens (B, T) at positions starts[b].. -> logits (B, T|1, V), raw taps (B, T, n*H) or None."""
        write, read, pos, mask = self.layout(rids, starts, counts, tokens.shape[1])
        self.tkv.prepare(read)
        return self.target.forward_logits_taps(
            tokens, write, self.tkv, attn_mask=mask, rope_pos=pos, key_slots=slots_upto(read.shape[1]),
            with_taps=self.draft is not None, last_only=last_only)

    @torch.no_grad()
    def draft_forward(self, rids: list[str], starts: list[int], tokens: torch.Tensor,
                      feature: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (B, T) with features (B, T, H) -> draft greedy target ids (B, T), features (B, T, H)."""
        write, read, pos, mask = self.layout(rids, starts, counts, tokens.shape[1])
        self.dkv.prepare(read)
        logits, h = self.draft(tokens, feature, write, self.dkv, attn_mask=mask, rope_pos=pos,
                               key_slots=slots_upto(read.shape[1]))
        return self.draft.to_target_ids(logits.argmax(-1)), h

    def catch_up(self, reqs: list[Request], k: int) -> None:
        """Feed each request's pending tokens + fused taps to the draft; sets first_draft / boundary.

        Rows whose backlog exceeds a round's k+1 tokens (after plain rounds) catch up on their
        own, so the batch is not padded to the longest backlog.
        """
        rows = [r for r in reqs if r.pending_ids]
        for r in [r for r in rows if len(r.pending_ids) > k + 1]:
            self.catch_up_rows([r])
        rows = [r for r in rows if r.pending_ids]
        if rows:
            self.catch_up_rows(rows)

    def catch_up_rows(self, rows: list[Request]) -> None:
        """One batched draft forward over these rows' whole backlogs (padded to the longest)."""
        counts = [len(r.pending_ids) for r in rows]
        T = max(counts)
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        taps = []
        for b, r in enumerate(rows):
            tokens[b, :counts[b]] = torch.tensor(r.pending_ids)
            t = torch.cat(r.pending_feats) if len(r.pending_feats) > 1 else r.pending_feats[0]
            taps.append(torch.cat([t, t[-1:].expand(T - t.shape[0], -1)]) if t.shape[0] < T else t)
        feature = self.draft.fuse(torch.stack(taps))  # (B, T, H)
        ids, h = self.draft_forward([r.id for r in rows], [r.draft_len for r in rows], tokens, feature,
                                    counts)
        last = torch.tensor(counts) - 1
        rows_idx = torch.arange(len(rows))
        firsts = ids[rows_idx, last].tolist()
        bounds = h[rows_idx, last]  # (B, H)
        for b, r in enumerate(rows):
            r.first_draft, r.boundary = firsts[b], bounds[b]
            r.draft_len += counts[b]
            r.pending_ids, r.pending_feats = [], []


@dataclass
class DraftPlan:
    reqs: list[Request]
    k: int  # drafts per row (0: a plain decoding step)


@dataclass
class DraftResult:
    drafts: torch.Tensor  # (B, k) target ids


@dataclass
class VerifyPlan:
    tokens: torch.Tensor  # (B, k+1): anchor then drafts
    starts: list[int]  # each row's anchor position


@dataclass
class VerifyResult:
    logits: torch.Tensor  # (B, k+1, V)
    taps: torch.Tensor | None  # (B, k+1, n*H) raw target taps, None without a head


def draft(runner: BatchRunner, plan: DraftPlan) -> DraftResult:
    """Each greedy row's d1 (from its catch-up) and k-1 batched draft steps after it.

    Sampled rows do not draft (they decode plainly): their k "drafts" repeat the anchor.
    """
    reqs, k = plan.reqs, plan.k
    out = torch.tensor([[r.anchor] * k for r in reqs], dtype=torch.long).view(len(reqs), k)  # (B, k)
    rows = [b for b, r in enumerate(reqs) if r.sampler is None]
    if k == 0 or not rows:
        return DraftResult(out)
    drafting = [reqs[b] for b in rows]
    runner.catch_up(drafting, k)
    drafts = [torch.tensor([r.first_draft for r in drafting])]  # (G,)
    feature = torch.stack([r.boundary for r in drafting])[:, None]  # (G, 1, H)
    rids = [r.id for r in drafting]
    for i in range(k - 1):  # speculative draft slots after each row's committed ones
        ids, feature = runner.draft_forward(rids, [r.draft_len + i for r in drafting], drafts[-1][:, None],
                                            feature, None)
        drafts.append(ids[:, 0])
    out[rows] = torch.stack(drafts, dim=1)
    return DraftResult(out)


def plan_verify(plan: DraftPlan, result: DraftResult) -> VerifyPlan:
    anchors = torch.tensor([[r.anchor] for r in plan.reqs])  # (B, 1)
    return VerifyPlan(torch.cat([anchors, result.drafts], dim=1), [r.target_len for r in plan.reqs])


def reserve(runner: BatchRunner, plan: DraftPlan) -> None:
    """Pages for the round's k+1 target positions (the draft's fit inside), all or none per request."""
    for r in plan.reqs:
        runner.pool.grow(r.id, min(r.target_len + plan.k + 1, runner.max_len))


def verify(runner: BatchRunner, plan: DraftPlan, vplan: VerifyPlan) -> VerifyResult:
    logits, taps = runner.target_forward([r.id for r in plan.reqs], vplan.starts, vplan.tokens)
    return VerifyResult(logits, taps)


@dataclass
class Committed:
    """One row's outcome: the tokens it emitted, whether it is done, its drafts counted and accepted,
    or the error that failed this row alone (its state is then left as it was)."""
    req: Request
    new: list[int]
    done: bool
    drafted: int = 0
    accepted: int = 0
    error: str | None = None


def commit(runner: BatchRunner, plan: DraftPlan, drafts: DraftResult,
           result: VerifyResult) -> list[Committed]:
    """Accept, emit and advance every row (a row whose own handling raises fails alone)."""
    greedy_ids = result.logits.argmax(-1)  # (B, k+1)
    host = torch.cat([greedy_ids, drafts.drafts], dim=1).tolist()  # one host sync for the batch
    out = []
    for b, r in enumerate(plan.reqs):
        try:
            out.append(_commit_row(plan.k, b, r, host[b], result))
        except Exception as e:
            out.append(Committed(r, [], True, error=f"{type(e).__name__}: {e}"))
    return out


def _commit_row(k: int, b: int, r: Request, host_row: list[int], result: VerifyResult) -> Committed:
    v, d = host_row[:k + 1], host_row[k + 1:]
    room = r.max_tokens - len(r.token_ids)
    k_used = a_used = 0
    if r.sampler is None:
        a = 0
        while a < k and d[a] == v[a]:
            a += 1
        tokens = d[:a] + [v[a]]
        k_used = min(k, room - 1)
        if k_used > 0:
            a_used = min(a, k_used)
            r.num_drafts += 1
            r.num_draft_tokens += k_used
            r.num_accepted += a_used
            r.accept_len_hist[a_used] += 1
            for i in range(a_used):
                r.accepted_per_pos[i] += 1
    else:  # sampled rows decode plainly: one token from the target's distribution
        a = 0
        tokens = [int(r.sampler.sample(r.sampler.probs(result.logits[b, 0])))]
    new: list[int] = []
    done = emit(new, tokens, r.stop_ids, room)
    r.token_ids.extend(new)
    r.target_len += a + 1  # anchor + accepted drafts now have K/V
    if result.taps is not None and r.sampler is None and not done:  # sampled rows never draft
        r.pending_ids.extend(tokens)
        r.pending_feats.append(result.taps[b, :a + 1])
    return Committed(r, new, done or len(r.token_ids) >= r.max_tokens, k_used, a_used)


def run_round(runner: BatchRunner, reqs: list[Request], k: int) -> list[Committed]:
    """The whole transaction for one round."""
    plan = DraftPlan(reqs, k)
    reserve(runner, plan)
    drafts = draft(runner, plan)
    vplan = plan_verify(plan, drafts)
    return commit(runner, plan, drafts, verify(runner, plan, vplan))
