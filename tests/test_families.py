"""A new model family is one `Family` value plus one registration line (`targets/families.py`).

Each test registers a family the package does not know, under a new HF `model_type` and GGUF
`general.architecture`, whose checkpoint is a tiny random `save_pretrained` of an existing
transformers architecture with that model_type written into its config.json; the native
target loaded from it (and from a GGUF file of it) must give transformers' logits (the oracle).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import make_hf_model
from eagle3.errors import Eagle3Error
from eagle3.targets import (
    FAMILIES,
    TARGETS,
    Family,
    NativeTarget,
    TargetSpec,
    forward_bounds,
    load_target,
    register_family,
)

pytestmark = pytest.mark.filterwarnings("ignore")

# (variant the checkpoint is made from, the new family): Llama's block as is, and Qwen3's
# (q/k norms) under a name of its own.
NEW = {
    "llama": Family("toyllama", "a Llama-like test family", "toyllama"),
    "qwen3": Family("toyqwen", "a Qwen3-like test family (q/k norms)", "toyqwen", qk_norm=True),
}
TAPS = (1, 3, 5)


@pytest.fixture
def family(request):
    """The family registered for one test, then taken out of the table and the registry."""
    fam = register_family(request.param)
    yield fam
    FAMILIES.pop(fam.model_type)
    TARGETS.pop(fam.model_type)


def save_as(model, path: str, model_type: str) -> str:
    """`model` saved with `save_pretrained`, its config.json naming `model_type`."""
    model.save_pretrained(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump({**cfg, "model_type": model_type}, f)
    return path


def check_logits(target, model) -> None:
    tokens = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, taps = target.forward_logits_taps(tokens, torch.arange(17), target.new_cache(2))
        out = model(input_ids=tokens, output_hidden_states=True, use_cache=False)
    torch.testing.assert_close(logits, out.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(taps, torch.cat([out.hidden_states[k] for k in TAPS], -1), atol=1e-4,
                               rtol=1e-4)


CASES = [pytest.param(base, fam, id=fam.model_type) for base, fam in NEW.items()]


@pytest.mark.parametrize("base,family", CASES, indirect=["family"])
def test_a_registered_family_loads_natively_and_matches_transformers(base, family, tmp_path):
    model = make_hf_model(base, seed=11)
    path = save_as(model, str(tmp_path / "ckpt"), family.model_type)
    target = load_target(path, taps=TAPS)
    assert isinstance(target, NativeTarget) and target.config.model_type == family.model_type
    assert target.config.qk_norm == family.qk_norm
    assert forward_bounds(target) == (family.min_forward_len + 1, target.config.max_seq_len)
    check_logits(target, model)


@pytest.mark.parametrize("base,family", CASES, indirect=["family"])
def test_a_registered_family_loads_from_its_gguf_architecture(base, family, tmp_path):
    from gguf_files import write_gguf

    model = make_hf_model(base, seed=12)
    path = str(tmp_path / "m.gguf")
    write_gguf(model, path, arch=family.gguf_arch)  # q/k rows as stored (not llama.cpp-permuted)
    target = load_target(path, taps=TAPS)
    assert target.config.model_type == family.model_type
    check_logits(target, model)


@pytest.mark.parametrize("family", [NEW["llama"]], indirect=True)
def test_the_loader_calls_the_registered_load_with_the_familys_bound(family, tmp_path, monkeypatch):
    """`load_target` goes through `TARGETS[model_type].load`, with the entry's forward bound as
    the cache length when the caller names none."""
    path = save_as(make_hf_model("llama", seed=13), str(tmp_path / "ckpt"), family.model_type)
    calls = []

    def spy(p, **kw):
        calls.append(kw["max_seq_len"])
        return TARGETS["llama"].load(p, **kw)

    monkeypatch.setitem(TARGETS, family.model_type, TargetSpec(spy, 40, 1, "spy"))
    assert load_target(path).config.max_seq_len == 40 and calls == [40]


def test_a_family_cannot_take_a_target_kinds_name():
    with pytest.raises(Eagle3Error, match="already names a target kind"):
        register_family(Family("gguf", "not a family"))
    assert "gguf" not in FAMILIES


def test_every_family_is_registered_with_its_bounds():
    for name, fam in FAMILIES.items():
        spec = TARGETS[name]
        assert (spec.max_forward_len, spec.min_forward_len, spec.description) == (
            fam.max_forward_len, fam.min_forward_len, fam.description)
