"""Tree drafting: shapes, the tree built from the draft, and greedy losslessness against plain decoding.

Tree greedy output must equal plain greedy output for every tree shape,
architecture, vocabulary and acceptance pattern (heads scripted to agree fully,
through a second child, or not at all, on a target whose attention changes its
output: tests/heads.py), with EOS inside an accepted path, and up to the cache's
last slot where the tree must shrink.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eagle3
from conftest import make_hf_model
from eagle3.decoding.accept import greedy_path
from eagle3.decoding.drafting import catch_up
from eagle3.decoding.round import Proposal, SequenceState, prefill
from eagle3.decoding.tree import DEFAULT_TREE, TreeShape, parse_tree, select_tree
from eagle3.draft import attach_head
from eagle3.errors import Eagle3Error
from eagle3.speculator import Eagle3Speculator
from eagle3.targets import load_target
from heads import random_head, save_context_target, scripted_head

V = 160
SHAPES = [dict(top_k=1, depth=1, total_tokens=1), dict(top_k=2, depth=3, total_tokens=5),
          dict(top_k=4, depth=5, total_tokens=16), dict(top_k=3, depth=8, total_tokens=40),
          dict(top_k=8, depth=2, total_tokens=30)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    out = {}
    for name in ("llama", "qwen2", "gemma2", "mistral", "gemma3"):
        d = str(root / name)
        make_hf_model(name, seed=3).save_pretrained(d)
        out[name] = d
    out["ctx"] = save_context_target(str(root / "ctx"), "llama")
    return out


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def spec_with(target, head) -> Eagle3Speculator:
    attach_head(head, target)
    return Eagle3Speculator(target, head)


def scripted(target, mode: str, ps: list[list[int]], n: int, **kw) -> Eagle3Speculator:
    """A speculator whose head drafts `target`'s greedy runs of `ps` (n tokens) per `mode`."""
    return spec_with(target, scripted_head(target, ps, n, mode, **kw))


def plain(target, prompt, n, stop=()):
    return Eagle3Speculator(target).generate(prompt, n, stop_token_ids=list(stop)).token_ids


# -- shapes -----------------------------------------------------------------------------------------

def test_parse_tree():
    assert parse_tree(None) is None and parse_tree(False) is None
    assert parse_tree(True) == DEFAULT_TREE
    assert parse_tree({"top_k": 2}) == TreeShape(2, DEFAULT_TREE.depth, DEFAULT_TREE.total_tokens)
    assert parse_tree({"top_k": 3, "depth": 4, "total_tokens": 10}) == TreeShape(3, 4, 10)
    for bad, msg in [({"width": 3}, "unknown tree key 'width'"), ({"top_k": 0}, "positive integer"),
                     ({"depth": 2.5}, "positive integer"), ("yes", "must be True"),
                     ({"top_k": 1, "depth": 3, "total_tokens": 4}, "more than the 3 nodes"),
                     ({"top_k": 20, "depth": 15, "total_tokens": 40}, "280 draft slots")]:
        with pytest.raises(Eagle3Error, match=msg):
            parse_tree(bad)


def test_bad_tree_requests(dirs):
    t = load_target(dirs["llama"])
    spec = spec_with(t, random_head(t, draft_vocab_size=16, taps=(1, 3, 5)))
    with pytest.raises(Eagle3Error, match="exceeds the head's draft vocabulary"):
        spec.generate([1, 2], 4, tree={"top_k": 17, "depth": 2, "total_tokens": 17})
    hf = eagle3.load(dirs["llama"], "none", backend="hf")
    hspec = spec_with(hf.target, random_head(hf.target, taps=(1, 3, 5)))
    with pytest.raises(Eagle3Error, match="need a native target"):
        hspec.generate([1, 2], 4, tree=True)


# -- the tree built from candidates -----------------------------------------------------------------

@st.composite
def candidates(draw):
    """A level-ordered candidate list as draft_tree builds it, with random log-probabilities."""
    k = draw(st.integers(1, 4))
    depth = draw(st.integers(1, 4))
    lp = lambda n: [-draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5])) for _ in range(n)]  # noqa: E731
    scores = lp(k)
    parents, levels = [-1] * k, [1] * k
    front = list(range(k))
    for level in range(2, depth + 1):
        base = len(scores)
        child = [scores[f] + x for f in front for x in lp(k)]
        scores += child
        parents += [f for f in front for _ in range(k)]
        levels += [level] * (k * k)
        order = sorted(range(len(child)), key=lambda i: -child[i])[:k]
        front = [base + i for i in order]
    n = draw(st.integers(1, len(scores)))
    return scores, parents, levels, n


@settings(max_examples=60, deadline=None)
@given(candidates())
def test_select_tree_is_a_connected_tree(c):
    scores, parents, levels, n = c
    M = len(scores)
    tokens, tree_parents, depth, mask = (x[0] for x in select_tree(
        torch.arange(M)[None], torch.tensor(scores)[None], torch.tensor(parents)[None],
        torch.tensor(levels)[None], n, max(levels)))
    kept = tokens.tolist()  # tokens = candidate ids here
    assert len(kept) == n == len(set(kept))
    # The n best scores are kept (ties may pick either candidate of equal score).
    assert sorted((scores[i] for i in kept), reverse=True) == sorted(scores, reverse=True)[:n]
    node_of = {cand: j for j, cand in enumerate(kept, start=1)}
    for j, cand in enumerate(kept, start=1):
        par = tree_parents[j - 1].item()
        assert par < j  # parents first
        assert par == (0 if parents[cand] < 0 else node_of[parents[cand]])  # connected
        assert depth[j] == levels[cand]
    # mask row j: node j and its ancestors, by walking up.
    for j in range(n + 1):
        want, node = {j}, j
        while node:
            node = tree_parents[node - 1].item()
            want.add(node)
        assert set(torch.nonzero(mask[j]).flatten().tolist()) == want


def test_greedy_path():
    # root -> 1 (a), 2 (b); 1 -> 3 (c), 4 (d); 2 -> 5 (c)
    tokens, parents = [10, 11, 12, 13, 12], [0, 0, 1, 1, 2]
    verify = [11, 99, 12, 0, 0, 7]  # after root: 11 -> node 2; after node 2: 12 -> node 5
    assert greedy_path(verify, tokens, parents) == [2, 5]
    assert greedy_path([42, 0, 0, 0, 0, 0], tokens, parents) == []


@torch.no_grad()
def test_draft_tree_equals_stateless_recompute(dirs):
    """Each node's draft score = its parent's + the log-prob the draft gives its token when run
    from scratch along the node's path (causal, fresh cache): the tree mask, RoPE positions,
    slots and features are right."""
    t = load_target(dirs["llama"])
    head = random_head(t, draft_vocab_size=48, taps=(1, 3, 5), scale=0.3)
    spec = spec_with(t, head)
    shape = TreeShape(3, 4, 20)
    prompt = torch.tensor([prompts(1, 5)[0] + [7, 9]])
    n = prompt.shape[1]
    seq = SequenceState("s", prompt[0].tolist(), 30, frozenset())
    anchor = torch.tensor([[prefill(spec.runner, seq)]])
    catch_up(spec.runner, [seq])
    tree = spec.runner.draft_tree([seq], shape, [shape.total_tokens])
    _, taps = t.forward_logits_taps(prompt, torch.arange(n), t.new_cache(), taps=(1, 3, 5))
    feats = head.fuse(taps)  # (1, n, H)
    seed = torch.cat([prompt[:, 1:], anchor], dim=1)
    tokens, parents = tree.tokens[0], tree.parents[0]

    def path_of(j):
        path = []
        while j:
            path.append(j)
            j = parents[j - 1].item()
        return path[::-1]

    t2d = {int(d + head.d2t[d]): d for d in range(48)}
    for j in range(1, tokens.shape[0] + 1):
        path = path_of(j)
        # From scratch: seed tokens with target features, then one step per path node before j.
        cache = head.new_cache(1, 64)
        logits, h = head(seed, feats, torch.arange(n), cache, kv_len=n)
        lg, feat = logits[0, -1], h[:, -1:]
        for i, node in enumerate(path[:-1]):
            tok = tokens[node - 1].view(1, 1)
            logits, feat = head(tok, feat, torch.tensor([n + i]), cache, kv_len=n + i + 1)
            lg = logits[0, -1]
        lp = torch.log_softmax(lg.float(), -1)
        tok = int(tokens[j - 1])
        assert tok in t2d
        assert lp[t2d[tok]] >= lp.topk(shape.top_k).values[-1] - 1e-5  # among its parent's top_k
    assert int(tree.depth.max()) <= shape.depth


# -- greedy losslessness ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("shape", SHAPES + [True], ids=lambda s: "default" if s is True else
                         f"{s['top_k']}x{s['depth']}x{s['total_tokens']}")
def test_random_head_tree_lossless(dirs, name, shape):
    t = load_target(dirs[name])
    head = random_head(t, taps=(1, 3, 5), scale=0.3, draft_vocab_size=64 if name == "qwen2" else None)
    spec = spec_with(t, head)
    for p in prompts(3, seed=len(name)):
        r = spec.generate(p, 20, tree=shape, stop_token_ids=[])
        assert r.token_ids == plain(t, p, 20)
        assert r.stats["tree"] == parse_tree(shape).as_dict()


@pytest.fixture(scope="module")
def ctx(dirs):
    return load_target(dirs["ctx"])


@pytest.mark.parametrize("mode", ["full", "second", "zero"])
@pytest.mark.parametrize("shape", [dict(top_k=2, depth=4, total_tokens=8),
                                   dict(top_k=4, depth=6, total_tokens=24)])
def test_forced_heads_tree(ctx, mode, shape):
    t = ctx
    spec = scripted(t, mode, ps := prompts(4, seed=11), 40)
    compacted = []
    real_compact = t.compact_cache
    t.compact_cache = lambda cache, src, dst: (compacted.append(src.tolist()), real_compact(cache, src, dst))
    try:
        for p in ps:
            r = spec.generate(p, 40, tree=shape, stop_token_ids=[])
            assert r.token_ids == plain(t, p, 40)
            hist = r.stats["accept_len_hist"]
            if mode == "full":  # the top-1 chain is always right: every round accepts `depth`
                assert hist[shape["depth"]] >= r.stats["rounds"] - 1
            elif mode == "second":  # the right token is a second child: one per round
                assert hist[1] >= r.stats["rounds"] - 2
    finally:
        del t.compact_cache
    if mode == "second":  # non-contiguous accepted paths were compacted
        assert compacted


def test_reduced_vocab_and_own_embedding_tree(ctx):
    ps = prompts(3, seed=4)
    vocab = sorted(set(range(0, V, 2)) | {tok for p in ps for tok in plain(ctx, p, 30)})
    for own in (False, True):
        spec = scripted(ctx, "full", ps, 30, draft_vocab=vocab, own_embedding=own)
        for p in ps:
            r = spec.generate(p, 30, tree=dict(top_k=3, depth=5, total_tokens=12), stop_token_ids=[])
            assert r.token_ids == plain(ctx, p, 30)
            assert r.stats["mean_accept_len"] > 4


def test_eos_inside_an_accepted_path(ctx):
    p = prompts(1, seed=9)[0]
    spec = scripted(ctx, "full", [p], 30)
    free = plain(ctx, p, 30)
    for i in (2, 3, 7):  # stop ids that occur inside accepted paths
        stop = [free[i]]
        want = plain(ctx, p, 30, stop)
        got = spec.generate(p, 30, tree=dict(top_k=2, depth=6, total_tokens=12), stop_token_ids=stop)
        assert got.token_ids == want and got.token_ids[-1] == stop[0]


@pytest.mark.parametrize("mode", ["full", "second"])
def test_tree_runs_exactly_to_max_len(dirs, mode):
    """Up to the last slot: the tree shrinks to the room left (capacity counts nodes)."""
    t = load_target(dirs["ctx"], max_seq_len=40)
    for plen in (1, 5, 17, 30, 38):
        p = prompts(1, seed=plen)[0][:1] * plen
        n = 40 - plen
        spec = scripted(t, mode, [p], n)
        r = spec.generate(p, n, tree=dict(top_k=4, depth=6, total_tokens=24), stop_token_ids=[])
        assert r.token_ids == plain(t, p, n)
        assert len(r.token_ids) == n


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(1, V - 1), min_size=1, max_size=12), k=st.integers(1, 4),
       depth=st.integers(1, 6), total=st.integers(1, 30), n=st.integers(1, 30),
       mode=st.sampled_from(["full", "second", "zero"]))
def test_property_tree_lossless(ctx, prompt, k, depth, total, n, mode):
    total = min(total, k + (depth - 1) * k * k)
    spec = scripted(ctx, mode, [prompt], n)
    got = spec.generate(prompt, n, tree=dict(top_k=k, depth=depth, total_tokens=total), stop_token_ids=[])
    assert got.token_ids == plain(ctx, prompt, n)
    s = got.stats
    assert s["rounds"] == sum(s["accept_len_hist"])
    assert s["accepted_tokens"] == sum(s["accepted_per_position"])


def test_low_acceptance_warning_judges_the_first_position(dirs, ctx, capsys):
    t = load_target(dirs["llama"])
    spec = spec_with(t, random_head(t, taps=(1, 3, 5)))  # agrees with the target ~never
    spec.generate(prompts(1)[0], 60, tree=dict(top_k=2, depth=2, total_tokens=3), stop_token_ids=[])
    assert "acceptance is near zero" in capsys.readouterr().err
    # A good head in a wide tree: 2 of 72 nodes accepted per round, every first position right.
    good = scripted(ctx, "full", prompts(1), 120)
    r = good.generate(prompts(1)[0], 120, tree=dict(top_k=8, depth=2, total_tokens=72),
                      stop_token_ids=[])
    assert r.stats["rounds"] >= 32 and r.stats["accepted_tokens"] / r.stats["draft_tokens"] < 0.05
    assert "near zero" not in capsys.readouterr().err


def test_cli_tree_and_sampling(dirs, ctx, tmp_path, capsys):
    import json

    from eagle3.cli import main
    from eagle3.draft import save_head

    p = prompts(1, 21)[0]
    save_head(scripted_head(ctx, [p], 20), str(tmp_path / "head"), "speculators", include_embedding=True)
    base = ["generate", "--target", dirs["ctx"], "--draft", str(tmp_path / "head"), "--prompt-ids",
            ",".join(map(str, p)), "--max-new-tokens", "20", "--stop-ids", "", "--json"]

    def run(*extra):
        code = main(base + list(extra))
        captured = capsys.readouterr()
        return code, (json.loads(captured.out) if code == 0 else captured.err)

    want = plain(ctx, p, 20)
    code, out = run("--tree-depth", "5", "--tree-top-k", "2", "--tree-total-tokens", "9")
    assert code == 0 and out["token_ids"] == want
    assert out["stats"]["tree"] == {"top_k": 2, "depth": 5, "total_tokens": 9}
    assert out["stats"]["mean_accept_len"] == pytest.approx(6.0, abs=1.0)  # depth 5 + the bonus
    code, out = run("--tree")
    assert code == 0 and out["token_ids"] == want and out["stats"]["tree"] == DEFAULT_TREE.as_dict()
    sampled = [run("--temperature", "0.9", "--top-p", "0.9", "--seed", "4", *extra)[1]["token_ids"]
               for extra in ([], [], ["--tree"])]
    assert sampled[0] == sampled[1] and len(sampled[2]) == 20
    for extra, msg in [(["--chain", "--tree-depth", "3"], "--chain contradicts"),
                       (["--tree-top-k", "0"], "top_k must be a positive integer"),
                       (["--temperature", "-1"], "temperature must be"),
                       (["--top-p", "0"], "top_p must be in"),
                       (["--tree-total-tokens", "500"], "more than the")]:
        code, err = run(*extra)
        assert code == 2 and msg in err and "Traceback" not in err, (extra, err)


def oracle_tree(tokens: list[int], parents: list[int]) -> Proposal:
    """A one-row proposal of these nodes (ancestor mask by walking up, written independently)."""
    depth = [0]
    for par in parents:
        depth.append(depth[par] + 1)
    N = len(tokens)
    mask = torch.zeros(N + 1, N + 1, dtype=torch.bool)
    for j in range(N + 1):
        node = j
        mask[j, node] = True
        while node:
            node = parents[node - 1]
            mask[j, node] = True
    return Proposal(torch.tensor([tokens]), torch.tensor([parents]), torch.tensor([depth]), mask[None],
                    q=[None], counts=[N])


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gemma3"])
def test_deep_paths_through_second_children_on_real_attention(dirs, name, monkeypatch):
    """Trees that put the target's own continuation, 10 deep, under a decoy first child: every
    round accepts a non-contiguous path through real attention layers (sliding windows of 7
    < the depth), so the tree mask, RoPE and window positions and the compaction all matter."""
    t = load_target(dirs[name])
    spec = spec_with(t, random_head(t, taps=(1, 3, 5)))
    prompt = [5, 9, 11, 3, 7, 1, 2]
    n, new, D = len(prompt), 60, 10
    full = plain(t, prompt, new)

    def oracle_draft_tree(rows, shape, counts):
        catch_up(spec.runner, rows)
        i = rows[0].draft_len - n  # the anchor is full[i]
        true = full[i + 1:i + 1 + D]
        tokens = [(true[0] + 1) % V] + true  # node 1: a decoy; nodes 2..: the continuation
        parents = [0, 0] + list(range(2, len(true) + 1))
        m = min(counts[0], len(tokens))
        return oracle_tree(tokens[:m], parents[:m])

    monkeypatch.setattr(spec.runner, "draft_tree", oracle_draft_tree)
    r = spec.generate(prompt, new, tree=dict(top_k=2, depth=D, total_tokens=D + 1), stop_token_ids=[])
    assert r.token_ids == full
    assert r.stats["accept_len_hist"][D] >= 4  # full-depth paths through the second child


def test_api_argument_errors(dirs):
    t = load_target(dirs["llama"])
    spec = spec_with(t, random_head(t, taps=(1, 3, 5)))
    with pytest.raises(Eagle3Error, match="with tree= set, leave it None"):
        spec.generate([1, 2], 4, tree=True, num_draft_tokens=3)
    with pytest.raises(Eagle3Error, match="temperature must be 0"):
        spec.generate([1, 2], 4, temperature=1e-39)
