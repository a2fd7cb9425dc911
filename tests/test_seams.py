"""The seams a newcomer reads first, held in place: one implementation of the contract methods
(the one export lowers), one planner for both drivers, weight formats and GGUF codes passed as
values, a prompt's forward marked by an argument, and the registry's forward bounds used."""

from __future__ import annotations

import inspect

import gguf
import pytest
import torch
import torch.nn.functional as F

import eagle3
import eagle3.kernels as kernels
from conftest import make_checkpoint, make_hf_model
from eagle3.decoding.contract import CONTRACT_METHODS, SpeculatorMethods
from eagle3.decoding.costs import REPICK_EVERY, RoundCosts
from eagle3.decoding.planner import Planner
from eagle3.decoding.types import Plan
from eagle3.draft import attach_head
from eagle3.errors import Eagle3Error
from eagle3.kernels import QLinear, WeightFormat
from eagle3.speculator import Eagle3Speculator
from eagle3.targets import TARGETS, TargetSpec, load_target, open_target, read_gguf_target
from gguf_files import write_gguf
from heads import random_head


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("seams") / "llama")
    make_checkpoint(d, "llama", seed=3)
    return d


def test_the_exported_program_lowers_the_eager_methods_themselves():
    """`SpeculatorProgram` adds caches and two extra methods; the four contract methods are
    `SpeculatorMethods`' own, the code the eager speculator runs."""
    from eagle3.export.program import SpeculatorProgram

    for name in CONTRACT_METHODS:
        assert getattr(SpeculatorProgram, name) is getattr(SpeculatorMethods, name), name
        assert name not in vars(SpeculatorProgram), name


def test_the_speculators_contract_methods_run_the_one_implementation(llama):
    """`Eagle3Speculator.prefill` etc. book slots and call `SpeculatorMethods`: the same ids
    and features as calling it directly on a fresh cache."""
    t = load_target(llama, max_seq_len=64)
    head = random_head(t, taps=(0, 1, 2), seed=4)
    attach_head(head, t)
    spec = Eagle3Speculator(t, head)
    assert isinstance(spec.contract, SpeculatorMethods)
    ids, pos = torch.tensor([[5, 17, 3, 99, 42]]), torch.arange(5)
    tok, feat = spec.prefill(ids, pos)
    direct = SpeculatorMethods(t, head, spec.taps, t.new_cache(1, 64), head.new_cache(1, 64))
    tok2, feat2 = direct.prefill(ids, pos)
    assert torch.equal(tok, tok2) and torch.equal(feat, feat2)
    d1, h1 = spec.draft_decode(torch.cat([ids[:, 1:], tok.view(1, 1)], 1), feat, pos)
    d2, h2 = direct.draft_decode(torch.cat([ids[:, 1:], tok2.view(1, 1)], 1), feat2, pos)
    assert torch.equal(d1, d2) and torch.equal(h1, h2)


def test_weight_formats_are_parsed_once_into_a_value():
    assert WeightFormat.parse("int4-g64") == WeightFormat("int4", 64, True, spec="int4-g64")
    assert WeightFormat.parse("int4-g64").name == "int4-g64" and WeightFormat.parse("int8").name == "int8-g32"
    assert WeightFormat.parse(None) == WeightFormat("float32")  # the default: not named
    assert WeightFormat.parse("none").fmt is None and WeightFormat.parse("gguf").name == "gguf"
    auto = WeightFormat.parse("auto")
    assert auto.auto and auto.settle(True).name == "gguf" and auto.settle(False) == WeightFormat(
        "float32", spec="auto")
    assert WeightFormat.parse("bf16").settle(True).fmt == "bfloat16"  # only auto is settled
    with pytest.raises(Eagle3Error, match="quantize must be one of"):
        WeightFormat.parse("int3")
    with pytest.raises(Eagle3Error, match="settled by eagle3.load"):
        kernels.prepare_target(torch.nn.Linear(2, 2), auto)


def test_a_gguf_files_codes_come_back_from_its_loader_not_on_the_model(llama, tmp_path):
    """`read_gguf_target` returns the target and the file's codes; nothing rides on the model,
    and `load_target` (float32 weights) keeps no codes either."""
    hf = make_hf_model("llama", seed=8)
    path = str(tmp_path / "m.gguf")
    write_gguf(hf, path, qtype=gguf.GGMLQuantizationType.Q8_0)
    t, codes = read_gguf_target(path)
    assert codes.stored_quantized and codes.blocks and codes.types
    assert not any(hasattr(t, a) for a in ("gguf_blocks", "gguf_types"))
    assert open_target(path)[1].stored_quantized and open_target(llama)[1] is None
    kernels.prepare_target(t, "gguf", None, codes.layers())
    assert t.weight_format == "gguf" and isinstance(t.model.layers[0].mlp.down_proj, QLinear)
    assert t.model.layers[0].mlp.down_proj.fmt == "int8"
    assert set(codes.blocks) <= {"model.embed_tokens.weight"}  # each layer's codes handed over once
    plain = load_target(path)
    assert not any(hasattr(plain, a) for a in ("gguf_blocks", "gguf_types"))


def test_a_prompts_forward_is_an_argument_not_a_thread_state(llama):
    """`prefill=True` lets a float32 layer take PyTorch's own matmul (`QLinear(x, stock=True)` is
    `F.linear` bit for bit); the kernels module holds no prefill state to switch."""
    assert not hasattr(kernels, "prefill_matmuls") and not hasattr(kernels, "in_prefill")
    w = torch.randn(48, 64)
    layer = QLinear.from_codes("float32", w)
    x = torch.randn(5, 64)
    assert torch.equal(layer(x, stock=True), F.linear(x, w))
    assert "prefill" in inspect.signature(load_target(llama).forward_logits_taps).parameters
    spec = eagle3.load(llama, "none", max_seq_len=64)
    ids = [5, 17, 3, 99, 42, 7, 131]
    t = spec.target
    cache = t.new_cache(1, 64)
    a, _ = t.forward_logits_taps(torch.tensor([ids]), torch.arange(7), cache, kv_len=7, with_taps=False,
                                 prefill=True)
    cache.truncate(0)
    b, _ = t.forward_logits_taps(torch.tensor([ids]), torch.arange(7), cache, kv_len=7, with_taps=False)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # the same logits, summed in another order


def test_the_registrys_forward_bound_is_the_default_cache_length(llama, monkeypatch):
    """A family's `TargetSpec.max_forward_len` is the cache a target gets when the caller names
    none (at most the checkpoint's max_position_embeddings); an explicit length wins."""
    monkeypatch.setitem(TARGETS, "llama", TargetSpec(TARGETS["llama"].load, 48, 1, "bounded"))
    assert load_target(llama).config.max_seq_len == 48
    assert load_target(llama, max_seq_len=40).config.max_seq_len == 40


def test_the_engine_planner_holds_a_choice_per_batch_size():
    """`Planner.held`: the same plan for REPICK_EVERY rounds at one batch size, chosen again
    when the batch size changes (the acceptance then moves the choice)."""
    p = Planner(4)
    # a round of K drafts costs 1 + 0.2 K ms (flat verify), plain 1 ms
    p.costs = RoundCosts({1: [1.0] * 6, 2: [1.0] * 6}, {1: [0.2] * 6, 2: [0.2] * 6}, {1: 1.0, 2: 1.0})
    first = p.held(1)
    assert first.k == 4  # the optimistic prior (0.8 per position): the longest chain pays most
    for _ in range(20):
        p.acceptance.record(4, 0)  # nothing accepted from now on
    assert all(p.held(1) == first for _ in range(REPICK_EVERY - 1))  # held
    assert p.held(1) == Plan()  # chosen again: plain decoding pays now
    assert p.held(2) == Plan()
