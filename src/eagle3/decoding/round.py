"""One speculative round over a batch of sequences: the only decoding loop body in eagle3.

`generate` runs it at batch 1 on a `StaticRunner`; the engine runs it over its
page pool (`engine.paged.PagedRunner`). A sequence's anchor (its last token, emitted
but not yet in the target cache) sits at position P = `target_len`; the draft cache
holds positions 0..P-1, its last output (`root` logits, `boundary` feature) predicts
the token after the anchor. A round with `Plan(k, tree)`:

    draft      per group of rows sharing a proposer and a plan, its `Proposal`s
               (`decoding.proposers`). The head's, through the runner's `draft_chain` /
               `draft_tree` (`decoding.drafting`): teacher-force each row's pending tokens
               with their target taps' features into the draft (its new root and
               boundary), then k chain drafts (argmax, or sampled from the draft's q for
               sampled rows), or a dynamic tree (`decoding.tree.expand_tree`); the text's,
               chains of earlier matches, alone or grafted onto the head's nodes. How the
               runner runs them (eager, or fused compiled graphs) is its own affair
    verify     one target forward over [anchor, nodes] per row, ancestor masks, RoPE
               positions P + depth
    accept     `decoding.accept.accept`: greedy path, or speculative / recursive-rejection
               sampling: a `Verdict` (accepted path, next token)
    commit     the accepted nodes' target K/V to contiguous positions (trees only), the
               target length past them, tokens emitted up to a stop id or max_new_tokens,
               the accepted path's taps queued for the next catch-up, stats; the row's
               proposer observes its verdict

The corrected/bonus token never gets a target forward of its own: it is the next
round's anchor, so a round costs one target forward. Capacity: a row
verifies at most min(nodes, max_len - P - 2) nodes, so its commit always fits; at 0
the round is a plain decoding step for that row, and `Plan()` (no drafts) is plain
decoding. Host synchronisations: one per round for greedy rows (verify ids, drafts
and parents in one `.tolist()`), more for sampled rows.
"""

from __future__ import annotations

import torch

from ..errors import brief
from ..kernels import argmax
from ..targets.cache import slots_upto
from .accept import accept
from .layout import Layout, causal_layout
from .profile import active
from .proposers import propose_round
from .runner import Runner
from .types import Plan, Proposal, SequenceState, Verdict


def emit(out: list[int], tokens: list[int], stop_ids: frozenset[int], max_new_tokens: int) -> bool:
    """Append `tokens` to `out` up to the first stop id or max_new_tokens; True when done."""
    for t in tokens:
        out.append(t)
        if t in stop_ids or len(out) >= max_new_tokens:
            return True
    return False


def grant(seq: SequenceState, plan: Plan, max_len: int) -> int:
    """Draft nodes this row may verify this round (0: it decodes plainly): a chain no more than
    it may still emit past the next token, and the commit (<= nodes + 1 tokens) must fit the
    cache."""
    if not plan.drafts or not seq.drafts or seq.root is None and not seq.pending_ids:
        return 0
    fits = max_len - seq.target_len - 2
    if plan.tree is not None:
        return max(0, min(plan.tree.total_tokens, fits))
    return max(0, min(plan.k, fits, seq.room() - 1))


def usual_catch_up(seq: SequenceState, plan: Plan) -> bool:
    """Whether a round of `plan` catches this row's draft up over no more than a drafting round
    leaves behind (the accepted path and the next token: K + 1, a tree's depth + 1), so its time
    is the plan's usual one: not the first (the whole prompt) nor the first after plain rounds
    (their tokens), which the cost model's correction must not learn as the plan's cost."""
    if not plan.drafts or not seq.drafts:
        return True
    most = (plan.tree.depth if plan.tree is not None else plan.k) + 1
    return seq.draft_len > 0 and len(seq.pending_ids) <= most


def draft_span(plan: Plan) -> int:
    """Draft positions past the anchor a round writes (speculative slots, overwritten later)."""
    if plan.tree is not None:
        return plan.tree.top_k * (min(plan.tree.depth, plan.tree.total_tokens) - 1)
    return max(plan.k - 1, 0)


# -- the steps ------------------------------------------------------------------------------------
@torch.no_grad()
def prefill(runner: Runner, seq: SequenceState) -> int:
    """The prompt's target forward: the first token; the prompt is queued for the draft, whose
    catch-up waits for the row's first drafting round (a row that only ever decodes plainly, as
    rows of a full batch often do, never pays for it)."""
    prof = active()
    prof.tic()
    n = len(seq.prompt)
    runner.reserve(seq, n)
    prompt = torch.tensor([seq.prompt], device=runner.device)
    drafts = runner.has_draft and seq.drafts and seq.max_new_tokens > 1
    # prefill: the same call in plain and speculative decoding, so it may take stock kernels
    logits, feats = runner.target([seq], prompt, causal_layout([0], n, device=runner.device),
                                   with_features=drafts, last_only=True, prefill=True)
    row = logits[0, -1]
    first = int(argmax(row) if seq.sampler is None else seq.sampler.sample(seq.sampler.probs(row)))
    seq.stats.target_forwards += 1
    seq.target_len = n
    seq.done = emit(seq.out, [first], seq.stop_ids, seq.max_new_tokens)
    if drafts and not seq.done:
        seq.pending_ids, seq.pending_feats = [*seq.prompt[1:], first], [feats[0]]
    prof.toc("prefill", logits, syncs=1)
    return first


def verify(runner: Runner, seqs: list[SequenceState],
           proposals: list[Proposal]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One target forward over [anchor, the row's nodes] per row: logits (B, T, V), taps,
    and the verified tokens (B, T). Rows that do not draft verify their anchor alone."""
    dev = runner.device
    B = len(seqs)
    T = 1 + max((max(p.counts) for p in proposals), default=0)
    tokens = torch.tensor([[s.anchor] * T for s in seqs], device=dev)
    counts = [1] * B
    region = rope = None
    if any(p.tree for p in proposals):  # ancestor masks and depths; chains are causal
        ar = slots_upto(T, dev)
        region = (ar[None, :] <= ar[:, None])[None].repeat(B, 1, 1)  # (B, T, T)
        rope = ar[None].repeat(B, 1)
    for p in proposals:
        idx = torch.tensor(p.rows, device=dev)
        n = min(T - 1, p.tokens.shape[1])
        tokens[idx, 1:n + 1] = p.tokens[:, :n]
        for g, b in enumerate(p.rows):
            counts[b] = p.counts[g] + 1
        if region is not None:
            region[idx, :n + 1, :n + 1] = p.mask[:, :n + 1, :n + 1]
            rope[idx, :n + 1] = p.depth[:, :n + 1]
    layout = Layout([s.target_len for s in seqs], slots_upto(T, dev), region=region, rope=rope,
                    region_pos=rope, counts=counts if B > 1 else None)
    with_features = runner.has_draft and any(s.drafts for s in seqs)
    logits, feats = runner.target(seqs, tokens, layout, with_features=with_features)
    return logits, feats, tokens


def commit(runner: Runner, seq: SequenceState, verdict: Verdict, feats: torch.Tensor | None,
           b: int) -> None:
    """Advance one row past its verdict (see the module docstring); fills `verdict.new`."""
    P = seq.target_len
    path = verdict.path
    a = len(path)
    contiguous = path == list(range(1, a + 1))  # a chain's path: nodes 1..a
    if not contiguous:  # accepted nodes' K/V to contiguous positions
        runner.compact(seq, [P + j for j in path], P + 1)
    seq.target_len = P + a + 1
    room = seq.room() - 1
    depths = verdict.depths
    if depths and room > 0:  # stats count what could be emitted: nodes past max_new_tokens are not
        verdict.drafted = sum(d <= room for d in depths)
        verdict.accepted = min(a, room)
        head = verdict.head_nodes
        seq.stats.record(verdict.drafted, verdict.accepted, min(max(depths), room),
                         sum(d <= room for d in depths[head:]),
                         sum(j > head for j in path[:verdict.accepted]))
    seq.stats.target_forwards += 1
    emitted = verdict.tokens
    new_start = len(seq.out)
    seq.done = emit(seq.out, emitted, seq.stop_ids, seq.max_new_tokens)
    verdict.new = seq.out[new_start:]
    verdict.done = seq.done
    if seq.proposer is not None:
        seq.proposer.observe(seq, verdict)
    if feats is not None and seq.drafts and not seq.done:
        seq.pending_ids.extend(emitted)
        seq.pending_feats.append(feats[b, :a + 1] if contiguous else feats[b, [0, *path]])


@torch.no_grad()
def run_round(runner: Runner, seqs: list[SequenceState], plan: Plan) -> list[Verdict]:
    """The whole transaction for one round over `seqs` (none of them done): each row drafts by
    its own plan when it has one, else by `plan`; rows of one plan draft together, all verify
    in one target forward."""
    prof = active()
    prof.tic()
    plans = [s.plan or plan for s in seqs]
    grants = [grant(s, p, runner.max_len) for s, p in zip(seqs, plans, strict=True)]
    for s, p, n in zip(seqs, plans, grants, strict=True):  # pages for the round's writes
        extra = s.proposer.nodes(s, runner.max_len, n) if s.proposer is not None else 0
        runner.reserve(s, s.target_len + (max(n + 1 + extra, draft_span(p)) if n else 1 + extra))
    proposals = propose_round(runner, seqs, plans, grants)  # each proposer in its own way
    if proposals:
        prof.toc("draft", proposals[-1].tokens)
    logits, feats, tokens = verify(runner, seqs, proposals)
    verdicts = accept(seqs, logits, tokens, proposals)
    prof.toc("verify", syncs=1)
    for b, (s, v) in enumerate(zip(seqs, verdicts, strict=True)):
        if v.error is not None:
            continue
        try:
            commit(runner, s, v, feats, b)
        except Exception as e:  # this row's own handling failed: it alone fails
            v.error = brief(e)
    return verdicts
