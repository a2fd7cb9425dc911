"""`Eagle3Speculator.compile()`: the torch.compile'd steps are lossless and compile once per shape.

The reference is eager plain greedy decoding (itself checked against
transformers in test_targets.py). Compiling takes seconds per graph even for
these tiny models, so the module shares one compiled speculator per case.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._dynamo.utils import counters

import eagle3
from conftest import make_hf_model
from eagle3.decoding.costs import RoundCosts
from eagle3.decoding.layout import causal_layout
from eagle3.decoding.types import Plan
from eagle3.draft import attach_head
from eagle3.kernels import kernel_available
from eagle3.speculator import Eagle3Speculator
from eagle3.targets import load_target
from heads import random_head, save_context_target, scripted_head

pytestmark = pytest.mark.slow
MAX_LEN = 48
STAT_KEYS = ("rounds", "draft_tokens", "accepted_tokens", "accepted_per_position",
             "drafted_per_position", "accept_len_hist", "target_forwards")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    save_context_target(str(root / "ctx"))
    make_hf_model("gemma2", seed=1).save_pretrained(str(root / "gemma2"))
    make_hf_model("llama", seed=3).save_pretrained(str(root / "llama"))
    return {"ctx": str(root / "ctx"), "gemma2": str(root / "gemma2"), "llama": str(root / "llama")}


def prompts(n: int, seed: int, V: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def plain(target, prompt, n, stop=()):
    return Eagle3Speculator(target).generate(prompt, n, stop_token_ids=list(stop)).token_ids


@pytest.mark.parametrize("mode", ["full", "partial", "zero"])
def test_compiled_chain_is_lossless_to_the_cache_end(dirs, mode):
    t = load_target(dirs["ctx"], max_seq_len=MAX_LEN)
    V = t.config.vocab_size
    ps = prompts(6, seed=3, V=V)
    head = scripted_head(t, ps, MAX_LEN, mode)
    attach_head(head, t)
    spec, eager = Eagle3Speculator(t, head).compile(), Eagle3Speculator(t, head)
    cases = [(p, n) for p in ps for n in (1, 2, 7, MAX_LEN - len(p))]
    for k in (1, 3):
        accepted = drafted = rounds = 0
        for p, n in cases:
            want = plain(t, p, n, stop=())
            r = spec.generate(p, n, num_draft_tokens=k, stop_token_ids=[])
            assert r.token_ids == want, (k, p, n)
            e = eager.generate(p, n, num_draft_tokens=k, stop_token_ids=[]).stats
            assert all(r.stats[key] == e[key] for key in STAT_KEYS), (k, p, n)
            accepted, drafted = accepted + r.stats["accepted_tokens"], drafted + r.stats["draft_tokens"]
            rounds += r.stats["rounds"]
        # Each head's acceptance is scripted (tests/heads.py), and observed exactly.
        expect = {"full": drafted, "partial": rounds, "zero": 0}[mode]
        assert drafted > 0 and accepted == expect, (k, accepted, drafted)
    # Stop ids inside an accepted span end the output exactly where plain decoding does.
    p = cases[0][0]
    full = plain(t, p, 20)
    stop = [full[5]]
    assert spec.generate(p, 20, num_draft_tokens=3, stop_token_ids=stop).token_ids == plain(t, p, 20, stop)


def test_one_graph_per_shape_not_per_position(dirs):
    t = load_target(dirs["ctx"], max_seq_len=MAX_LEN)
    ps = prompts(8, seed=5, V=t.config.vocab_size)
    head = scripted_head(t, ps, 12, "partial")
    attach_head(head, t)
    spec = Eagle3Speculator(t, head).compile()
    base = Eagle3Speculator(t).compile()
    for s, k in ((spec, 2), (base, None)):
        s.generate(ps[0], 12, num_draft_tokens=k, stop_token_ids=[])  # compiles the shapes
    graphs = counters["stats"]["unique_graphs"]
    for p in ps[1:]:  # other prompt lengths and positions: no new graph (away from the cache end)
        for s, k in ((spec, 2), (base, None)):
            assert s.generate(p, 12, num_draft_tokens=k, stop_token_ids=[]).token_ids == plain(t, p, 12, ())
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_plain_decoding_matches_eager_on_gemma2(dirs):
    """Soft-capped attention and sliding windows through the compiled decode step."""
    t = load_target(dirs["gemma2"], max_seq_len=MAX_LEN)
    spec = Eagle3Speculator(t).compile()
    for p in prompts(3, seed=7, V=t.config.vocab_size):
        assert spec.generate(p, 24, stop_token_ids=[]).token_ids == plain(t, p, 24)


def test_compiled_random_head_on_gemma2_is_lossless(dirs):
    t = load_target(dirs["gemma2"], max_seq_len=MAX_LEN)
    head = random_head(t, taps=(1, 2, 3))
    attach_head(head, t)
    spec = Eagle3Speculator(t, head).compile()
    for p in prompts(3, seed=8, V=t.config.vocab_size):
        assert spec.generate(p, 20, num_draft_tokens=2, stop_token_ids=[]).token_ids == plain(t, p, 20)


def test_compile_needs_the_native_backend(dirs, capsys):
    assert eagle3.load(dirs["ctx"], draft="none", compile=True).compiled is True
    spec = eagle3.load(dirs["ctx"], draft="none", backend="hf")
    with pytest.raises(eagle3.Eagle3Error, match="native backend"):
        spec.compile()
    from eagle3.cli import main

    capsys.readouterr()
    assert main(["generate", "--target", dirs["ctx"], "--draft", "none", "--backend", "hf",
                 "--prompt-ids", "1,2", "--compile"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eagle3: error:") and "native backend" in err and "\n" not in err


def test_compiled_auto_k_rising_and_falling_mid_generation(dirs, monkeypatch):
    """K changes every 8 rounds (forced through 2, 5, 1, 4, 3)."""
    t = load_target(dirs["ctx"], max_seq_len=MAX_LEN)
    ps = prompts(3, seed=9, V=t.config.vocab_size)
    head = scripted_head(t, ps, MAX_LEN, "full")
    attach_head(head, t)
    spec = Eagle3Speculator(t, head).compile()
    spec.costs = RoundCosts({1: [1.0] * 9}, {1: [0.1] * 9}, {1: 1.0})
    choices = itertools.cycle([2, 5, 1, 4, 3])
    monkeypatch.setattr(spec.planner, "choose", lambda B, text_drafts=False: Plan(next(choices)))
    seen = set()
    for p in ps:
        n = MAX_LEN - len(p)  # to the cache's end
        r = spec.generate(p, n, stop_token_ids=[])
        assert r.token_ids == plain(t, p, n)
        seen.add(r.stats["num_draft_tokens"])
    assert len(seen) > 1


def test_compiled_stats_count_only_emittable_drafts(dirs):
    """Fixed shapes draft the full K in the last round; the stats match eager decoding's."""
    t = load_target(dirs["ctx"], max_seq_len=MAX_LEN)
    p = prompts(1, seed=10, V=t.config.vocab_size)[0]
    head = scripted_head(t, [p], 7, "full")
    attach_head(head, t)
    eager, compiled = Eagle3Speculator(t, head), Eagle3Speculator(t, head).compile()
    for n in (2, 3, 7):
        a = eager.generate(p, n, num_draft_tokens=4, stop_token_ids=[]).stats
        b = compiled.generate(p, n, num_draft_tokens=4, stop_token_ids=[]).stats
        assert {k: a[k] for k in STAT_KEYS} == {k: b[k] for k in STAT_KEYS}, n


@pytest.mark.parametrize("mode", ["full", "second", "zero"])
def test_compiled_tree_is_lossless_to_the_cache_end(dirs, mode):
    """Tree rounds run compiled (catch-up, draft levels, verify), to the cache's end where the
    tree shrinks. Same output as plain decoding, same stats as eager trees."""
    t = load_target(dirs["ctx"], max_seq_len=MAX_LEN)
    V = t.config.vocab_size
    ps = prompts(8, seed=8, V=V)
    head = scripted_head(t, ps, MAX_LEN, mode)
    attach_head(head, t)
    spec, eager = Eagle3Speculator(t, head).compile(), Eagle3Speculator(t, head)
    shape = {"top_k": 3, "depth": 4, "total_tokens": 9}
    verified = []
    backend = spec.runner
    real_verify = backend._target_step
    backend._target_step = lambda *a: verified.append(a[3] is not None) or real_verify(*a)
    for i, p in enumerate(ps):
        if i == 4:  # the shapes are compiled: new prompts and positions compile nothing more
            counters.clear()
        for n in (2, 9, MAX_LEN - len(p)):
            want = plain(t, p, n)
            r = spec.generate(p, n, tree=shape, stop_token_ids=[])
            assert r.token_ids == want, (p, n)
            e = eager.generate(p, n, tree=shape, stop_token_ids=[]).stats
            assert all(r.stats[key] == e[key] for key in STAT_KEYS), (p, n)
    assert sum(verified) > 20  # tree verifies (with a mask) ran through the compiled step
    assert counters["stats"].get("unique_graphs", 0) <= 2, dict(counters["stats"])


def test_compiled_tree_random_head_on_gemma2(dirs):
    """A random head whose attention matters (the scripted heads' does not), on a target with
    soft-capping and sliding windows: compiled trees stay lossless to the cache end."""
    t = load_target(dirs["gemma2"], max_seq_len=MAX_LEN)
    head = random_head(t, taps=(1, 3, 5), scale=0.3)
    attach_head(head, t)
    spec = Eagle3Speculator(t, head).compile()
    for p in prompts(3, seed=6, V=t.config.vocab_size):
        for n in (12, MAX_LEN - len(p)):
            r = spec.generate(p, n, tree={"top_k": 3, "depth": 5, "total_tokens": 12}, stop_token_ids=[])
            assert r.token_ids == plain(t, p, n), (p, n)


def test_first_auto_generation_compiles_every_k(dirs, monkeypatch):
    """After the first automatic generation (which measures the cost model over every verify
    and draft size), a generation that switches through every K compiles nothing new."""
    t = load_target(dirs["ctx"], max_seq_len=MAX_LEN)
    p = prompts(1, seed=12, V=t.config.vocab_size)[0][:5]
    head = scripted_head(t, [p], MAX_LEN, "full")
    attach_head(head, t)
    spec = Eagle3Speculator(t, head).compile()
    assert spec.generate(p, 8, stop_token_ids=[]).token_ids == plain(t, p, 8)
    counters.clear()
    choices = itertools.cycle([8, 1, 5, 2, 7, 3, 6, 4])
    monkeypatch.setattr(spec.planner, "choose", lambda B, text_drafts=False: Plan(next(choices)))
    for n in (30, MAX_LEN - len(p)):
        assert spec.generate(p, n, stop_token_ids=[]).token_ids == plain(t, p, n)
    assert counters["stats"].get("unique_graphs", 0) == 0, dict(counters["stats"])


@pytest.mark.skipif(not kernel_available(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("quantize", [None, "int4"])
def test_compiled_verify_rows_equal_decode_rows_in_each_format(dirs, quantize):
    """The compiled target step over 9 tokens gives each row the logits of the compiled 1-token
    step, bit for bit; so compiled speculation equals compiled plain decoding. (The features
    fused by the head's fc are not compared: a float32 head keeps stock layers, and its
    proposals need not be row-invariant for the output to be exact.)"""
    t = eagle3.load(dirs["llama"], "none", quantize=quantize).target
    head = random_head(t, taps=(1, 3, 5), seed=4)
    attach_head(head, t)
    spec = Eagle3Speculator(t, head).compile()
    b = spec.runner
    g = torch.Generator().manual_seed(0)
    prompt, new = torch.randint(1, 160, (1, 11), generator=g), torch.randint(1, 160, (1, 9), generator=g)
    with torch.no_grad():
        b.target([None], prompt, causal_layout([0], 11), last_only=True)
        verify, _ = b.target([None], new, causal_layout([11], 9))
        for i in range(9):
            one, _ = b.target([None], new[:, i:i + 1], causal_layout([11 + i], 1))
            assert torch.equal(one[0, 0], verify[0, i]), f"row {i}"
    plain_spec = Eagle3Speculator(t).compile()
    for p in prompts(3, seed=5, V=160):
        assert spec.generate(p, 24, num_draft_tokens=3).token_ids == plain_spec.generate(p, 24).token_ids
