"""Speculation checked against oracles that share nothing with the path under test.

- transformers computes the context targets' greedy continuations itself (its own modules,
  no cache, no kernel of ours); eagle3's speculative chains, trees and engine batches on the
  float32 targets must produce exactly those tokens, with drafts accepted.
- The engine's batched verify (paged K/V, ragged rows, tree masks) must give every row the
  logits a lone 1-row decode of that row's prefix gives, bit for bit, in each weight format
  (the row-invariant kernels promise it; a batch- or page-dependent row would break it). A
  row's prefix is rebuilt from its proposal's parents (the tokens the proposer drafted), not
  from the verify's mask, so a wrong ancestor set in the mask cannot reproduce itself.

Both run on the Llama context target and on windowed ones (Mistral-style, Gemma 2 and Gemma 3
with a window of 7), with prompts and outputs longer than the window.
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


WINDOWED = ("mistral", "gemma2", "gemma3")  # sliding window 7 (tests/conftest.py VARIANTS)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("oracles")
    return {name: save_context_target(str(root / name), name) for name in ("llama", *WINDOWED)}


def long_prompts(name: str, n: int, seed: int) -> list[list[int]]:
    """Windowed targets get prompts longer than their window (7)."""
    return prompts(n, seed=seed, low=9 if name in WINDOWED else 2)


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


@pytest.mark.parametrize("name", ["llama", *WINDOWED])
def test_speculation_equals_transformers_greedy(targets, name):
    ctx = targets[name]
    ps = long_prompts(name, 3, seed=1)
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
    assert sum(r.seq.stats.accepted_tokens for r in reqs) > 0


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


def row_prefixes(full: list[int], start: int, anchor: int, proposal, g: int) -> list[list[int]]:
    """Each verified row's token sequence (the row's own token last), from the proposal: row 0
    is the anchor, row j >= 1 node j, whose ancestors its parents name (0 = the anchor)."""
    if proposal is None:  # a row that did not draft verifies its anchor alone
        return [full[:start] + [anchor]]
    n = proposal.counts[g]
    toks, pars = proposal.tokens[g, :n].tolist(), proposal.parents[g, :n].tolist()
    out = [full[:start] + [anchor]]
    for j in range(1, n + 1):
        path = []
        while j:
            path.append(toks[j - 1])
            j = pars[j - 1]
        out.append(full[:start] + [anchor] + path[::-1])
    return out


CASES = [("llama", q) for q in ("fp32", "bf16", "int8", "int4")] + [(w, "int4") for w in WINDOWED]


@pytest.mark.parametrize("name,quantize", CASES, ids=[f"{n}-{q}" for n, q in CASES])
@pytest.mark.parametrize("plan", ["chain", "tree"])
def test_engine_batched_verify_rows_equal_one_row_decodes(targets, name, quantize, plan, monkeypatch):
    import eagle3.decoding.round as round_module

    t = eagle3.load(targets[name], "none", quantize=quantize).target
    assert t.exact
    ps = long_prompts(name, 4, seed=2)
    head = scripted_head(t, ps, 20, "mixed")
    attach_head(head, t)
    spec = Eagle3Speculator(t, head)
    config = (EngineConfig(max_batch=4, num_draft_tokens=3) if plan == "chain" else
              EngineConfig(max_batch=4, tree=dict(top_k=2, depth=3, total_tokens=6), auto_plan=False))
    engine = Engine(spec, config).start(background=False)
    proposed, calls = [], []
    real_propose = round_module.propose_round

    def propose(runner, seqs, *args):
        out = real_propose(runner, seqs, *args)
        proposed.append(out)
        return out

    monkeypatch.setattr(round_module, "propose_round", propose)
    real = engine.runner.target

    def target(seqs, tokens, layout, **kw):
        logits, feats = real(seqs, tokens, layout, **kw)
        if logits.shape[1] == tokens.shape[1] > 1:  # every row's logits: a verify
            by_row = {b: (p, g) for p in proposed[-1] for g, b in enumerate(p.rows)}
            calls.append(([(s.prompt, s.prompt + s.out, s.target_len, s.anchor, *by_row.get(b, (None, 0)))
                           for b, s in enumerate(seqs)], logits.clone()))
        return logits, feats

    engine.runner.target = target
    reqs = [engine.submit(p, 12 + 2 * i, stop_token_ids=[]) for i, p in enumerate(ps)]  # ragged
    engine.run_until_idle()
    assert all(r.token_ids for r in reqs)
    assert sum(r.seq.stats.accepted_tokens for r in reqs) > 0  # drafts decided some rows
    rows = 0
    for fulls, logits in calls:
        for b, (prompt, full, start, anchor, proposal, g) in enumerate(fulls):
            for t_, prefix in enumerate(row_prefixes(full, start, anchor, proposal, g)):
                want = one_row_logits(t, prompt, prefix)
                assert torch.equal(logits[b, t_], want), (name, quantize, plan, b, t_)
                rows += 1
    assert rows > 40 and len(calls) > 3 and any(len(f) > 1 for f, *_ in calls)
