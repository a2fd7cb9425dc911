"""Speculation checked against oracles that share nothing with the path under test.

- transformers computes the context target's greedy continuation itself (its own modules,
  no cache, no kernel of ours); eagle3's speculative chains, trees and engine batches on the
  float32 target must produce exactly those tokens.
- The engine's batched verify (paged K/V, ragged rows, tree masks) must give every row the
  logits a lone 1-row decode of that row's prefix gives, bit for bit, in each weight format
  (the row-invariant kernels promise it; a batch- or page-dependent row would break it).
"""

from __future__ import annotations

import pytest
import torch

import eagle3
from eagle3.draft import attach_head
from eagle3.engine import Engine, EngineConfig
from eagle3.speculator import Eagle3Speculator
from heads import random_prompts as prompts
from heads import save_context_target, scripted_head

N = 28


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return save_context_target(str(tmp_path_factory.mktemp("oracles") / "ctx"))


@torch.no_grad()
def transformers_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by transformers alone (a full forward per token), with each step's
    margin checked: a near-tie would make any float path's choice a coin toss."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1].double()
        top = logits.topk(2).values
        assert top[0] - top[1] > 1e-3, "a near-tie on the oracle's path; pick another prompt seed"
        seq.append(int(logits.argmax()))
    return seq[len(prompt):]


def test_speculation_equals_transformers_greedy(ctx):
    ps = prompts(3, seed=1)
    want = [transformers_greedy(ctx, p, N) for p in ps]
    spec = eagle3.load(ctx, "none", quantize="fp32")
    t = spec.target
    head = scripted_head(t, ps, N, "mixed")
    attach_head(head, t)
    spec = Eagle3Speculator(t, head)
    for kw in (dict(num_draft_tokens=1), dict(num_draft_tokens=2), dict(num_draft_tokens=4),
               dict(tree=dict(top_k=2, depth=4, total_tokens=8)), {}):
        got = [spec.generate(p, N, stop_token_ids=[], **kw) for p in ps]
        assert [g.token_ids for g in got] == want, kw
        if kw:  # (automatic K may choose plain rounds on a model this small)
            assert sum(g.stats["accepted_tokens"] for g in got) > 0, kw  # drafts were accepted
    engine = Engine(spec, EngineConfig(max_batch=3, num_draft_tokens=3)).start(background=False)
    reqs = [engine.submit(p, N, stop_token_ids=[]) for p in ps]
    engine.run_until_idle()
    assert [r.token_ids for r in reqs] == want


def one_row_logits(target, prompt: list[int], prefix: list[int]) -> torch.Tensor:
    """The logits a lone sequence gets for the last token of `prefix` (which starts with
    `prompt`): the prompt's forward alone (as generate runs it: stock float kernels, see
    `forward_logits_taps(prefill=True)`), then one 1-row decode step per later token."""
    cache = target.new_cache(1, len(prefix) + 1)
    n = len(prompt)
    with torch.no_grad():
        logits, _ = target.forward_logits_taps(torch.tensor([prompt]), torch.arange(n), cache,
                                               kv_len=n, with_taps=False, prefill=True)
        for i in range(n, len(prefix)):
            logits, _ = target.forward_logits_taps(torch.tensor([prefix[i:i + 1]]), torch.tensor([i]),
                                                   cache, kv_len=i + 1, with_taps=False)
    return logits[0, -1]


def row_prefixes(full: list[int], start: int, tokens: torch.Tensor, layout, b: int) -> list[list[int]]:
    """Each valid row's token sequence (the row's own token last), from the layout."""
    count = tokens.shape[1] if layout.counts is None else layout.counts[b]
    if layout.region is None:  # a chain: row t follows rows 0..t-1
        return [full[:start] + tokens[b, :t + 1].tolist() for t in range(count)]
    out = []
    offsets = layout.offsets.tolist()
    rope = layout.rope[b] if layout.rope is not None else layout.offsets
    for t in range(count):  # a tree node: the rows its mask shows, in position order
        seen = [j for j in range(count) if bool(layout.region[b, t, offsets[j]])]
        out.append(full[:start] + [int(tokens[b, j]) for j in sorted(seen, key=lambda j: int(rope[j]))])
    return out


@pytest.mark.parametrize("quantize", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("plan", ["chain", "tree"])
def test_engine_batched_verify_rows_equal_one_row_decodes(ctx, quantize, plan):
    t = eagle3.load(ctx, "none", quantize=quantize).target
    assert t.exact
    ps = prompts(4, seed=2)
    head = scripted_head(t, ps, 20, "mixed")
    attach_head(head, t)
    spec = Eagle3Speculator(t, head)
    config = (EngineConfig(max_batch=4, num_draft_tokens=3) if plan == "chain" else
              EngineConfig(max_batch=4, tree=dict(top_k=2, depth=3, total_tokens=6), auto_plan=False))
    engine = Engine(spec, config).start(background=False)
    calls = []
    real = engine.runner.target

    def target(seqs, tokens, layout, **kw):
        logits, feats = real(seqs, tokens, layout, **kw)
        if logits.shape[1] == tokens.shape[1] > 1:  # every row's logits: a verify
            calls.append(([(s.prompt, s.prompt + s.out) for s in seqs], tokens.clone(), layout,
                          logits.clone()))
        return logits, feats

    engine.runner.target = target
    reqs = [engine.submit(p, 12 + 2 * i, stop_token_ids=[]) for i, p in enumerate(ps)]  # ragged
    engine.run_until_idle()
    assert all(r.token_ids for r in reqs)
    rows = 0
    for fulls, tokens, layout, logits in calls:
        for b, (prompt, full) in enumerate(fulls):
            for t_, prefix in enumerate(row_prefixes(full, layout.starts[b], tokens, layout, b)):
                assert torch.equal(logits[b, t_], one_row_logits(t, prompt, prefix)), (quantize, plan, b, t_)
                rows += 1
    assert rows > 40 and len(calls) > 3 and any(len(f) > 1 for f, *_ in calls)
