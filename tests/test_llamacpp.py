"""llama.cpp as a peer: heads converted for it (its own converter), and, when its tools are
built (`make llama.cpp`), heads it runs.

The converter comes from the llama.cpp sources `make` unpacks (scripts/build_llama_cpp.sh
--sources); the tests that need them or the built tools skip with the reason otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import make_hf_model
from eagle3.draft import llamacpp, save_head
from eagle3.targets import load_target
from heads import random_head

needs_sources = pytest.mark.skipif(llamacpp.sources() is None,
                                   reason=f"llama.cpp sources missing: {llamacpp.BUILD_HINT}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny random Llama target with SmolLM2's vocabulary and tokenizer (one llama.cpp's
    converter recognises), and a reduced-vocabulary head for it."""
    import shutil

    from eagle3.targets.gguf import gguf_tokenizer_dir
    from eagle3.targets.named import model_path

    gguf_file = model_path("smollm2-135m-instruct")
    root = tmp_path_factory.mktemp("llamacpp")
    tdir = str(root / "target")
    make_hf_model("llama", seed=5, vocab_size=49152, hidden_size=64,
                  num_hidden_layers=6).save_pretrained(tdir)
    tok = gguf_tokenizer_dir(gguf_file)
    for name in os.listdir(tok):
        shutil.copy(os.path.join(tok, name), tdir)
    target = load_target(tdir)
    head = random_head(target, draft_vocab_size=64, taps=(1, 3, 4), seed=6)
    hdir = str(root / "head")
    save_head(head, hdir, "speculators")  # any format: converted to official on the way
    return tdir, hdir, head


@needs_sources
def test_head_converts_to_llama_cpp_gguf(pair, tmp_path):
    import gguf

    tdir, hdir, head = pair
    out = str(tmp_path / "head.gguf")
    llamacpp.head_to_gguf(hdir, out, tdir)
    r = gguf.GGUFReader(out)
    assert r.fields["general.architecture"].contents() == "eagle3"
    assert r.fields["eagle3.target_layers"].contents() == [1, 3, 4]
    assert r.fields["eagle3.target_hidden_size"].contents() == head.config.target_hidden_size
    tensors = {t.name: t for t in r.tensors}
    fc = np.asarray(tensors["fc.weight"].data).reshape(head.fc.weight.shape)
    assert np.array_equal(fc, head.fc.weight.detach().numpy())
    # llama.cpp stores d2t as absolute target ids: id = draft id + offset
    d2t = np.asarray(tensors["d2t"].data).reshape(-1)
    assert d2t.tolist() == (torch.arange(64) + head.d2t).tolist()
    assert not [f for f in os.listdir(tmp_path) if f != "head.gguf"]  # no temporary left behind


@needs_sources
def test_convert_cli_writes_the_head_llama_cpp_loads(pair, tmp_path):
    import gguf

    tdir, hdir, head = pair
    out = tmp_path / "cli.gguf"
    p = subprocess.run([sys.executable, "-m", "eagle3", "convert", hdir, str(out), "--to", "gguf",
                        "--target", tdir], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    r = gguf.GGUFReader(str(out))
    assert r.fields["general.architecture"].contents() == "eagle3"
    assert r.fields["eagle3.target_layers"].contents() == [1, 3, 4]
    tensors = {t.name: t for t in r.tensors}
    fc = np.asarray(tensors["fc.weight"].data).reshape(head.fc.weight.shape)
    assert np.array_equal(fc, head.fc.weight.detach().numpy())
    assert sorted(os.listdir(tmp_path)) == ["cli.gguf"]


def test_convert_cli_errors(pair, tmp_path):
    tdir, hdir, _ = pair
    run = lambda *a: subprocess.run([sys.executable, "-m", "eagle3", "convert", *a],  # noqa: E731
                                    capture_output=True, text=True)
    no_target = run(hdir, str(tmp_path / "h.gguf"), "--to", "gguf")
    assert no_target.returncode == 2 and "--to gguf needs --target" in no_target.stderr
    stray = run(hdir, str(tmp_path / "h2"), "--to", "official", "--target", tdir)
    assert stray.returncode == 2 and "--target applies to --to gguf only" in stray.stderr
    if llamacpp.sources() is not None:
        not_file = run(hdir, str(tmp_path / "dir"), "--to", "gguf", "--target", tdir)
        assert not_file.returncode == 2 and "name it *.gguf" in not_file.stderr
    for r in (no_target, stray):
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.skipif(llamacpp.binary("llama-speculative-simple") is None,
                    reason=f"llama.cpp tools not built: {llamacpp.BUILD_HINT}")
def test_bench_runs_llama_cpp_plain_and_eagle3_on_the_default(tmp_path):
    import json


    out = tmp_path / "b.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_DEFAULT")}
    run = subprocess.run([sys.executable, "-m", "eagle3", "bench", "--prompts", "sharegpt-heldout",
                          "--limit", "1", "--max-new-tokens", "16", "--num-draft-tokens", "2",
                          "--tree", "none", "--repeats", "1", "--quantize", "gguf", "--peers",
                          "llama.cpp", "--json", str(out)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-500:]
    peers = json.loads(out.read_text())["peers"]
    assert set(peers) == {"llama.cpp plain", "llama.cpp eagle3 K=2"}
    assert all(p["tokens_per_s"] > 0 and p["tokens"] > 0 for p in peers.values())
    assert peers["llama.cpp eagle3 K=2"]["mean_accept_len"] >= 1.0


def test_saved_logits_file_reads_back_llama_cpps_log_probs(tmp_path):
    """`read_saved_logits` decodes `llama-perplexity --kl-divergence-base`'s format (written here
    as its source writes it: magic, n_ctx, n_vocab, n_chunk, tokens, then per saved position two
    floats, scale and floor, and 16-bit codes over the vocabulary padded to even); a truncated
    file is a one-line error."""
    from eagle3.bench.llamacpp import read_saved_logits
    from eagle3.errors import Eagle3Error

    n_ctx, n_vocab, n_chunk = 6, 5, 2
    first, n_pos, nv = 3, 6 - 1 - 3, 2 * ((5 + 1) // 2) + 4
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, n_vocab, (n_chunk, n_ctx)).astype(np.int32)
    logits = rng.normal(size=(n_chunk, n_pos, n_vocab)).astype(np.float32)
    logits[0, 0, 0] = -40.0  # more than 16 below the top: stored as the floor
    rec = np.zeros((n_chunk, n_pos, nv), np.uint16)
    want = np.zeros_like(logits)
    for c in range(n_chunk):
        for p in range(n_pos):
            x = logits[c, p]
            mx, mn = x.max(), max(x.min(), x.max() - 16)
            lse = np.log(np.exp(x.astype(np.float64) - mx).sum())
            scale, floor = np.float32((mx - mn) / 65535), np.float32(mn - mx - lse)
            rec[c, p, :4] = np.array([scale, floor], np.float32).view(np.uint16)
            q = np.where(x > mn, np.rint((x - mn) / scale), 0).astype(np.uint16)
            rec[c, p, 4:4 + n_vocab] = q
            want[c, p] = floor + scale * q.astype(np.float32)
    path = tmp_path / "logits.bin"
    path.write_bytes(b"_logits_" + np.array([n_ctx, n_vocab, n_chunk], np.int32).tobytes()
                     + tokens.tobytes() + rec.tobytes())
    got = read_saved_logits(str(path))
    assert (got["n_ctx"], got["n_vocab"], got["first"]) == (n_ctx, n_vocab, first)
    assert np.array_equal(got["tokens"], tokens)
    np.testing.assert_allclose(got["log_probs"], want, rtol=0, atol=1e-6)
    # above the floor, the codes hold the log-softmax to the format's resolution
    ref = logits - logits.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    above = got["log_probs"] > got["floor"][..., None]
    assert above.sum() == logits.size - n_chunk * n_pos  # each position's lowest sits on the floor
    np.testing.assert_allclose(got["log_probs"][above], ref[above], atol=16 / 65535)
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(Eagle3Error, match="truncated"):
        read_saved_logits(str(path))
