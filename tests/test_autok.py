"""num_draft_tokens='auto': acceptance accounting, tau, the choice of K, and losslessness.

The cost model is injected where a test asserts which K is chosen (timings are
machine noise); the measured one is only checked for its structure.
"""

from __future__ import annotations

import itertools
import math

import pytest

import eagle3
from eagle3.bench.harness import run_bench
from eagle3.bench.report import markdown
from eagle3.cli.bench import parse_ks
from eagle3.decoding.costs import AUTO_MAX_K, PRIOR_ACCEPT, Acceptance, RoundCosts, choose_plan, repick_now
from eagle3.decoding.planner import EXPLORE_PLAIN, PROBE_EVERY
from eagle3.decoding.types import Plan
from eagle3.draft import attach_head, save_head
from eagle3.speculator import Eagle3Speculator
from eagle3.targets import load_target
from heads import save_context_target, scripted_head

PROMPTS = [[5, 17, 3, 99, 42, 7], [11, 60, 23], [150, 4, 88, 31, 9, 77, 120]]


def flat_cost(ratio: float = 1.0, draft: float = 0.1, max_k: int = AUTO_MAX_K) -> RoundCosts:
    """Batch-1 costs: a plain step 1 ms, a verify of 2..max_k+1 tokens `ratio` ms, a draft
    forward `draft` ms whatever its length (a K-chain round: ratio + K * draft)."""
    return RoundCosts({1: [1.0] + [ratio] * max_k}, {1: [draft] * (max_k + 1)}, {1: 1.0})


def choose(acc: Acceptance, cost: RoundCosts) -> int:
    return choose_plan(cost, acc, 1, AUTO_MAX_K, min_k=1).k


def test_record_counts_reached_and_accepted_positions():
    auto = Acceptance(max_k=4)
    auto.record(4, 2)  # positions 0, 1 accepted; 2 reached and rejected; 3 never reached
    auto.record(2, 2)  # all accepted; nothing drafted past position 1
    auto.record(3, 0)
    assert auto.reached == [3, 2, 1, 0]
    assert auto.accepted == [2, 2, 0, 0]


def test_rates_shrink_to_the_prior_and_follow_the_data():
    auto = Acceptance(max_k=3)
    assert auto.rates() == pytest.approx([PRIOR_ACCEPT] * 3)
    for _ in range(10_000):
        auto.record(3, 1)  # position 0 always accepted, position 1 never
    q = auto.rates()
    assert q[0] == pytest.approx(1.0, abs=1e-3) and q[1] == pytest.approx(0.0, abs=1e-3)
    assert q[2] == q[1]  # never reached: like the last position measured


def test_tau_is_the_expected_accepted_length_plus_one():
    auto = Acceptance(max_k=5)
    for k, a in [(5, 5), (5, 3), (4, 1), (5, 0), (2, 2), (5, 4), (3, 2)]:
        auto.record(k, a)
    q = auto.rates()
    for k in range(1, 6):
        # Independently: P(a = j) = q_0..q_{j-1} * (1 - q_j) for j < k, P(a = k) = q_0..q_{k-1}.
        dist = [math.prod(q[:j]) * (1 - q[j]) for j in range(k)] + [math.prod(q[:k])]
        assert sum(dist) == pytest.approx(1.0)
        assert auto.tau(k) == pytest.approx(1 + sum(j * p for j, p in enumerate(dist)))


@pytest.mark.parametrize("ratio,draft,rounds,expect", [
    (1.0, 0.01, [(8, 8)] * 50, 8),  # every draft accepted, drafting nearly free: the longest chain
    (1.0, 0.1, [(8, 0)] * 50, 1),  # nothing accepted: the shortest chain
    (1.0, 2.0, [(8, 8)] * 50, 1),  # a draft step dearer than a target forward never pays
])
def test_choose_is_the_argmax_of_the_predicted_speedup(ratio, draft, rounds, expect):
    auto, cost = Acceptance(), flat_cost(ratio, draft)
    for k, a in rounds:
        auto.record(k, a)
    assert choose(auto, cost) == expect
    best = max(range(1, AUTO_MAX_K + 1), key=lambda k: cost.predicted_speedup(auto.tau(k), Plan(k)))
    assert choose(auto, cost) == best
    # independently: tau / (ratio + K * draft) against a 1 ms plain step
    assert cost.predicted_speedup(auto.tau(3), Plan(3)) == pytest.approx(auto.tau(3) / (ratio + 3 * draft))


@pytest.mark.parametrize("gain,drafts", [(1.03, False), (1.08, True)])
def test_drafting_must_beat_plain_by_a_margin(gain, drafts):
    """A chain predicted 3% faster than plain decoding (within the timings' noise) is not chosen
    over it; one predicted 8% faster is."""
    acc = Acceptance(max_k=1)
    for _ in range(400):
        acc.record(1, 1)
    acc.record(1, 0)  # tau(1) = 1 + q, q just under 1
    q = acc.rates()[0]
    # K=1 costs verify(2) + catch-up draft(2) = ratio + 0 ms: ratio sets the predicted gain
    cost = RoundCosts({1: [1.0, (1 + q) / gain]}, {1: [0.0, 0.0]}, {1: 1.0})
    assert cost.predicted_speedup(acc.tau(1), Plan(1)) == pytest.approx(gain)
    assert choose_plan(cost, acc, 1, 1).drafts == drafts


def test_observed_rounds_are_priced_with_the_text_nodes_they_verified():
    """A round that verified text nodes beyond its plan's is compared with the model's time for
    that many nodes: a round that took exactly that leaves no correction (ratio 1), so text
    nodes riding along in some rounds cannot make the plan look slow."""
    from eagle3.decoding.planner import Planner

    planner = Planner(4)
    planner.costs = RoundCosts({1: [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5]}, {1: [0.1] * 8}, {1: 1.0})
    # K=2 with 3 text nodes: verify over 6 tokens (3.5 ms) + catch-up (0.1) + one step (0.1)
    planner.observe(1, Plan(2), 3.7, text_drafts=True, nodes=5)
    assert planner.observed.ratio[1, Plan(2), True] == pytest.approx(1.0)
    # plain decoding with 2 text nodes: a verify over 3 tokens (2.0 ms) instead of a step
    planner.observe(1, Plan(), 2.0, text_drafts=True, nodes=2)
    assert planner.observed.ratio[1, Plan(), True] == pytest.approx(1.0)
    planner.observe(1, Plan(1), 3.2, nodes=1)  # no text: 1.5 + 0.1, took twice that
    assert planner.observed.ratio[1, Plan(1), False] == pytest.approx(2.0)


def test_a_round_after_plain_rounds_is_not_a_plans_usual_cost():
    """Rounds whose catch-up covers the prompt or the tokens of plain rounds before it do not
    correct the cost model; rounds that catch up what a drafting round leaves do."""
    from eagle3.decoding.round import usual_catch_up
    from eagle3.decoding.tree import TreeShape
    from eagle3.decoding.types import SequenceState

    s = SequenceState("s", [1, 2, 3], 20, frozenset())
    s.pending_ids = [1, 2, 3]
    assert not usual_catch_up(s, Plan(2))  # the prompt: the draft never ran
    s.draft_len = 3
    assert usual_catch_up(s, Plan(2)) and not usual_catch_up(s, Plan(1))
    s.pending_ids = list(range(12))  # after 11 plain rounds
    assert not usual_catch_up(s, Plan(4)) and usual_catch_up(s, Plan())
    assert usual_catch_up(s, Plan(tree=TreeShape(2, 11, 8))) and not usual_catch_up(s, Plan(tree=TreeShape()))


def test_choose_skips_unmeasured_sizes():
    cost = flat_cost(max_k=2)  # verify timed for 1..3 tokens only
    auto = Acceptance()
    for _ in range(50):
        auto.record(8, 8)
    assert choose(auto, cost) == 2 and cost.predicted_speedup(3.0, Plan(3)) is None


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_context_target(str(tmp_path_factory.mktemp("autok") / "ctx"))


def scripted(t, mode: str, prompts=PROMPTS, n: int = 40):
    """A head scripted along `t`'s greedy runs of `prompts` (tests/heads.py), right per `mode`;
    kept small (a few runs, width 256) so that its step stays cheap next to the target's, as a
    real head's is: automatic K weighs the two."""
    return scripted_head(t, prompts, n, mode)


def plain(t, prompt, n):
    return Eagle3Speculator(t).generate(prompt, n, stop_token_ids=[]).token_ids


@pytest.mark.parametrize("mode,expect", [("full", AUTO_MAX_K), ("zero", 0)])
def test_auto_is_lossless_and_settles_on_the_right_k(target, mode, expect):
    t = load_target(target)
    head = scripted(t, mode)
    attach_head(head, t)
    spec = Eagle3Speculator(t, head)
    spec.costs = flat_cost(1.0, 0.05)  # injected: the choice then depends on acceptance only
    spec.observed.record = lambda *a: None  # (no correction from this machine's real timings)
    chosen, runs = [], []
    for p, n in itertools.product(PROMPTS, (5, 40)):
        r = spec.generate(p, n, stop_token_ids=[])  # num_draft_tokens=None: auto
        assert r.token_ids == plain(t, p, n)
        chosen.append(r.stats["num_draft_tokens"])
        runs.append(r.stats)
    if mode == "full":
        assert chosen[-1] == expect
    else:  # the prior's first choice was longer, then the data pulled K down to plain decoding
        assert runs[0]["drafted_per_position"][1] > 0 and expect in chosen
        # Plain rounds re-probe the head with K=1 every PROBE_EVERY rounds (the draft kept its
        # backlog): a long generation that starts plain drafts again, and stays lossless.
        n = PROBE_EVERY + 6
        r = spec.generate(PROMPTS[0], n, stop_token_ids=[])
        assert r.token_ids == plain(t, PROMPTS[0], n)
        assert r.stats["rounds"] > 0 and r.stats["drafted_per_position"][0] == r.stats["rounds"]
        assert r.stats["target_forwards"] == n  # nothing accepted: one forward per token


def test_auto_times_plain_rounds_once_before_trusting_the_model(target, monkeypatch):
    """The calibration's few forwards can misjudge a plain step on a busy machine: automatic K
    runs EXPLORE_PLAIN plain rounds once per speculator (at its first re-choice) to time them,
    stays lossless, and the next generation trusts the timed model. Rounds are timed by a clock
    that gives every round 1 ms, plain or drafting (real timings on a shared machine could make
    plain rounds rightly win the second generation too)."""
    import eagle3.speculator as speculator

    class Clock:  # each reading 1 ms after the last: generate reads it twice a round
        now = 0.0

        def perf_counter(self) -> float:
            self.now += 1e-3
            return self.now

    monkeypatch.setattr(speculator, "time", Clock())
    t = load_target(target)
    attach_head(head := scripted(t, "full", PROMPTS[:1], 160), t)
    spec = Eagle3Speculator(t, head)
    spec.costs = flat_cost(1.0, 0.05)
    spec.costs.plain = {1: 50.0}  # misjudged: by the model alone, plain decoding never pays
    p, n = PROMPTS[0], 160
    plain_rounds = []
    for _ in range(2):
        r = spec.generate(p, n, stop_token_ids=[])
        assert r.token_ids == plain(t, p, n)
        plain_rounds.append(r.stats["target_forwards"] - r.stats["rounds"] - 1)  # less the prompt's
    assert spec.observed.seen(1, Plan())
    assert plain_rounds[0] >= EXPLORE_PLAIN > plain_rounds[1]


def test_auto_chooses_again_early_then_every_few_rounds():
    """A wrong prior costs every round until the data overrides it: automatic K chooses again
    after 2 and 4 drafting rounds, then every 8."""
    assert [r for r in range(1, 33) if repick_now(r)] == [2, 4, 8, 16, 24, 32]


def test_first_auto_generation_measures_the_cost_model(target):
    t = load_target(target)
    head = scripted(t, "full")
    attach_head(head, t)
    spec = Eagle3Speculator(t, head)
    assert spec.costs is None
    r = spec.generate(PROMPTS[0], 12, num_draft_tokens="auto", stop_token_ids=[])
    assert r.token_ids == plain(t, PROMPTS[0], 12)
    cost = spec.costs.cost_ratios()
    assert set(cost["verify_cost_ratio"]) == {str(m) for m in range(2, AUTO_MAX_K + 2)}
    assert cost["draft_step_over_target_forward"] > 0
    assert spec.acceptance.reached[0] == r.stats["rounds"]  # every round was recorded
    # Measured costs under a loaded machine may choose plain decoding; injected ones that make
    # drafting pay force drafting rounds, and each of them is recorded too.
    spec.costs, spec.acceptance.reached[0] = flat_cost(1.0, 0.05), 0
    r = spec.generate(PROMPTS[0], 12, num_draft_tokens="auto", stop_token_ids=[])
    assert r.token_ids == plain(t, PROMPTS[0], 12)
    assert spec.acceptance.reached[0] == r.stats["rounds"] > 0
    # An explicit K keeps its K and leaves auto's counts alone.
    before = list(spec.acceptance.reached)
    r = spec.generate(PROMPTS[1], 12, num_draft_tokens=3, stop_token_ids=[])
    assert r.stats["num_draft_tokens"] == 3 and spec.acceptance.reached == before
    # Calibration is not timed inside a generation: a second calibrate() measures nothing new.
    assert spec.calibrate() is spec.costs
    with pytest.raises(eagle3.Eagle3Error, match="'auto' or an integer"):
        spec.generate(PROMPTS[0], 4, num_draft_tokens="fast")


def test_load_measures_the_cost_model_before_any_generation(target, tmp_path):
    t = load_target(target)
    save_head(scripted(t, "full"), str(tmp_path / "head"), "speculators", include_embedding=True)
    spec = eagle3.load(target, str(tmp_path / "head"))
    costs = spec.costs
    assert costs is not None and costs.seconds > 0
    assert set(costs.cost_ratios()["verify_cost_ratio"]) == {str(m) for m in range(2, AUTO_MAX_K + 2)}
    r = spec.generate(PROMPTS[0], 12, stop_token_ids=[])  # automatic K
    assert spec.costs is costs, "a generation measured the cost model again"
    assert r.token_ids == plain(t, PROMPTS[0], 12)
    assert eagle3.load(target, "none").costs is None  # plain decoding needs no cost model
    assert eagle3.load(target, str(tmp_path / "head"), calibrate=False).costs is None
    # Eager calibration times the verify at five lengths and fits the line through them.
    lazy = eagle3.load(target, str(tmp_path / "head"), calibrate=False)
    seen, verify = set(), lazy.runner.target
    lazy.runner.target = lambda seqs, tokens, layout, **kw: (seen.add(tokens.shape[1]),
                                                              verify(seqs, tokens, layout, **kw))[1]
    lazy.calibrate()
    assert seen == {1, 2, 3, 5, 9}
    # A context too short for K = 8 still calibrates, and automatic K still decodes exactly.
    tiny = eagle3.load(target, str(tmp_path / "head"), max_seq_len=8)
    assert tiny.costs.max_T == 5
    r = tiny.generate(PROMPTS[0][:2], 6, stop_token_ids=[])
    assert r.token_ids == plain(load_target(target, max_seq_len=8), PROMPTS[0][:2], 6)


def test_bench_auto_row(target):
    t = load_target(target)
    head = scripted(t, "full")
    attach_head(head, t)
    spec = Eagle3Speculator(t, head)
    report = run_bench(spec, PROMPTS, ks=[2], max_new_tokens=12, repeats=1, auto=True)
    rows = {r["k"]: r for r in report["rows"]}
    assert set(rows) == {None, 2, "auto"} and report["outputs_identical"] is True
    assert isinstance(rows["auto"]["chosen_k"], int) and rows["auto"]["predicted_speedup"] is None
    assert f"K=auto ({rows['auto']['chosen_k']} last)" in markdown(report)
    assert parse_ks("auto,4,2") == ([2, 4], True) and parse_ks("3") == ([3], False)
    assert parse_ks("auto") == ([], True)
    with pytest.raises(eagle3.Eagle3Error, match="num-draft-tokens"):
        parse_ks("auto,0")
