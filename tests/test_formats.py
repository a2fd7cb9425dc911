"""EAGLE-3 head formats: real configs, small heads in every format, conversion, inspect, a reference
forward, and validation.

Heads are written here from raw tensors (never only by our own saver), named as each format names
them: official / SGLang `midlayer.*`, speculators `layers.0.*`; `d2t`/`t2d` for a reduced vocabulary.
The real published configs live in `shared/formats/` beside the repository. The draft forward is
checked against an independent plain-torch computation (float64) of DESIGN §2's recipe.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import eagle3
from conftest import make_checkpoint, make_hf_model
from eagle3 import Eagle3Error
from eagle3.cli import main as cli_main
from eagle3.draft import convert_head, load_head, parse_head_config
from eagle3.draft.formats import read_head

FORMATS_DIR = Path(__file__).resolve().parent / "data" / "formats"  # a copy of ../shared/formats
OFFICIAL, QWEN3, GEMMA3, GEMMA4 = ("eagle-official-llama3.1-8b.config.json",
                                   "sglang-qwen3-4b-eagle3.config.json",
                                   "sglang-gemma3-1b-eagle3.config.json",
                                   "speculators-gemma4-31b-eagle3.config.json")
V, H, DV, TAPS = 160, 64, 100, [1, 3, 5]  # the tiny llama target: vocab 160, hidden 64, 6 layers
PROMPT = [5, 17, 3, 99, 42, 7, 131, 64]
M = "midlayer."


# -- helpers ------------------------------------------------------------------------------------
def real_config(name: str) -> dict:
    return json.loads((FORMATS_DIR / name).read_text())


def raw_tensors(*, h=H, heads=4, kv=2, hd=16, inter=128, vocab=V, dv=DV, th=None, seed=0,
                embed=False, input_norm=False) -> dict[str, torch.Tensor]:
    """Random head tensors in the official naming; norms away from 1 so swapping them shows."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1
    n = lambda d: 1.0 + 0.2 * torch.randn(d, generator=g)
    th = th or h
    sd = {"fc.weight": r(h, 3 * th), M + "self_attn.q_proj.weight": r(heads * hd, 2 * h),
          M + "self_attn.k_proj.weight": r(kv * hd, 2 * h), M + "self_attn.v_proj.weight": r(kv * hd, 2 * h),
          M + "self_attn.o_proj.weight": r(h, heads * hd), M + "mlp.gate_proj.weight": r(inter, h),
          M + "mlp.up_proj.weight": r(inter, h), M + "mlp.down_proj.weight": r(h, inter),
          M + "input_layernorm.weight": n(h), M + "hidden_norm.weight": n(h),
          M + "post_attention_layernorm.weight": n(h), "norm.weight": n(h), "lm_head.weight": r(dv, h)}
    if dv < vocab:
        used = torch.sort(torch.randperm(vocab, generator=g)[:dv]).values
        sd["d2t"] = used - torch.arange(dv)
        sd["t2d"] = torch.zeros(vocab, dtype=torch.bool)
        sd["t2d"][used] = True
    if embed:
        sd["embed_tokens.weight"] = torch.randn(vocab, h, generator=g)
    if input_norm:
        sd["input_norm.weight"] = n(3 * th)
    return sd


def official_config(*, h=H, heads=4, kv=2, inter=128, vocab=V, dv=DV, **extra) -> dict:
    """A config.json as the official EAGLE release writes it (no head_dim, no rope_theta)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
            "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
            "num_hidden_layers": 1, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "vocab_size": vocab, "draft_vocab_size": dv, "tie_word_embeddings": False, **extra}


def write_raw(path, config: dict, tensors: dict[str, torch.Tensor], fmt: str) -> str:
    """Write a head by hand: official -> pytorch_model.bin, others -> model.safetensors."""
    os.makedirs(path, exist_ok=True)
    if fmt == "speculators":
        tensors = {("layers.0." + k[len(M):] if k.startswith(M) else k): v for k, v in tensors.items()}
    if fmt == "official":
        torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def good_head(path, **cfg_extra) -> str:
    """The official-format head used across tests (taps named in its config)."""
    return write_raw(path, official_config(eagle_aux_hidden_state_layer_ids=TAPS, **cfg_extra),
                     raw_tensors(), "official")


def assert_one_line_error(exc: pytest.ExceptionInfo, *words: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w.lower() in msg.lower(), f"{w!r} not in {msg!r}"


def run_cli(*argvs: list[str]) -> list[subprocess.CompletedProcess]:
    """Run `python -m eagle3 ARGS` for each argv concurrently (stdin closed); results in order."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "eagle3", *a], stdin=subprocess.DEVNULL, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in argvs]
    out = []
    for p, a in zip(procs, argvs, strict=True):
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess([*a], p.returncode, stdout, stderr))
    return out


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("fmt_target") / "llama"
    make_checkpoint(str(d), "llama")
    return str(d)


@pytest.fixture(scope="module")
def greedy(target) -> list[int]:
    return list(eagle3.load(target, "none").generate(PROMPT, 12).token_ids)


# -- 1. the real published configs -------------------------------------------------------------
REAL = {  # file: (format, hidden, heads, kv heads, head_dim, vocab, rope theta, taps, norm_before_residual)
    OFFICIAL: ("official", 4096, 32, 8, 128, 128256, 10000.0, None, False),
    QWEN3: ("sglang", 2560, 32, 8, 80, 151936, 1e6, None, False),
    GEMMA3: ("sglang", 1152, 4, 1, 256, 262145, 1e6, None, False),
    GEMMA4: ("speculators", 5376, 32, 16, 256, 262144, 10000.0, (2, 30, 57), True),
}


@pytest.mark.parametrize("name", list(REAL))
def test_parse_real_config(name):
    fmt, hidden, heads, kv, hd, vocab, theta, taps, nbr = REAL[name]
    got_fmt, cfg = parse_head_config(real_config(name), name)
    assert got_fmt == fmt
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == \
        (hidden, heads, kv, hd)
    assert (cfg.vocab_size, cfg.draft_vocab_size) == (vocab, 32000)
    assert cfg.rope.theta == theta and cfg.rope.rope_type == "default"
    assert cfg.taps == taps
    assert cfg.norm_before_residual is nbr and cfg.norm_before_fc is False
    assert cfg.target_hidden_size == hidden  # speculators: target_hidden_size null -> draft hidden


def test_parse_config_variants():
    spec = real_config(GEMMA4)
    old = {**spec, "architectures": ["Eagle3Speculator"]}  # older speculators releases
    assert parse_head_config(old)[0] == "speculators"
    layer = {k: v for k, v in spec["transformer_layer_config"].items() if k != "rope_parameters"}
    c = {**spec, "transformer_layer_config": {**layer, "rope_theta": 5e5}, "target_hidden_size": 4096,
         "norm_before_fc": True}
    cfg = parse_head_config(c)[1]
    assert (cfg.rope.theta, cfg.target_hidden_size, cfg.norm_before_fc) == (5e5, 4096, True)
    sg = {**real_config(QWEN3), "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}}
    assert parse_head_config(sg)[1].taps == (1, 17, 32)  # verbatim, no SGLang +1 shift
    off = real_config(OFFICIAL)
    assert parse_head_config({k: v for k, v in off.items() if k != "draft_vocab_size"})[1].draft_vocab_size \
        == off["vocab_size"]


@pytest.mark.parametrize("change, words", [
    ({"num_hidden_layers": 2}, ["not an eagle-3 head"]),
    ({"model_type": "mistral"}, ["not an eagle-3 head"]),
    ({"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 2}, ["one decoder layer", "2"]),
    ({"hidden_act": "gelu"}, ["activation", "gelu"]),
    ({"attention_bias": True}, ["bias"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["rope", "yarn"]),
    ({"hidden_size": None}, ["hidden_size"]),
])
def test_parse_rejects(change, words):
    with pytest.raises(Eagle3Error) as e:
        parse_head_config({**real_config(OFFICIAL), **change}, "head/config.json")
    assert_one_line_error(e, *words)


# -- 2. shrunken copies of the real configs, with weights ---------------------------------------
# Small sizes that keep each config's quirks (head_dim != hidden/heads where the real one has it).
SHRINK = {
    OFFICIAL: {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
               "intermediate_size": 128, "vocab_size": V, "draft_vocab_size": DV},
    QWEN3: {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
            "intermediate_size": 128, "vocab_size": V, "draft_vocab_size": DV},
    GEMMA3: {"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
             "intermediate_size": 96, "vocab_size": V, "draft_vocab_size": DV},
    GEMMA4: {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "intermediate_size": 128, "vocab_size": V, "draft_vocab_size": DV,
             "eagle_aux_hidden_state_layer_ids": [1, 3, 4]},
}
TOP_LEVEL = ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids")


def shrunken(name: str, embed: bool = False) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """(format, small config with the real one's keys and flags, matching random tensors)."""
    real = real_config(name)
    cfg = copy.deepcopy(real)
    layer = cfg.get("transformer_layer_config", cfg)
    for k, v in SHRINK[name].items():
        d = cfg if k in TOP_LEVEL else layer
        assert k in d, k
        d[k] = v
    assert set(cfg) == set(real)
    fmt = parse_head_config(real)[0]
    h, heads = layer["hidden_size"], layer["num_attention_heads"]
    tensors = raw_tensors(h=h, heads=heads, kv=layer["num_key_value_heads"],
                          hd=layer.get("head_dim") or h // heads, inter=layer["intermediate_size"],
                          vocab=layer["vocab_size"], dv=cfg["draft_vocab_size"],
                          seed=len(name), embed=embed)
    return fmt, cfg, tensors


@pytest.mark.parametrize("name", list(SHRINK))
def test_load_shrunken_real_head(tmp_path, name):
    fmt, cfg, tensors = shrunken(name, embed=name == GEMMA4)
    path = write_raw(tmp_path / "head", cfg, tensors, fmt)
    got_fmt, head = load_head(path)
    assert got_fmt == fmt
    sd = head.state_dict()
    assert set(sd) == set(tensors)
    for k, v in tensors.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    layer = cfg.get("transformer_layer_config", cfg)
    hd = layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]
    assert head.config.head_dim == hd and head.rope.cos.shape[-1] == hd
    assert head.config.norm_before_residual is bool(cfg.get("norm_before_residual"))
    assert (head.embed_tokens is not None) is (name == GEMMA4)


@pytest.mark.parametrize("name", [OFFICIAL, QWEN3, GEMMA4])
def test_shrunken_real_head_is_lossless(tmp_path, target, greedy, name):
    fmt, cfg, tensors = shrunken(name, embed=name == GEMMA4)
    path = write_raw(tmp_path / "head", cfg, tensors, fmt)
    spec = eagle3.load(target, path, taps=None if cfg.get("eagle_aux_hidden_state_layer_ids") else TAPS)
    assert spec.taps == tuple(cfg.get("eagle_aux_hidden_state_layer_ids") or TAPS)
    r = spec.generate(PROMPT, 12, num_draft_tokens=3)
    assert list(r.token_ids) == greedy and r.stats["draft_tokens"] > 0


# -- 3. conversion ------------------------------------------------------------------------------
def no_extra(cfg):
    return dataclasses.replace(cfg, extra={})


def chain_source(tmp_path) -> str:
    extra = {"torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 500000.0}
    return good_head(tmp_path / "src", **extra)


def check_round_trip(src: str, dst: str) -> None:
    """Same format, tensors (names, dtypes, values), DraftConfig and verbatim taps."""
    f0, c0, s0 = read_head(src)
    f1, c1, s1 = read_head(dst)
    assert f0 == f1
    assert set(s0) == set(s1)
    for k in s0:
        assert s0[k].dtype == s1[k].dtype and torch.equal(s0[k], s1[k]), k
    assert no_extra(c0) == no_extra(c1)
    assert c0.extra == c1.extra  # torch_dtype, token ids, target_model_type survive every format
    raw0, raw1 = (json.load(open(os.path.join(d, "config.json"))) for d in (src, dst))
    taps = lambda c: c.get("eagle_aux_hidden_state_layer_ids") or c["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    assert taps(raw0) == taps(raw1) == list(c1.taps)


def test_convert_round_trip(tmp_path):
    src = chain_source(tmp_path)
    prev = src
    for fmt in ("speculators", "sglang", "official"):
        dst = str(tmp_path / fmt)
        assert convert_head(prev, dst, fmt) == read_head(prev)[0]
        assert read_head(dst)[0] == fmt
        prev = dst
    spec_cfg = json.load(open(tmp_path / "speculators" / "config.json"))
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == TAPS
    assert set(load_file(str(tmp_path / "speculators" / "model.safetensors"))) >= {
        "layers.0.self_attn.q_proj.weight", "fc.weight", "d2t", "t2d"}
    sg_cfg = json.load(open(tmp_path / "sglang" / "config.json"))
    assert sg_cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert sg_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == TAPS
    check_round_trip(src, prev)
    c = read_head(prev)[1]
    assert c.taps == tuple(TAPS) and c.rope.theta == 500000.0 and c.extra["bos_token_id"] == 1


def test_convert_round_trip_sglang_quirks(tmp_path):
    """The real Gemma-3 SGLang config (head_dim 32 != 48/4, target_model_type, theta 1e6, taps in
    eagle_config): sglang -> official -> speculators -> sglang."""
    fmt, cfg, tensors = shrunken(GEMMA3)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True}
    prev = src = write_raw(tmp_path / "src", cfg, tensors, fmt)
    for fmt in ("official", "speculators", "sglang"):
        convert_head(prev, str(tmp_path / fmt), fmt)
        prev = str(tmp_path / fmt)
    check_round_trip(src, prev)
    c = read_head(prev)[1]
    assert (c.head_dim, c.rope.theta, c.extra["target_model_type"]) == (32, 1e6, "gemma3_text")


def test_convert_full_vocab_drops_d2t(tmp_path):
    t = {**raw_tensors(dv=V), "d2t": torch.zeros(V, dtype=torch.long), "t2d": torch.ones(V, dtype=torch.bool)}
    src = write_raw(tmp_path / "src", official_config(dv=V), t, "official")
    convert_head(src, str(tmp_path / "spec"), "speculators")
    assert "d2t" not in load_file(str(tmp_path / "spec" / "model.safetensors"))  # identity: not written
    for path in (src, str(tmp_path / "spec")):
        _, head = load_head(path)
        assert torch.equal(head.d2t, torch.zeros(V, dtype=torch.long)) and bool(head.t2d.all())


def nbr_head(tmp_path, embed=True, input_norm=False) -> str:
    fmt, cfg, tensors = shrunken(GEMMA4, embed=embed)
    if input_norm:
        cfg["norm_before_fc"], cfg["norm_before_residual"] = True, False
        tensors["input_norm.weight"] = 1.0 + 0.1 * torch.randn(3 * H)
    return write_raw(tmp_path / "nbr", cfg, tensors, fmt)


@pytest.mark.parametrize("input_norm", [False, True])
@pytest.mark.parametrize("fmt", ["official", "sglang"])
def test_convert_refuses_norm_options(tmp_path, fmt, input_norm):
    src = nbr_head(tmp_path, input_norm=input_norm)
    dst = tmp_path / "out"
    with pytest.raises(Eagle3Error) as e:
        convert_head(src, str(dst), fmt)
    assert_one_line_error(e, "norm_before_fc" if input_norm else "norm_before_residual", fmt, "speculators")
    assert not dst.exists()
    convert_head(src, str(tmp_path / "ok"), "speculators")  # the format that can express it
    assert torch.equal(read_head(src)[2]["embed_tokens.weight"],
                       read_head(str(tmp_path / "ok"))[2]["embed_tokens.weight"])


def test_convert_bad_input(tmp_path):
    src = good_head(tmp_path / "h")
    for args, words in [((src, src, "speculators"), ["same directory"]),
                        ((src, str(tmp_path / "o"), "gguf"), ["unknown head format", "gguf"]),
                        ((str(tmp_path / "nope"), str(tmp_path / "o"), "sglang"), ["not a directory"])]:
        with pytest.raises(Eagle3Error) as e:
            convert_head(*args)
        assert_one_line_error(e, *words)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_convert_cli(tmp_path):
    src = chain_source(tmp_path)
    prev = src
    for fmt in ("speculators", "sglang", "official"):
        dst = str(tmp_path / fmt)
        (p,) = run_cli(["convert", prev, dst, "--to", fmt])
        assert p.returncode == 0, p.stderr
        assert fmt in p.stdout
        prev = dst
    check_round_trip(src, prev)
    (bad,) = run_cli(["convert", nbr_head(tmp_path), str(tmp_path / "x"), "--to", "sglang"])
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert "norm_before_residual" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


# -- 4. inspect ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_inspect_cli(tmp_path, target):
    off = good_head(tmp_path / "off")
    spec = nbr_head(tmp_path)
    p_text, p_spec, p_tgt = run_cli(["inspect", off], ["inspect", spec, "--json"],
                                    ["inspect", target, "--json"])
    for p in (p_text, p_spec, p_tgt):
        assert p.returncode == 0, p.stderr
    lines = {k: v.strip() for k, v in (line.split(None, 1) for line in p_text.stdout.splitlines())}
    assert (lines["kind"], lines["format"], lines["hidden_size"], lines["vocab_size"],
            lines["draft_vocab_size"], lines["taps"]) == ("eagle3 head", "official", str(H), str(V),
                                                          str(DV), str(TAPS))
    assert lines["embedding"] == "none (uses the target's)"
    s, t = json.loads(p_spec.stdout), json.loads(p_tgt.stdout)
    assert (s["kind"], s["format"], s["taps"], s["norm_before_residual"]) == \
        ("eagle3 head", "speculators", [1, 3, 4], True)
    assert (s["hidden_size"], s["head_dim"], s["kv_heads"], s["draft_vocab_size"]) == (H, 32, 2, DV)
    assert "ships" in s["embedding"]
    assert t["kind"] == "target" and t["layers"] == 6 and t["hidden_size"] == H and t["vocab_size"] == V


def test_inspect_in_process(tmp_path, target):
    from eagle3.cli.inspection import inspect_path

    o = inspect_path(good_head(tmp_path / "h"))
    assert o["kind"] == "eagle3 head" and o["format"] == "official"
    assert (o["hidden_size"], o["head_dim"], o["vocab_size"], o["draft_vocab_size"]) == (H, 16, V, DV)
    assert o["taps"] == TAPS and o["reduced_vocab"] and o["has_d2t"] and "none" in o["embedding"]
    assert inspect_path(target)["kind"] == "target"
    full = write_raw(tmp_path / "full", official_config(dv=V), raw_tensors(dv=V), "official")
    info = inspect_path(full)
    assert not info["reduced_vocab"] and "default" in str(info["taps"])
    one = tmp_path / "one_layer_target"  # a 1-layer Llama target is not an official head
    make_hf_model("llama", num_hidden_layers=1).save_pretrained(str(one))
    info = inspect_path(str(one))
    assert info["kind"] == "target" and info["layers"] == 1


# -- 5. the draft forward against an independent reference -------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def reference_draft(sd, *, heads, kv, hd, eps, theta, nbr, emb, tokens, taps):
    """EAGLE-3 draft step over positions 0..T-1 in float64. Returns (target ids, h, fused g, margin)."""
    sd = {k: v.double() if v.is_floating_point() else v for k, v in sd.items()}
    x = taps.double()  # (T, 3Ht)
    if "input_norm.weight" in sd:
        x = rms(x, sd["input_norm.weight"], eps)
    g = x @ sd["fc.weight"].T  # (T, H)
    T = g.shape[0]
    e = emb.double()[tokens]
    gn = rms(g, sd[M + "hidden_norm.weight"], eps)
    residual = gn if nbr else g
    a = torch.cat([rms(e, sd[M + "input_layernorm.weight"], eps), gn], -1)  # (T, 2H)
    q = (a @ sd[M + "self_attn.q_proj.weight"].T).view(T, heads, hd)
    k = (a @ sd[M + "self_attn.k_proj.weight"].T).view(T, kv, hd)
    v = (a @ sd[M + "self_attn.v_proj.weight"].T).view(T, kv, hd)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)  # GQA
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, heads * hd)
    h = residual + o @ sd[M + "self_attn.o_proj.weight"].T
    m = rms(h, sd[M + "post_attention_layernorm.weight"], eps)
    h = h + (F.silu(m @ sd[M + "mlp.gate_proj.weight"].T) * (m @ sd[M + "mlp.up_proj.weight"].T)) \
        @ sd[M + "mlp.down_proj.weight"].T
    logits = rms(h, sd["norm.weight"], eps) @ sd["lm_head.weight"].T  # (T, draft vocab)
    top = logits.topk(2, -1).values
    best = logits.argmax(-1)
    return best + sd["d2t"][best], h, g, float((top[:, 0] - top[:, 1]).min())


def contract_head(path) -> tuple[str, dict]:
    """Like shared/contract_check.py build(): torch.save'd dict + hand-written official config."""
    sd = raw_tensors(seed=7)
    torch.save(sd, os.path.join(path, "pytorch_model.bin"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(official_config(eagle_aux_hidden_state_layer_ids=TAPS), f)
    return sd, dict(heads=4, kv=2, hd=16, eps=1e-5, theta=10000.0, nbr=False)


def speculators_head(path) -> tuple[str, dict]:
    """Speculators head: own embedding, draft hidden 48 != target 64, head_dim 24 != 48/4,
    norm_before_residual + norm_before_fc, RoPE base from rope_parameters."""
    sd = raw_tensors(h=48, heads=4, kv=2, hd=24, inter=96, th=H, seed=8, embed=True, input_norm=True)
    layer = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 24, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
             "vocab_size": V, "hidden_act": "silu", "max_position_embeddings": 256,
             "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    cfg = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "draft_vocab_size": DV,
           "eagle_aux_hidden_state_layer_ids": TAPS, "norm_before_residual": True, "norm_before_fc": True,
           "target_hidden_size": H, "transformer_layer_config": layer}
    write_raw(path, cfg, sd, "speculators")
    return sd, dict(heads=4, kv=2, hd=24, eps=1e-6, theta=1e6, nbr=True)


@pytest.mark.parametrize("build", [contract_head, speculators_head], ids=["official", "speculators"])
def test_draft_matches_reference(tmp_path, target, greedy, build):
    sd, kw = build(str(tmp_path))
    spec = eagle3.load(target, str(tmp_path))
    temb = spec.target.embedding_weight
    own = "embed_tokens.weight" in sd
    if own:  # a head that ships its own embedding uses it
        assert torch.equal(spec.draft.embed_tokens.weight, sd["embed_tokens.weight"])
        assert spec.draft.embed_tokens.weight.shape != temb.shape or \
            not torch.equal(spec.draft.embed_tokens.weight, temb)
    else:  # else it gets the target's table itself (shared storage, no copy)
        assert spec.draft.embed_tokens.weight.data_ptr() == temb.data_ptr()
        assert spec.draft.embed_tokens.weight.shape == temb.shape
    emb = sd["embed_tokens.weight"] if own else temb.detach()
    T = len(PROMPT)
    taps = torch.randn(1, T, 3 * H, generator=torch.Generator().manual_seed(3))
    ref_ids, ref_h, ref_g, margin = reference_draft(sd, emb=emb, tokens=torch.tensor(PROMPT), taps=taps[0],
                                                    **kw)
    assert margin > 1e-4  # no near-ties: argmax is well defined
    with torch.no_grad():
        feature = spec.draft.fuse(taps)
    torch.testing.assert_close(feature[0], ref_g.float(), atol=1e-5, rtol=1e-5)
    ids, h = spec.draft_decode(torch.tensor([PROMPT]), feature, torch.arange(T))
    assert ids.shape == (1, T) and ids[0].tolist() == ref_ids.tolist()
    assert bool(spec.draft.t2d[ids].all())  # d2t maps into the draft vocab's target ids
    torch.testing.assert_close(h[0], ref_h.float(), atol=1e-5, rtol=1e-5)
    assert list(spec.generate(PROMPT, 12, num_draft_tokens=3).token_ids) == greedy


# -- 6. validation ------------------------------------------------------------------------------
def _drop(*names):
    return lambda c, t: [t.pop(n) for n in names]


def _set_cfg(**kw):
    return lambda c, t: c.update(kw)


def _other_target(c, t):  # a whole head for a hidden-96 target (vocab equal)
    t.clear()
    t.update(raw_tensors(h=96, hd=24, inter=192))
    c.update(hidden_size=96, intermediate_size=192)


def _vocab(c, t):
    t.update({k: v for k, v in raw_tensors(vocab=200).items() if k in ("d2t", "t2d")})
    c.update(vocab_size=200)


def _d2t_outside(c, t):
    t["d2t"][-1] += V


def _d2t_dup(c, t):
    t["d2t"][1] = t["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id


def _d2t_float(c, t):
    t["d2t"] = t["d2t"].float()


def _own_hidden(c, t):  # draft hidden 32 != target 64 and no embedding of its own
    t.clear()
    t.update(raw_tensors(h=32, hd=8, th=H))
    c.update(hidden_size=32, target_hidden_size=H)


BAD = {
    "other_target_hidden": (_other_target, ["hidden size 96", "different target"]),
    "target_hidden_size": (_set_cfg(target_hidden_size=96), ["fc.weight", "shape"]),
    "vocab": (_vocab, ["vocabulary of 200", "160", "different target"]),
    "no_d2t": (_drop("d2t", "t2d"), ["reduced vocabulary", "d2t"]),
    "d2t_outside": (_d2t_outside, ["d2t", "outside"]),
    "d2t_not_injective": (_d2t_dup, ["d2t", "injective"]),
    "d2t_float": (_d2t_float, ["d2t", "integer"]),
    "d2t_list": (lambda c, t: t.update(d2t=t["d2t"].tolist()), ["d2t", "integer tensor"]),
    "t2d_shape": (lambda c, t: t.update(t2d=t["t2d"][:-1]), ["t2d", "shape"]),
    "int_weight": (lambda c, t: t.update({"fc.weight": t["fc.weight"].long()}), ["fc.weight", "floating"]),
    "norm_before_fc_no_weight": (_set_cfg(norm_before_fc=True), ["lacks", "input_norm.weight"]),
    "input_norm_without_flag": (lambda c, t: t.update({"input_norm.weight": torch.ones(3 * H)}),
                                ["input_norm.weight", "norm_before_fc"]),
    "bad_num_heads": (_set_cfg(num_key_value_heads=3), ["multiple of num_key_value_heads"]),
    "taps_not_a_list": (_set_cfg(eagle_aux_hidden_state_layer_ids="1,3,5"), ["list of layer indices"]),
    "null_size": (_set_cfg(intermediate_size=None), ["intermediate_size", "positive integer"]),
    "head_dim": (_set_cfg(head_dim=32), ["q_proj", "head_dim"]),
    "missing_tensor": (_drop(M + "mlp.up_proj.weight"), ["lacks", "up_proj"]),
    "missing_fc": (_drop("fc.weight"), ["lacks", "fc.weight"]),
    "lm_head_shape": (lambda c, t: t.update({"lm_head.weight": t["lm_head.weight"][:-1]}),
                      ["lm_head.weight", "shape"]),
    "two_layers": (_set_cfg(num_hidden_layers=2), ["not an EAGLE-3 head"]),
    "sglang_two_layers": (_set_cfg(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=2),
                          ["one decoder layer"]),
    "no_embedding_fits": (_own_hidden, ["embed_tokens", "own embedding"]),
    "bad_taps": (_set_cfg(eagle_aux_hidden_state_layer_ids=[1, 3, 9]), ["taps", "out of range"]),
    "two_taps": (_set_cfg(eagle_aux_hidden_state_layer_ids=[1, 3]), ["3 taps", "names 2"]),
}


def bad_head(path, case: str) -> str:
    cfg = official_config(eagle_aux_hidden_state_layer_ids=TAPS)
    tensors = raw_tensors()
    BAD[case][0](cfg, tensors)
    return write_raw(path, cfg, tensors, "official")


def corrupt_head(path, kind: str) -> str:
    path = good_head(path)
    if kind == "truncated_bin":
        f = os.path.join(path, "pytorch_model.bin")
        data = open(f, "rb").read()
        open(f, "wb").write(data[: len(data) // 2])
    elif kind == "truncated_safetensors":
        os.remove(os.path.join(path, "pytorch_model.bin"))
        save_file(raw_tensors(), os.path.join(path, "model.safetensors"))
        f = os.path.join(path, "model.safetensors")
        data = open(f, "rb").read()
        open(f, "wb").write(data[: len(data) - 1000])
    elif kind == "no_weights":
        os.remove(os.path.join(path, "pytorch_model.bin"))
    elif kind == "bad_json":
        open(os.path.join(path, "config.json"), "w").write("{not json")
    elif kind == "no_config":
        os.remove(os.path.join(path, "config.json"))
    return path


CORRUPT = {"truncated_bin": ["truncated or corrupt"], "truncated_safetensors": ["truncated or corrupt"],
           "no_weights": ["no weights"], "bad_json": ["not valid JSON"],
           "no_config": ["config.json"]}


@pytest.mark.parametrize("case", list(BAD) + list(CORRUPT))
def test_bad_head(tmp_path, target, greedy, capsys, case):
    if case in BAD:
        path, words = bad_head(tmp_path / "bad", case), BAD[case][1]
    else:
        path, words = corrupt_head(tmp_path / "bad", case), CORRUPT[case]
    with pytest.raises(Eagle3Error) as e:
        eagle3.load(target, path)
    assert_one_line_error(e, *words)
    before = {p.name: p.read_bytes() for p in Path(path).iterdir()}
    capsys.readouterr()
    rc = cli_main(["generate", "--target", target, "--draft", path, "--prompt-ids", "1,2,3",
                   "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("eagle3: error:") and words[0].lower() in err.lower()
    assert {p.name: p.read_bytes() for p in Path(path).iterdir()} == before  # nothing written
    # Nothing half-loaded: a good head right after works and is lossless.
    spec = eagle3.load(target, good_head(tmp_path / "good"))
    assert list(spec.generate(PROMPT, 12, num_draft_tokens=4).token_ids) == greedy


def test_unknown_tensors_only_warn(tmp_path, target, greedy, capsys):
    cfg = official_config(eagle_aux_hidden_state_layer_ids=TAPS)
    tensors = {**raw_tensors(), "midlayer.rotary_emb.inv_freq": torch.ones(8),
               "extra_head.weight": torch.ones(2)}
    path = write_raw(tmp_path / "h", cfg, tensors, "official")
    capsys.readouterr()
    spec = eagle3.load(target, path)
    err = capsys.readouterr().err
    assert "unknown tensor" in err and "midlayer.rotary_emb.inv_freq" in err and "extra_head.weight" in err
    assert "extra_head.weight" not in spec.draft.state_dict()
    assert list(spec.generate(PROMPT, 12, num_draft_tokens=3).token_ids) == greedy


def test_draft_decode_without_head_is_refused(target):
    with pytest.raises(Eagle3Error) as e:
        eagle3.load(target, "none").draft_decode(torch.tensor([[1]]), torch.zeros(1, 1, H), torch.arange(1))
    assert_one_line_error(e, "no draft head")


@pytest.mark.parametrize("args, words", [
    (["--num-draft-tokens", "0"], ["num_draft_tokens"]),
    (["--num-draft-tokens", "-1"], ["num_draft_tokens"]),
    (["--draft", "MISSING"], ["not a directory"]),
])
def test_generate_cli_errors(tmp_path, target, capsys, args, words):
    head = good_head(tmp_path / "h")
    args = [str(tmp_path / "missing") if a == "MISSING" else a for a in args]
    argv = ["generate", "--target", target, "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]
    argv += args if "--draft" in args else ["--draft", head, *args]
    capsys.readouterr()
    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err


@pytest.mark.slow
def test_generate_cli_errors_subprocess(tmp_path, target):
    ok_head = good_head(tmp_path / "ok")
    base = ["generate", "--target", target, "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]
    ps = run_cli([*base, "--draft", bad_head(tmp_path / "b1", "other_target_hidden")],
                 [*base, "--draft", corrupt_head(tmp_path / "b2", "truncated_bin")],
                 [*base, "--draft", ok_head, "--num-draft-tokens", "-1"])
    for p, word in zip(ps, ["different target", "truncated or corrupt", "num_draft_tokens"], strict=True):
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.startswith("eagle3: error:") and len(p.stderr.strip().splitlines()) == 1
        assert word in p.stderr
