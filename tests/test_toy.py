"""The toy code model (models/toy; "default" in the tests): loads, tokenizes, speculates losslessly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import eagle3
from eagle3.targets.default import TOY_MODELS as REPO_MODELS


@pytest.fixture(scope="module")
def spec():
    return eagle3.load("default")


def held_out_prompts() -> list[str]:
    with open(REPO_MODELS / "prompts.jsonl") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def test_default_loads_with_head_and_tokenizer(spec):
    assert spec.draft is not None and spec.tokenizer is not None
    ids = spec.tokenizer.encode("def parse_args(argv):")
    assert spec.tokenizer.decode(ids) == "def parse_args(argv):"


@pytest.mark.slow
def test_default_speculation_is_lossless_and_accepts(spec):
    plain = eagle3.load("default", "none")
    accepted = drafted = 0
    for text in held_out_prompts()[:4]:
        ids = spec.tokenizer.encode(text)
        want = plain.generate(ids, 48).token_ids
        for k in (1, 4, 6):
            r = spec.generate(ids, 48, num_draft_tokens=k)
            assert r.token_ids == want
            accepted += r.stats["accepted_tokens"]
            drafted += r.stats["draft_tokens"]
    assert accepted / drafted > 0.3  # a trained head, not a random one


@pytest.mark.slow
def test_generate_compare_command(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "eagle3")
    p = subprocess.run([exe, "generate", "def parse_args(argv):", "--max-new-tokens", "24", "--compare"],
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).parents[1])
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()
    assert "speedup" in p.stderr and "outputs identical: True" in p.stderr


def test_default_target_matches_transformers(spec):
    """The shipped checkpoint is a plain HF Llama: transformers loads it and agrees with ours."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    d = str(REPO_MODELS / "target")
    oracle = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    text = held_out_prompts()[0]
    ids = PreTrainedTokenizerFast.from_pretrained(d)(text)["input_ids"]
    assert ids == spec.tokenizer.encode(text)
    x = torch.tensor([ids])
    with torch.no_grad():
        want = oracle(x).logits
        got, _ = spec.target.forward_logits_taps(x, torch.arange(len(ids)), spec.target.new_cache(),
                                                 with_taps=False)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
