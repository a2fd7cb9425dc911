"""GGUF targets: tiny files written here (gguf.GGUFWriter), checked against transformers' GGUF loader."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import eagle3
from conftest import make_hf_model
from eagle3.errors import Eagle3Error
from eagle3.targets import load_target
from gguf_files import Q, oracle, write_gguf

# transformers' GGUF loader ignores Gemma's softcap and query-scale keys (it keeps its config
# defaults: softcaps 50 / 30, query_pre_attn_scalar 256), so the Gemma fixtures use those values.
GEMMA = dict(head_dim=256, query_pre_attn_scalar=256)
ARCHS = {
    "llama": ("llama", {}),
    "llama_tied": ("llama_tied", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 128}),  # transformers reads no key_length for qwen3: its default 128
    "gemma2": ("gemma2", {**GEMMA, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": ("gemma3", {**GEMMA, "sliding_window": 7}),
}
# K-quants need rows of 256: a wider model.
WIDE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=4, vocab_size=256)


def _tap_check(model, path: str, length: int = 20, seed: int = 0) -> None:
    ref = oracle(path)
    torch.manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, length))
    L = model.config.num_hidden_layers
    model.tap_layers = (1, L // 2, L - 1)
    with torch.no_grad():
        want = ref(ids, output_hidden_states=True)
        got, taps = model(ids, torch.arange(length), model.new_cache(1, 64), kv_len=length)
    torch.testing.assert_close(got, want.logits, atol=1e-4, rtol=1e-4)
    H = model.config.hidden_size
    for i, k in enumerate(model.tap_layers):
        torch.testing.assert_close(taps[..., i * H:(i + 1) * H], want.hidden_states[k], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_architectures_match_transformers(arch, tmp_path):
    variant, extra = ARCHS[arch]
    hf = make_hf_model(variant, seed=1, **extra)
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(hf, path)
    model = load_target(path)
    assert model.config.model_type == hf.config.model_type
    _tap_check(model, path, length=20)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_quant_types_dequantize_like_transformers(qtype, tmp_path):
    q = getattr(Q, qtype)
    hf = make_hf_model("llama", seed=2, **(WIDE if qtype.endswith("_K") else {}))
    path = str(tmp_path / f"m-{qtype}.gguf")
    write_gguf(hf, path, qtype=q)
    _tap_check(load_target(path), path, length=12)


def test_gguf_greedy_equals_transformers_generate(tmp_path):
    hf = make_hf_model("gemma3", seed=3, **ARCHS["gemma3"][1])
    path = str(tmp_path / "g3.gguf")
    write_gguf(hf, path, qtype=Q.Q8_0)
    ref = oracle(path)
    spec = eagle3.load(path, quantize="fp32")  # the oracle's arithmetic: float32
    prompt = [5, 17, 33, 2, 90, 11]
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                        eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert spec.generate(prompt, 24, stop_token_ids=[]).token_ids == want


def test_gguf_speculation_is_lossless(tmp_path):
    from eagle3.draft import attach_head
    from eagle3.kernels import WeightFormat
    from eagle3.speculator import Eagle3Speculator
    from eagle3.targets.prepare import prepare_loaded
    from heads import random_head

    hf = make_hf_model("qwen3", seed=4, head_dim=128)
    path = str(tmp_path / "q3.gguf")
    write_gguf(hf, path, qtype=Q.Q8_0)
    target = load_target(path)
    # The row-invariant kernels (eagle3.load's default): speculative == plain bit for bit on any
    # CPU; stock float layers can flip a near-tie between a verify and a decode.
    prepare_loaded(target, WeightFormat.parse("fp32"))
    head = random_head(target, draft_vocab_size=80, seed=1, taps=(1, 3, 5))
    attach_head(head, target)
    spec = Eagle3Speculator(target, head)
    plain = spec.plain()
    for k in (1, 3, 6):
        prompt = [3, 9, 27, 81, 4]
        assert spec.generate(prompt, 40, num_draft_tokens=k, stop_token_ids=[]).token_ids == \
            plain.generate(prompt, 40, stop_token_ids=[]).token_ids


def _bpe(vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
            "def main():\n    return 0\n"] * 20
    tok.train_from_iterator(text, trainer)
    return tok


TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def test_gguf_tokenizer_and_chat_template(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok = _bpe()
    hf = make_hf_model("llama", seed=5, vocab_size=320)
    path = str(tmp_path / "tok.gguf")
    write_gguf(hf, path, tokenizer=tok, chat_template=TEMPLATE)
    spec = eagle3.load(path)
    for text in ("hello world, how are you today?", "the lazy fox\n    return 0", "zebra xylophone!"):
        assert spec.tokenizer.encode(text) == tok.encode(text).ids
        assert spec.tokenizer.decode(tok.encode(text).ids) == text
    msgs = [{"role": "user", "content": "hello world"}]
    rendered = "<s>user\nhello world</s>\n<s>assistant\n"
    assert spec.tokenizer.apply_chat_template(msgs) == tok.encode(rendered).ids
    assert spec.target.config.eos_token_ids == (1,)
    # A directory holding one .gguf loads the same way; the cached tokenizer is reused.
    assert eagle3.load(str(tmp_path)).tokenizer.encode("hello") == tok.encode("hello").ids


def test_gguf_bad_input(tmp_path):
    hf = make_hf_model("llama", seed=6)
    good = str(tmp_path / "good.gguf")
    write_gguf(hf, good, qtype=Q.Q8_0)
    data = open(good, "rb").read()
    cases = {}
    for frac in (0.02, 0.5, 0.97):
        p = tmp_path / f"cut{frac}.gguf"
        p.write_bytes(data[:int(len(data) * frac)])
        cases[str(p)] = "truncated"
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    cases[str(junk)] = "not a GGUF"
    unknown = str(tmp_path / "unknown.gguf")
    write_gguf(hf, unknown, arch="rwkv6")
    cases[unknown] = "architecture 'rwkv6' is not supported"
    lora = str(tmp_path / "lora.gguf")
    write_gguf(hf, lora, general_type="adapter")
    cases[lora] = "adapter"
    clip = str(tmp_path / "mmproj.gguf")
    write_gguf(hf, clip, arch="clip")
    cases[clip] = "vision projector"
    for path, words in cases.items():
        with pytest.raises(Eagle3Error, match=words):
            load_target(path)
    two = tmp_path / "two"
    two.mkdir()
    for n in ("a", "b"):
        (two / f"{n}.gguf").write_bytes(data)
    with pytest.raises(Eagle3Error, match="holds 2 .gguf files"):
        load_target(str(two))
    with pytest.raises(Eagle3Error, match="does not exist"):
        load_target(str(tmp_path / "missing.gguf"))


def test_gguf_unsupported_quant_type(tmp_path):
    import gguf
    import numpy as np

    hf = make_hf_model("llama", seed=7)
    path = str(tmp_path / "iq.gguf")
    write_gguf(hf, path)
    # Relabel one tensor's type in place: rewrite the file with an IQ4_NL tensor of the right size.
    w = gguf.GGUFWriter(path, "llama")
    for key, fn in (("block_count", w.add_block_count), ("embedding_length", w.add_embedding_length)):
        fn(hf.config.num_hidden_layers if key == "block_count" else hf.config.hidden_size)
    w.add_head_count(4)
    raw = np.zeros((hf.config.vocab_size, hf.config.hidden_size // 32 * 18), np.uint8)
    w.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(Eagle3Error, match="IQ4_NL"):
        load_target(path)


def test_cli_gguf_errors_and_inspect(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "eagle3")
    hf = make_hf_model("qwen2", seed=8)
    good = str(tmp_path / "q2.gguf")
    write_gguf(hf, good, qtype=Q.Q4_0)
    p = subprocess.run([exe, "inspect", good, "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    import json

    info = json.loads(p.stdout)
    assert info["kind"] == "target" and info["model_type"] == "qwen2" and info["format"] == "gguf"
    assert set(info["quant_types"]) == {"F32", "Q4_0"}  # norms stay F32, matrices Q4_0
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(open(good, "rb").read()[:500])
    for argv in (["inspect", str(bad)], ["generate", "--target", str(bad), "--prompt-ids", "1,2"]):
        p = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=300)
        assert p.returncode == 2, p.stderr
        assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr


def test_cli_chat_needs_a_chat_template(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    exe = os.path.join(os.path.dirname(sys.executable), "eagle3")
    tok = _bpe()
    hf = make_hf_model("llama", seed=9, vocab_size=320)
    plain = str(tmp_path / "plain.gguf")
    write_gguf(hf, plain, tokenizer=tok)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for argv in (["chat", "--target", plain], ["generate", "--target", plain, "--chat", "hi"]):
        p = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=300, input="hi\n", env=env)
        assert p.returncode == 2 and "no chat template" in p.stderr and "generate" in p.stderr, p.stderr
        assert p.stderr.count("\n") == 1, p.stderr
    chat = str(tmp_path / "chat" / "m.gguf")
    os.makedirs(os.path.dirname(chat))
    write_gguf(hf, chat, tokenizer=tok, chat_template=TEMPLATE)
    p = subprocess.run([exe, "generate", "--target", chat, "--chat", "hello world", "--system", "be brief",
                        "--max-new-tokens", "6", "--stop-ids", "", "--json"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    rendered = "<s>system\nbe brief</s>\n<s>user\nhello world</s>\n<s>assistant\n"
    want = eagle3.load(chat).generate(tok.encode(rendered).ids, 6, stop_token_ids=[]).token_ids
    assert json.loads(p.stdout)["token_ids"] == want
    p = subprocess.run([exe, "chat", "--target", chat, "--max-new-tokens", "4"], capture_output=True,
                       text=True, timeout=300, input="hello world\n/reset\nthe fox\n/exit\n", env=env)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("tok/s") == 2 and "conversation reset" in p.stderr


@pytest.mark.parametrize("layers", [3, 46])
def test_gemma2_gguf_reads_its_softcaps_and_query_scale(tmp_path, layers):
    """Soft-caps unlike transformers' defaults (50 / 30) come from the file's metadata, and the
    query scale follows llama.cpp's rule: 1/sqrt(head_dim), or 1/sqrt(H/heads) for the 46-layer
    (27B) shape, here with head_dim != H/heads. transformers' GGUF loader keeps its config
    defaults for these keys, so the oracle is the transformers model the file was written from."""
    H, heads, hd = 64, 4, 32
    scalar = H // heads if layers == 46 else hd
    hf = make_hf_model("gemma2", seed=4, num_hidden_layers=layers, head_dim=hd, sliding_window=7,
                       attn_logit_softcapping=7.0, final_logit_softcapping=4.0, query_pre_attn_scalar=scalar)
    with torch.no_grad():  # tied, small embeddings: logits far from the final cap otherwise
        hf.get_input_embeddings().weight.mul_(100.0)
    path = str(tmp_path / "gemma2.gguf")
    write_gguf(hf, path)
    t = load_target(path, taps=(0, 1, 2))
    cfg = t.config
    assert (cfg.attn_softcap, cfg.final_softcap) == (7.0, 4.0)
    assert cfg.attn_scale == pytest.approx(scalar ** -0.5)
    ids = torch.randint(0, hf.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
        got, _ = t.forward_logits_taps(ids, torch.arange(24), t.new_cache(1, 64), kv_len=24, with_taps=False)
    assert want.abs().max() > 3.0  # the final cap (4.0) is reached, not idle
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _same_as_library(path: str) -> list[str]:
    """eagle3's reader (`gguf._reader`) against the gguf package's own on `path`: every field and
    tensor the same, long arrays stepped over with their lengths kept; returns the stepped keys."""
    import gguf
    import numpy as np

    from eagle3.targets import gguf as eagle3_gguf

    ours, lib = eagle3_gguf._reader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(lib.fields)
    stepped = []
    for key, field in ours.fields.items():
        want = lib.fields[key]
        assert field.offset == want.offset and field.types == want.types, key
        if len(want.data) > eagle3_gguf.LONG_ARRAY:  # stepped over: its length kept, no parts
            assert field.contents() == [] and int(field.parts[4][0]) == len(want.data), key
            stepped.append(key)
        else:
            assert field.contents() == want.contents(), key
    assert ours.data_offset == lib.data_offset and len(ours.tensors) == len(lib.tensors)
    for t, u in zip(ours.tensors, lib.tensors):
        assert (t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) == \
            (u.name, u.tensor_type, list(u.shape), u.data_offset, u.n_bytes)
        assert np.array_equal(np.asarray(t.data), np.asarray(u.data))
    assert eagle3_gguf._scalars(ours) == eagle3_gguf._scalars(lib)
    return stepped


@pytest.mark.parametrize("endian", ["little", "big"])
def test_gguf_reader_steps_over_long_arrays_like_the_library(tmp_path, endian):
    """Long arrays (a vocabulary, merges, scores, token types: strings of any length, empty and
    multi-byte ones included, and fixed-size numbers) are stepped over without losing the place
    of the fields and tensors after them; short ones are read as the library reads them."""
    import gguf
    import numpy as np

    from eagle3.targets.gguf import LONG_ARRAY

    rng = np.random.default_rng(0)
    n = LONG_ARRAY + 77
    words = ["", "é", "\u4e2d\u6587", "a" * 300] + [f"tok{i}" * int(rng.integers(1, 5)) for i in range(n)]
    path = str(tmp_path / f"arrays-{endian}.gguf")
    order = gguf.GGUFEndian.BIG if endian == "big" else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(path, "llama", endianess=order)
    w.add_token_list(words)
    w.add_token_scores(rng.standard_normal(n).astype(np.float32).tolist())
    w.add_token_types([int(x) for x in rng.integers(1, 6, n)])
    w.add_array("test.short_strings", ["x", "yy", ""])
    w.add_array("test.exactly_long", list(range(LONG_ARRAY)))
    w.add_uint32("test.after", 7)
    w.add_string("test.name", "after the arrays")
    w.add_tensor("a", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal((5, 32)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    stepped = _same_as_library(path)
    assert sorted(stepped) == ["tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.tokens"]


def test_gguf_reader_on_the_default_target_file():
    from eagle3.targets.gguf import find_gguf
    from eagle3.targets.named import model_path

    stepped = _same_as_library(find_gguf(model_path("smollm2-135m-instruct")))
    assert sorted(stepped) == ["tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.tokens"]
