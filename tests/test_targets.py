"""Oracle tests for the targets: transformers is the reference (DESIGN §5).

Every variant in `conftest.VARIANTS` is loaded natively and compared with the
transformers model that saved it: logits (fp32, 1e-4), taps
(`output_hidden_states[k]`), incremental decoding, cache truncation (rewind),
`last_only`, and greedy decoding token for token against `model.generate`.
The transformers adapter (`HFTarget`) runs the same checks on a few variants.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import eagle3
from conftest import COMMON, VARIANTS, make_hf_model
from eagle3.errors import Eagle3Error
from eagle3.targets import (
    NATIVE_FAMILIES,
    TARGETS,
    HFTarget,
    NativeTarget,
    TapTarget,
    TargetSpec,
    default_taps,
    load_target,
)

NAMES = list(VARIANTS)
HF_NAMES = ["llama", "qwen3", "gemma2"]  # the adapter is checked on these
# (variant, backend): every variant natively, a few through the adapter.
CASES = [pytest.param(n, "native", id=n) for n in NAMES] + [
    pytest.param(n, "hf", id=f"hf-{n}") for n in HF_NAMES]
SLIDING = [n for n, (_, kw) in VARIANTS.items() if kw.get("sliding_window")]
L = COMMON["num_hidden_layers"]  # 6: the default taps (2, 3, 3) collide, so tests choose taps
V = COMMON["vocab_size"]
TAPS = [(0, 3, 6), (1, 2, 5)]  # (0, 3, 6) includes tap L, the final normed state
ATOL = 1e-4

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def rand_tokens(seed: int, n: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, n), generator=g)  # (B, n)


def oracle(model, tokens: torch.Tensor, taps=None):
    """transformers logits (B, T, V) and concatenated taps (B, T, n*H)."""
    out = model(input_ids=tokens, output_hidden_states=True, use_cache=False)
    cat = torch.cat([out.hidden_states[k] for k in taps], -1) if taps else None
    return out.logits, cat


def load(checkpoints, name: str, backend: str = "native", taps=TAPS[0]):
    d, model = checkpoints[name]
    t = load_target(d, backend=backend, taps=taps)
    assert isinstance(t, NativeTarget if backend == "native" else HFTarget)
    return t, model


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL, what: str = "") -> None:
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-4, msg=lambda m: f"{what}: {m}")


# -- 1, 2: one full forward == transformers -------------------------------------------------
@pytest.mark.parametrize("name,backend", CASES)
def test_logits_match_oracle(checkpoints, name, backend):
    t, model = load(checkpoints, name, backend)
    tokens = rand_tokens(1, 20, batch=2)
    logits, _ = t.forward_logits_taps(tokens, torch.arange(20), t.new_cache(batch_size=2))
    ref, _ = oracle(model, tokens)
    assert logits.dtype == torch.float32
    close(logits, ref, what=f"{name} logits")
    assert ref.std() > 0.05, "oracle logits are nearly constant: the test would prove nothing"


@pytest.mark.parametrize("taps", TAPS, ids=str)
@pytest.mark.parametrize("name,backend", CASES)
def test_taps_match_hidden_states(checkpoints, name, backend, taps):
    t, model = load(checkpoints, name, backend, taps=None if taps == TAPS[1] else taps)
    if taps == TAPS[1]:
        t.tap_layers = list(taps)  # the setter path (a list is accepted, stored as a tuple)
    assert t.tap_layers == taps
    tokens = rand_tokens(2, 20)
    logits, got = t.forward_logits_taps(tokens, torch.arange(20), t.new_cache())
    ref_logits, ref = oracle(model, tokens, taps)
    H = model.config.hidden_size
    assert got.shape == (1, 20, len(taps) * H)
    close(got, ref, what=f"{name} taps {taps}")
    close(logits, ref_logits, what=f"{name} logits")
    # low..high order: each H-wide slice is its own layer (slices differ from each other)
    for i in range(len(taps) - 1):
        assert not torch.allclose(got[..., i * H:(i + 1) * H], got[..., (i + 1) * H:(i + 2) * H])
    _, none = t.forward_logits_taps(tokens, torch.arange(20), t.new_cache(), with_taps=False)
    assert none is None


# -- 3: prefill + incremental decoding == one full forward ------------------------------------
@pytest.mark.parametrize("use_kv_len", [True, False], ids=["kv_len", "no_kv_len"])
@pytest.mark.parametrize("name,backend", CASES)
def test_incremental_decoding_matches_full(checkpoints, name, backend, use_kv_len):
    t, model = load(checkpoints, name, backend)
    T, p0 = 20, 8  # 20 > the sliding windows (7): the window is exercised while decoding
    tokens = rand_tokens(3, T)
    full_logits, full_taps = t.forward_logits_taps(tokens, torch.arange(T), t.new_cache())
    cache = t.new_cache(1, 32)
    kw = {"kv_len": p0} if use_kv_len else {}
    lg, tp = t.forward_logits_taps(tokens[:, :p0], torch.arange(p0), cache, **kw)
    logits, taps = [lg], [tp]
    for p in range(p0, T):
        kw = {"kv_len": p + 1} if use_kv_len else {}
        lg, tp = t.forward_logits_taps(tokens[:, p:p + 1], torch.arange(p, p + 1), cache, **kw)
        assert lg.shape == (1, 1, V)
        logits.append(lg)
        taps.append(tp)
    close(torch.cat(logits, 1), full_logits, what=f"{name} incremental logits")
    close(torch.cat(taps, 1), full_taps, what=f"{name} incremental taps")
    ref_logits, ref_taps = oracle(model, tokens, t.tap_layers)
    close(torch.cat(logits, 1), ref_logits, what=f"{name} incremental vs oracle")
    close(torch.cat(taps, 1), ref_taps, what=f"{name} incremental taps vs oracle")


# -- 4: truncate (rewind) then re-forward == a fresh run ---------------------------------------
@pytest.mark.parametrize("truncate", [True, False], ids=["truncate", "overwrite"])
@pytest.mark.parametrize("name,backend", CASES)
def test_truncate_then_reforward_matches_fresh(checkpoints, name, backend, truncate):
    """Rewind after rejected tokens: explicitly, or by simply writing over their slots."""
    t, model = load(checkpoints, name, backend)
    prompt, junk, new = rand_tokens(4, 12), rand_tokens(5, 5), rand_tokens(6, 5)
    assert not torch.equal(junk, new)
    cache = t.new_cache(1, 40)
    t.forward_logits_taps(prompt, torch.arange(12), cache)
    t.forward_logits_taps(junk, torch.arange(12, 17), cache)  # speculative tokens, rejected
    if truncate:
        cache.truncate(12)
        assert cache.length <= 12
    logits, taps = t.forward_logits_taps(new, torch.arange(12, 17), cache)
    seq = torch.cat([prompt, new], 1)  # (1, 17)
    ref_logits, ref_taps = oracle(model, seq, t.tap_layers)
    close(logits, ref_logits[:, 12:], what=f"{name} after truncate")
    close(taps, ref_taps[:, 12:], what=f"{name} taps after truncate")
    fresh_logits, _ = t.forward_logits_taps(seq, torch.arange(17), t.new_cache(1, 40))
    close(logits, fresh_logits[:, 12:], what=f"{name} vs fresh native run")


@pytest.mark.parametrize("name,backend", [pytest.param(n, "native", id=n) for n in SLIDING] + [
    pytest.param(n, "hf", id=f"hf-{n}") for n in HF_NAMES if n in SLIDING])
def test_truncate_past_the_window(checkpoints, name, backend):
    """Sequences far longer than the window (7); rewind by more than a window; decode one by one."""
    t, model = load(checkpoints, name, backend)
    prompt, junk, new = rand_tokens(7, 24), rand_tokens(8, 10), rand_tokens(9, 10)
    cache = t.new_cache(1, 64)
    t.forward_logits_taps(prompt, torch.arange(24), cache, kv_len=24)
    t.forward_logits_taps(junk, torch.arange(24, 34), cache, kv_len=34)
    cache.truncate(24)
    logits = []
    for i in range(10):
        p = 24 + i
        lg, _ = t.forward_logits_taps(new[:, i:i + 1], torch.arange(p, p + 1), cache, kv_len=p + 1)
        logits.append(lg)
    seq = torch.cat([prompt, new], 1)  # (1, 34)
    ref, _ = oracle(model, seq)
    close(torch.cat(logits, 1), ref[:, 24:], what=f"{name} rewind past the window")


@pytest.mark.parametrize("name", ["mistral", "qwen2_swa"])
def test_sliding_window_matters(checkpoints, name):
    """The same weights without a window give the same logits inside it and different ones after."""
    _, model = checkpoints[name]
    unwindowed = make_hf_model(name, sliding_window=None, use_sliding_window=False) \
        if name == "qwen2_swa" else make_hf_model(name, sliding_window=None)
    tokens = rand_tokens(10, 20)
    a, _ = oracle(model, tokens)
    b, _ = oracle(unwindowed, tokens)
    close(a[:, :7], b[:, :7], what="inside the window")
    assert (a[:, 8:] - b[:, 8:]).abs().amax() > 1e-2, "the window changes nothing: test is vacuous"
    t, _ = load(checkpoints, name)
    logits, _ = t.forward_logits_taps(tokens, torch.arange(20), t.new_cache())
    close(logits, a, what=f"{name} windowed")


def legacy_config(cfg: dict) -> dict:
    """The transformers 4.x layout of a config saved by 5.x: top-level RoPE keys, no layer_types."""
    cfg = dict(cfg)
    rp = dict(cfg.pop("rope_parameters", None) or {})
    cfg.pop("layer_types", None)
    if rp and all(isinstance(v, dict) for v in rp.values()):  # keyed by layer type (Gemma 3)
        cfg["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
        cfg["sliding_window_pattern"] = 6
        rp = dict(rp["full_attention"])
    cfg["rope_theta"] = rp.pop("rope_theta", 10000.0)
    kind = rp.pop("rope_type", "default")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rp}  # 4.x used "type" too
    return cfg


LEGACY = ["llama3_rope", "llama_linear_rope", "mistral", "qwen2_swa", "gemma2", "gemma3_linear_rope"]


@pytest.mark.parametrize("name", LEGACY)
def test_legacy_config_layout(checkpoints, name, tmp_path):
    """The same weights under a transformers 4.x style config.json give the same logits."""
    d, model = checkpoints[name]
    with open(os.path.join(d, "config.json")) as f:
        cfg = legacy_config(json.load(f))
    assert "layer_types" not in cfg and "rope_parameters" not in cfg
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    os.symlink(os.path.join(d, "model.safetensors"), tmp_path / "model.safetensors")
    t = load_target(str(tmp_path), backend="native", taps=TAPS[0])
    tokens = rand_tokens(16, 20)
    logits, taps = t.forward_logits_taps(tokens, torch.arange(20), t.new_cache())
    ref, ref_taps = oracle(model, tokens, TAPS[0])
    close(logits, ref, what=f"{name} legacy config")
    close(taps, ref_taps, what=f"{name} legacy config taps")


TREE_VARIANTS = ["llama", "mistral", "qwen2_swa", "gemma2", "gemma3"]


@pytest.mark.parametrize("name", TREE_VARIANTS)
def test_tree_mask_and_compact(checkpoints, name):
    """Tree verify (attn_mask + rope_pos) then compacting the accepted path == fresh runs.

    Tree after a 12-token prompt: a, b children of the prompt; c child of b; d child of a;
    at slots 12..15 with RoPE positions 12, 12, 13, 13. Slots run ahead of positions, so a
    sliding window (7) must be measured in positions, not slots.
    """
    t, model = load(checkpoints, name)
    prompt = rand_tokens(17, 12)
    a, b, c, d = rand_tokens(18, 4)[0].tolist()
    cache = t.new_cache(1, 32)
    t.forward_logits_taps(prompt, torch.arange(12), cache, kv_len=12)
    mask = torch.zeros(4, 16, dtype=torch.bool)
    mask[:, :12] = True
    mask[torch.arange(4), 12 + torch.arange(4)] = True
    mask[2, 13] = mask[3, 12] = True  # c sees b, d sees a
    logits, taps = t.forward_logits_taps(torch.tensor([[a, b, c, d]]), torch.arange(12, 16), cache,
                                         kv_len=16, attn_mask=mask, rope_pos=torch.tensor([12, 12, 13, 13]))
    p = prompt[0].tolist()
    for row, path in enumerate([[a], [b], [b, c], [a, d]]):
        ref, ref_taps = oracle(model, torch.tensor([p + path]), t.tap_layers)
        close(logits[:, row], ref[:, -1], what=f"{name} tree node {row}")
        close(taps[:, row], ref_taps[:, -1], what=f"{name} tree node {row} taps")
    # accept b, c: move their K/V from slots 13, 14 to 12, 13, then decode on
    cache.compact(torch.tensor([13, 14]), 12)
    cache.truncate(14)
    y = rand_tokens(19, 1)
    logits, _ = t.forward_logits_taps(y, torch.arange(14, 15), cache, kv_len=15)
    ref, _ = oracle(model, torch.tensor([p + [b, c] + y[0].tolist()]))
    close(logits[:, -1], ref[:, -1], what=f"{name} after compact")


def test_hf_adapter_refuses_tree_mask(checkpoints):
    t, _ = load(checkpoints, "llama", "hf")
    cache = t.new_cache()
    with pytest.raises(Eagle3Error, match="mask"):
        t.forward_logits_taps(rand_tokens(0, 2), torch.arange(2), cache,
                              attn_mask=torch.ones(2, 2, dtype=torch.bool))


# -- 5: last_only -------------------------------------------------------------------------------
@pytest.mark.parametrize("taps", TAPS, ids=str)
@pytest.mark.parametrize("name,backend", CASES)
def test_last_only(checkpoints, name, backend, taps):
    t, _ = load(checkpoints, name, backend, taps=taps)
    tokens = rand_tokens(11, 15, batch=2)
    full, full_taps = t.forward_logits_taps(tokens, torch.arange(15), t.new_cache(2))
    last, last_taps = t.forward_logits_taps(tokens, torch.arange(15), t.new_cache(2), last_only=True)
    assert last.shape == (2, 1, V)
    close(last, full[:, -1:], what=f"{name} last_only")
    close(last_taps, full_taps, what=f"{name} last_only taps (all positions)")


# -- 6: greedy decoding == model.generate --------------------------------------------------------
GREEDY_PROMPTS = [(21, 5), (22, 11), (23, 17)]  # (seed, length)
NEW = 48
TIE_GAP = 1e-3


def oracle_generate(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def first_divergence(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)


def top2_gap(model, seq: list[int]) -> float:
    logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("name,backend", CASES)
def test_greedy_matches_generate(checkpoints, name, backend):
    d, model = checkpoints[name]
    spec = eagle3.load(d, draft="none", backend=backend)
    assert isinstance(spec.target, NativeTarget if backend == "native" else HFTarget)
    ties, varied = 0, 0
    for seed, n in GREEDY_PROMPTS:
        prompt = rand_tokens(seed, n)[0].tolist()
        got = spec.generate(prompt, max_new_tokens=NEW, stop_token_ids=[]).token_ids
        want = oracle_generate(model, prompt)
        assert len(got) == len(want) == NEW
        varied += len(set(want)) >= 4
        i = first_divergence(got, want)
        if i is None:
            continue
        gap = top2_gap(model, prompt + want[:i])
        assert gap < TIE_GAP, (f"{name}: greedy diverges from model.generate at step {i} "
                               f"({got[i]} vs {want[i]}) with a top-2 gap of {gap:.2e}")
        ties += 1
    assert ties <= 1, f"{name}: {ties} of {len(GREEDY_PROMPTS)} prompts diverged at near-ties"
    assert varied >= 2, f"{name}: greedy output degenerates (a few repeated tokens)"


def test_greedy_tie_check_can_fail(checkpoints):
    """The tie escape hatch is narrow: a real divergence has a large top-2 gap."""
    _, model = checkpoints["llama"]
    prompt = rand_tokens(21, 5)[0].tolist()
    want = oracle_generate(model, prompt)
    gaps = [top2_gap(model, prompt + want[:i]) for i in (0, 10, 20)]
    assert sum(g >= TIE_GAP for g in gaps) >= 2


# -- 7: protocol conformance ------------------------------------------------------------------------
def test_protocol_conformance(checkpoints):
    d, _ = checkpoints["llama"]
    native = load_target(d, taps=(1, 2, 3))
    hf = load_target(d, backend="hf", taps=(1, 2, 3))
    for t in (native, hf):
        assert isinstance(t, TapTarget)
        assert t.config.num_hidden_layers == L and t.config.vocab_size == V
        assert t.config.hidden_size == 64
        emb = t.embed(torch.tensor([[1, 2, 3]]))
        assert emb.shape == (1, 3, 64)
    close(native.embed(torch.tensor([[5, 6]])), hf.embed(torch.tensor([[5, 6]])), what="embed")
    assert not isinstance(object(), TapTarget)


def test_native_embed_is_unscaled_for_gemma(checkpoints):
    """`embed` is the raw table row (what a draft head consumes), without Gemma's sqrt(H) scale."""
    d, model = checkpoints["gemma2"]
    t = load_target(d, taps=TAPS[0])
    ids = torch.tensor([[3, 4]])
    close(t.embed(ids), model.get_input_embeddings().weight[ids], what="gemma embed")


# -- 8: taps validation -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["native", "hf"])
def test_tap_validation(checkpoints, backend):
    t, _ = load(checkpoints, "llama", backend)
    for bad in [(1, 1, 3), (3, 2, 1), (1, 3, 2), (-1, 2, 3), (1, 2, L + 1), (), "abc", None, 3]:
        with pytest.raises(Eagle3Error):
            t.tap_layers = bad
        assert t.tap_layers == TAPS[0], "a rejected setter call must leave the taps unchanged"
    t.tap_layers = (0, L)
    assert t.tap_layers == (0, L)
    with pytest.raises(Eagle3Error):
        load_target(checkpoints["llama"][0], backend=backend, taps=(2, 2, 4))


def test_default_taps():
    assert default_taps(7) == (2, 3, 4)
    assert default_taps(8) == (2, 4, 5)
    assert default_taps(32) == (2, 16, 29)
    assert default_taps(80) == (2, 40, 77)
    for small in (3, 4, 5, 6):  # L=6 gives (2, 3, 3): a collision too
        with pytest.raises(Eagle3Error):
            default_taps(small)


def test_default_taps_used_when_unset(tmp_path):
    model = make_hf_model("llama", num_hidden_layers=8)
    model.save_pretrained(tmp_path)
    t = load_target(str(tmp_path))
    assert t.tap_layers == (2, 4, 5)
    tokens = rand_tokens(12, 6)
    _, taps = t.forward_logits_taps(tokens, torch.arange(6), t.new_cache())
    _, ref = oracle(model, tokens, (2, 4, 5))
    close(taps, ref, what="default taps")


def test_small_target_needs_explicit_taps(checkpoints):
    t = load_target(checkpoints["llama"][0])  # L = 6: the default taps collide
    with pytest.raises(Eagle3Error, match="taps"):
        t.forward_logits_taps(rand_tokens(0, 3), torch.arange(3), t.new_cache())
    logits, taps = t.forward_logits_taps(rand_tokens(0, 3), torch.arange(3), t.new_cache(),
                                         with_taps=False)
    assert taps is None and logits.shape == (1, 3, V)


# -- 9: dtypes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_bfloat16_load(checkpoints, name):
    d, model = checkpoints[name]
    t = load_target(d, dtype="bfloat16", taps=TAPS[0])
    assert t.lm_head.weight.dtype == torch.bfloat16
    tokens = rand_tokens(13, 16)
    logits, taps = t.forward_logits_taps(tokens, torch.arange(16), t.new_cache())
    assert logits.dtype == torch.bfloat16 and taps.dtype == torch.bfloat16
    ref, ref_taps = oracle(model, tokens, TAPS[0])
    err = (logits.float() - ref).abs().max()
    assert err < 0.1 * ref.abs().max(), f"bf16 logits too far from fp32: {err}"
    assert (logits.float().argmax(-1) == ref.argmax(-1)).float().mean() > 0.7


def test_bf16_checkpoint_loads_in_fp32(tmp_path):
    make_hf_model("qwen3", seed=3).to(torch.bfloat16).save_pretrained(tmp_path)
    model = make_hf_model("qwen3", seed=3)  # the oracle: the bf16-rounded weights, exactly, in fp32
    for p in model.parameters():  # (not `.float()` of the bf16 model: that rounds RoPE buffers too)
        p.copy_(p.to(torch.bfloat16).float())
    t = load_target(str(tmp_path), taps=TAPS[0])
    assert t.lm_head.weight.dtype == torch.float32
    tokens = rand_tokens(14, 16)
    logits, taps = t.forward_logits_taps(tokens, torch.arange(16), t.new_cache())
    assert logits.dtype == torch.float32
    ref, ref_taps = oracle(model, tokens, TAPS[0])
    close(logits, ref, what="bf16 checkpoint, fp32 compute")
    close(taps, ref_taps, what="bf16 checkpoint taps")


def test_unknown_dtype_is_rejected(checkpoints):
    with pytest.raises(Eagle3Error, match="dtype"):
        load_target(checkpoints["llama"][0], dtype="float8")


# -- 10: the TARGETS registry -------------------------------------------------------------------------------
def test_targets_registry():
    assert TARGETS
    for name, spec in TARGETS.items():
        assert isinstance(spec, TargetSpec), name
        assert callable(spec.load), name
        assert isinstance(spec.max_forward_len, int) and isinstance(spec.min_forward_len, int)
        assert 1 <= spec.min_forward_len <= spec.max_forward_len, name
    for family in NATIVE_FAMILIES:  # every native model_type has an entry
        assert family in TARGETS
    assert "hf" in TARGETS and "default" in TARGETS


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_registry_load_matches_load_target(checkpoints, name):
    d, model = checkpoints[name]
    t = TARGETS[model.config.model_type].load(d, taps=TAPS[0])
    tokens = rand_tokens(15, 10)
    logits, _ = t.forward_logits_taps(tokens, torch.arange(10), t.new_cache())
    close(logits, oracle(model, tokens)[0], what=f"TARGETS[{name}].load")


def test_family_name_is_not_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so 'llama' is not a directory here
    assert not os.path.exists("llama")
    with pytest.raises(Eagle3Error, match="family"):
        load_target("llama")
