"""The serving engine: lossless under batching, KV pool accounting, abort/cleanup, metrics.

Every engine output is compared with single-request plain greedy decoding
(`Eagle3Speculator.generate` without a head), for heads scripted to agree with
a target whose attention changes its output fully, partly, erratically or not at
all, with requests joining and leaving between rounds, stop ids inside accepted spans, the model's last
position, and KV pools small enough that requests wait for pages.
"""

from __future__ import annotations

import itertools
import threading
import time
import zlib

import pytest
import torch

from eagle3 import Eagle3Error
from eagle3.decoding import drafting
from eagle3.decoding.costs import choose_plan
from eagle3.decoding.round import Plan, run_round
from eagle3.draft import attach_head
from eagle3.engine import Engine, EngineConfig, EngineError, RequestState
from eagle3.engine.paged import PagePool, gather_rows
from eagle3.kernels import WeightFormat
from eagle3.speculator import Eagle3Speculator
from eagle3.targets import load_target
from eagle3.targets.prepare import prepare_loaded
from heads import random_head, save_context_target, scripted_head

V = 160


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return save_context_target(str(tmp_path_factory.mktemp("engine") / "ctx"))


@pytest.fixture(scope="module")
def random_target(tmp_path_factory):
    from conftest import make_hf_model

    d = str(tmp_path_factory.mktemp("engine") / "llama")
    make_hf_model("llama", seed=3).save_pretrained(d)
    return d


_SPECS: dict = {}


def spec_for(path: str, mode: str, max_seq_len: int | None = None, ps: list[list[int]] = (),
             n: int = 0) -> Eagle3Speculator:
    """A speculator on `path` whose head is random or drafts the greedy runs of `ps` (`n` new
    tokens each) per `mode` (tests/heads.py `scripted_head`)."""
    key = (path, mode, max_seq_len, tuple(map(tuple, ps)), n)
    if key not in _SPECS:
        t = load_target(path, max_seq_len=max_seq_len)
        # The row-invariant kernels, as eagle3.load runs a float32 target: a verify row equals a
        # decode row bit for bit, so speculative == plain holds at near-ties too (stock PyTorch
        # layers differ in the last bits between a 5-row and a 1-row forward: a greedy step
        # whose margin is 1e-6 can flip).
        prepare_loaded(t, WeightFormat.parse("fp32"))
        head = random_head(t, seed=5) if mode == "random" else scripted_head(t, list(ps), n, mode)
        attach_head(head, t, taps=(1, 2, 3))
        _SPECS[key] = Eagle3Speculator(t, head)
    return _SPECS[key]


def stable_seed(*parts) -> int:
    """A seed from a test's parameters, the same in every process (`hash` of a str is not)."""
    return zlib.crc32(repr(parts).encode())


def prompts(n: int, seed: int, low: int = 1, high: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def plain(spec: Eagle3Speculator, prompt: list[int], n: int, stop=None) -> list[int]:
    return spec.plain().generate(prompt, n, stop_token_ids=stop).token_ids


def run_all(engine: Engine, requests: list[tuple[list[int], int]], **kw) -> list:
    engine.start(background=False)
    reqs = [engine.submit(p, n, **kw) for p, n in requests]
    engine.run_until_idle()
    return reqs


# -- losslessness under batching ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["full", "partial", "zero", "mixed", "random"])
@pytest.mark.parametrize("k", [1, 3, None])
def test_batched_speculation_equals_single_request_greedy(ctx, random_target, mode, k):
    ps = prompts(10, seed=stable_seed(mode, k) % 1000)
    lens = [5 + 7 * i % 40 for i in range(len(ps))]
    spec = spec_for(random_target if mode == "random" else ctx, mode, ps=ps, n=max(lens))
    engine = Engine(spec, EngineConfig(max_batch=4, num_draft_tokens=k))
    reqs = run_all(engine, list(zip(ps, lens)), stop_token_ids=[])
    for r, p, n in zip(reqs, ps, lens):
        assert r.state == RequestState.FINISHED and r.finish_reason == "length"
        assert r.token_ids == plain(spec, p, n, stop=[]), (mode, k, p)
    m = engine.metrics()
    assert m["kv_used_tokens"] == 0 and m["num_running"] == 0
    assert m["requests_finished"] == len(ps)
    if mode == "full" and k is not None:  # the scripted head is always right
        assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"] > 0
    if mode == "zero":  # automatic K may rightly choose plain rounds throughout: no drafts to count
        assert m["spec_decode_num_accepted_tokens"] == 0
        assert m["spec_decode_num_drafts"] > 0 or k is None
    assert sum(m["spec_decode_num_accepted_tokens_per_pos"]) == m["spec_decode_num_accepted_tokens"]


def test_requests_joining_between_rounds_and_waiting_for_pages(ctx):
    """A pool of 4 pages x 16: requests wait for pages; each joins a running batch mid-flight."""
    ps = prompts(7, seed=11, low=2, high=12)
    spec = spec_for(ctx, "mixed", ps=ps, n=27)
    engine = Engine(spec, EngineConfig(max_batch=3, num_draft_tokens=4, max_kv_tokens=64, page_size=16))
    engine.start(background=False)
    reqs = []
    for i, p in enumerate(ps):  # a new request every other step
        reqs.append(engine.submit(p, 20 + i, stop_token_ids=[]))
        engine.step()
        engine.step()
        assert engine.pool.used_tokens <= 64 and engine.pool.reserved <= engine.pool.num_pages
    engine.run_until_idle()
    for r, p, i in zip(reqs, ps, range(len(ps))):
        assert r.token_ids == plain(spec, p, 20 + i, stop=[])
    sizes = set(engine.k_history)
    assert max(sizes) > 1  # requests did share rounds
    assert engine.pool.used_tokens == 0 and engine.pool.reserved == 0


def test_stop_ids_inside_accepted_spans_and_the_last_position(ctx):
    ps = prompts(6, seed=13, low=3, high=20)
    spec = spec_for(ctx, "full", max_seq_len=48, ps=ps, n=48)
    wants = [plain(spec, p, 48 - len(p), stop=[]) for p in ps]
    stops = [w[5] for w in wants]  # likely inside a span of K=6 accepted drafts
    engine = Engine(spec, EngineConfig(max_batch=6, num_draft_tokens=6))
    engine.start(background=False)
    reqs = [engine.submit(p, 48 - len(p), stop_token_ids=[s]) for p, s in zip(ps, stops)]
    to_end = [engine.submit(p, 48 - len(p), stop_token_ids=[]) for p in ps]  # the model's last slot
    engine.run_until_idle()
    for r, p, s in zip(reqs, ps, stops):
        assert r.token_ids == plain(spec, p, 48 - len(p), stop=[s]) and r.finish_reason == "stop"
    for r, w in zip(to_end, wants):
        assert r.token_ids == w and len(r.token_ids) + len(r.prompt_ids) == 48


def test_speculation_off_and_sampling(random_target):
    spec = spec_for(random_target, "random")
    ps = prompts(5, seed=17)
    off = run_all(Engine(spec, EngineConfig(max_batch=3, speculate=False)), [(p, 12) for p in ps])
    assert [r.token_ids for r in off] == [plain(spec, p, 12) for p in ps]
    # Sampled rows speculate inside the same batches as greedy ones: the same draws as generate.
    engine = Engine(spec, EngineConfig(max_batch=5, num_draft_tokens=3))
    engine.start(background=False)
    greedy = [engine.submit(p, 12) for p in ps[:2]]
    sampled = [engine.submit(p, 12, temperature=0.9, top_p=0.9, seed=i) for i, p in enumerate(ps[2:])]
    engine.run_until_idle()
    assert [r.token_ids for r in greedy] == [plain(spec, p, 12) for p in ps[:2]]
    assert engine.metrics()["spec_decode_num_drafts"] > 0
    for i, (r, p) in enumerate(zip(sampled, ps[2:])):
        assert r.metrics["spec_decode_num_drafts"] > 0
        want = spec.generate(p, 12, temperature=0.9, top_p=0.9, seed=i, num_draft_tokens=3).token_ids
        assert r.token_ids == want


# -- the speculative transaction -----------------------------------------------------------------------

@pytest.mark.parametrize("mode,accepted", [("full", 3), ("zero", 0), ("partial", 1)])
def test_transaction_commits_the_accepted_prefix_and_rolls_back_the_rest(ctx, mode, accepted):
    """One round by hand: target length advances by a+1, the draft gets [d1..da, c] pending, and
    the K/V kept for the request equals a fresh prefill of the same tokens (rejected slots rewritten)."""
    ps = prompts(2, seed=19, low=5, high=9)
    spec = spec_for(ctx, mode, ps=ps, n=40)
    engine = Engine(spec, EngineConfig(max_batch=2, num_draft_tokens=3)).start(background=False)
    reqs = [engine.submit(p, 30, stop_token_ids=[]) for p in ps]
    engine._admit()
    before = [r.seq.target_len for r in reqs]
    verdicts = run_round(engine.runner, [r.seq for r in reqs], Plan(3))
    for v, r, n0 in zip(verdicts, reqs, before):
        assert v.accepted == accepted and len(v.new) == accepted + 1
        assert v.path == list(range(1, accepted + 1))
        assert r.seq.target_len == n0 + accepted + 1
        assert r.seq.pending_ids == v.new and r.seq.pending_feats[0].shape[0] == accepted + 1
    engine.run_until_idle()  # a second round overwrites the rolled-back slots
    for r in reqs:
        assert r.token_ids == plain(spec, r.prompt_ids, 30, stop=[])
    # K/V equality after rounds of rollback: rerun with a live request and compare the pool.
    r = engine.submit(ps[0], 40, stop_token_ids=[])
    for _ in range(4):
        engine.step()
    seq = r.prompt_ids + r.token_ids[:-1]
    assert r.state == RequestState.RUNNING and r.seq.target_len == len(seq)
    cache = spec.target.new_cache(1, len(seq))
    spec.target.forward_logits_taps(torch.tensor([seq]), torch.arange(len(seq)), cache, kv_len=len(seq),
                                    with_taps=False)
    slots = engine.pool.slots[r.id][:len(seq)]
    for layer in range(spec.target.config.num_hidden_layers):
        got = engine.runner.tkv.k[layer][slots]  # (n, nkv, hd)
        torch.testing.assert_close(got, cache.k[layer][0, :, :len(seq)].transpose(0, 1), atol=1e-5, rtol=1e-5)
    engine.stop()
    assert engine.pool.used_tokens == 0


# -- abort, failure, timeout ---------------------------------------------------------------------------

def test_abort_and_a_failing_request_free_their_pages_and_spare_the_others(ctx):
    ps = prompts(6, seed=23, low=4, high=10)
    spec = spec_for(ctx, "mixed", ps=ps, n=40)
    engine = Engine(spec, EngineConfig(max_batch=6, num_draft_tokens=2)).start(background=False)

    def explode(req, new, finished):
        if not finished and len(req.token_ids) > 5:
            raise RuntimeError("consumer went away")

    reqs = [engine.submit(p, 40, stop_token_ids=[], on_event=explode if i == 2 else None)
            for i, p in enumerate(ps)]
    waiting = engine.submit(ps[0], 40, stop_token_ids=[])
    engine.abort(waiting)  # aborted before it ever ran
    for _ in range(3):
        engine.step()
    engine.abort(reqs[0])
    engine.abort(reqs[4].id, reason="timeout")
    engine.run_until_idle()
    assert waiting.state == RequestState.ABORTED and waiting.token_ids == []
    assert reqs[0].state == RequestState.ABORTED and reqs[0].finish_reason == "abort"
    assert reqs[4].finish_reason == "timeout"
    assert reqs[2].state == RequestState.FAILED and "consumer went away" in reqs[2].error
    for i in (1, 3, 5):
        assert reqs[i].token_ids == plain(spec, ps[i], 40, stop=[])
    m = engine.metrics()
    assert m["kv_used_tokens"] == 0 and engine.pool.reserved == 0
    assert (m["requests_finished"], m["requests_aborted"], m["requests_failed"]) == (3, 3, 1)


def test_timeouts_and_the_background_thread(ctx):
    spec = spec_for(ctx, "full", ps=prompts(1, seed=29), n=30)
    engine = Engine(spec, EngineConfig(max_batch=2, num_draft_tokens=2)).start()
    try:
        events = []
        done = threading.Event()

        def on_event(req, new, finished):
            events.append((list(new), finished))
            if finished:
                done.set()

        p = prompts(1, seed=29)[0]
        r = engine.submit(p, 30, stop_token_ids=[], on_event=on_event)
        assert r.wait(30) and done.wait(5)
        assert [t for new, _ in events for t in new] == r.token_ids == plain(spec, p, 30, stop=[])
        assert [f for _, f in events].count(True) == 1 and events[-1][1]
        slow = engine.submit(p, 200, stop_token_ids=[], timeout_s=1e-3)
        assert slow.wait(30) and slow.finish_reason == "timeout"
        m = r.metrics
        assert m["ttft_s"] > 0 and m["e2e_s"] >= m["ttft_s"] and m["queue_s"] >= 0
    finally:
        engine.stop()
    assert engine.metrics()["kv_used_tokens"] == 0
    with pytest.raises(EngineError) as e:
        engine.submit([1, 2], 3)
    assert e.value.status == 503


def test_a_failing_batched_forward_fails_its_batch_and_the_engine_goes_on(ctx):
    ps = prompts(3, seed=31)
    spec = spec_for(ctx, "full", ps=ps, n=20)
    engine = Engine(spec, EngineConfig(max_batch=4, num_draft_tokens=2)).start(background=False)
    first = [engine.submit(p, 20, stop_token_ids=[]) for p in ps]
    engine._admit()
    real = engine.runner.target
    engine.runner.target = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    engine.step()
    engine.runner.target = real
    assert all(r.state == RequestState.FAILED and "device lost" in r.error for r in first)
    assert engine.pool.used_tokens == 0
    later = engine.submit(ps[0], 20, stop_token_ids=[])
    engine.run_until_idle()
    assert later.token_ids == plain(spec, ps[0], 20, stop=[])


# -- admission and errors ---------------------------------------------------------------------------------

def test_submit_errors_carry_http_statuses(ctx):
    spec = spec_for(ctx, "full", max_seq_len=64)
    engine = Engine(spec, EngineConfig(max_batch=1, max_queue=2, max_kv_tokens=48, num_draft_tokens=2))
    with pytest.raises(EngineError) as e:
        engine.submit([1], 2)
    assert e.value.status == 503
    engine.start(background=False)
    cases = [(([], 3), 400), (([1, 2], 0), 400), (([V], 3), 400), ((["a"], 3), 400),
             (([1] * 40, 25), 400), (([1] * 30, 30), 413)]
    for (p, n), status in cases:
        with pytest.raises(EngineError) as e:
            engine.submit(p, n)
        assert e.value.status == status, (p, n)
        assert "\n" not in str(e.value)
    with pytest.raises(EngineError, match="temperature"):
        engine.submit([1, 2], 3, temperature=-1)
    engine.submit([1, 2], 3)
    engine.submit([1, 2], 3)
    with pytest.raises(EngineError) as e:
        engine.submit([1, 2], 3)
    assert e.value.status == 429
    engine.run_until_idle()
    assert engine.metrics()["requests_finished"] == 2 and engine.pool.used_tokens == 0


def test_engine_refuses_unsupported_setups(tmp_path, ctx):
    with pytest.raises(Eagle3Error, match="native target"):
        Engine(Eagle3Speculator(load_target(ctx, backend="hf")))
    spec = spec_for(ctx, "full")
    for bad in (dict(max_batch=0), dict(num_draft_tokens=-1), dict(max_kv_tokens=0)):
        with pytest.raises(Eagle3Error):
            Engine(spec, EngineConfig(**bad))
    # K is checked by the one function generate uses: the same bound, the same words (the
    # engine also takes 0, "never draft").
    for k in (33, 2.5, True, "fast"):
        with pytest.raises(Eagle3Error) as by_generate:
            spec.generate([1, 2], 4, num_draft_tokens=k)
        with pytest.raises(Eagle3Error) as by_engine:
            Engine(spec, EngineConfig(num_draft_tokens=k))
        assert str(by_engine.value) == str(by_generate.value).replace("1..", "0..")
    config = EngineConfig(num_draft_tokens="auto")
    assert Engine(spec, config).automatic and config.num_draft_tokens == "auto"  # not mutated
    assert Engine(spec, EngineConfig(num_draft_tokens=32)).kmax == 32
    assert not Engine(spec, EngineConfig(num_draft_tokens=0)).speculate


def test_page_pool_is_all_or_nothing():
    pool = PagePool(4, 8)
    pool.admit("a", 20)  # 3 pages promised
    assert not pool.can_admit(16) and pool.can_admit(8)
    pool.grow("a", 9)
    assert pool.used_tokens == 16 and pool.slots["a"].tolist() == list(range(16))
    with pytest.raises(Eagle3Error, match="outgrew"):
        pool.grow("a", 25)  # would need a 4th page: nothing allocated
    assert pool.used_tokens == 16
    pool.release("a")
    pool.release("a")
    assert pool.used_tokens == 0 and pool.reserved == 0 and sorted(pool.free) == [0, 1, 2, 3]


def test_automatic_k_uses_the_measured_costs(ctx):
    ps = prompts(4, seed=37)
    spec = spec_for(ctx, "full", ps=ps, n=24)
    engine = Engine(spec, EngineConfig(max_batch=4)).start(background=False)
    assert set(engine.costs.verify) == {1, 2, 4}
    reqs = [engine.submit(p, 24, stop_token_ids=[]) for p in ps]
    t0 = time.perf_counter()
    engine.run_until_idle()
    assert time.perf_counter() - t0 < 60
    assert [r.token_ids for r in reqs] == [plain(spec, p, 24, stop=[]) for p in ps]
    # a head that is always right: the model predicts speculation pays at small batches
    assert choose_plan(engine.costs, engine.acceptance, 1, engine.kmax).k > 0


# -- found in review ----------------------------------------------------------------------------------------

def test_submissions_racing_stop_all_end(ctx):
    """Threads submitting while the engine stops: each submission is refused (503) or ends."""
    spec = spec_for(ctx, "full")
    def client(engine, accepted, refused):
        for i in range(40):
            try:
                accepted.append(engine.submit([1 + i % 50, 2], 20, stop_token_ids=[]))
            except EngineError as e:
                assert e.status == 503
                refused.append(e)

    for trial in range(3):
        engine = Engine(spec, EngineConfig(max_batch=2, num_draft_tokens=2, max_queue=1000)).start()
        accepted, refused = [], []
        threads = [threading.Thread(target=client, args=(engine, accepted, refused)) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.01 * trial)
        engine.stop()
        for t in threads:
            t.join()
        assert all(r.wait(10) for r in accepted)
        assert engine.pool.used_tokens == 0 and engine.pool.reserved == 0 and not engine.waiting


def test_cost_probe_fits_a_tight_pool_and_leaks_nothing(ctx):
    spec = spec_for(ctx, "full", max_seq_len=40, ps=prompts(1, seed=41, low=3, high=5), n=10)
    for page, kv, batch in ((5, 65, 2), (16, 47, 3)):
        engine = Engine(spec, EngineConfig(max_batch=batch, page_size=page, max_kv_tokens=kv))
        engine.start(background=False)
        assert engine.pool.reserved == 0 and engine.pool.used_tokens == 0 and not engine.pool.pages
        p = prompts(1, seed=41, low=3, high=5)[0]
        r = engine.submit(p, 10, stop_token_ids=[])
        engine.run_until_idle()
        assert r.token_ids == plain(spec, p, 10, stop=[])


def test_a_failing_sampler_fails_only_its_request(ctx):
    ps = prompts(3, seed=43, low=4, high=8)
    spec = spec_for(ctx, "mixed", ps=ps, n=16)
    engine = Engine(spec, EngineConfig(max_batch=3, num_draft_tokens=2)).start(background=False)
    greedy = [engine.submit(p, 16, stop_token_ids=[]) for p in ps[:2]]
    sampled = engine.submit(ps[2], 16, temperature=1.0, seed=1, stop_token_ids=[])
    engine._admit()

    def broken(probs):
        raise RuntimeError("sampler broke")

    sampled.seq.sampler.sample = broken
    engine.run_until_idle()
    assert sampled.state == RequestState.FAILED and "sampler broke" in sampled.error
    assert [r.token_ids for r in greedy] == [plain(spec, p, 16, stop=[]) for p in ps[:2]]
    assert engine.pool.used_tokens == 0


def test_plain_rounds_catch_up_alone(ctx, monkeypatch):
    """A row after plain rounds catches up on its own rather than padding the batch, and stays
    lossless; a sampled row's backlog grows the same way and it then speculates again."""
    ps = prompts(3, seed=47, low=4, high=8)
    spec = spec_for(ctx, "mixed", ps=ps, n=40)
    engine = Engine(spec, EngineConfig(max_batch=3, num_draft_tokens=3)).start(background=False)
    sampled = engine.submit(ps[0], 40, temperature=0.8, seed=3, stop_token_ids=[])
    greedy = engine.submit(ps[1], 40, stop_token_ids=[])
    engine._admit()
    from eagle3.decoding.planner import Fixed

    engine.schedule = Fixed(Plan())  # plain rounds: the greedy row's backlog grows
    for _ in range(6):
        engine.step()
    # The prompt's catch-up waits for a drafting round too: prompt + first token + 6 rounds.
    assert len(sampled.seq.pending_ids) == len(ps[0]) + 6
    assert len(greedy.seq.pending_ids) == len(ps[1]) + 6
    assert sampled.seq.draft_len == greedy.seq.draft_len == 0
    engine.schedule = Fixed(Plan(3))
    sizes = []
    real = drafting.catch_up_rows
    monkeypatch.setattr(drafting, "catch_up_rows",
                        lambda b, rows, **kw: (sizes.append([len(r.pending_ids) for r in rows]),
                                              real(b, rows, **kw)))
    late = engine.submit(ps[2], 20, stop_token_ids=[])
    engine.run_until_idle()
    assert [len(ps[1]) + 6] in sizes  # the backlog caught up alone
    assert greedy.token_ids == plain(spec, ps[1], 40, stop=[])
    assert late.token_ids == plain(spec, ps[2], 20, stop=[])
    assert len(sampled.token_ids) == 40 and sampled.metrics["spec_decode_num_drafts"] > 0


def test_the_cost_model_picks_plain_when_verifying_costs_too_much():
    from eagle3.decoding.costs import Acceptance, RoundCosts, fit_line, probe_lengths
    from eagle3.decoding.tree import TreeShape

    flat = [10.0] * 13  # verifying more tokens costs nothing: speculation always pays
    acc = Acceptance(8)
    cheap = RoundCosts({4: flat}, {4: [1.0] * 13})
    assert choose_plan(cheap, acc, 4, 8).k > 0
    steep = RoundCosts({4: [10.0 * T for T in range(1, 14)]}, {4: [1.0] * 13})
    assert choose_plan(steep, acc, 4, 8) == Plan()  # each extra token costs a full forward
    tree = TreeShape(2, 3, 6)
    for _ in range(50):  # a tree that accepts 3 tokens a round beats chains that accept none
        acc.record(4, 0)
        acc.record(0, 2, tree=True)
    assert choose_plan(cheap, acc, 4, 8, tree=tree).tree == tree
    # Measured rounds slower than predicted take the plan's edge away: plain wins back.
    from eagle3.decoding.costs import Observed

    seen = Observed(weight=1.0)
    mild = RoundCosts({4: [10.0, 11.0] + [12.0] * 11}, {4: [0.5] * 13})
    acc2 = Acceptance(8)
    for _ in range(50):
        acc2.record(1, 1)
        acc2.record(2, 0)
    assert choose_plan(mild, acc2, 4, 2).k > 0  # predicted: ~1.5-1.75 tokens per ~12 ms vs 1 per 10
    for k in (1, 2):
        seen.record(4, Plan(k), actual_ms=30.0, predicted_ms=mild.round_ms(4, Plan(k)))
    assert choose_plan(mild, acc2, 4, 2, observed=seen) == Plan()
    # An untried plan borrows the correction of the tried one nearest in verify length (so it
    # cannot look cheaper by the host work only a run shows); plain decoding never borrows.
    seen = Observed(weight=1.0)
    seen.record(1, Plan(2), actual_ms=30.0, predicted_ms=10.0)
    seen.record(1, Plan(6), actual_ms=20.0, predicted_ms=10.0)
    assert seen.scale(1, Plan(3)) == 3.0 and seen.scale(1, Plan(5)) == 2.0
    assert seen.scale(1, Plan(tree=TreeShape(2, 3, 6))) == 2.0 and seen.scale(1, Plan()) == 1.0
    assert seen.scale(2, Plan(3)) == 1.0  # another batch size: nothing to borrow
    assert fit_line([5.0, 1.0, 9.0, 7.0, 8.0]) == sorted(fit_line([5.0, 1.0, 9.0, 7.0, 8.0]))
    assert min(fit_line([3.0, 0.1, 0.1, 0.1])) >= 0.1
    # Timed at a few lengths (calibration's probe_lengths), the line is given at every T.
    at = probe_lengths(9)
    assert at == [1, 2, 3, 5, 9]
    assert fit_line([2 + 0.5 * t for t in at], at) == pytest.approx([2 + 0.5 * t for t in range(1, 10)])


# -- one round for both paths: the engine equals generate -------------------------------------------

MODES = [dict(num_draft_tokens=1), dict(num_draft_tokens=3),
         dict(tree={"top_k": 2, "depth": 3, "total_tokens": 5}),
         dict(tree={"top_k": 3, "depth": 4, "total_tokens": 10})]


def engine_config(mode: dict, max_batch: int = 4) -> EngineConfig:
    if "tree" in mode:
        return EngineConfig(max_batch=max_batch, tree=mode["tree"], auto_plan=False)
    return EngineConfig(max_batch=max_batch, num_draft_tokens=mode["num_draft_tokens"])


@pytest.mark.parametrize("head", ["full", "partial", "zero", "second", "random"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "tree{total_tokens}".format(**m["tree"])
                         if "tree" in m else f"K={m['num_draft_tokens']}")
def test_engine_equals_generate_greedy_and_sampled(ctx, random_target, head, mode):
    """The same request through the engine (batched with others) and through generate: the same
    tokens and the same speculation counts, greedy and seeded sampling, to the cache's end."""
    ps = prompts(6, seed=stable_seed(head, mode) % 997, low=2, high=14)
    spec = spec_for(random_target if head == "random" else ctx, head, max_seq_len=48, ps=ps, n=48)
    cases = [(p, 48 - len(p) if i % 3 == 0 else 5 + 4 * i,
              dict(temperature=0.8, top_p=0.9, seed=i) if i % 2 else {}) for i, p in enumerate(ps)]
    engine = Engine(spec, engine_config(mode)).start(background=False)
    reqs = [engine.submit(p, n, stop_token_ids=[], **kw) for p, n, kw in cases]
    engine.run_until_idle()
    for r, (p, n, kw) in zip(reqs, cases):
        g = spec.generate(p, n, stop_token_ids=[], **kw, **mode)
        assert r.state == RequestState.FINISHED and r.token_ids == g.token_ids, (head, mode, kw)
        m = r.metrics
        assert (m["spec_decode_num_drafts"], m["spec_decode_num_draft_tokens"],
                m["spec_decode_num_accepted_tokens"]) == (g.stats["rounds"], g.stats["draft_tokens"],
                                                          g.stats["accepted_tokens"])
        if not kw:
            assert g.token_ids == plain(spec, p, n, stop=[])
    assert engine.metrics()["spec_decode_num_drafts"] > 0 and engine.pool.used_tokens == 0


def test_engine_equals_generate_with_stop_ids_inside_accepted_paths(ctx):
    ps = prompts(4, seed=61, low=3, high=10)
    spec = spec_for(ctx, "full", ps=ps, n=30)
    for mode in MODES:
        stops = [plain(spec, p, 30, stop=[])[4] for p in ps]
        engine = Engine(spec, engine_config(mode)).start(background=False)
        reqs = [engine.submit(p, 30, stop_token_ids=[s]) for p, s in zip(ps, stops)]
        engine.run_until_idle()
        for r, p, s in zip(reqs, ps, stops):
            assert r.token_ids == spec.generate(p, 30, stop_token_ids=[s], **mode).token_ids
            assert r.token_ids == plain(spec, p, 30, stop=[s]) and r.finish_reason == "stop"


@pytest.mark.parametrize("name", ["mistral", "qwen2_swa", "gemma2", "gemma3"])
def test_sliding_window_targets_run_in_the_engine(tmp_path, name):
    """Windows of 7 positions, sequences far longer: chains and trees in ragged batches equal
    plain decoding (window masks compare positions, also a tree node's own)."""
    from conftest import make_hf_model

    d = str(tmp_path / name)
    make_hf_model(name, seed=2).save_pretrained(d)
    t = load_target(d)
    head = random_head(t, seed=4, scale=0.3)
    attach_head(head, t, taps=(1, 2, 3))
    spec = Eagle3Speculator(t, head)
    ps = prompts(4, seed=71, low=3, high=20)
    for mode in (MODES[1], MODES[3]):
        engine = Engine(spec, engine_config(mode)).start(background=False)
        reqs = [engine.submit(p, 30, stop_token_ids=[]) for p in ps]
        engine.run_until_idle()
        for r, p in zip(reqs, ps):
            assert r.token_ids == plain(spec, p, 30, stop=[]), (name, mode)


def test_engine_automatic_plan_may_pick_the_tree(ctx):
    """With a tree offered and a head that is always right, the cost model's plans stay
    lossless and the tree is drafted once its measured tokens per round beat the chains'."""
    ps = prompts(3, seed=83, low=3, high=10)
    spec = spec_for(ctx, "full", ps=ps, n=40)
    engine = Engine(spec, EngineConfig(max_batch=2, tree={"top_k": 2, "depth": 6, "total_tokens": 8}))
    engine.start(background=False)
    engine.acceptance.record(0, 5, tree=True)  # seen before: a tree round accepted 5
    reqs = [engine.submit(p, 40, stop_token_ids=[]) for p in ps]
    engine.run_until_idle()
    assert [r.token_ids for r in reqs] == [plain(spec, p, 40, stop=[]) for p in ps]
    assert engine.costs is not None and set(engine.costs.verify) == {1, 2}


def test_engine_holds_a_plan_for_repick_every_rounds(ctx, monkeypatch):
    """As generate does, the engine re-chooses its plan every REPICK_EVERY rounds at one batch
    size, and at once when the batch size changes (a choice each round chases timing noise)."""
    import eagle3.decoding.driver as driver_module
    import eagle3.decoding.planner as planner_module
    from eagle3.decoding.costs import REPICK_EVERY

    spec = spec_for(ctx, "mixed", ps=[prompts(1, 4)[0], prompts(1, 5)[0]], n=60)
    engine = Engine(spec, EngineConfig(max_batch=2)).start(background=False)
    chosen, sizes = [], []  # the batch size of each choice and of each round
    real_choose, real_round = planner_module.choose_plan, driver_module.run_round
    monkeypatch.setattr(planner_module, "choose_plan", lambda costs, acc, B, *a, **kw:
                        chosen.append(B) or real_choose(costs, acc, B, *a, **kw))
    monkeypatch.setattr(driver_module, "run_round", lambda runner, seqs, plan:
                        sizes.append(len(seqs)) or real_round(runner, seqs, plan))
    first = engine.submit(prompts(1, 4)[0], 60, stop_token_ids=[])
    while engine.step():
        if len(sizes) == REPICK_EVERY + 3:  # mid-hold: a second request changes the batch size
            second = engine.submit(prompts(1, 5)[0], 30, stop_token_ids=[])
    assert first.state == second.state == RequestState.FINISHED
    runs = [(B, len(list(g))) for B, g in itertools.groupby(sizes)]
    assert [B for B, _ in runs][:2] == [1, 2] and len(runs) >= 2
    assert chosen == [B for B, n in runs for _ in range(-(-n // REPICK_EVERY))]


def test_every_sampling_parameter_reaches_the_engine(random_target):
    """Each of temperature, top_p, top_k and seed changes the engine's output, and the output
    with it equals generate's: a parameter the engine dropped would fail one or the other."""
    spec = spec_for(random_target, "random")
    p = prompts(1, seed=89, low=4, high=8)[0]
    base = dict(temperature=1.0, top_p=1.0, top_k=0, seed=1)
    variants = [base, {**base, "temperature": 0.3}, {**base, "top_p": 0.5}, {**base, "top_k": 3},
                {**base, "seed": 2}]
    engine = Engine(spec, EngineConfig(max_batch=5, num_draft_tokens=2)).start(background=False)
    reqs = [engine.submit(p, 24, stop_token_ids=[], **kw) for kw in variants]
    engine.run_until_idle()
    outs = [r.token_ids for r in reqs]
    for kw, out in zip(variants, outs):
        assert out == spec.generate(p, 24, stop_token_ids=[], num_draft_tokens=2, **kw).token_ids, kw
    assert all(out != outs[0] for out in outs[1:]), "a sampling parameter changed nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_rows_is_index_select(dtype):
    """The paged cache's gather (16-bit pools through an int16 view of their bytes) returns
    exactly `index_select`'s rows, NaN and infinity bit patterns included."""
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(97, 3, 8, generator=g).to(dtype)
    pool[5, 1, 2], pool[6, 0, 0] = float("nan"), float("-inf")
    idx = torch.tensor([5, 6, 0, 96, 5, 40])
    got = gather_rows(pool, idx)
    assert got.dtype == dtype and got.shape == (6, 3, 8)
    bits = lambda t: t.view(torch.int16 if t.element_size() == 2 else torch.int32)  # noqa: E731
    assert torch.equal(bits(got), bits(pool.index_select(0, idx)))
