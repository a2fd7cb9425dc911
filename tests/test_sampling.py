"""Sampling: the target's distribution (temperature / top-k / top-p against transformers'
warpers), the rejection rules, and speculative sampling's output distribution against the
exact one computed by enumeration on a tiny target.

Distribution checks use a chi-square test at fixed seeds (deterministic pass or fail); the
same check rejects a deliberately lossy rule, so it has the power to fail.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from conftest import assert_probs_match_transformers, make_hf_model, nucleus_by_sort
from eagle3.decoding.sampling import (
    FIRST_CANDIDATES,
    Sampler,
    SamplingParams,
    check_sampling,
    nucleus,
    speculative_accept,
    tree_accept,
)
from eagle3.draft import attach_head
from eagle3.errors import Eagle3Error
from eagle3.kernels import top_p_cut
from eagle3.speculator import Eagle3Speculator
from eagle3.targets import load_target
from heads import greedy_runs, random_head


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """p-value of observed `counts` against expected `probs` over n draws (cells with expected
    count < 5 pooled); Wilson-Hilferty approximation of the chi-square tail."""
    stat, df, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for key, p in probs.items():
        e = n * p
        if e < 5:
            pool_obs, pool_exp = pool_obs + counts.get(key, 0), pool_exp + e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        df += 1
    stray = sum(c for key, c in counts.items() if key not in probs)  # impossible outcomes
    if stray:
        return 0.0
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / max(pool_exp, 1e-9)
        df += 1
    df = max(df, 1)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


# -- the target's distribution --------------------------------------------------------------------

@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0),
                                                     (1.0, 0, 0.9), (0.8, 7, 0.6), (2.0, 1, 1.0),
                                                     (1.0, 0, 0.05), (0.5, 50, 0.95)])
def test_probs_match_transformers_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(int(100 * temperature) + top_k)
    logits = torch.randn(6, 40, generator=g) * 3
    logits[0, :5] = 2.0  # ties
    ours = Sampler(SamplingParams(temperature, top_p, top_k)).probs(logits)
    scores = transformers.TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = transformers.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = transformers.TopPLogitsWarper(top_p)(None, scores)
    torch.testing.assert_close(ours, scores.softmax(-1))


def score_rows(V: int, seed: int) -> torch.Tensor:
    """Rows of scores (R, V) from nearly flat to one token holding almost everything, rows of
    many ties, all-equal rows, and rows already cut by top-k (-inf)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(V, generator=g) * s for s in (0.02, 0.5, 1.0, 3.0, 8.0, 30.0)]
    rows += [(torch.randn(V, generator=g) * 3).round() / 2 for _ in range(3)]  # many ties
    rows += [torch.zeros(V), torch.full((V,), 5.0)]
    peak = torch.full((V,), -30.0)
    peak[V // 2] = 0.0
    cut = torch.randn(V, generator=g) * 2
    cut[cut < cut.topk(min(5, V)).values[-1]] = float("-inf")
    return torch.stack(rows + [peak, cut])


@pytest.mark.parametrize("V", [7, 1000, 49152])
def test_top_p_by_partial_selection_keeps_what_the_full_sort_keeps(V):
    """`nucleus` (PyTorch: the most likely tokens only, 64, then more as needed) and the C++
    op (`top_p_cut`: candidates above a fraction of the largest mass, a weighted selection
    among them) keep exactly the tokens the rule written out with a full sort and integer sums
    keeps (`nucleus_by_sort`), for every kind of row and top_p, batched or one row at a time;
    the C++ op leaves the kept scores as they were."""
    scores = score_rows(V, seed=V)
    kept_counts = set()
    for top_p in (0.05, 0.3, 0.6, 0.9, 0.95, 0.99, 0.999999):
        want = nucleus_by_sort(scores, top_p)
        got = nucleus(scores, top_p)
        assert torch.equal(got, want), top_p
        cut = scores.clone()
        assert top_p_cut(cut, scores.softmax(-1), top_p)  # the kernels run on every x86-64
        assert torch.equal(cut.isfinite(), want) and torch.equal(cut[want], scores[want]), top_p
        assert torch.equal(nucleus(scores[:12].view(2, 6, V), top_p), want[:12].view(2, 6, V))
        for row, w in zip(scores, want, strict=True):
            assert torch.equal(nucleus(row, top_p), w)
        kept_counts |= set(want.sum(-1).tolist())
    if V > FIRST_CANDIDATES:  # both the first look and the wider ones were needed
        assert min(kept_counts) < FIRST_CANDIDATES < max(kept_counts)


def test_top_p_keeps_or_drops_a_tie_whole():
    """Probabilities 0.4, 0.3, 0.3 at top_p 0.5: the two 0.3s hold 0.6 > 0.5, so both stay.
    transformers' warper (a sort, then a float32 cumulative sum) drops whichever 0.3 its sort
    put first: the one place where the kept sets differ by design, not by rounding."""
    scores = torch.tensor([0.4, 0.3, 0.3]).log()
    assert nucleus(scores, 0.5).tolist() == [True, True, True]
    theirs = transformers.TopPLogitsWarper(0.5)(None, scores[None].clone())[0]
    assert int(theirs.isfinite().sum()) == 2
    # Below the tie's mass the pair goes together: 0.4 alone holds more than 1 - 0.35.
    assert nucleus(scores, 0.35).tolist() == [True, False, False]


@pytest.mark.parametrize("V", [1000, 49152])
def test_probs_match_transformers_warpers_on_random_rows(V):
    """Away from the ties and rounding that can move a cut (at most a few rows here), the kept
    set and its probabilities are transformers' exactly."""
    logits = score_rows(V, seed=V + 1)[:6]
    for temperature, top_k, top_p in [(0.7, 0, 0.95), (1.0, 0, 0.9), (0.7, 40, 0.95), (1.3, 0, 0.5),
                                      (0.5, 5, 1.0)]:
        assert assert_probs_match_transformers(logits, temperature, top_k, top_p) >= 5


def test_check_sampling():
    assert check_sampling(0, 1.0, 0, None).greedy
    assert check_sampling(0.7, 0.9, 5, 3) == SamplingParams(0.7, 0.9, 5, 3)
    for args, msg in [((-1, 1, 0, None), "temperature"), ((float("nan"), 1, 0, None), "temperature"),
                      ((1e-39, 1, 0, None), "temperature"),
                      ((1, 0, 0, None), "top_p"), ((1, 1.5, 0, None), "top_p"),
                      ((1, 1, -2, None), "top_k"), ((1, 1, 2.0, None), "top_k"),
                      ((1, 1, 0, -1), "seed"), ((1, 1, 0, "x"), "seed")]:
        with pytest.raises(Eagle3Error, match=msg):
            check_sampling(*args)


def test_a_draw_follows_its_weights_and_never_takes_a_zero():
    """`Sampler.sample` (inverse CDF): rows of weights (normalised or not, zeros at either end
    and inside) drawn 60,000 times each: every zero-weight id never, the rest within 4 standard
    deviations of their probability; a lone positive weight is always drawn."""
    sampler = Sampler(SamplingParams(1.0, seed=5))
    w = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0], [0.0, 0.0, 3.0, 1.0, 0.0, 4.0]])  # (2, 6)
    n = 60_000
    ids = sampler.sample(w[:, None, :].expand(2, n, 6))  # (2, n)
    assert ids.shape == (2, n)
    for row, got in zip(w, ids, strict=True):
        p = row / row.sum()
        freq = torch.bincount(got, minlength=6).double() / n
        assert (freq[p == 0] == 0).all(), freq
        sd = (p * (1 - p) / n).sqrt()
        assert ((freq - p).abs() <= 4 * sd + 1e-12).all(), (freq, p)
    for one in ([0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 7.0]):
        t = torch.tensor(one)
        assert sampler.sample(t[None].expand(500, -1)).eq(int(t.argmax())).all()


# -- the rules ------------------------------------------------------------------------------------

def _rule_setup(V=6, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, -1)
    return p, q


def _first_two(emit, n, seed=0):
    """Empirical first emitted token, and second one (present when the first was an accepted
    draft); `emit(sampler) -> emitted tokens` runs one round."""
    sampler = Sampler(SamplingParams(1.0, seed=seed))
    first, second = {}, {}
    for _ in range(n):
        emitted = emit(sampler)
        first[emitted[0]] = first.get(emitted[0], 0) + 1
        if len(emitted) > 1:
            second[emitted[1]] = second.get(emitted[1], 0) + 1
    return first, second


@pytest.mark.parametrize("one_hot", [False, True])
def test_speculative_accept_is_lossless(one_hot):
    """Target rows independent of the history: the first token ~ p[0], the second ~ p[1].
    Drafts sampled from q, or (one-hot variant) each row's argmax of q."""
    p, q = _rule_setup()

    def emit(sampler):
        d = q.argmax(-1) if one_hot else sampler.sample(q)
        a, nxt = speculative_accept(sampler, p, d, None if one_hot else q)
        return d.tolist()[:a] + [nxt]

    n = 6000
    first, second = _first_two(emit, n)
    assert chi_square_p(first, {i: float(x) for i, x in enumerate(p[0])}, n) > 1e-3
    m = sum(second.values())
    assert m > 1000 and chi_square_p(second, {i: float(x) for i, x in enumerate(p[1])}, m) > 1e-3


def test_a_lossy_rule_is_caught():
    """Power: accepting every draft (no rejection) fails the same check."""
    p, q = _rule_setup()

    def accept_all(sampler):
        return sampler.sample(q).tolist() + [int(sampler.sample(p[-1]))]

    first, _ = _first_two(accept_all, 6000)
    assert chi_square_p(first, {i: float(x) for i, x in enumerate(p[0])}, 6000) < 1e-6


def test_tree_accept_is_lossless():
    """root -> children 1 (a), 2 (b), 3 (a, a duplicate: skipped); 1 -> 4 (c), 5 (d); 2 -> 6 (c).
    The first token ~ p[root]; after child j is accepted, the second ~ p[j]."""
    g = torch.Generator().manual_seed(3)
    V = 5
    probs = torch.softmax(torch.randn(7, V, generator=g) * 1.5, -1)
    tokens, parents = [0, 1, 0, 2, 3, 2], [0, 0, 0, 1, 1, 2]
    sampler = Sampler(SamplingParams(1.0, seed=1))
    n = 8000
    first, second = {}, {0: {}, 1: {}}
    for _ in range(n):
        path, nxt = tree_accept(sampler, probs, tokens, parents)
        emitted = [tokens[j - 1] for j in path] + [nxt]
        first[emitted[0]] = first.get(emitted[0], 0) + 1
        if path:
            c = second[path[0] - 1]  # node 1 (token 0) or node 2 (token 1)
            c[emitted[1]] = c.get(emitted[1], 0) + 1
    assert chi_square_p(first, {i: float(x) for i, x in enumerate(probs[0])}, n) > 1e-3
    for node in (1, 2):
        c = second[node - 1]
        m = sum(c.values())
        assert m > 500 and chi_square_p(c, {i: float(x) for i, x in enumerate(probs[node])}, m) > 1e-3


# -- end to end on a tiny target ------------------------------------------------------------------
#
# Six new tokens from a vocabulary of 8: chains of K = 1..4 and a tree run several rounds, and
# the exact distribution of every adjacent pair of output positions is computed by enumerating
# all 8^5 prefixes. n draws make the chi-square check strong enough that a sampler with a
# planted bug (the rejected draft kept, or the resample not taken from the residual) fails it:
# `test_a_broken_sampler_fails_the_end_to_end_check` runs those negative controls.

VOCAB = 8
N_NEW = 6
SPANS = [(i, i + 1) for i in range(N_NEW - 1)]  # every adjacent pair
DRAWS = 1500


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny") / "llama")
    make_hf_model("llama", seed=5, scale=1.5, vocab_size=VOCAB).save_pretrained(d)
    t = load_target(d)
    head = random_head(t, taps=(1, 3, 5), scale=0.5, seed=2)
    attach_head(head, t)
    reduced = random_head(t, taps=(1, 3, 5), scale=0.5, seed=3, draft_vocab_size=6)
    attach_head(reduced, t)
    return t, head, reduced


@torch.no_grad()
def exact_pairs(target, prompt: list[int], params: SamplingParams) -> dict:
    """{span: {(a, b): P(out[i] = a, out[j] = b)}} by enumerating every prefix of the output
    (batched forwards on fresh caches), from the target's sampling distribution alone."""
    sampler = Sampler(params)
    joint = torch.ones(1, dtype=torch.float64)  # over the prefixes, in lexicographic order
    prefixes = torch.zeros(1, 0, dtype=torch.long)
    for _ in range(N_NEW):
        n, T = prefixes.shape[0], len(prompt) + prefixes.shape[1]
        tokens = torch.cat([torch.tensor([prompt]).expand(n, -1), prefixes], 1)
        nxt = []
        for chunk in tokens.split(4096):
            logits, _ = target.forward_logits_taps(chunk, torch.arange(T), target.new_cache(len(chunk), T),
                                                   kv_len=T, with_taps=False)
            nxt.append(sampler.probs(logits[:, -1]).double())
        joint = (joint[:, None] * torch.cat(nxt)).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0),
                              torch.arange(VOCAB).repeat(n)[:, None]], 1)
    J = joint.reshape((VOCAB,) * N_NEW)
    out = {}
    for i, j in SPANS:
        pair = J.sum(dim=[d for d in range(N_NEW) if d not in (i, j)])
        out[(i, j)] = {(a, b): float(pair[a, b]) for a in range(VOCAB) for b in range(VOCAB)}
    return out


def pair_p_values(outputs: list[tuple], want: dict) -> dict:
    """The chi-square p-value of each span's observed pairs against `want`."""
    out = {}
    for (i, j), probs in want.items():
        counts: dict = {}
        for seq in outputs:
            counts[(seq[i], seq[j])] = counts.get((seq[i], seq[j]), 0) + 1
        out[(i, j)] = chi_square_p(counts, probs, len(outputs))
    return out


def draw(spec, prompt, params, mode: str, n: int = DRAWS) -> tuple[list[tuple], int]:
    """n seeded samples of N_NEW tokens after `prompt` (seeds 0..n-1) in MODES[mode], and the
    drafts accepted. Chains and trees of the head's full vocabulary run as one engine batch of
    32 rows: the engine gives each seeded request generate's tokens (`tests/test_engine.py`
    `test_engine_equals_generate_greedy_and_sampled`, sampled chains and trees; hybrid in
    `tests/test_suffix.py`), ~20x cheaper here than n sequential generates. Other modes
    (plain, a reduced draft vocabulary) call generate itself, so its draws stay tested directly."""
    kw = MODES[mode]
    if mode != "plain" and not mode.endswith("reduced_vocab"):
        return draw_batched(spec, prompt, params, kw, n)
    outputs, accepted = [], 0
    for seed in range(n):
        r = spec.generate(prompt, N_NEW, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k, seed=seed, stop_token_ids=[], **kw)
        outputs.append(tuple(r.token_ids))
        accepted += r.stats["accepted_tokens"]
    return outputs, accepted


def draw_batched(spec, prompt, params, kw: dict, n: int) -> tuple[list[tuple], int]:
    from eagle3.engine import Engine, EngineConfig

    shape = (dict(tree=kw["tree"], auto_plan=False) if "tree" in kw else
             dict(num_draft_tokens=kw["num_draft_tokens"]))
    engine = Engine(spec, EngineConfig(max_batch=32, max_queue=n, proposer=kw.get("proposer"),
                                       **shape)).start(background=False)
    reqs = [engine.submit(prompt, N_NEW, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k, seed=seed, stop_token_ids=[]) for seed in range(n)]
    engine.run_until_idle()
    assert engine.pool.used_tokens == 0
    return ([tuple(r.token_ids) for r in reqs],
            sum(r.metrics["spec_decode_num_accepted_tokens"] for r in reqs))


TREE = dict(tree=dict(top_k=3, depth=3, total_tokens=8))
MODES = {"plain": dict(), "K=1": dict(num_draft_tokens=1), "K=2": dict(num_draft_tokens=2),
         "K=4": dict(num_draft_tokens=4), "tree": TREE,
         "K=2_reduced_vocab": dict(num_draft_tokens=2), "tree_reduced_vocab": TREE,
         # with drafts from the text (`decoding.suffix`): point masses, by recursive rejection
         "hybrid_K=2": dict(num_draft_tokens=2, proposer="hybrid"),
         "hybrid_tree": dict(**TREE, proposer="hybrid")}
PARAMS = [SamplingParams(1.0), SamplingParams(0.8, top_p=0.85, top_k=5)]
# Every mode at temperature 1; the warped distribution on a chain and a tree (suite time).
CASES = [(m, PARAMS[0]) for m in MODES] + [("K=2", PARAMS[1]), ("tree", PARAMS[1])]


def spec_for(tiny, mode: str) -> Eagle3Speculator:
    target, head, reduced = tiny
    return Eagle3Speculator(target, None if mode == "plain" else
                            reduced if mode.endswith("reduced_vocab") else head)


@pytest.fixture(scope="module")
def exact(tiny):
    return {p: exact_pairs(tiny[0], [3, 7, 1], p) for p in PARAMS}


@pytest.mark.slow
@pytest.mark.parametrize("mode,params", CASES,
                         ids=[f"{m}-t{p.temperature}-p{p.top_p}-k{p.top_k}" for m, p in CASES])
def test_speculative_sampling_matches_the_exact_distribution(tiny, exact, mode, params):
    outputs, accepted = draw(spec_for(tiny, mode), [3, 7, 1], params, mode)
    for span, p in pair_p_values(outputs, exact[params]).items():
        assert p > 1e-3, (mode, span, p)
    if mode != "plain":  # hundreds of accepted drafts: the rules ran, over several rounds
        assert accepted > DRAWS // 10, accepted


SUFFIX_MODES = {"suffix": dict(proposer="suffix"), "hybrid_K=2": dict(num_draft_tokens=2, proposer="hybrid"),
                "hybrid_tree": dict(**TREE, proposer="hybrid")}


SUFFIX_PARAMS = SamplingParams(0.5)


@pytest.fixture(scope="module")
def repeating(tmp_path_factory):
    """A sharper tiny target (weights x4), a random head for it, a prompt whose text the suffix
    proposer matches and continues with tokens the target likes (its own greedy run of 40
    tokens after [3, 7, 1], which settles into a repetition), and the exact pair distributions
    after that prompt at temperature 0.5."""
    d = str(tmp_path_factory.mktemp("sharp") / "llama")
    make_hf_model("llama", seed=5, scale=4.0, vocab_size=VOCAB).save_pretrained(d)
    t = load_target(d)
    head = random_head(t, taps=(1, 3, 5), scale=0.5, seed=2)
    attach_head(head, t)
    (prompt,) = greedy_runs(t, [[3, 7, 1]], 40)
    return t, head, prompt, exact_pairs(t, prompt, SUFFIX_PARAMS)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(SUFFIX_MODES))
def test_suffix_sampling_matches_the_exact_distribution(repeating, mode):
    """Drafts from the text are point masses, accepted by recursive rejection: the same
    chi-square checks, on a prompt whose text they match, with hundreds of their tokens
    accepted (so the rule ran)."""
    target, head, prompt, exact = repeating
    spec = Eagle3Speculator(target, head)
    p = SUFFIX_PARAMS
    outputs, from_text = [], 0
    for seed in range(DRAWS):
        r = spec.generate(prompt, N_NEW, temperature=p.temperature, seed=seed, stop_token_ids=[],
                          **SUFFIX_MODES[mode])
        outputs.append(tuple(r.token_ids))
        from_text += r.stats["suffix_accepted_tokens"]
    assert len(set(outputs)) > 20  # a distribution, not one greedy answer
    for span, pv in pair_p_values(outputs, exact).items():
        assert pv > 1e-3, (mode, span, pv)
    assert from_text > DRAWS // 5, from_text


@pytest.mark.slow
def test_a_broken_text_rule_fails_the_same_check(repeating, monkeypatch):
    """The negative control for drafts from the text: recursive rejection that always keeps a
    node's first child (the text's token) must fail the check above (p < 1e-6 on some span)."""
    from eagle3.decoding import accept

    monkeypatch.setattr(accept, "tree_accept", _keep_first_child)
    target, _, prompt, exact = repeating
    spec = Eagle3Speculator(target)
    outputs = [tuple(spec.generate(prompt, N_NEW, temperature=SUFFIX_PARAMS.temperature, seed=seed,
                                   stop_token_ids=[], proposer="suffix").token_ids) for seed in range(DRAWS)]
    assert min(pair_p_values(outputs, exact).values()) < 1e-6


def _keep_first_child(sampler, probs, tokens, parents):
    """A broken tree rule: every node's first child accepted, never a rejection."""
    path, node = [], 0
    while True:
        kids = [j for j, par in enumerate(parents, start=1) if par == node]
        if not kids:
            return path, int(sampler.sample(probs[node]))
        path.append(kids[0])
        node = kids[0]


def _keep_the_rejected_draft(sampler, p, drafts, q=None):
    a, nxt = speculative_accept(sampler, p, drafts, q)
    if a < drafts.shape[0]:  # off by one: the first rejected draft is emitted as accepted
        return a + 1, int(sampler.sample(p[a + 1]))
    return a, nxt


def _resample_from_the_target(sampler, p, drafts, q=None):
    a, nxt = speculative_accept(sampler, p, drafts, q)
    if a < drafts.shape[0]:  # after a rejection, draw from p rather than from max(p - q, 0)
        return a, int(sampler.sample(p[a]))
    return a, nxt


@pytest.mark.slow
@pytest.mark.parametrize("bug", [_keep_the_rejected_draft, _resample_from_the_target],
                         ids=["rejected-draft-kept", "no-residual"])
def test_a_broken_sampler_fails_the_end_to_end_check(tiny, exact, bug, monkeypatch):
    """The negative controls: the same draws and check as above with one rule broken must fail
    (p < 1e-6 on some span), so the check above has the power to catch such a bug."""
    from eagle3.decoding import accept

    monkeypatch.setattr(accept, "speculative_accept", bug)
    params = PARAMS[0]
    outputs, _ = draw(spec_for(tiny, "K=2"), [3, 7, 1], params, "K=2")
    assert min(pair_p_values(outputs, exact[params]).values()) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tree", "hybrid_tree"])
def test_a_broken_tree_rule_fails_the_end_to_end_check(tiny, exact, mode, monkeypatch):
    """The negative control for the head's tree and for hybrid sampling (the head's tree with
    the text's chains grafted on): the same draws and check with every first child accepted
    must fail (p < 1e-6 on some span)."""
    from eagle3.decoding import accept

    monkeypatch.setattr(accept, "tree_accept", _keep_first_child)
    params = PARAMS[0]
    outputs, _ = draw(spec_for(tiny, mode), [3, 7, 1], params, mode)
    assert min(pair_p_values(outputs, exact[params]).values()) < 1e-6


@pytest.mark.parametrize("mode", list(MODES))
def test_same_seed_same_output(tiny, mode):
    spec = spec_for(tiny, mode)
    run = lambda seed: spec.generate([1, 2, 3], 12, temperature=1.0, seed=seed, stop_token_ids=[],  # noqa: E731
                                     **MODES[mode]).token_ids
    assert run(7) == run(7)
    assert len({tuple(run(s)) for s in range(8)}) > 1


@pytest.mark.parametrize("mode", list(MODES))
def test_top_k_one_is_greedy(tiny, mode):
    """top_k=1 (or a tiny top_p) leaves the argmax only: sampling must equal greedy decoding."""
    target = tiny[0]
    spec = spec_for(tiny, mode)
    greedy = Eagle3Speculator(target).generate([4, 5], 15, stop_token_ids=[]).token_ids
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        got = spec.generate([4, 5], 15, temperature=1.0, seed=0, stop_token_ids=[], **kw, **MODES[mode])
        assert got.token_ids == greedy


def test_sampling_to_the_cache_end_with_stop_ids(tiny):
    """Sampled chains and trees run to the cache's last slot (shrinking drafts), and stop after
    the first stop id exactly as plain sampling's semantics say."""
    target, head, _ = tiny
    spec = Eagle3Speculator(target, head)
    room = target.config.max_seq_len - 3
    for kw in (dict(num_draft_tokens=3), TREE):
        r = spec.generate([1, 2, 3], room, temperature=1.0, seed=5, stop_token_ids=[], **kw)
        assert len(r.token_ids) == room
        s = r.stats
        assert s["rounds"] == sum(s["accept_len_hist"]) and s["accepted_tokens"] == sum(
            s["accepted_per_position"])
        stop = r.token_ids[10]
        cut = spec.generate([1, 2, 3], room, temperature=1.0, seed=5, stop_token_ids=[stop], **kw)
        first = r.token_ids.index(stop)
        assert cut.token_ids == r.token_ids[:first + 1]  # same draws up to the stop
