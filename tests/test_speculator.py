"""Eagle3Speculator: the four methods, the shifted chain runner, losslessness, stats, capacity.

Losslessness is checked against plain greedy decoding (itself checked against
transformers in test_targets.py) with random heads (acceptance ~0) and with
heads scripted to agree with the target fully, partially or not at all, on
targets whose attention changes their output (`heads.save_context_target`):
a wrong K/V row, mask, RoPE position or rollback changes the tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eagle3
from conftest import make_hf_model
from eagle3.decoding.drafting import catch_up, draft_chain
from eagle3.decoding.round import Plan, SequenceState, grant, prefill
from eagle3.draft import attach_head, save_head
from eagle3.engine import Engine, EngineConfig
from eagle3.speculator import Eagle3Speculator
from eagle3.targets import load_target
from heads import random_head, save_context_target, scripted_head

V = 160


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Checkpoints: random targets and context targets (attention matters, greedy runs vary)."""
    root = tmp_path_factory.mktemp("spec")
    out = {}
    for name in ("llama", "qwen2", "gemma2"):
        d = str(root / name)
        make_hf_model(name, seed=1).save_pretrained(d)
        out[name] = d
        out[f"ctx_{name}"] = save_context_target(str(root / f"ctx_{name}"), name)
    return out


def prompts(n: int, seed: int = 0, low: int = 1, high: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def plain_tokens(target, prompt, n, stop=()):
    return Eagle3Speculator(target).generate(prompt, n, stop_token_ids=list(stop)).token_ids


def spec_with(target, head) -> Eagle3Speculator:
    attach_head(head, target)
    return Eagle3Speculator(target, head)


def scripted(target, mode: str, ps: list[list[int]], n: int, **kw) -> Eagle3Speculator:
    """A speculator whose head drafts `target`'s greedy runs of `ps` (n tokens) per `mode`."""
    return spec_with(target, scripted_head(target, ps, n, mode, **kw))


# -- the four methods ------------------------------------------------------------------------------

def test_methods_match_the_underlying_models(dirs):
    t = load_target(dirs["llama"])
    head = random_head(t, taps=(1, 3, 5))
    spec = spec_with(t, head)
    prompt = torch.tensor([prompts(1, 3, 10, 11)[0]])  # (1, 10)
    n = prompt.shape[1]
    with torch.no_grad():
        ref_logits, ref_taps = t.forward_logits_taps(prompt, torch.arange(n), t.new_cache(), taps=(1, 3, 5))
    spec.reset_caches()
    tok, feat = spec.prefill(prompt, torch.arange(n))
    assert tok.tolist() == [int(ref_logits[0, -1].argmax())]
    torch.testing.assert_close(feat, head.fuse(ref_taps))
    assert feat.shape == (1, n, head.config.hidden_size)

    # target_verify reuses the prefilled cache: same as one forward over prompt + new tokens.
    new = torch.tensor([[5, 6, 7, 8]])
    vids, vfeat = spec.target_verify(new, torch.arange(n, n + 4))
    with torch.no_grad():
        full_logits, full_taps = t.forward_logits_taps(torch.cat([prompt, new], 1), torch.arange(n + 4),
                                                       t.new_cache(), taps=(1, 3, 5))
    assert vids.tolist() == full_logits[:, n:].argmax(-1).tolist()
    torch.testing.assert_close(vfeat, head.fuse(full_taps[:, n:]), atol=1e-5, rtol=1e-5)

    # draft_decode == the head's own forward mapped through d2t.
    ids, h = spec.draft_decode(prompt, feat, torch.arange(n))
    with torch.no_grad():
        dlogits, dh = head(prompt, feat, torch.arange(n), head.new_cache())
    assert ids.tolist() == head.to_target_ids(dlogits.argmax(-1)).tolist()
    torch.testing.assert_close(h, dh)

    # decode: one plain step.
    spec.reset_caches()
    spec.prefill(prompt, torch.arange(n))
    nxt, f1 = spec.decode(tok.view(1, 1), torch.tensor([n]))
    with torch.no_grad():
        ref, _ = t.forward_logits_taps(torch.cat([prompt, tok.view(1, 1)], 1), torch.arange(n + 1),
                                       t.new_cache(), with_taps=False)
    assert nxt.tolist() == [int(ref[0, -1].argmax())]
    assert f1.shape == (1, 1, head.config.hidden_size)


def test_alignment_contract(dirs):
    """prefill token == greedy[0]; target_verify over [greedy[0..K]] gives greedy[1..K+1]."""
    t = load_target(dirs["qwen2"])
    spec = spec_with(t, random_head(t, taps=(0, 3, 6)))
    for prompt in prompts(3, 5):
        greedy = plain_tokens(t, prompt, 10)
        n = len(prompt)
        spec.reset_caches()
        tok, _ = spec.prefill(torch.tensor([prompt]), torch.arange(n))
        assert int(tok) == greedy[0]
        vids, vfeat = spec.target_verify(torch.tensor([greedy[:6]]), torch.arange(n, n + 6))
        assert vids[0].tolist() == greedy[1:7]
        assert vfeat.shape[1] == 6


def test_heads_with_other_taps_share_one_target(dirs):
    """Taps are the head's, passed to every forward: attaching a head leaves the target as it
    was, and two speculators over one target each read their own layers."""
    t = load_target(dirs["llama"], taps=(1, 2, 3))
    before = t.tap_layers
    a, b = random_head(t, taps=(1, 3, 5), scale=0.2), random_head(t, taps=(0, 2, 4), scale=0.2)
    assert attach_head(a, t) == (1, 3, 5) and attach_head(b, t) == (0, 2, 4)
    assert t.tap_layers == before
    sa, sb = Eagle3Speculator(t, a), Eagle3Speculator(t, b)
    prompt = torch.tensor([prompts(1, 5, 9, 10)[0]])
    n = prompt.shape[1]
    for spec, taps in ((sa, (1, 3, 5)), (sb, (0, 2, 4)), (sa, (1, 3, 5))):  # interleaved
        spec.reset_caches()
        _, feat = spec.prefill(prompt, torch.arange(n))
        with torch.no_grad():
            _, ref = t.forward_logits_taps(prompt, torch.arange(n), t.new_cache(), taps=taps)
        torch.testing.assert_close(feat, spec.draft.fuse(ref))
    assert (sa.runner.taps, sb.runner.taps) == ((1, 3, 5), (0, 2, 4))
    assert Engine(sb, EngineConfig(max_batch=1, num_draft_tokens=2)).runner.taps == (0, 2, 4)
    greedy = plain_tokens(t, prompt[0].tolist(), 16)
    assert sa.generate(prompt[0].tolist(), 16, num_draft_tokens=3).token_ids == greedy
    assert sb.generate(prompt[0].tolist(), 16, num_draft_tokens=3).token_ids == greedy
    assert t.tap_layers == before


def test_cached_draft_chain_equals_stateless_recompute(dirs):
    t = load_target(dirs["llama"])
    head = random_head(t, taps=(1, 3, 5), scale=0.2)
    spec = spec_with(t, head)
    prompt = torch.tensor([prompts(1, 7, 12, 13)[0]])
    n = prompt.shape[1]
    seq = SequenceState("s", prompt[0].tolist(), 20, frozenset())
    tok = prefill(spec.runner, seq)  # the prompt's forward; the draft's catch-up waits
    assert (seq.draft_len, seq.target_len, len(seq.pending_ids)) == (0, n, n)
    catch_up(spec.runner, [seq])
    assert seq.draft_len == seq.target_len == n and not seq.pending_ids
    drafts, _ = draft_chain(spec.runner, [seq], seq.root[None], seq.boundary[None, None], [n], 5)
    with torch.no_grad():
        _, taps = t.forward_logits_taps(prompt, torch.arange(n), t.new_cache(), taps=(1, 3, 5))
    feat = head.fuse(taps)
    seed_tokens = torch.cat([prompt[:, 1:], torch.tensor([[tok]])], 1)
    # Recompute without a cache: one forward over all slots, feeding each step the previous output.
    tokens, feats = seed_tokens, feat
    ids = []
    with torch.no_grad():
        for _ in range(5):
            logits, h = head(tokens, feats, torch.arange(tokens.shape[1]), head.new_cache())
            nxt = head.to_target_ids(logits[:, -1:].argmax(-1))
            ids.append(int(nxt))
            tokens = torch.cat([tokens, nxt], 1)
            feats = torch.cat([feats, h[:, -1:]], 1)
    assert drafts[0].tolist() == ids
    assert seq.draft_len == n  # drafting leaves the committed length unchanged


def test_the_heads_fc_runs_once_a_catch_up_over_the_accepted_rows_only(monkeypatch):
    """The target's taps become the head's features at the catch-up, over the row's backlog in
    one call: one fc per drafting round, over the prompt first, then over each round's accepted
    path and next token (never a verify's rejected rows), and none in plain rounds."""
    from eagle3.decoding import planner

    s = eagle3.load("default")
    ids = s.tokenizer.encode("Name three rivers and the seas they flow into.")
    s.generate(ids, 8, proposer="eagle", num_draft_tokens=3)  # the cost model's calibration first
    rows: list[int] = []
    fuse = s.draft.fuse
    monkeypatch.setattr(s.draft, "fuse", lambda taps: rows.append(taps.shape[1]) or fuse(taps))
    st = s.generate(ids, 48, proposer="eagle", num_draft_tokens=3).stats
    assert len(rows) == st["rounds"] and rows[0] == len(ids)
    # each later catch-up: the previous round's accepted drafts and its next token
    last = max(a for a, c in enumerate(st["accept_len_hist"]) if c)
    assert st["accepted_tokens"] + st["rounds"] - 1 - last <= sum(rows[1:]) \
        <= st["accepted_tokens"] + st["rounds"] - 1 < 4 * (st["rounds"] - 1)  # < the verified rows
    # automatic K that finds plain decoding best: its plain rounds leave the head alone
    monkeypatch.setattr(planner, "PROBE_EVERY", 10 ** 6)
    monkeypatch.setattr(planner.Planner, "choose", lambda self, B, text_drafts=False: Plan())
    rows.clear()
    plain = s.generate(ids, 48, proposer="eagle")
    assert plain.stats["rounds"] == 0 and plain.stats["target_forwards"] == 48 and rows == []


def test_the_round_drafts_through_the_backend_alone(dirs, monkeypatch):
    """The backend owns drafting: the round asks its `draft_chain(rows, k, counts)` for each
    group's proposal and verifies what it returns. A backend proposing the target's own
    continuation has every draft accepted (K=4: tau 5 until the end), one proposing decoys has
    none, and both stay lossless; near max_new_tokens the round asks for fewer than K."""
    from eagle3.decoding.tree import chain_proposal
    from eagle3.decoding.types import Proposal

    t = load_target(dirs["llama"])
    spec = spec_with(t, random_head(t, taps=(1, 3, 5)))
    prompt, new = prompts(1, 11, 5, 6)[0], 23
    full = plain_tokens(t, prompt, new, stop=[])
    asked = []

    def oracle(decoy: bool):
        def draft_chain(rows, k, counts):
            catch_up(spec.runner, rows)
            asked.append((k, counts[0]))
            i = rows[0].draft_len - len(prompt)  # the anchor is full[i]
            true = full[i + 1:i + 1 + counts[0]]
            tokens = [(x + 1) % V if decoy else x for x in true] + [0] * (counts[0] - len(true))
            return Proposal(*chain_proposal(torch.tensor([tokens])), q=[None], counts=counts, tree=False)
        return draft_chain

    for decoy in (False, True):
        asked.clear()
        monkeypatch.setattr(spec.runner, "draft_chain", oracle(decoy))
        r = spec.generate(prompt, new, num_draft_tokens=4, stop_token_ids=[])
        assert r.token_ids == full
        assert r.stats["accepted_tokens"] == (0 if decoy else new - 1 - r.stats["rounds"])
        assert all(k == 4 for k, _ in asked) and asked[-1][1] < 4  # the last round: fewer than K
        assert r.stats["rounds"] == len(asked)


# -- losslessness ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("draft_vocab", [None, 90])
def test_random_head_lossless_for_every_k(dirs, name, draft_vocab):
    t = load_target(dirs[name])
    spec = spec_with(t, random_head(t, taps=(1, 3, 5), draft_vocab_size=draft_vocab, scale=0.3))
    for i, prompt in enumerate(prompts(4, 11)):
        want = plain_tokens(t, prompt, 20)
        for k in range(1, 9):
            r = spec.generate(prompt, 20, num_draft_tokens=k, stop_token_ids=[])
            assert r.token_ids == want, (name, draft_vocab, i, k)


@pytest.mark.parametrize("name", ["ctx_llama", "ctx_qwen2", "ctx_gemma2"])
@pytest.mark.parametrize("mode", ["full", "partial", "zero"])
def test_forced_acceptance_is_lossless_and_observed(dirs, name, mode):
    t = load_target(dirs[name])
    spec = scripted(t, mode, ps := prompts(4, 13), 30)
    for prompt in ps:
        want = plain_tokens(t, prompt, 30)
        assert len(set(want)) > 2, "greedy run degenerate; pick another seed"
        for k in range(1, 9):
            r = spec.generate(prompt, 30, num_draft_tokens=k, stop_token_ids=[])
            assert r.token_ids == want, (mode, k)
            s = r.stats
            assert s["rounds"] > 0
            if mode == "full":
                assert s["accepted_tokens"] == s["draft_tokens"]
                assert s["target_forwards"] == 1 + s["rounds"] + (len(want) - 1 - s["rounds"]
                                                                 - s["accepted_tokens"])
            elif mode == "partial":
                assert s["accept_len_hist"][1] == s["rounds"]
                assert s["accepted_tokens"] == s["rounds"]
            else:
                assert s["accepted_tokens"] == 0 and s["accept_len_hist"][0] == s["rounds"]


@pytest.mark.parametrize("mode", ["full", "partial"])
def test_forced_heads_reduced_vocab_and_own_embedding(dirs, mode):
    t = load_target(dirs["ctx_llama"])
    ps = prompts(3, 17)
    vocab = sorted({tok for p in ps for tok in plain_tokens(t, p, 24)})
    for own in (False, True):
        spec = scripted(t, mode, ps, 24, draft_vocab=vocab, own_embedding=own)
        assert spec.draft.reduced_vocab
        if not own:
            assert spec.draft.embed_tokens.weight.data_ptr() == t.embedding_weight.data_ptr()
        for prompt in ps:
            want = plain_tokens(t, prompt, 24)
            for k in (1, 2, 4, 7):
                r = spec.generate(prompt, 24, num_draft_tokens=k, stop_token_ids=[])
                assert r.token_ids == want
                assert r.stats["accepted_tokens"] > 0


def test_full_acceptance_default_residual_short_chains(dirs):
    t = load_target(dirs["ctx_llama"])
    spec = scripted(t, "full", ps := prompts(3, 19), 20, norm_before_residual=False)
    for prompt in ps:
        want = plain_tokens(t, prompt, 20)
        for k in (1, 2):
            r = spec.generate(prompt, 20, num_draft_tokens=k, stop_token_ids=[])
            assert r.token_ids == want
            assert r.stats["accepted_tokens"] == r.stats["draft_tokens"]


def test_hf_target_lossless(dirs):
    t = load_target(dirs["ctx_llama"], backend="hf")
    for mode in ("full", "partial", "zero"):
        spec = scripted(t, mode, ps := prompts(2, 23), 20)
        for prompt in ps:
            want = plain_tokens(t, prompt, 20)
            for k in (1, 3, 6):
                r = spec.generate(prompt, 20, num_draft_tokens=k, stop_token_ids=[])
                assert r.token_ids == want, (mode, k)
    native = load_target(dirs["ctx_llama"])
    assert plain_tokens(native, prompts(1, 23)[0], 20) == plain_tokens(t, prompts(1, 23)[0], 20)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(1, V - 1), min_size=1, max_size=30), k=st.integers(1, 8),
       n=st.integers(1, 40), mode=st.sampled_from(["full", "partial", "zero"]))
def test_property_lossless(dirs, prompt, k, n, mode):
    t = _cached_target(dirs["ctx_qwen2"])
    spec = scripted(t, mode, [prompt], n)
    want = plain_tokens(t, prompt, n)
    r = spec.generate(prompt, n, num_draft_tokens=k, stop_token_ids=[])
    assert r.token_ids == want
    if mode == "full":
        assert r.stats["accepted_tokens"] == r.stats["draft_tokens"]


_CACHE: dict = {}


def _cached_target(d):
    if d not in _CACHE:
        _CACHE[d] = load_target(d)
    return _CACHE[d]


# -- stopping, capacity, stats -------------------------------------------------------------------------

def test_stop_token_inside_accepted_span(dirs):
    t = load_target(dirs["ctx_llama"])
    prompt = prompts(1, 29)[0]
    spec = scripted(t, "full", [prompt], 30)
    want = plain_tokens(t, prompt, 30)
    k = 6
    r = spec.generate(prompt, 30, num_draft_tokens=k, stop_token_ids=[])
    assert r.stats["accepted_tokens"] == r.stats["draft_tokens"]
    # Rounds emit tokens 1..7, 8..14, ...: index 3 lies strictly inside the first accepted span.
    j = next(i for i in range(2, 6) if want[i] not in want[:i])
    stop = want[j]
    got = spec.generate(prompt, 30, num_draft_tokens=k, stop_token_ids=[stop])
    assert got.token_ids == want[:j + 1]
    assert got.token_ids == plain_tokens(t, prompt, 30, stop=[stop])
    assert got.stats["target_forwards"] == 2  # prefill + one round; emission cut inside it


def granted_drafts(k: int, cur: int, max_len: int, room: int = 1000) -> int:
    """Drafts a chain round may verify with `cur` tokens so far (the anchor at cur - 1)."""
    seq = SequenceState("s", [0], room, frozenset(), target_len=cur - 1, root=torch.zeros(1))
    return grant(seq, Plan(k), max_len)


def test_capacity_table():
    assert [granted_drafts(3, n, 100) for n in (96, 97, 98, 99)] == [3, 2, 1, 0]
    assert granted_drafts(8, 10, 100) == 8 and granted_drafts(3, 100, 100) == 0
    assert granted_drafts(8, 10, 100, room=4) == 3  # drafts past max_new_tokens are not verified


@pytest.mark.parametrize("mode", ["full", "zero"])
def test_generation_runs_exactly_to_max_len(dirs, mode):
    t = load_target(dirs["ctx_llama"], max_seq_len=40)
    prompt = prompts(1, 31, 9, 10)[0]
    n = 40 - len(prompt)
    spec = scripted(t, mode, [prompt], n)
    want = plain_tokens(t, prompt, n)
    for k in (1, 3, 5, 8):
        r = spec.generate(prompt, n, num_draft_tokens=k, stop_token_ids=[])
        assert r.token_ids == want and len(r.token_ids) == n
    with pytest.raises(eagle3.Eagle3Error, match="max_seq_len"):
        spec.generate(prompt, n + 1)


def test_one_new_token_is_the_prefill_token(dirs):
    t = load_target(dirs["ctx_llama"])
    prompt = prompts(1, 37)[0]
    spec = scripted(t, "full", [prompt], 1)
    r = spec.generate(prompt, 1, num_draft_tokens=4, stop_token_ids=[])
    assert r.token_ids == plain_tokens(t, prompt, 1)
    assert r.stats["target_forwards"] == 1 and r.stats["rounds"] == 0


def test_stats_are_consistent(dirs):
    t = load_target(dirs["ctx_qwen2"])
    for mode in ("full", "partial", "zero"):
        spec = scripted(t, mode, prompts(1, 41), 37)
        for k in (2, 5):
            r = spec.generate(prompts(1, 41)[0], 37, num_draft_tokens=k, stop_token_ids=[])
            s = r.stats
            hist, per_pos = s["accept_len_hist"], s["accepted_per_position"]
            assert len(hist) == k + 1 and len(per_pos) == k
            assert sum(hist) == s["rounds"]
            assert sum(a * c for a, c in enumerate(hist)) == s["accepted_tokens"] == sum(per_pos)
            assert all(x >= y for x, y in zip(per_pos, per_pos[1:]))
            assert per_pos[0] == s["rounds"] - hist[0]
            assert s["mean_accept_len"] == pytest.approx(1 + s["accepted_tokens"] / s["rounds"])
            assert s["draft_tokens"] <= k * s["rounds"]
            assert s["seconds"] > 0


def test_bad_requests_leave_no_state(dirs):
    t = load_target(dirs["ctx_llama"])
    prompt = prompts(1, 43)[0]
    spec = scripted(t, "full", [prompt], 12)
    want = spec.generate(prompt, 12, num_draft_tokens=3, stop_token_ids=[]).token_ids
    for bad in (dict(num_draft_tokens=0), dict(num_draft_tokens=-1), dict(num_draft_tokens=33),
                dict(num_draft_tokens=2.5)):
        with pytest.raises(eagle3.Eagle3Error, match="num_draft_tokens"):
            spec.generate(prompt, 12, **bad)
    with pytest.raises(eagle3.Eagle3Error, match="vocabulary"):
        spec.generate([1, V + 5], 12)
    assert spec.generate(prompt, 12, num_draft_tokens=3, stop_token_ids=[]).token_ids == want


def test_speculator_requires_a_head_with_an_embedding(dirs):
    t = load_target(dirs["llama"])
    head = random_head(t, taps=(1, 3, 5))
    with pytest.raises(eagle3.Eagle3Error, match="embedding"):
        Eagle3Speculator(t, head)


# -- the public API and CLI ---------------------------------------------------------------------------

def test_load_and_cli_with_a_saved_head(dirs, tmp_path):
    t = load_target(dirs["ctx_llama"])
    prompt = prompts(1, 47)[0]
    head = scripted_head(t, [prompt], 16)
    for fmt in ("speculators",):
        save_head(head, str(tmp_path / fmt), fmt, include_embedding=True)
    spec = eagle3.load(dirs["ctx_llama"], str(tmp_path / "speculators"))
    want = plain_tokens(t, prompt, 16)
    r = spec.generate(prompt, 16, num_draft_tokens=4, stop_token_ids=[])
    assert r.token_ids == want and r.stats["accepted_tokens"] == r.stats["draft_tokens"]

    cmd = [sys.executable, "-m", "eagle3", "generate", "--target", dirs["ctx_llama"], "--draft",
           str(tmp_path / "speculators"), "--prompt-ids", ",".join(map(str, prompt)),
           "--max-new-tokens", "16", "--num-draft-tokens", "4", "--stop-ids", "", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["token_ids"] == want
    assert out["stats"]["accepted_tokens"] == out["stats"]["draft_tokens"] > 0
    assert out["stats"]["tokens_per_s"] > 0


def test_draft_cache_rejects_gaps_and_allows_rollback(dirs):
    t = load_target(dirs["llama"])
    spec = spec_with(t, random_head(t, taps=(1, 3, 5)))
    spec.reset_caches()
    H = spec.draft.config.hidden_size
    tok, feat = torch.tensor([[1, 2, 3, 4]]), torch.randn(1, 4, H)
    spec.draft_decode(tok, feat, torch.arange(4))  # slots 0..3
    with pytest.raises(eagle3.Eagle3Error, match="gap"):
        spec.draft_decode(tok[:, :1], feat[:, :1], torch.tensor([6]), kv_len=7)
    a, _ = spec.draft_decode(tok[:, :2], feat[:, :2], torch.tensor([2, 3]), kv_len=4)  # rollback: ok
    spec.draft_decode(tok[:, :1], feat[:, :1], torch.tensor([4]), kv_len=5)  # extends: ok
    assert spec.draft_cache.length == 5
    # Overwriting slot 1 forgets slots 2..4: writing at 3 now leaves a gap.
    spec.draft_decode(tok[:, :1], feat[:, :1], torch.tensor([1]), kv_len=2)
    with pytest.raises(eagle3.Eagle3Error, match="gap"):
        spec.draft_decode(tok[:, :1], feat[:, :1], torch.tensor([3]), kv_len=4)


def test_target_cache_records_its_fill_and_rejects_gaps(dirs):
    """The contract methods record the target cache's writes too: a verify past the filled
    prefix is refused, a verify that overwrites part of it (a rollback) is not."""
    t = load_target(dirs["llama"])
    spec = spec_with(t, random_head(t, taps=(1, 3, 5)))
    spec.reset_caches()
    spec.prefill(torch.tensor([[5, 6, 7]]), torch.arange(3), kv_len=3)
    assert spec.target_cache.length == 3
    with pytest.raises(eagle3.Eagle3Error, match="gap"):
        spec.target_verify(torch.tensor([[1, 2]]), torch.tensor([5, 6]), kv_len=7)
    spec.target_verify(torch.tensor([[1, 2, 3]]), torch.arange(3, 6), kv_len=6)
    spec.decode(torch.tensor([[4]]), torch.tensor([4]), kv_len=5)  # rolls back to 5 slots
    assert spec.target_cache.length == 5
