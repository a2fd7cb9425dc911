"""Drafts from the text itself (`decoding.suffix`): the index, the graft, and losslessness of
'suffix' and 'hybrid' proposals against plain greedy decoding (transformers-free oracle:
`heads.greedy_runs` recomputes every token from scratch) and in distribution when sampling.

The targets are tiny random models whose greedy output falls into a cycle after a few tokens
(checked below), so suffix matches exist and are accepted: a proposer that proposed nothing,
or proposals the round ignored, fail `test_a_repeating_output_accepts_long_suffix_runs`.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_hf_model
from eagle3.decoding.graft import graft, grow_mask
from eagle3.decoding.proposers import PROPOSERS
from eagle3.decoding.request import resolve_proposer
from eagle3.decoding.suffix import MAX_MATCH, SuffixBudget, SuffixIndex, SuffixState
from eagle3.decoding.types import SequenceState
from eagle3.draft import attach_head
from eagle3.engine import Engine, EngineConfig
from eagle3.errors import Eagle3Error
from eagle3.speculator import Eagle3Speculator
from eagle3.targets import load_target
from heads import greedy_runs, random_head, scripted_head

USES_DEFAULT_PROPOSER = True  # conftest: the real default proposer here
V = 24  # a small vocabulary: random greedy outputs cycle soon


# -- the index ------------------------------------------------------------------------------------
def naive_match(text: list[int], min_match: int, max_match: int) -> tuple[int, int]:
    """The longest suffix (<= max_match) seen earlier and its latest earlier occurrence's next
    index, by brute force."""
    for n in range(min(max_match, len(text) - 1), min_match - 1, -1):
        suffix = text[-n:]
        for end in range(len(text) - 1, n - 1, -1):  # an occurrence ending before the text's end
            if text[end - n:end] == suffix:
                return n, end
    return 0, -1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 4), st.integers(1, 6))
def test_index_matches_brute_force(text, min_match, max_match):
    index = SuffixIndex(max_match=max_match)
    for i, t in enumerate(text):  # grown token by token, as a request is
        index.extend([t])
        assert index.match(min_match) == naive_match(text[:i + 1], min_match, max_match)
    assert len(index.table) <= max_match * len(text)  # bounded by the text


def test_continuation_reads_on_as_a_repetition():
    index = SuffixIndex([5, 1, 2, 3, 1, 2])
    n, start = index.match(1)
    assert (n, start) == (2, 3)  # "1 2" seen before, followed by 3
    assert index.continuation(start, 7) == [3, 1, 2, 3, 1, 2, 3]
    index = SuffixIndex([7, 7])
    assert index.continuation(index.match(1)[1], 4) == [7, 7, 7, 7]
    assert SuffixIndex([1, 2, 3]).match(1) == (0, -1)


def test_proposer_learns_which_match_lengths_pay():
    cheap = SuffixBudget(ms_per_token=1.0, extra_ms=(0.0, 0.05, 0.1, 0.15))
    p = SuffixState.over([1, 2, 3, 4, 1, 2])
    p.budget = cheap
    assert p.propose(3) == [3, 4, 1]
    rejected = 0
    while p.propose(3):  # every proposal after a 2-token match is rejected: it stops proposing
        p.observe(0, 0)
        rejected += 1
        assert rejected < 20
    assert rejected >= 1 and p.propose(1) == []
    q = SuffixState.over([7, 8, 9, 7, 8, 9, 7, 8])
    q.budget = cheap
    assert q.propose(3) == [9, 7, 8]  # a longer match: a prior that pays
    q.observe(3, 3)  # accepted whole: counts as a run of `nodes`
    assert q.runs[5][q.nodes] == 1
    q.budget = SuffixBudget(ms_per_token=1.0, extra_ms=(0.0, 5.0, 5.0, 5.0))
    assert q.propose(3) == []  # worth less than its verify slots
    q.budget = None  # no cost model: the fixed MIN_GAIN rule
    assert q.propose(2) == [9, 7]


def test_a_drivers_pooled_runs_are_the_next_requests_prior():
    """Text drafts that failed in a driver's earlier requests lower what the next request expects
    of them at the same match length (the fixed prior shrunk towards the pool), so it stops
    paying to re-learn it; requests of a driver without a pool keep the fixed prior."""
    from eagle3.decoding.suffix import PRIOR_EXTRA, PRIOR_WEIGHT, SUFFIX_NODES

    def suffix_proposer(name, prompt, pools=None):  # a request's text state, as its proposer starts it
        seq = SequenceState("s", prompt, 8, frozenset())
        PROPOSERS[name].start(seq, pools)
        return seq.suffix

    text = [7, 8, 9, 7, 8, 9, 7, 8]
    pools: dict = {}
    first = suffix_proposer("hybrid", text, pools)
    first.budget = SuffixBudget(ms_per_token=1.0, extra_ms=(0.0, 0.05, 0.1, 0.15))
    length = first.index.match(1)[0]
    for _ in range(3):  # three proposals after this match, none accepted
        assert first.propose(3)
        first.observe(0, 0)
    fixed = PRIOR_EXTRA[length] * 3 / SUFFIX_NODES
    pooled = fixed * PRIOR_WEIGHT / (3 + PRIOR_WEIGHT)  # three runs of 0 against the prior
    later = suffix_proposer("hybrid", text, pools)
    assert later.gain(length, 3) == pytest.approx(pooled)
    assert suffix_proposer("hybrid", text).gain(length, 3) == pytest.approx(fixed)
    assert suffix_proposer("suffix", text, pools).gain(length, 3) > pooled  # its own pool


def test_graft_shares_agreeing_nodes_and_masks_ancestors():
    # root -> 1 (a) -> 2 (b) -> 3 (c); root -> 4 (x)
    tokens, parents = [10, 11, 12, 13], [0, 1, 2, 0]
    new_t, new_p, shared = graft(tokens, parents, [10, 11, 20, 21])
    assert (new_t, new_p, shared) == ([20, 21], [2, 5], 2)
    assert graft(tokens, parents, [13, 5]) == ([5], [4], 1)
    assert graft(tokens, parents, [10, 11, 12]) == ([], [], 3)
    n = len(tokens)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    for j, p in enumerate([0, *parents]):
        mask[j] = mask[p]
        mask[j, j] = True
    depth = torch.tensor([0, 1, 2, 3, 1])
    m, d = grow_mask(mask, depth, new_p)
    assert d.tolist() == [0, 1, 2, 3, 1, 3, 4]
    assert m[6].nonzero().flatten().tolist() == [0, 1, 2, 5, 6]  # its ancestors and itself


def test_bad_proposer_settings_are_one_line_errors():
    for bad, head, msg in (("ngram", True, "proposer must be one of"),
                           ("hybrid", False, "needs a draft head"),
                           ("eagle", False, "needs a draft head")):
        with pytest.raises(Eagle3Error, match=msg) as e:
            resolve_proposer(bad, head)
        assert "\n" not in str(e.value)
    with pytest.raises(Eagle3Error, match="transformers adapter"):
        resolve_proposer("hybrid", True, trees=False)
    assert resolve_proposer(None, False) == "eagle" and resolve_proposer("suffix", False) == "suffix"
    # the default: hybrid for greedy requests with a head on a runner that verifies trees
    assert resolve_proposer(None, True) == "hybrid"
    assert resolve_proposer(None, True, greedy=False) == resolve_proposer(None, True, trees=False) == "eagle"


# -- decoding ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name in ("llama", "gemma2"):
        d = str(tmp_path_factory.mktemp("suffix") / name)
        make_hf_model(name, seed=7, vocab_size=V).save_pretrained(d)
        out[name] = load_target(d, max_seq_len=96)
    return out


PROMPTS = [[3, 9, 4, 3, 9, 4, 3], [1, 2, 5, 7], [11, 12, 13, 11, 12, 13, 11, 12], [6]]
N_NEW = 48


@pytest.fixture(scope="module")
def oracle(models):
    return {name: greedy_runs(t, PROMPTS, N_NEW) for name, t in models.items()}


def test_the_targets_repeat(models, oracle):
    """The premise of the tests below: each target's greedy output repeats itself."""
    for name in models:
        for p, run in zip(PROMPTS, oracle[name], strict=True):
            out = run[len(p):]
            assert len(set(out[-16:])) < 12, (name, out)


def head_for(target, kind: str):
    if kind == "random":
        head = random_head(target, taps=(1, 3, 4), seed=4, draft_vocab_size=16)
    else:  # right on the prompts' runs for a while, then noise: both sources get their turn
        head = scripted_head(target, PROMPTS, 12, kind)
    attach_head(head, target)
    return head


MODES = [("suffix", None, {}), ("suffix", "random", {}), ("hybrid", "random", dict(num_draft_tokens=3)),
         ("hybrid", "random", dict(tree=dict(top_k=2, depth=3, total_tokens=6))),
         ("hybrid", "partial", dict(num_draft_tokens=2)), ("hybrid", "full", dict(num_draft_tokens=5)),
         ("hybrid", "second", dict(tree=True)), ("hybrid", "random", {}), ("eagle", "random", {})]


@pytest.mark.parametrize("name", ["llama", "gemma2"])
@pytest.mark.parametrize("proposer,head,kw", MODES, ids=[f"{p}-{h}-{k}" for p, h, k in MODES])
def test_greedy_suffix_and_hybrid_equal_plain_decoding(models, oracle, name, proposer, head, kw):
    target = models[name]
    spec = Eagle3Speculator(target, head_for(target, head) if head else None)
    if "num_draft_tokens" not in kw and "tree" not in kw and head:
        spec.calibrate()
    for p, want in zip(PROMPTS, oracle[name], strict=True):
        r = spec.generate(p, N_NEW, stop_token_ids=[], proposer=proposer, **kw)
        assert r.token_ids == want[len(p):], (proposer, head, kw, p)
        s = r.stats
        assert s["suffix_accepted_tokens"] <= s["accepted_tokens"]
        if proposer == "eagle":
            assert s["suffix_rounds"] == 0


def _parent_only(mask, depth, parents):
    """A planted bug: a grafted node sees itself and its parent, not its parent's ancestors."""
    N, M = mask.shape[0] - 1, len(parents)
    out = torch.zeros(N + M + 1, N + M + 1, dtype=torch.bool)
    out[:N + 1, :N + 1] = mask
    dep = torch.cat([depth, depth.new_zeros(M)])
    for i, p in enumerate(parents):
        j = N + 1 + i
        out[j, p] = out[j, j] = True
        dep[j] = dep[p] + 1
    return out, dep


PLANTED = {
    "never_merged": ("graft", lambda tokens, parents, chain: ([], [], 0)),  # text drafts dropped
    "parent_only_mask": ("grow_mask", _parent_only),
    "flat_depth": ("grow_mask", lambda mask, depth, parents: (lambda m, d: (m, d.clamp(max=1)))(
        *grow_mask(mask, depth, parents))),  # grafted nodes all at depth 1: wrong positions
}


@pytest.fixture(scope="module")
def exact_llama(tmp_path_factory):
    """The Llama model above on the row-invariant fp32 kernels (verify rows equal decode rows
    bit for bit on any CPU, so no near-tie can part hybrid from plain decoding) and its greedy
    runs of PROMPTS."""
    from eagle3.kernels import WeightFormat
    from eagle3.targets.prepare import prepare_loaded

    d = str(tmp_path_factory.mktemp("suffix_exact") / "llama")
    make_hf_model("llama", seed=7, vocab_size=V).save_pretrained(d)
    t = load_target(d, max_seq_len=96)
    prepare_loaded(t, WeightFormat.parse("fp32"))
    return t, greedy_runs(t, PROMPTS, N_NEW)


def hybrid_runs(target, oracle_runs, kw) -> tuple[int, int]:
    """Greedy hybrid with a head whose first draft is always wrong ('zero'; a tree's other
    children may be right): (runs equal to plain decoding, text tokens accepted)."""
    head = scripted_head(target, PROMPTS, N_NEW, "zero")
    attach_head(head, target)
    spec = Eagle3Speculator(target, head)
    same = text = 0
    for p, want in zip(PROMPTS, oracle_runs, strict=True):
        r = spec.generate(p, N_NEW, stop_token_ids=[], proposer="hybrid", **kw)
        same += r.token_ids == want[len(p):]
        text += r.stats["suffix_accepted_tokens"]
    return same, text


HYBRID_KW = [dict(num_draft_tokens=2), dict(tree=dict(top_k=2, depth=2, total_tokens=4))]


@pytest.mark.parametrize("kw", HYBRID_KW, ids=["chain", "tree"])
def test_greedy_hybrid_accepts_text_drafts_on_its_own(exact_llama, kw):
    """Hybrid with a head that is always wrong must still accept the repeating outputs' text
    drafts, grafted beside the head's nodes (a tree round), and stay plain decoding."""
    same, text = hybrid_runs(*exact_llama, kw)
    assert same == len(PROMPTS)
    assert text >= N_NEW, text


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_a_planted_graft_bug_fails_the_hybrid_checks(exact_llama, monkeypatch, bug):
    """Negative controls: each planted bug in `graft` / `grow_mask` breaks what the test above
    asserts (no text accepted, output other than plain decoding, or a failed generation)."""
    import eagle3.decoding.graft as graft_module

    name, fn = PLANTED[bug]
    monkeypatch.setattr(graft_module, name, fn)
    failed = 0
    for kw in HYBRID_KW:
        try:
            same, text = hybrid_runs(*exact_llama, kw)
        except Eagle3Error:  # a loud failure is caught too (flat depths index past the tree)
            failed += 1
            continue
        failed += same < len(PROMPTS) or text < N_NEW
    assert failed, f"the planted bug {bug} went unnoticed"


def test_a_repeating_output_accepts_long_suffix_runs(models, oracle):
    """Suffix drafts alone, no head: the repeating outputs must be drafted and accepted in long
    runs (plain decoding takes one target forward per token)."""
    spec = Eagle3Speculator(models["llama"])
    accepted = forwards = longest = 0
    for p, want in zip(PROMPTS, oracle["llama"], strict=True):
        r = spec.generate(p, N_NEW, stop_token_ids=[], proposer="suffix")
        assert r.token_ids == want[len(p):]
        s = r.stats
        assert s["suffix_accepted_tokens"] == s["accepted_tokens"]
        accepted += s["accepted_tokens"]
        forwards += s["target_forwards"]
        longest = max(longest, max(i for i, n in enumerate(s["accept_len_hist"]) if n))
    assert accepted >= N_NEW and forwards <= 0.6 * len(PROMPTS) * N_NEW, (accepted, forwards)
    assert longest >= 5  # runs as long as the proposals


@pytest.mark.parametrize("stop_at", [0, 1, 5, 13])
def test_stop_ids_inside_suffix_runs(models, oracle, stop_at):
    target = models["llama"]
    spec = Eagle3Speculator(target, head_for(target, "random"))
    for p, want in zip(PROMPTS, oracle["llama"], strict=True):
        out = want[len(p):]
        stop = out[stop_at]
        expect = out[:out.index(stop) + 1]
        for proposer in ("suffix", "hybrid"):
            r = spec.generate(p, N_NEW, stop_token_ids=[stop], proposer=proposer, num_draft_tokens=2)
            assert r.token_ids == expect, (proposer, p, stop)


def test_up_to_the_cache_end(models):
    """Prompt + max_new_tokens exactly fills the cache: suffix nodes shrink to what fits."""
    target = models["llama"]
    spec = Eagle3Speculator(target, head_for(target, "random"))
    p = PROMPTS[0] * 3
    n = target.config.max_seq_len - len(p)
    (want,) = greedy_runs(target, [p], n)
    for proposer, kw in (("suffix", {}), ("hybrid", dict(num_draft_tokens=4)),
                         ("hybrid", dict(tree=dict(top_k=2, depth=4, total_tokens=8)))):
        r = spec.generate(p, n, stop_token_ids=[], proposer=proposer, **kw)
        assert r.token_ids == want[len(p):], (proposer, kw)


def test_engine_equals_generate_with_mixed_proposers(models, oracle):
    target = models["llama"]
    spec = Eagle3Speculator(target, head_for(target, "random"))
    engine = Engine(spec, EngineConfig(max_batch=4, num_draft_tokens=2))
    engine.start()
    try:
        reqs = [engine.submit(p, N_NEW, stop_token_ids=[], proposer=pr)
                for p, pr in zip(PROMPTS * 2, ["suffix", "hybrid", "eagle", None] * 2, strict=True)]
        sampled = [engine.submit(p, 20, temperature=1.0, seed=3, stop_token_ids=[], proposer="hybrid")
                   for p in PROMPTS]
        for r in reqs:
            r.wait(120)
        for r in sampled:
            r.wait(120)
    finally:
        engine.stop()
    for r, want in zip(reqs, oracle["llama"] * 2, strict=True):
        assert r.token_ids == want[len(r.prompt_ids):]
    assert sum(r.seq.stats.suffix_accepted_tokens for r in reqs) > 0
    for r, p in zip(sampled, PROMPTS, strict=True):  # the same draws as generate at batch 1
        g = spec.generate(p, 20, temperature=1.0, seed=3, stop_token_ids=[], proposer="hybrid",
                          num_draft_tokens=2)
        assert r.token_ids == g.token_ids


def test_the_index_is_freed_with_the_request(models):
    target = models["llama"]
    engine = Engine(Eagle3Speculator(target), EngineConfig(max_batch=2))
    engine.start()
    try:
        r = engine.submit(PROMPTS[0], 16, stop_token_ids=[], proposer="suffix")
        index = weakref.ref(r.seq.suffix.index)
        r.wait(60)
        with pytest.raises(Eagle3Error, match="needs a draft head"):  # no head in this engine
            engine.submit(PROMPTS[0], 4, proposer="hybrid")
    finally:
        engine.stop()
    gc.collect()
    assert index() is None and r.seq.suffix is None
    assert r.seq.stats.suffix_accepted_tokens > 0


def test_index_memory_is_bounded():
    index = SuffixIndex(list(range(50)) * 20)
    assert len(index.table) <= MAX_MATCH * len(index)


def test_cli_draft_none_proposer_suffix_and_bad_settings(models, oracle, tmp_path):
    """`generate --draft none --proposer suffix` speculates without a head (the same tokens as
    plain decoding, drafts from the text accepted); bad settings: one line, exit 2."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    target = models["llama"]
    d = str(tmp_path / "llama")
    make_hf_model("llama", seed=7, vocab_size=V).save_pretrained(d)
    run = lambda *a: subprocess.run([sys.executable, "-m", "eagle3", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    p = PROMPTS[0]
    r = run("generate", "--target", d, "--draft", "none", "--proposer", "suffix", "--prompt-ids",
            ",".join(map(str, p)), "--max-new-tokens", str(N_NEW), "--stop-ids", "", "--json",
            "--max-seq-len", str(target.config.max_seq_len))
    assert r.returncode == 0, r.stderr
    out = __import__("json").loads(r.stdout)
    assert out["token_ids"] == oracle["llama"][0][len(p):]
    assert out["stats"]["suffix_accepted_tokens"] == out["stats"]["accepted_tokens"] > 0
    for args, msg in ((("--proposer", "hybrid"), "needs a draft head"),
                      (("--proposer", "ngram"), "invalid choice")):
        r = run("generate", "--target", d, "--draft", "none", "--prompt-ids", "1,2", *args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run("bench", "--target", d, "--proposer", "ngram")
    assert r.returncode == 2 and "--proposer takes" in r.stderr and r.stderr.count("\n") == 1, r.stderr
