"""Simulated acceptance (`train.simulate`): chains' acceptance read off the training-time-test
unroll on held-out sequences, checked on heads whose agreement with the target is known.

The target is tests/heads.py's context target and the sequences its own greedy runs; the
heads are scripted along those runs (right everywhere, only at the first draft, nowhere,
or after even tokens), so the share of rows whose first k drafts are all right is known
without the code under test: K+1 / 2 / 1 tokens per round, and for the mixed head a count
taken from the runs themselves. The walked tau (rounds as a decode takes them) is checked
against real greedy decodes of the same prompts with the same heads.
"""

from __future__ import annotations

import pytest
import torch

from eagle3.draft import attach_head
from eagle3.speculator import Eagle3Speculator
from eagle3.targets import load_target
from eagle3.train.simulate import chain_hits, chain_runs, simulated_tau, walked_rounds, walked_tau
from heads import greedy_runs, save_context_target, scripted_head

K, N = 5, 24


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    t = load_target(save_context_target(str(tmp_path_factory.mktemp("sim") / "ctx")))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 160, (6,), generator=g).tolist() for _ in range(3)]
    runs = torch.tensor(greedy_runs(t, prompts, N))  # (3, 6 + N)
    mask = torch.zeros_like(runs, dtype=torch.bool)
    # Loss from the second response token: the first (x_6) comes from the prompt's forward at
    # inference, never from a draft, and the scripted heads hold keys from slot 5 on.
    mask[:, 7:] = True
    with torch.no_grad():
        _, taps = t.forward_logits_taps(runs, torch.arange(runs.shape[1]), t.new_cache(3, 64),
                                        kv_len=runs.shape[1], taps=(1, 2, 3))
    return t, prompts, runs, mask, taps


def hits_of(case, mode):
    t, prompts, runs, mask, taps = case
    head = scripted_head(t, prompts, N, mode)
    attach_head(head, t)
    return chain_hits(head, runs, mask, taps, K)


def expected_rows(runs, mask):
    """Rows (slots t) whose next k tokens all carry loss, counted per k."""
    T = runs.shape[1]
    return torch.tensor([float(sum(all(bool(mask[b, t + 1 + j]) for j in range(1, k + 1))
                                   for b in range(runs.shape[0]) for t in range(T - 1 - k)))
                         for k in range(1, K + 1)])


@pytest.mark.parametrize("mode,tau", [("full", [2, 3, 4, 5, 6]), ("partial", [2] * K), ("zero", [1] * K)])
def test_known_heads_give_known_tau(case, mode, tau):
    hits, rows = hits_of(case, mode)
    assert torch.equal(rows, expected_rows(case[2], case[3]))
    assert simulated_tau(hits, rows) == tau


def test_mixed_head_matches_the_rule_it_was_built_with(case):
    """Later drafts right only after an even token: row t's first k drafts are all right iff
    x_{t+2} .. x_{t+k} are even (the token each later draft follows), counted from the runs."""
    runs, mask = case[2], case[3]
    hits, rows = hits_of(case, "mixed")
    T = runs.shape[1]
    want = torch.zeros(K)
    for k in range(1, K + 1):
        for b in range(runs.shape[0]):
            for t in range(T - 1 - k):
                if all(bool(mask[b, t + 1 + j]) for j in range(1, k + 1)) and \
                        all(int(runs[b, t + 1 + j]) % 2 == 0 for j in range(1, k)):
                    want[k - 1] += 1
    assert torch.equal(rows, expected_rows(runs, mask)) and torch.equal(hits, want)
    assert 0 < want[-1] < want[0] == rows[0]  # the rule bites: depths differ


@pytest.mark.parametrize("mode", ["full", "partial", "zero", "mixed"])
def test_walked_rounds_are_a_real_decodes_rounds(case, mode):
    """Greedy `generate` with chains of K = 1..K: its drafting rounds and accepted drafts, summed
    over the prompts, equal what `walked_rounds` reads off the unroll over the same responses."""
    t, prompts, runs, _, taps = case
    head = scripted_head(t, prompts, N, mode)
    attach_head(head, t)
    mask = torch.zeros_like(runs, dtype=torch.bool)
    mask[:, len(prompts[0]):] = True  # the whole response; its first token anchors round one
    counts = walked_rounds(chain_runs(head, runs, mask, taps, K)[0], mask, K)
    spec = Eagle3Speculator(t, head)
    for k in range(1, K + 1):
        rounds = accepted = 0
        for p, run in zip(prompts, runs.tolist()):
            out = spec.generate(p, N, num_draft_tokens=k, stop_token_ids=[])
            assert out.token_ids == run[len(p):]
            rounds, accepted = rounds + out.stats["rounds"], accepted + out.stats["accepted_tokens"]
        assert counts[k - 1].tolist() == [rounds, accepted], f"K={k}"
    tau = walked_tau(counts)
    if mode in ("zero", "partial"):  # no draft / the first draft alone accepted, every round
        assert tau == [1.0 + (mode == "partial")] * K
    else:  # the first draft always right; deeper chains accept more, a round's end caps them
        assert tau[0] == 2.0 < tau[2] < tau[-1] < K + 1
