"""Checkpoint loading: every on-disk layout and dtype, and every kind of bad input.

Layouts (single / sharded safetensors, .bin, sharded .bin) and half-precision
checkpoints must give the transformers oracle's logits. Bad input must raise
`Eagle3Error` with a one-line message naming the problem, and leave nothing
behind: the checkpoint directory is untouched and a speculator that refused a
request still generates exactly what a fresh one does.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import eagle3
from conftest import make_checkpoint, make_hf_model
from eagle3 import Eagle3Error
from eagle3.targets import HFTarget, NativeTarget, load_target

IDS = [5, 17, 3, 99, 42, 7, 131, 64, 8, 150, 1, 77]


# -- helpers ------------------------------------------------------------------
def native_logits(target, ids=IDS) -> torch.Tensor:
    """Full-sequence logits (T, V) from a `TapTarget` in one prefill."""
    cache = target.new_cache(1, len(ids))
    logits, _ = target.forward_logits_taps(torch.tensor([ids]), torch.arange(len(ids)), cache,
                                           with_taps=False)
    return logits[0].float()


@torch.no_grad()
def oracle_logits(model, ids=IDS) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids, n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def error_of(fn, *args, **kw) -> str:
    """Call fn and return its Eagle3Error message, checking it is one line."""
    with pytest.raises(Eagle3Error) as info:
        fn(*args, **kw)
    msg = str(info.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


def assert_words(msg: str, *words: str) -> None:
    low = msg.lower()
    for w in words:
        assert w.lower() in low, f"{w!r} not in {msg!r}"


def snapshot(path: str) -> dict[str, tuple[int, int]]:
    """{relative file: (size, mtime_ns)} under path, to prove a failed load wrote nothing."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            full = os.path.join(root, f)
            st = os.stat(full)
            out[os.path.relpath(full, path)] = (st.st_size, st.st_mtime_ns)
    return out


def edit_config(path: str, **changes) -> None:
    """Rewrite path/config.json with keys changed (value None deletes the key)."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(dir, oracle) of a plain Llama checkpoint saved as one model.safetensors."""
    d = str(tmp_path_factory.mktemp("loading") / "llama")
    return d, make_checkpoint(d, "llama")


@pytest.fixture
def ckpt(base, tmp_path):
    """A private copy of the base checkpoint that a test may damage."""
    d = str(tmp_path / "ckpt")
    shutil.copytree(base[0], d)
    return d


# -- layouts and dtypes ------------------------------------------------------
def test_single_safetensors(base):
    d, model = base
    assert os.path.isfile(os.path.join(d, "model.safetensors"))
    target = load_target(d)
    assert isinstance(target, NativeTarget)
    torch.testing.assert_close(native_logits(target), oracle_logits(model), rtol=0, atol=1e-4)


def test_sharded_safetensors(tmp_path, base):
    d = str(tmp_path / "sharded")
    model = base[1]
    model.save_pretrained(d, max_shard_size="50KB")
    assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    assert not os.path.exists(os.path.join(d, "model.safetensors"))
    assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) > 1
    torch.testing.assert_close(native_logits(load_target(d)), oracle_logits(model), rtol=0, atol=1e-4)


def _write_bin(d: str, model, shards: int = 1) -> None:
    """A pytorch_model.bin checkpoint (transformers 5 only writes safetensors)."""
    os.makedirs(d, exist_ok=True)
    model.config.save_pretrained(d)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if shards == 1:
        torch.save(state, os.path.join(d, "pytorch_model.bin"))
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in names[i::shards]}
        torch.save(part, os.path.join(d, fname))
        weight_map.update(dict.fromkeys(part, fname))
    with open(os.path.join(d, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.mark.parametrize("shards", [1, 3])
def test_pytorch_bin(tmp_path, base, shards):
    d = str(tmp_path / "bin")
    _write_bin(d, base[1], shards)
    assert not any(f.endswith(".safetensors") for f in os.listdir(d))
    torch.testing.assert_close(native_logits(load_target(d)), oracle_logits(base[1]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_half_precision_checkpoint(tmp_path, dtype, atol):
    d = str(tmp_path / "half")
    make_hf_model("llama").to(dtype).save_pretrained(d)
    assert next(iter(load_file(os.path.join(d, "model.safetensors")).values())).dtype == dtype
    # The oracle: transformers loading the same (rounded) weights in float32.
    oracle = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ref = oracle_logits(oracle)
    # Default compute dtype is float32: the half weights upcast exactly, so fp32 tolerance holds.
    up = load_target(d)
    assert up.lm_head.weight.dtype == torch.float32
    torch.testing.assert_close(native_logits(up), ref, rtol=0, atol=1e-4)
    # Computing in the checkpoint's own dtype is close, not exact.
    half = load_target(d, dtype=dtype)
    assert half.lm_head.weight.dtype == dtype
    got = native_logits(half)
    assert (got - ref).abs().max() < atol
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_dtype_strings(base):
    for name, dt in [("bf16", torch.bfloat16), ("float16", torch.float16), ("fp32", torch.float32)]:
        assert load_target(base[0], dtype=name).lm_head.weight.dtype == dt


# -- bad checkpoints ---------------------------------------------------------
def test_missing_directory(tmp_path):
    missing = str(tmp_path / "nope")
    for fn in (lambda: eagle3.load(missing, "none"), lambda: load_target(missing)):
        msg = error_of(fn)
        assert_words(msg, missing, "not a directory")
    assert not os.path.exists(missing)


def test_directory_without_config(tmp_path):
    msg = error_of(eagle3.load, str(tmp_path), "none")
    assert_words(msg, "config.json", "missing")


@pytest.mark.parametrize("text,words", [
    ("{not json", ["config.json", "not valid JSON"]),
    ("", ["config.json", "not valid JSON"]),
    ("[1, 2, 3]", ["config.json", "JSON object", "list"]),
    ('"llama"', ["config.json", "JSON object", "str"]),
])
def test_malformed_config(ckpt, text, words):
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        f.write(text)
    for backend in ("auto", "native", "hf"):
        assert_words(error_of(load_target, ckpt, backend=backend), *words)


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "num_hidden_layers",
                                 "vocab_size", "intermediate_size"])
def test_config_missing_key(ckpt, key):
    edit_config(ckpt, **{key: None})
    assert_words(error_of(load_target, ckpt), key, "config.json")


@pytest.mark.parametrize("changes,words", [
    ({"hidden_size": "big"}, ["hidden_size", "big"]),
    ({"num_attention_heads": 0}, ["num_attention_heads", "0"]),
    ({"num_hidden_layers": -1}, ["num_hidden_layers", "-1"]),
    ({"num_key_value_heads": 3}, ["num_attention_heads", "num_key_value_heads"]),
    ({"head_dim": 2.5}, ["head_dim", "2.5"]),
    ({"vocab_size": True}, ["vocab_size", "True"]),
    ({"rms_norm_eps": "tiny"}, ["malformed", "tiny"]),
    ({"eos_token_id": "eos"}, ["malformed", "eos"]),
    ({"rope_parameters": None, "rope_scaling": ["linear", 2.0]}, ["malformed"]),
    ({"rope_parameters": {"rope_type": "linear", "factor": "two"}}, ["malformed", "two"]),
])
def test_config_bad_values(ckpt, changes, words):
    edit_config(ckpt, **changes)
    assert_words(error_of(load_target, ckpt), *words)


def test_missing_weight_files(ckpt):
    os.remove(os.path.join(ckpt, "model.safetensors"))
    msg = error_of(load_target, ckpt)
    assert_words(msg, "no weights", "model.safetensors", "pytorch_model.bin")


@pytest.mark.parametrize("cut", ["half", "header", "empty"])
def test_truncated_safetensors(ckpt, cut):
    path = os.path.join(ckpt, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    data = {"half": data[:len(data) // 2], "header": data[:4], "empty": b""}[cut]
    with open(path, "wb") as f:
        f.write(data)
    before = snapshot(ckpt)
    msg = error_of(eagle3.load, ckpt, "none")
    assert_words(msg, "model.safetensors", "truncated")
    assert snapshot(ckpt) == before


def test_truncated_bin(tmp_path, base):
    d = str(tmp_path / "bin")
    _write_bin(d, base[1])
    path = os.path.join(d, "pytorch_model.bin")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    assert_words(error_of(load_target, d), "pytorch_model.bin", "truncated")


def test_bad_shard_index(tmp_path, base):
    d = str(tmp_path / "sharded")
    base[1].save_pretrained(d, max_shard_size="50KB")
    index = os.path.join(d, "model.safetensors.index.json")
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    # A shard the index names is gone.
    victim = sorted(set(weight_map.values()))[2]
    os.rename(os.path.join(d, victim), os.path.join(d, victim + ".bak"))
    assert_words(error_of(load_target, d), victim, "missing")
    os.rename(os.path.join(d, victim + ".bak"), os.path.join(d, victim))
    # The index itself is malformed.
    for text in ("{oops", "{}", "[]"):
        with open(index, "w") as f:
            f.write(text)
        assert_words(error_of(load_target, d), "index")


def _resave(d: str, fn) -> None:
    path = os.path.join(d, "model.safetensors")
    state = load_file(path)
    fn(state)
    save_file(state, path, metadata={"format": "pt"})


def test_wrong_shape(ckpt):
    name = "model.layers.3.mlp.up_proj.weight"
    _resave(ckpt, lambda s: s.__setitem__(name, s[name][:100].contiguous()))
    msg = error_of(load_target, ckpt)
    assert_words(msg, name, "shape", "(100, 64)", "(128, 64)")


def test_missing_tensor(ckpt):
    name = "model.layers.1.self_attn.k_proj.weight"
    _resave(ckpt, lambda s: s.pop(name))
    assert_words(error_of(load_target, ckpt), name, "lacks")


def test_missing_lm_head_untied(ckpt):
    _resave(ckpt, lambda s: s.pop("lm_head.weight"))
    assert_words(error_of(load_target, ckpt), "lm_head.weight")


def test_unsupported_architecture_native(ckpt):
    edit_config(ckpt, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    msg = error_of(load_target, ckpt, backend="native")
    assert_words(msg, "gpt2", "supported", "llama", "qwen2", "gemma2", "backend='hf'")


def test_unsupported_rope_native(ckpt):
    edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": 64})
    assert_words(error_of(load_target, ckpt, backend="native"), "rope", "yarn", "backend='hf'")
    # The older top-level layout says the same.
    edit_config(ckpt, rope_parameters=None, rope_theta=10000.0,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    assert_words(error_of(load_target, ckpt, backend="native"), "yarn", "backend='hf'")


def test_unsupported_activation_native(ckpt):
    edit_config(ckpt, hidden_act="relu")
    assert_words(error_of(load_target, ckpt, backend="native"), "relu", "backend='hf'")


def test_invalid_taps(base):
    d = base[0]
    assert_words(error_of(load_target, d, taps=(4, 2, 1)), "ascending")
    assert_words(error_of(load_target, d, taps=(1, 1, 3)), "unique")
    assert_words(error_of(load_target, d, taps=(0, 3, 7)), "out of range", "0..6")
    assert_words(error_of(load_target, d, taps=(-1, 2, 3)), "out of range")
    assert_words(error_of(load_target, d, taps=()), "at least one")
    assert_words(error_of(load_target, d, taps=("a", "b")), "layer indices")
    assert_words(error_of(load_target, d, taps=5), "layer indices")
    target = load_target(d, taps=(1, 3, 6))
    assert target.tap_layers == (1, 3, 6)
    # Setting bad taps later leaves the old ones in place.
    with pytest.raises(Eagle3Error):
        target.tap_layers = (3, 2)
    assert target.tap_layers == (1, 3, 6)
    # A 6-layer target loads; its default taps (2, 3, 3) collide, which is an error on use.
    plain = load_target(d)
    assert_words(error_of(lambda: plain.tap_layers), "default taps", "explicitly")


def test_unknown_dtype_backend_and_target(base, tmp_path):
    d = base[0]
    assert_words(error_of(eagle3.load, d, "none", dtype="int8"), "dtype", "int8", "bfloat16")
    assert_words(error_of(load_target, d, backend="onnx"), "backend", "onnx", "native", "hf")
    assert_words(error_of(eagle3.load, d, "none", max_seq_len=1), "max_seq_len")
    assert_words(error_of(eagle3.load, "", "none"), "target")
    assert_words(error_of(eagle3.load, None, "none"), "target")
    # A family name is not a checkpoint.
    assert_words(error_of(load_target, "llama"), "llama", "checkpoint directory")


def test_draft_dir_without_config_is_clear(base, tmp_path):
    msg = error_of(eagle3.load, base[0], str(tmp_path))
    assert_words(msg, "draft")


@pytest.mark.parametrize("text", [
    '[1]', 'nope', '{"eos_token_id": null}',
    '{"eos_token_id": "x"}', '{"eos_token_id": [2, null]}',
])
def test_malformed_generation_config(ckpt, text):
    """generation_config.json is optional: junk there is ignored or named, never a traceback."""
    with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
        f.write(text)
    try:
        target = load_target(ckpt)
    except Eagle3Error as e:
        assert_words(str(e), "generation_config.json")
        assert "\n" not in str(e)
    else:
        assert target.config.eos_token_ids in ((), (2,))  # fell back to config.json's


def test_tokenizer_presence(ckpt, tmp_path):
    from eagle3.targets.default import RANDOM_CONFIG, build_random_checkpoint

    assert eagle3.load(ckpt, "none").tokenizer is None
    d = str(tmp_path / "tok")
    build_random_checkpoint(d, {**RANDOM_CONFIG, "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 2})
    tok = eagle3.load(d, "none").tokenizer
    ids = tok.encode("import os\n")
    assert ids and all(0 <= t < 512 for t in ids)
    assert tok.decode(ids) == "import os\n"


def test_corrupt_tokenizer(ckpt):
    with open(os.path.join(ckpt, "tokenizer.json"), "w") as f:
        f.write("{broken")
    assert_words(error_of(eagle3.load, ckpt, "none"), "tokenizer")


# -- bad requests ------------------------------------------------------------
@pytest.fixture(scope="module")
def spec32(base):
    return eagle3.load(base[0], "none", max_seq_len=32)


def test_request_errors(spec32):
    gen = spec32.generate
    assert spec32.max_seq_len == 32
    assert_words(error_of(gen, list(range(40)), 4), "40", "max_seq_len", "32")
    assert_words(error_of(gen, list(range(20)), 13), "20", "13", "max_seq_len", "32")
    assert_words(error_of(gen, [1, -1, 2], 4), "-1", "vocabulary", "0..159")
    assert_words(error_of(gen, [1, 160, 2], 4), "160", "vocabulary")
    assert_words(error_of(gen, [10 ** 12], 4), "vocabulary")
    assert_words(error_of(gen, [], 4), "empty")
    assert_words(error_of(gen, torch.tensor([], dtype=torch.long), 4), "empty")
    assert_words(error_of(gen, [1, 2], 0), "max_new_tokens", "0")
    assert_words(error_of(gen, [1, 2], -3), "max_new_tokens")
    assert_words(error_of(gen, [1, 2], 2.5), "max_new_tokens")
    assert_words(error_of(gen, ["a", "b"], 4), "integer")
    assert_words(error_of(gen, None, 4), "integer")
    # Exactly full is fine.
    assert len(gen(list(range(20)), 12, stop_token_ids=[]).token_ids) == 12


def test_no_state_left_behind(base):
    d = base[0]
    spec = eagle3.load(d, "none", max_seq_len=64)
    prompt = [4, 8, 15, 16, 23, 42]
    first = spec.generate(prompt, 10, stop_token_ids=[]).token_ids
    for bad in ([4, 8, 999], [], list(range(70))):
        with pytest.raises(Eagle3Error):
            spec.generate(bad, 10)
    with pytest.raises(Eagle3Error):
        spec.generate(prompt, 0)
    fresh = eagle3.load(d, "none", max_seq_len=64).generate(prompt, 10, stop_token_ids=[]).token_ids
    assert spec.generate(prompt, 10, stop_token_ids=[]).token_ids == first == fresh
    assert first == hf_greedy_no_eos(base[1], prompt, 10)


@torch.no_grad()
def hf_greedy_no_eos(model, ids, n):
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_failed_load_then_good_load(ckpt, base):
    edit_config(ckpt, hidden_size=32)  # config and weights disagree
    before = snapshot(ckpt)
    with pytest.raises(Eagle3Error):
        load_target(ckpt)
    assert snapshot(ckpt) == before
    torch.testing.assert_close(native_logits(load_target(base[0])), oracle_logits(base[1]),
                               rtol=0, atol=1e-4)


# -- the transformers adapter ------------------------------------------------
@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    cfg = transformers.GPT2Config(vocab_size=160, n_embd=64, n_layer=4, n_head=4, n_positions=128,
                                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2 and "wte" not in n and "wpe" not in n:
                p.mul_(4.0)
    d = str(tmp_path_factory.mktemp("gpt2") / "gpt2")
    model.save_pretrained(d)
    return d, model


def test_auto_backend_uses_hf_adapter(gpt2, capsys):
    d, model = gpt2
    spec = eagle3.load(d, "none")
    assert "transformers adapter" in capsys.readouterr().err
    assert isinstance(spec.target, HFTarget)
    assert spec.target.config.model_type == "gpt2"
    assert spec.max_seq_len == 128
    for prompt in ([5, 17, 3], IDS):
        got = spec.generate(prompt, 16).token_ids
        assert got == hf_greedy(model, prompt, 16)
    torch.testing.assert_close(native_logits(spec.target), oracle_logits(model), rtol=0, atol=1e-4)
    # backend='native' refuses it; backend='hf' is the same as auto here.
    assert_words(error_of(load_target, d, backend="native"), "gpt2", "backend='hf'")
    assert isinstance(load_target(d, backend="hf"), HFTarget)
    # Bad requests are checked against the adapter's sizes too.
    assert_words(error_of(spec.generate, [160], 4), "vocabulary")
    assert_words(error_of(spec.generate, list(range(120)), 9), "max_seq_len", "128")


def test_auto_backend_falls_back_for_unsupported_rope(ckpt, base):
    edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": 64})
    target = load_target(ckpt)
    assert isinstance(target, HFTarget)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    torch.testing.assert_close(native_logits(target), oracle_logits(oracle), rtol=0, atol=1e-4)


def test_hf_backend_bad_weights(ckpt):
    path = os.path.join(ckpt, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    msg = error_of(load_target, ckpt, backend="hf")
    assert_words(msg, "transformers could not load", ckpt)


# -- stop tokens -------------------------------------------------------------
def test_stop_token_semantics(base, tmp_path):
    d, model = base
    spec = eagle3.load(d, "none")
    prompt = [9, 33, 71, 5]
    free = spec.generate(prompt, 24, stop_token_ids=[]).token_ids
    assert len(free) == 24
    assert free == hf_greedy_no_eos(model, prompt, 24)
    # Pick a token whose first occurrence is not at the start.
    i = next(i for i in range(3, 24) if free[i] not in free[:i])
    t = free[i]
    assert spec.generate(prompt, 24, stop_token_ids=[t]).token_ids == free[:i + 1]
    assert spec.generate(prompt, 24, stop_token_ids=[10 ** 6, t]).token_ids == free[:i + 1]
    assert spec.generate(prompt, 24, stop_token_ids=(t,)).token_ids == free[:i + 1]
    # The first generated token can stop it; max_new_tokens still bounds it.
    assert spec.generate(prompt, 24, stop_token_ids=[free[0]]).token_ids == free[:1]
    assert spec.generate(prompt, i, stop_token_ids=[t]).token_ids == free[:i]
    # Default stop ids are the target's EOS (generation_config.json wins over config.json).
    d2 = str(tmp_path / "eos")
    shutil.copytree(d, d2)
    edit_config(d2, eos_token_id=free[0])
    with open(os.path.join(d2, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [10 ** 6, t]}, f)
    spec2 = eagle3.load(d2, "none")
    assert t in spec2.target.config.eos_token_ids
    assert spec2.generate(prompt, 24).token_ids == free[:i + 1]
    assert spec2.generate(prompt, 24).token_ids == hf_greedy(
        transformers.AutoModelForCausalLM.from_pretrained(d2).eval(), prompt, 24)
    assert spec2.generate(prompt, 24, stop_token_ids=[]).token_ids == free
    # Without generation_config.json, config.json's eos_token_id is the default.
    os.remove(os.path.join(d2, "generation_config.json"))
    edit_config(d2, eos_token_id=t)
    assert eagle3.load(d2, "none").generate(prompt, 24).token_ids == free[:i + 1]
