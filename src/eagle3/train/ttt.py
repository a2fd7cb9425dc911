"""Training-time test (TTT): unroll the draft head as it runs at inference.

Row t of a sequence x_0..x_{T-1} is a chain that starts at draft slot t:
step 0 sees (x_{t+1}, fc(taps_t)) at position t and predicts x_{t+2}; step i
sees (x_{t+1+i}, h^{i-1}_t), its own previous output, at position t+i and
predicts x_{t+2+i}. Attention matches inference exactly: step i of row t
attends to the teacher-forced step-0 keys of slots 0..t plus the keys its own
chain wrote at steps 1..i (slots t+1..t+i at inference). Loss at step i: soft
cross-entropy to the target's next-token distribution restricted to the draft
vocabulary, weighted 0.8^i and by the loss mask of the predicted token. With
`hard` > 0 a share of it is the plain cross-entropy to the token the sequence
holds there instead (on greedily regenerated data: the target's own greedy pick,
the draft that a greedy round accepts), on the rows where that token is in the
draft vocabulary (elsewhere no draft can be right, and the soft part alone
teaches the head the target's distribution).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..draft.model import Eagle3Draft
from ..targets.decoder import rotate_half

CHUNK_ROWS = 256  # rows per logits chunk (loss, drafts): 8 MB of float32 at 8,192 draft ids


def _shift(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[:, by:] left-aligned and right-padded to the same length."""
    if by == 0:
        return x
    pad = x.new_full((x.shape[0], by) + tuple(x.shape[2:]), fill)
    return torch.cat([x[:, by:], pad], dim=1)


def chain_rows(mask: torch.Tensor, steps: int) -> torch.Tensor | None:
    """The rows whose chains some step's loss reads, packed: (B, N) slot indices, ascending,
    or None where that is every row. Row t carries loss at step i when token t+2+i does;
    on chat data the prompt's rows carry none (~57% of the campaign's rows), and only their
    step-0 keys are read (by later rows). Each sequence's needed rows come first, then
    unneeded ones pad it to the batch's widest, so the slots stay distinct."""
    B, T = mask.shape
    R = T - 1
    need = torch.zeros(B, R, dtype=torch.bool, device=mask.device)
    for i in range(steps):
        need |= _shift(mask[:, 1:], 1 + i, False)  # [t] = mask[t+2+i]
    N = int(need.sum(1).max())
    if N == R:
        return None
    t = torch.arange(R, device=mask.device)
    order = torch.where(need, t, t + R).argsort(dim=1)  # needed rows first, each part ascending
    return order[:, :N].sort(dim=1).values


def unroll(head: Eagle3Draft, tokens: torch.Tensor, taps: torch.Tensor, steps: int,
           rows: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """The head's features h of TTT steps 0..steps-1, (B, N, H) each.

    tokens (B, T), taps (B, T, 3Ht) from the frozen target. Row t of step i is the chain from
    draft slot t after i steps (see the module docstring). `rows` (B, N) from `chain_rows`:
    those chains alone are run (every row's step-0 keys and values still are: later rows
    attend to them); None: all R = T-1 rows, N = R. The caller reads each step's logits from
    h, on the rows it needs."""
    B, T = tokens.shape
    R = T - 1  # rows: slot t pairs token t+1 with feature t
    layer, attn = head.midlayer, head.midlayer.self_attn
    nh, nkv, hd = attn.n_heads, attn.n_kv, attn.hd
    slots = torch.arange(R, device=tokens.device)
    if rows is None:
        causal = torch.ones(R, R, dtype=torch.bool, device=tokens.device).tril()  # (R, R)
    else:
        causal = (slots[None, None, :] <= rows[:, :, None])[:, None]  # (B, 1, N, R)
    N = R if rows is None else rows.shape[1]

    def pick(x: torch.Tensor) -> torch.Tensor:  # (B, R, D) -> (B, N, D), the chains run
        return x if rows is None else x.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))

    scale = hd ** -0.5

    def rope(x: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # x (B, heads, N|R, hd)
        cos, sin = head.rope(pos.clamp_max(head.max_len - 1), dtype)
        if pos.dim() == 2:  # per-chain positions (B, N): (B, 1, N, hd)
            cos, sin = cos[:, None], sin[:, None]
        return x * cos + rotate_half(x) * sin

    g = head.fuse(taps[:, :R])  # (B, R, H)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i in range(steps):
        step_tokens = _shift(tokens[:, 1:], i)  # (B, R): x_{t+1+i}
        if i > 0 and rows is not None:
            step_tokens = step_tokens.gather(1, rows)  # (B, N)
        pos = (slots if rows is None else rows) + i  # step i's chain positions: (R,) or (B, N)
        dtype = g.dtype  # the previous step's features' (the rotation's dtype, as inference's)
        a, residual = layer.mix(head.embed_tokens(step_tokens), g)  # g: (B, R|N, H)
        if i == 0:  # every row's keys: the teacher-forced prefix the chains attend to
            k = rope(attn.k_proj(a).view(B, R, nkv, hd).transpose(1, 2), slots, dtype)
            v = attn.v_proj(a).view(B, R, nkv, hd).transpose(1, 2)
            a, residual = pick(a), pick(residual)
        else:
            k = rope(attn.k_proj(a).view(B, N, nkv, hd).transpose(1, 2), pos, dtype)
            v = attn.v_proj(a).view(B, N, nkv, hd).transpose(1, 2)
        q = rope(attn.q_proj(a).view(B, N, nh, hd).transpose(1, 2), pos, dtype)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)  # (B, nh, ., hd)
        keys.append(k)
        values.append(v)
        s0 = (q @ keys[0].transpose(-1, -2)) * scale  # (B, nh, N, R): teacher-forced prefix
        s0 = s0.masked_fill(~causal, float("-inf"))
        diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]  # own chain
        w = torch.softmax(torch.cat([s0] + diag, dim=-1), dim=-1)
        out = w[..., :R] @ values[0]
        for j, vj in enumerate(values[1:]):
            out = out + w[..., R + j:R + j + 1] * vj
        out = out.transpose(1, 2).reshape(B, N, nh * hd)
        g = layer.finish(residual, attn.o_proj(out))  # (B, N, H)
        yield g


@torch.no_grad()
def ttt_drafts(head: Eagle3Draft, tokens: torch.Tensor, taps: torch.Tensor, steps: int) -> torch.Tensor:
    """The head's greedy draft (a draft-vocabulary id) of every row at every TTT step:
    (steps, B, T-1); [i, b, t] is step i of row t. The logits are read in chunks of rows and
    never kept whole (at 6 steps of a batch of 8 they would be ~700 MB)."""
    B, R = tokens.shape[0], tokens.shape[1] - 1
    out = []
    for h in unroll(head, tokens, taps, steps):
        rows = h.reshape(B * R, -1)
        out.append(torch.cat([head.lm_head(head.norm(c)).max(-1).indices
                              for c in rows.split(CHUNK_ROWS)]).view(B, R))
    return torch.stack(out)


def ttt_loss(head: Eagle3Draft, tokens: torch.Tensor, mask: torch.Tensor, taps: torch.Tensor,
             target_logits: torch.Tensor, steps: int = 7, decay: float = 0.8,
             norm: float | None = None, return_logits: bool = False,
             hard: float = 0.0) -> tuple[torch.Tensor, ...]:
    """(loss, correct (steps,), counted (steps,)) for one batch.

    tokens (B, T), mask (B, T) bool (loss on these tokens as predictions),
    taps (B, T, 3Ht) and target_logits from the frozen target, over its whole vocabulary
    (B, T, V) or already over the draft vocabulary (B, T, draft_vocab). The
    loss is a sum over weighted positions divided by `norm` (default: the
    number of step-0 positions), so data-parallel ranks can share one norm.
    With `return_logits`, a fourth element holds the draft logits of every
    step, (steps, B, T-1, draft_vocab): [i, b, t] is step i of row t.
    """
    B, T = tokens.shape
    R = T - 1
    ids = head.vocab_ids()  # (dv,)
    if target_logits.shape[-1] != head.config.draft_vocab_size:
        target_logits = target_logits[..., ids]
    target_p = torch.softmax(target_logits.float(), dim=-1)  # (B, T, dv)
    # max(-1) rather than argmax: faster on these rows, the same first index (docs/training.md)
    target_top = target_p.max(-1).indices  # (B, T)
    if hard:  # each token's draft id, -1 outside the draft vocabulary
        to_draft = torch.full((head.t2d.numel(),), -1, dtype=torch.long, device=tokens.device)
        to_draft[ids] = torch.arange(ids.numel(), device=tokens.device)
        token_draft = to_draft[tokens]  # (B, T)
    # Every (row b, slot t) of the batch, flattened: (B*R,) each.
    b_idx, t_idx = [x.reshape(-1) for x in torch.meshgrid(
        torch.arange(B, device=tokens.device), torch.arange(R, device=tokens.device), indexing="ij")]
    total = tokens.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(steps)
    counted = torch.zeros(steps)
    all_logits = []
    if norm is None:
        norm = float(mask[:, 2:].sum().clamp_min(1))
    # The chains some loss reads (None: all, and always so for `return_logits`).
    chains = None if return_logits else chain_rows(mask, steps)  # (B, N)
    if chains is not None:  # slot t of sequence b -> its place in the packed chains
        place = torch.full((B, R), -1, dtype=torch.long, device=tokens.device)
        place.scatter_(1, chains, torch.arange(chains.shape[1], device=tokens.device).expand_as(chains))
    for i, h in enumerate(unroll(head, tokens, taps, steps, chains)):
        # Rows whose prediction carries loss: logits only there (prompt rows feed the chain but
        # predict nothing worth learning), the lm_head being most of a step's work.
        rows = (t_idx + 2 + i < T) & mask[b_idx, (t_idx + 2 + i).clamp_max(T - 1)]  # (B*R,)
        bi, ti = b_idx[rows], t_idx[rows]
        hi = ti if chains is None else place[bi, ti]  # (rows,) into h's second axis
        if return_logits:
            full = head.lm_head(head.norm(h))  # (B, R, dv)
            all_logits.append(full.detach())
        # In chunks of rows, so that no (rows, dv) float32 temporary outgrows glibc's mmap
        # threshold (32 MB at most): a larger one is a fresh mapping each time, its pages
        # faulting in on first touch, which slowed the loss (docs/training.md).
        for c in torch.split(torch.arange(bi.numel(), device=tokens.device), CHUNK_ROWS):
            cb, ct = bi[c], ti[c]
            logits = full[cb, ct] if return_logits else head.lm_head(head.norm(h[cb, hi[c]]))  # (c, dv)
            # Soft cross-entropy to the target's distribution at position t+1+i.
            ce = F.cross_entropy(logits.float(), target_p[cb, ct + 1 + i], reduction="sum")
            if hard:
                label = token_draft[cb, ct + 2 + i]  # the token the sequence holds at t+2+i
                inside = label >= 0
                ce = (1 - hard) * ce + hard * F.cross_entropy(logits[inside].float(), label[inside],
                                                              reduction="sum")
            total = total + (decay ** i) * ce / norm
            with torch.no_grad():
                correct[i] += (logits.max(-1).indices == target_top[cb, ct + 1 + i]).sum()
        counted[i] = rows.sum()
    if return_logits:
        return total, correct, counted, torch.stack(all_logits)
    return total, correct, counted
