"""The proposer interface (`decoding.proposers`): a new drafter is one class and one registration
line, and it runs through `generate` and the engine, lossless against plain greedy decoding
recomputed from scratch (`heads.greedy_runs`, no speculation)."""

from __future__ import annotations

import pytest

from conftest import make_hf_model
from eagle3.decoding.graft import chain_alone
from eagle3.decoding.proposers import PROPOSERS, Proposer, register, room
from eagle3.draft import attach_head
from eagle3.engine import Engine, EngineConfig
from eagle3.errors import Eagle3Error
from eagle3.speculator import Eagle3Speculator
from eagle3.targets import load_target
from heads import greedy_runs, random_head

V = 24  # a small vocabulary: random greedy outputs fall into cycles, some with repeated tokens
PROMPTS = [[3, 9, 4, 3, 9, 4, 3], [1, 2, 5, 7], [6], [5, 5, 5]]
N_NEW = 40


class PreviousToken(Proposer):
    """Proposes the row's last token again, twice: the whole of a new drafter."""

    name = "previous"
    greedy_only = True

    def nodes(self, seq, max_len, head_nodes):
        return room(seq, max_len, head_nodes, 2)

    def propose(self, runner, rows, plan, counts):
        out = []
        for g, s in enumerate(rows):
            n = self.nodes(s, runner.max_len, 0)
            if n:
                out.append(chain_alone(g, [s.anchor] * n, runner.device))
        return out


@pytest.fixture
def previous():
    register(PreviousToken())  # the one registration line
    yield
    del PROPOSERS["previous"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("proposers") / "llama")
    make_hf_model("llama", seed=7, vocab_size=V).save_pretrained(d)
    return load_target(d, max_seq_len=96)


@pytest.fixture(scope="module")
def oracle(target):
    return greedy_runs(target, PROMPTS, N_NEW)


def first_repeat(out: list[int]) -> int | None:
    return next((i for i in range(1, len(out)) if out[i] == out[i - 1]), None)


def test_a_new_proposer_runs_lossless_in_generate_and_the_engine(previous, target, oracle):
    outs = [run[len(p):] for p, run in zip(PROMPTS, oracle, strict=True)]
    # The premise: some outputs repeat a token (then a round's anchor is that token: before the
    # first repeat no draft was accepted, so every token was an anchor), so its drafts must land.
    repeating = [i for i, o in enumerate(outs) if first_repeat(o) is not None and first_repeat(o) < N_NEW - 3]
    assert repeating, outs
    random = random_head(target, taps=(1, 3, 4), seed=4, draft_vocab_size=16)
    attach_head(random, target)
    for head in (None, random):
        spec = Eagle3Speculator(target, head)
        for i, (p, want) in enumerate(zip(PROMPTS, outs, strict=True)):
            r = spec.generate(p, N_NEW, stop_token_ids=[], proposer="previous")
            assert r.token_ids == want, (head is not None, p)
            s = r.stats
            assert s["draft_tokens"] > 0  # its nodes were verified
            if i in repeating:
                assert s["accepted_tokens"] >= 1
        if head is None:  # the engine needs a native target and takes the proposer per request
            engine = Engine(spec, EngineConfig(max_batch=4)).start(background=False)
            try:
                reqs = [engine.submit(p, N_NEW, stop_token_ids=[], proposer="previous") for p in PROMPTS]
                engine.run_until_idle()
                assert [r.token_ids for r in reqs] == outs
                assert sum(r.metrics["spec_decode_num_accepted_tokens"] for r in reqs) >= len(repeating)
            finally:
                engine.stop()


def test_an_unregistered_proposer_is_a_one_line_error(target):
    spec = Eagle3Speculator(target)
    with pytest.raises(Eagle3Error, match="proposer must be one of eagle, suffix, hybrid") as e:
        spec.generate([1, 2], 4, proposer="previous")
    assert "\n" not in str(e.value)
