"""Negative controls for the lossless tests: bugs planted in the speculative path are caught.

A lossless test can fail only if the bug it guards against changes the target's output. On
the context target (tests/heads.py) it does, and these tests show it: each bug below, planted
at the target's forward (so it hits generate's and the engine's rounds alike), makes the
speculative output differ from plain decoding, while the same run without it is identical.
(On a target whose attention and MLP outputs are zero, as these tests once used, a stale K/V
row or a wrong position changes nothing: such bugs passed every lossless test.)
"""

from __future__ import annotations

import pytest
import torch

from eagle3.draft import attach_head
from eagle3.engine import Engine, EngineConfig
from eagle3.speculator import Eagle3Speculator
from eagle3.targets import load_target
from heads import random_prompts as prompts
from heads import save_context_target, scripted_head

N = 30


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return save_context_target(str(tmp_path_factory.mktemp("punish") / "ctx"))


def plant(target, bug: str) -> None:
    """Wrap `target`'s forward so that every verify (several rows after the prompt) has `bug`:
    'rope'  - its rows rotated one position too far;
    'peek'  - each row also sees the next one (a causal mask off by one);
    'stale' - its first row's K/V is computed but not kept: the slot keeps what it held, as
              when a rollback forgets to rewrite a rejected draft's row."""
    real = target.forward_logits_taps

    def forward(tokens, input_pos, cache, **kw):
        pos = kw.get("rope_pos")
        pos = input_pos if pos is None else pos
        if tokens.shape[-1] == 1 or int(pos.reshape(-1)[0]) == 0:  # decode or a prompt: as is
            return real(tokens, input_pos, cache, **kw)
        if bug == "rope":
            kw["rope_pos"] = pos + 1
        elif bug == "peek":
            keys = torch.arange(kw["kv_len"])
            kw["attn_mask"] = keys[None, :] <= input_pos[:, None] + 1
        elif bug == "stale":
            slot = input_pos[:1]
            kept = [(k[..., slot, :].clone(), v[..., slot, :].clone()) for k, v in zip(cache.k, cache.v)]
            out = real(tokens, input_pos, cache, **kw)
            for (k, v), (k0, v0) in zip(zip(cache.k, cache.v), kept):
                k[..., slot, :], v[..., slot, :] = k0, v0
            return out
        return real(tokens, input_pos, cache, **kw)

    target.forward_logits_taps = forward


def outputs(spec, ps, **kw) -> list[list[int]]:
    return [spec.generate(p, N, stop_token_ids=[], **kw).token_ids for p in ps]


def setup(ctx: str, seed: int, mode: str):
    """(target, prompts, their plain outputs, a speculator whose head is scripted per `mode`)."""
    t = load_target(ctx)
    ps = prompts(4, seed=seed)
    plain = outputs(Eagle3Speculator(t), ps)
    head = scripted_head(t, ps, N, mode)
    attach_head(head, t)
    return t, ps, plain, Eagle3Speculator(t, head)


@pytest.mark.parametrize("bug", ["rope", "peek", "stale"])
def test_a_planted_verify_bug_changes_the_output(ctx, bug):
    t, ps, plain, spec = setup(ctx, 3, "mixed")
    assert outputs(spec, ps, num_draft_tokens=3) == plain  # the control: no bug, no difference
    plant(t, bug)
    got = outputs(spec, ps, num_draft_tokens=3)
    assert got != plain, f"the {bug} bug went unnoticed"


def test_an_uncompacted_tree_path_changes_the_output(ctx):
    """A tree round accepting a second child leaves the path's K/V in scattered slots;
    forgetting to move it changes the next rounds' attention."""
    t, ps, plain, spec = setup(ctx, 5, "second")
    tree = dict(top_k=2, depth=3, total_tokens=6)
    assert outputs(spec, ps, tree=tree) == plain
    t.compact_cache = lambda cache, src, dst: None
    assert outputs(spec, ps, tree=tree) != plain, "skipping compaction went unnoticed"


def test_a_planted_bug_in_the_engines_batched_verify_changes_the_output(ctx):
    t, ps, plain, spec = setup(ctx, 7, "mixed")

    def engine_outputs():
        engine = Engine(spec, EngineConfig(max_batch=4, num_draft_tokens=3)).start(background=False)
        reqs = [engine.submit(p, N, stop_token_ids=[]) for p in ps]
        engine.run_until_idle()
        return [r.token_ids for r in reqs]

    assert engine_outputs() == plain
    plant(t, "rope")
    assert engine_outputs() != plain, "the engine's rope bug went unnoticed"
