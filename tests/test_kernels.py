"""Weight formats and the row-invariant kernels (eagle3/kernels).

The kernels are checked against formulas written here in float64 from the codes and
scales (not against their own reference path), for row invariance bit for bit (a row's
result must not depend on how many rows share the call, on the thread count, or on
what sits in masked cache slots), and end to end: `target_verify` rows == 1-row decode
rows bitwise, and speculative output == plain output in every format.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import eagle3
from conftest import make_hf_model
from eagle3.errors import Eagle3Error
from eagle3.kernels import (
    FORMATS,
    QLinear,
    exact_linear,
    isa,
    isa_paths,
    kernel_available,
    kernel_status,
    pack_codes,
    parse_quantize,
    quantize_model,
    unpack_codes,
    use_isa,
)
from eagle3.kernels import argmax as kernel_argmax
from eagle3.targets.cache import masked_attention

GROUPS = {"float32": [None], "bfloat16": [None], "int8": [32, 64], "int4": [32, 64]}
CASES = [(f, g) for f in FORMATS for g in GROUPS[f]] + [("q4_0", 32)]
X86 = platform.machine().lower() in ("x86_64", "amd64")
PATHS = isa_paths()


def test_kernels_build_on_every_x86_cpu():
    """A kernel this CPU can run but that does not build is a failure, never a skip: on x86-64
    the kernels build, and the scalar and AVX2 paths run wherever the CPU has them."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if not X86:
        assert not kernel_available() and "x86-64" in kernel_status()
        return
    assert kernel_available(), kernel_status()
    assert "scalar" in PATHS and isa() in PATHS
    want = ["scalar"]
    if all(f in flags.split() for f in ("avx2", "fma", "f16c")):
        want.append("avx2")
    if all(f in flags.split() for f in ("avx2", "fma", "f16c", "avx_vnni")):
        want.append("avxvnni")
    if all(f in flags.split() for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")):
        want.append("avx512")
    assert sorted(PATHS) == sorted(want)
    assert isa() == want[-1]  # the best one by default


def linear(N: int, K: int, seed: int = 0, bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
    return lin


def make_layer(fmt: str, lin: torch.nn.Linear, group: int | None) -> QLinear:
    if fmt != "q4_0":
        return QLinear.quantize(lin, fmt, group)
    w = lin.weight.detach()  # Q4_0: symmetric codes 0..15 around 8, no offsets
    d = (w.reshape(w.shape[0], -1, 32).abs().amax(-1) / 8).half().float()
    codes = torch.round(w.reshape(w.shape[0], -1, 32) / d[..., None] + 8).clamp(0, 15)
    b = None if lin.bias is None else lin.bias.detach()
    return QLinear.from_codes("int4", codes.reshape(w.shape).to(torch.uint8), d, None, bias=b)


def int_reference(q: QLinear, x: torch.Tensor) -> torch.Tensor:
    """The packed formats' arithmetic, written here from the GGUF definitions: each row of x
    quantized per block of 32 to int8 (scale amax/127, round half to even), exact integer
    block sums, then fp32 per block in order: acc += (d * xd) * isum [+ m * (xd * xs)]."""
    N, K = q.out_features, q.in_features
    nb = K // 32
    w = q.codes().long().reshape(N, nb, 32)
    d = q.scale.float().permute(0, 2, 1).reshape(N, nb)  # (N/16, nb, 16) -> (N, nb)
    m = q.offset.float().permute(0, 2, 1).reshape(N, nb) if q.offset.numel() else None
    zp = 8 if q.fmt == "int4" and m is None else 0
    y = torch.zeros(x.shape[0], N)
    for r in range(x.shape[0]):
        xb = x[r].reshape(nb, 32)
        xd = xb.abs().amax(-1) / torch.tensor(127.0)
        inv = torch.where(xd > 0, torch.tensor(1.0) / xd, torch.tensor(0.0))
        xq = torch.round(xb * inv[:, None]).clamp(-127, 127).long()  # (nb, 32)
        xs = xq.sum(-1)
        isum = (w * xq[None]).sum(-1) - zp * xs[None]  # (N, nb) int64, exact
        acc = torch.zeros(N)
        for b in range(nb):
            acc = acc + (d[:, b] * xd[b]) * isum[:, b].float()
            if m is not None:
                acc = acc + m[:, b] * (xd[b] * xs[b].float())
        y[r] = acc
    return y + q.bias if q.bias is not None else y


def float_reference(q: QLinear, x: torch.Tensor) -> torch.Tensor:
    """Float formats in float64 (the kernels sum in 16 lanes: equal to rounding)."""
    y = x.double() @ q.w.double().t()
    return y + q.bias.double() if q.bias is not None else y


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt,group", CASES)
@pytest.mark.parametrize("rows", [7, 40])
def test_every_path_computes_the_format_exactly(fmt, group, path, rows):
    """Packed formats: every instruction-set path equals the integer reference bit for bit
    (and so each other); float formats: close to float64, and every path equal to scalar.
    40 rows: five full register chunks of 8 rows on the AVX-512 path, ten of 4 on the 256-bit
    ones."""
    lin = linear(48, 192, bias=True)
    q = make_layer(fmt, lin, group)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(5))
    with use_isa(path):
        y = q(x)
    with use_isa("scalar"):
        assert torch.equal(y, q(x))
    if q.fmt in ("int8", "int4"):
        assert torch.equal(y, int_reference(q, x))
        assert torch.equal(exact_linear(q, x) + q.bias, y)  # the package's own PyTorch reference
    else:
        torch.testing.assert_close(y.double(), float_reference(q, x), rtol=1e-5, atol=2e-5)
    # and the format is close to the float32 layer it came from (quantization error only)
    tol = {"float32": 1e-5, "bfloat16": 0.02, "int8": 0.04, "int4": 0.3, "q4_0": 0.5}[fmt]
    assert (y - lin(x)).abs().max().item() < tol


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ["int8", "int4", "q4_0"])
def test_activation_codes_round_half_to_even_on_every_path(fmt, path):
    """Rows built so that x / xd lands exactly on halves (amax 127 -> xd 1): codes round half to
    even (0.5 -> 0, 1.5 -> 2, -2.5 -> -2), an all-zero block has xd 0, tiny values survive;
    every path equals the integer reference written in this file."""
    halves = torch.tensor([127.0] + [k + 0.5 for k in range(-15, 16)])  # -14.5 .. 15.5
    row = torch.cat([halves, torch.zeros(32), torch.linspace(-1e-30, 1e-30, 32), halves.flip(0)])
    x = torch.stack([row, -row, row * 3, row / 127])
    q = make_layer(fmt, linear(32, x.shape[1], seed=3), None)
    with use_isa(path):
        y = q(x)
    assert torch.equal(y, int_reference(q, x))
    # rounding half away from zero would give other codes and so other sums
    away = torch.sign(halves[1:]) * torch.floor(halves[1:].abs() + 0.5)
    assert not torch.equal(away, torch.round(halves[1:]))


@pytest.mark.parametrize("path", PATHS)
def test_argmax_is_torchs_on_every_path(path):
    """`kernels.argmax` (greedy decisions) equals torch.argmax(-1): the first maximum, the first
    NaN, -0.0 and 0.0 tied, every length around the vector width, any leading shape."""
    g = torch.Generator().manual_seed(7)
    vocab = torch.randn(3, 49152, generator=g)
    vocab[1, 40000] = vocab[1, 7] = vocab[1].max() + 1  # a tie: the first one wins
    nan = torch.randn(100, generator=g)
    nan[[60, 90]] = float("nan")
    cases = [vocab, nan, torch.tensor([-0.0, 0.0] * 20), torch.full((37,), float("-inf")),
             torch.randn(2, 3, 100, generator=g)]
    cases += [torch.randn(n, generator=g) for n in (1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 8193)]
    late = torch.randn(50, generator=g)
    late[49] = 9.0  # the maximum in the tail after the last full vector
    tail_nan = torch.randn(53, generator=g)
    tail_nan[52] = float("nan")  # past every full vector of 8 and of 16 lanes
    lanes = torch.zeros(40)
    lanes[[13, 3, 29]] = 2.0  # equal maxima in different lanes: the smallest index wins
    cases += [late, tail_nan, lanes]
    with use_isa(path):
        for x in cases:
            got = torch.ops.eagle3.argmax(x)
            assert got.dtype == torch.long and torch.equal(got, x.argmax(-1)), x.shape
            assert torch.equal(kernel_argmax(x), x.argmax(-1))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt,group", CASES)
def test_rows_do_not_depend_on_the_batch_or_threads(fmt, group, path):
    q = make_layer(fmt, linear(64, 128, seed=1), group)
    x = torch.randn(21, 128)  # more rows than any register tile, the last one partial
    with use_isa(path):
        full = q(x)
        for i in range(21):
            assert torch.equal(q(x[i:i + 1]), full[i:i + 1]), f"row {i} alone differs"
        for a, b in ((0, 5), (3, 19), (16, 21)):
            assert torch.equal(q(x[a:b]), full[a:b])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2 if threads == 1 else 1)
            assert torch.equal(q(x), full)
        finally:
            torch.set_num_threads(threads)


@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**31 - 1), st.sampled_from(["int8", "int4"]))
@settings(max_examples=25, deadline=None)
def test_packing_round_trips(nb, kb, seed, fmt):
    g = torch.Generator().manual_seed(seed)
    if fmt == "int4":
        codes = torch.randint(0, 16, (16 * nb, 32 * kb), generator=g, dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (16 * nb, 32 * kb), generator=g).to(torch.int8)
    assert torch.equal(unpack_codes(pack_codes(codes, fmt), 16 * nb, 32 * kb, fmt), codes)


def test_float_formats_take_any_shape_and_packed_formats_fall_back_to_float32():
    q = QLinear.quantize(linear(20, 40), "float32")  # K not a multiple of 16 or 32
    x = torch.randn(3, 40)
    for path in PATHS:
        with use_isa(path):
            torch.testing.assert_close(q(x).double(), float_reference(q, x), rtol=1e-6, atol=1e-6)
    with pytest.raises(Eagle3Error, match="divisible by 32"):
        QLinear.quantize(linear(32, 40), "int4")
    model = torch.nn.Sequential(linear(32, 64), linear(20, 32))
    counts = quantize_model(model, "int4")
    assert counts["converted"] == 2 and counts["float32"] == 1
    assert [m.fmt for m in model] == ["int4", "float32"]


def test_bad_input_to_the_kernel_is_one_line():
    q = QLinear.quantize(linear(32, 64), "int4")
    op = torch.ops.eagle3.wlinear
    bad = [((torch.randn(2, 64).double(), q.w, q.scale, q.offset, 3, 32, 32), "float32"),
           ((torch.randn(2, 64), q.w[:-1], q.scale, q.offset, 3, 32, 32), "bytes"),
           ((torch.randn(2, 64), q.w, q.scale.float(), q.offset, 3, 32, 32), "float16"),
           ((torch.randn(2, 64), q.w, q.scale, q.offset, 3, 64, 32), "block of 32"),
           ((torch.randn(2, 64), q.w, q.scale, q.offset, 9, 32, 32), "unknown weight format"),
           ((torch.randn(2, 40), q.w, q.scale, q.offset, 3, 32, 32), "multiple of 32")]
    for args, what in bad:
        with pytest.raises(RuntimeError, match=what):
            op(*args)
    with pytest.raises(RuntimeError, match="unknown path"):
        torch.ops.eagle3.set_isa("sse9")


def test_isa_env_forces_a_path_and_names_it(llama_dir):
    code = "import eagle3.kernels as k; print(k.isa())"
    for path in PATHS:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "EAGLE3_ISA": path})
        assert p.returncode == 0 and p.stdout.strip() == path, p.stderr
    p = subprocess.run([sys.executable, "-m", "eagle3", "generate", "--target", llama_dir, "--draft", "none",
                        "--prompt-ids", "1,2"],
                       capture_output=True, text=True, env={**os.environ, "EAGLE3_ISA": "sse9"})
    assert p.returncode == 2 and "EAGLE3_ISA" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_quantize_names():
    assert parse_quantize(None) is None and parse_quantize("none") is None
    assert parse_quantize("int4") == ("int4", 32)
    assert parse_quantize("int4-g64") == ("int4", 64)
    assert parse_quantize("int8") == ("int8", 32)
    assert parse_quantize("bf16") == ("bfloat16", None)
    for bad in ("int3", "int4-g48", "bf16-g32", "int4-gx", "int4-g16"):
        with pytest.raises(Eagle3Error, match="quantize"):
            parse_quantize(bad)


# -- attention ------------------------------------------------------------------------------

@pytest.mark.parametrize("hd,softcap", [(64, None), (24, None), (16, 5.0)])
@pytest.mark.parametrize("path", PATHS)
def test_attention_rows_are_independent_of_the_call(hd, softcap, path):
    with use_isa(path):
        check_attention_rows(hd, softcap)
    torch.manual_seed(0)
    q = torch.randn(1, 4, 3, hd)
    k, v = torch.randn(1, 2, 20, hd), torch.randn(1, 2, 20, hd)
    mask = torch.ones(3, 20, dtype=torch.bool)
    with use_isa(path):
        out = masked_attention(q, k, v, mask, 0.3, softcap, exact=True)
    with use_isa("scalar"):
        assert torch.equal(out, masked_attention(q, k, v, mask, 0.3, softcap, exact=True))
    # A bf16 cache: the kernel reads each element widened exactly, so it equals the float32
    # kernel on the same (bf16-valued) keys bit for bit, on this path and on the scalar one.
    kb, vb = k.bfloat16(), v.bfloat16()
    with use_isa(path):
        out = masked_attention(q, kb, vb, mask, 0.3, softcap, exact=True)
        assert torch.equal(out, masked_attention(q, kb.float(), vb.float(), mask, 0.3, softcap, exact=True))
    with use_isa("scalar"):
        assert torch.equal(out, masked_attention(q, kb, vb, mask, 0.3, softcap, exact=True))
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.eagle3.attention(q, kb, v, mask[None], 0.3, 0.0)


@pytest.mark.parametrize("nh,nkv,T", [(9, 3, 1), (9, 3, 4), (7, 1, 2), (8, 1, 1), (6, 2, 5)])
@pytest.mark.parametrize("path", PATHS)
def test_grouped_query_heads_score_as_each_head_alone(nh, nkv, T, path):
    """The heads sharing a key/value head are scored together (in chunks that depend on the
    call's size): each head's output equals that head computed alone bit for bit, and equals
    the scalar path, for groups of 1 to 8 heads and any number of rows."""
    g = torch.Generator().manual_seed(nh * 10 + T)
    S = 53
    q = torch.randn(1, nh, T, 64, generator=g)
    k = torch.randn(1, nkv, S, 64, generator=g).bfloat16()
    v = torch.randn(1, nkv, S, 64, generator=g).bfloat16()
    mask = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
    with use_isa(path):
        out = masked_attention(q, k, v, mask, 0.125, None, exact=True)  # (1, T, nh * 64)
        G = nh // nkv
        for h in range(nh):
            kh = h // G
            alone = masked_attention(q[:, h:h + 1], k[:, kh:kh + 1], v[:, kh:kh + 1], mask, 0.125, None,
                                     exact=True)
            assert torch.equal(alone[..., :], out[..., h * 64:(h + 1) * 64]), h
    with use_isa("scalar"):
        assert torch.equal(out, masked_attention(q, k, v, mask, 0.125, None, exact=True))


@pytest.mark.parametrize("path", PATHS)
def test_bf16_queries_run_the_kernel_row_by_row(path):
    """bf16 queries outside a prompt's `stock` forward take the kernel in float32 (exact or
    not; PyTorch's bf16 SDPA is ~15x slower per decoded row on CPUs without AMX): the output is
    the float32 kernel's rounded to bf16, each row equals that row alone bit for bit, on every
    path as on the scalar one, and it stays within bf16 rounding of float32 SDPA."""
    g = torch.Generator().manual_seed(3)
    B, nh, nkv, T, S = 3, 9, 3, 4, 41
    q = torch.randn(B, nh, T, 64, generator=g).bfloat16()
    k = torch.randn(B, nkv, S, 64, generator=g).bfloat16()
    v = torch.randn(B, nkv, S, 64, generator=g).bfloat16()
    mask = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]  # (T, S) causal
    with use_isa(path):
        out = masked_attention(q, k, v, mask, 0.125)
        assert out.dtype == torch.bfloat16 and out.shape == (B, T, nh * 64)
        assert torch.equal(out, masked_attention(q.float(), k, v, mask, 0.125, exact=True).bfloat16())
        for b in range(B):
            for i in range(T):
                n = S - T + i + 1
                one = masked_attention(q[b:b + 1, :, i:i + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                       mask[i:i + 1, :n], 0.125)
                assert torch.equal(one, out[b:b + 1, i:i + 1]), (b, i)
        stock = masked_attention(q, k, v, mask, 0.125, stock=True)  # a prompt's forward: SDPA
    with use_isa("scalar"):
        assert torch.equal(out, masked_attention(q, k, v, mask, 0.125))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125, enable_gqa=True)
    ref = ref.transpose(1, 2).reshape(B, T, nh * 64)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(stock.float(), ref, rtol=2e-2, atol=2e-2)


def check_attention_rows(hd, softcap):
    torch.manual_seed(0)
    S, T = 37, 6
    q = torch.randn(1, 4, T, hd)
    k, v = torch.randn(1, 2, S + 9, hd), torch.randn(1, 2, S + 9, hd)
    pos = torch.arange(S - T, S)
    mask = torch.arange(S)[None, :] <= pos[:, None]  # (T, S) causal
    out = masked_attention(q, k[:, :, :S], v[:, :, :S], mask, 0.3, softcap, exact=True)
    ref = masked_attention(q, k[:, :, :S], v[:, :, :S], mask, 0.3, softcap)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for i in range(T):  # each row alone, over only the keys it may see
        n = S - T + i + 1
        one = masked_attention(q[:, :, i:i + 1], k[:, :, :n], v[:, :, :n], mask[i:i + 1, :n], 0.3,
                               softcap, exact=True)
        assert torch.equal(one, out[:, i:i + 1])
    # whatever the masked slots hold (stale rounds, NaN) changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[:, :, S - 1], v2[:, :, S - 1] = float("nan"), 1e30
    row0 = masked_attention(q[:, :, :1], k2[:, :, :S], v2[:, :, :S], mask[:1], 0.3, softcap, exact=True)
    assert torch.equal(row0, out[:, :1])


# -- the fused elementwise steps (norm, RoPE, SwiGLU) ----------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_fused_steps_match_pytorch_and_every_path(path):
    """rms_norm and silu_mul equal PyTorch's formulas to rounding; rope_ equals PyTorch's
    `x * cos + rotate_half(x) * sin` bit for bit; every path equals the scalar one; each row
    alone gives the bits it gives in a batch."""
    import torch.nn.functional as F

    from eagle3.targets.decoder import rotate_half

    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(6, 200, generator=g), torch.randn(200, generator=g)  # H not a multiple of 16
    gu = torch.randn(5, 2 * 72, generator=g) * 6
    q = torch.randn(2, 4, 3, 40, generator=g)  # (B, T, heads, hd)
    cos, sin = torch.randn(4, 40, generator=g), torch.randn(4, 40, generator=g)
    runs = {}
    for p in (path, "scalar"):
        with use_isa(p):
            qr = q.clone()
            torch.ops.eagle3.rope_(qr, cos, sin)
            ops = torch.ops.eagle3
            runs[p] = (ops.rms_norm(x, w, 1e-6, False), ops.rms_norm(x, w, 1e-6, True), ops.silu_mul(gu), qr)
            for i in range(6):
                assert torch.equal(torch.ops.eagle3.rms_norm(x[i:i + 1], w, 1e-6, False), runs[p][0][i:i + 1])
            for i in range(5):
                assert torch.equal(torch.ops.eagle3.silu_mul(gu[i:i + 1]), runs[p][2][i:i + 1])
    for a, b in zip(runs[path], runs["scalar"]):
        assert torch.equal(a, b)
    norm, gemma_norm, silu, rope = runs[path]
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm, w * h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemma_norm, h * (1 + w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(silu, F.silu(gu[:, :72]) * gu[:, 72:], rtol=1e-5, atol=1e-5)
    qt = q.transpose(1, 2)
    assert torch.equal(rope.transpose(1, 2), qt * cos + rotate_half(qt) * sin)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.eagle3.rms_norm(x.double(), w, 1e-6, False)


def test_fused_steps_stay_out_of_autograd_and_compilation():
    """Training (gradients) takes PyTorch's own ops: the fused kernels have no backward."""
    from eagle3.kernels import fused_step_ok

    a = torch.randn(3, 8)
    assert fused_step_ok(a)
    assert not fused_step_ok(a.requires_grad_())
    with torch.no_grad():
        assert fused_step_ok(a)
    assert not fused_step_ok(torch.randn(3, 8).double())


# -- whole targets -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("kern") / "llama")
    make_hf_model("llama", seed=3, vocab_size=160).save_pretrained(d)
    return d


@pytest.mark.parametrize("quantize", [None, "bf16", "int8", "int4"])
def test_verify_rows_equal_decode_rows_bitwise(llama_dir, quantize):
    assert_verify_rows_equal_decode_rows(eagle3.load(llama_dir, "none", quantize=quantize).target)


def assert_verify_rows_equal_decode_rows(t) -> None:
    """A 9-token verify (chain, then a tree) against 1-token steps over the same prefix: every
    row's logits and taps bit for bit."""
    t.tap_layers = (1, 3, 5)
    assert t.exact and t.weight_format is not None
    torch.manual_seed(0)
    prompt = torch.randint(1, 160, (1, 11))
    new = torch.randint(1, 160, (1, 9))
    with torch.no_grad():
        cache = t.new_cache(1, 64)
        t(prompt, torch.arange(11), cache, kv_len=11)
        verify, vtaps = t(new, torch.arange(11, 20), cache, kv_len=20)
        for i in range(9):
            one, otaps = t(new[:, i:i + 1], torch.arange(11 + i, 12 + i), cache, kv_len=12 + i)
            assert torch.equal(one[0, 0], verify[0, i]), f"row {i}"
            assert torch.equal(otaps[0, 0], vtaps[0, i])
        # A tree over slots 11..19: nodes 0, 2, 4, 6, 8 are a path (depth 0..4), each odd
        # node 2n+1 a child of node 2n. Every path node's row must equal decoding the path
        # as a chain: same keys in the same order, the same RoPE positions.
        depth = [j // 2 + j % 2 for j in range(9)]
        mask = torch.zeros(9, 20, dtype=torch.bool)
        mask[:, :11] = True
        for j in range(9):
            anc = list(range(0, j - j % 2 + 1, 2)) + ([j] if j % 2 else [])
            mask[j, [11 + a for a in anc]] = True
        tv, _ = t(new, torch.arange(11, 20), cache, kv_len=20, attn_mask=mask,
                  rope_pos=torch.tensor(depth) + 11)
        chain = t.new_cache(1, 64)
        t(prompt, torch.arange(11), chain, kv_len=11)
        for n, j in enumerate(range(0, 9, 2)):
            one, _ = t(new[:, j:j + 1], torch.arange(11 + n, 12 + n), chain, kv_len=12 + n)
            assert torch.equal(one[0, 0], tv[0, j]), f"tree node {j}"


def layer_op_calls(fn) -> int:
    """How many times `fn()` ran the one-op layer (`eagle3::decoder_layer`)."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "eagle3::decoder_layer")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("variant,quantize", [("llama", None), ("llama", "int4"), ("llama", "bf16"),
                                              ("llama_bias", "int8"), ("mistral", "int4"),
                                              ("llama_mqa_head_dim", None), ("qwen2", "int4")])
def test_the_one_op_layer_equals_the_layer_op_by_op(variant, quantize, path, tmp_path):
    """`eagle3::decoder_layer` (a whole pre-norm layer in one C++ op) gives the logits, taps and
    K/V bits the same layer gives run op by op from Python, for a prompt, 1-token steps, a
    chain verify, a tree verify and a batch of 2, on every path; and it does run."""
    make_hf_model(variant, seed=5).save_pretrained(tmp_path)
    t = eagle3.load(str(tmp_path), "none", quantize=quantize).target
    t.tap_layers = (1, 3, 5)
    g = torch.Generator().manual_seed(2)
    prompt, new = torch.randint(1, 160, (2, 9), generator=g), torch.randint(1, 160, (2, 6), generator=g)
    tree = torch.ones(6, 15, dtype=torch.bool).tril(9)
    tree[3, 10:12] = False  # node 3 hangs off the prompt's last token, not nodes 0-1

    def run(one_op: bool) -> list[torch.Tensor]:
        for block in t.model.layers:
            block.fused = one_op
        out, cache = [], t.new_cache(2, 32)
        with torch.no_grad(), use_isa(path):
            out += t(prompt, torch.arange(9), cache, kv_len=9)
            out += t(new[:, :1], torch.arange(9, 10), cache, kv_len=10)
            out += t(new, torch.arange(10, 16), cache, kv_len=16)
            out += t(new, torch.arange(9, 15), cache, kv_len=15, attn_mask=tree,
                     rope_pos=torch.tensor([9, 10, 11, 10, 11, 12]))
            out += t(new[:1, 2:5], torch.arange(15, 18), t.new_cache(1, 32), kv_len=18,
                     attn_mask=torch.ones(3, 18, dtype=torch.bool))
        return out + cache.k + cache.v

    calls = layer_op_calls(lambda: run(True))
    assert calls == 5 * 6  # every call, in each of 6 layers
    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("quantize", [None, "int4", "int8"])
def test_the_heads_layer_runs_as_one_op_with_the_same_bits(quantize, path):
    """An EAGLE-3 head's layer after its input norms runs as `eagle3::decoder_layer` (q/k/v and
    gate/up as their concatenations): the same logits, features and cache as op by op, for a
    catch-up of 3 rows and single steps, on every path; and it does run."""
    s = eagle3.load("default", quantize=quantize)
    d, H = s.draft, s.draft.config.hidden_size
    g = torch.Generator().manual_seed(4)
    tokens, feats = torch.randint(1, 1000, (1, 3), generator=g), torch.randn(1, 3, H, generator=g)

    def run(one_op: bool) -> list[torch.Tensor]:
        d.midlayer.fused = one_op
        cache, out = d.new_cache(1, 16), []
        with torch.no_grad(), use_isa(path):
            out += d(tokens, feats, torch.arange(3), cache, kv_len=3)
            for p in (3, 4):
                out += d(tokens[:, :1], out[-1][:, -1:], torch.tensor([p]), cache, kv_len=p + 1)
        return out + [cache.k[0], cache.v[0]]

    assert d.midlayer.fused and d.midlayer.step_args() is not None
    assert layer_op_calls(lambda: run(True)) == 3
    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
    d.midlayer.fused = True


def reference_chain(d, tokens: torch.Tensor, feats: torch.Tensor, start: int, k: int, cache) -> tuple:
    """The head's catch-up and greedy chain step by step from Python, its layer op by op: the
    drafts (k,), root logits and feature the one-op chain must give."""
    d.midlayer.fused = False
    R = tokens.shape[0]
    logits, h = d(tokens[None], feats[None], torch.arange(start, start + R), cache, kv_len=start + R)
    root, bound = logits[0, -1], h[0, -1]
    lg, ft, drafts = root[None], h[:, -1:], []
    for i in range(k):
        tok = d.to_target_ids(lg.argmax(-1))  # (1,)
        drafts.append(int(tok))
        if i < k - 1:
            p = start + R + i
            out, ft = d(tok[:, None], ft, torch.tensor([p]), cache, kv_len=p + 1)
            lg = out[:, 0]
    d.midlayer.fused = True
    return torch.tensor(drafts), root, bound


def head_on(source: str, fmt: str, tmp_path) -> torch.nn.Module:
    """An EAGLE-3 head ready for the one-op chain: the toy default's in `fmt` (its embedding a
    float32 table), or a random int4 head on a tied GGUF target of type `fmt` (its embedding the
    target's LM head codes)."""
    if source == "toy":
        return eagle3.load("default", quantize=fmt).draft
    import gguf

    from eagle3.draft import attach_head
    from eagle3.kernels import use_fused_steps
    from eagle3.kernels.weight_formats import quantize_model
    from gguf_files import write_gguf
    from heads import random_head

    path = str(tmp_path / "tied.gguf")
    write_gguf(make_hf_model("llama_tied", seed=6), path, qtype=getattr(gguf.GGMLQuantizationType, fmt))
    target = eagle3.load(path, "none", quantize="gguf").target
    head = random_head(target, taps=(1, 3, 5), seed=9, scale=0.3, draft_vocab_size=96)
    attach_head(head, target)
    quantize_model(head, "int4", None)
    use_fused_steps(head)
    return head


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("source,fmt", [("toy", "int4"), ("toy", "int8"), ("toy", "fp32"),
                                        ("gguf", "Q8_0"), ("gguf", "Q4_0"), ("gguf", "Q4_1")])
def test_the_heads_chain_runs_as_one_op_with_the_same_bits(source, fmt, path, tmp_path):
    """`eagle3::draft_chain` (a catch-up over a backlog and k greedy drafts in one C++ call)
    gives the drafts, root logits, boundary feature and draft-cache K/V the head gives step by
    step from Python with its layer op by op, on every path: int4, int8 and float32 heads over a
    float32 embedding table, and int4 heads over a tied GGUF target's Q8_0 / Q4_0 / Q4_1 codes
    (a reduced draft vocabulary, through d2t)."""
    from eagle3.targets.decoder import CodesEmbedding

    d = head_on(source, fmt, tmp_path)
    assert isinstance(d.embed_tokens, CodesEmbedding) == (source == "gguf")
    assert d.chain_op_args() is not None
    H, V = d.config.hidden_size, d.config.vocab_size
    g = torch.Generator().manual_seed(9)
    start, R, k = 6, 4, 5
    prefix = torch.randint(0, V, (1, start), generator=g), torch.randn(1, start, H, generator=g)
    tokens, feats = torch.randint(0, V, (R,), generator=g), torch.randn(R, H, generator=g)
    caches = []
    with torch.no_grad(), use_isa(path):
        for _ in range(2):
            caches.append(d.new_cache(1, 32))
            d(*prefix, torch.arange(start), caches[-1], kv_len=start)
        got = d.greedy_chain(tokens, feats, start, k, caches[0])
        want = reference_chain(d, tokens, feats, start, k, caches[1])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert len(set(want[0].tolist())) > 1  # the drafts depend on the steps (not one token repeated)
    used = start + R + k - 1  # the last draft is never run through the head
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
        assert torch.equal(a[:, :, :used], b[:, :, :used])


def reference_tree(d, tokens: torch.Tensor, feats: torch.Tensor, start: int, k: int, depth: int,
                   n: int, max_rope: int, cache) -> tuple:
    """The head's catch-up, then `expand_tree` with its forward level by level from Python (its
    layer op by op, the masks and positions a static runner builds): what the one-op tree gives."""
    from eagle3.decoding.tree import expand_tree

    d.midlayer.fused = False
    R = tokens.shape[0]
    logits, h = d(tokens[None], feats[None], torch.arange(start, start + R), cache, kv_len=start + R)
    root, bound = logits[0, -1], h[0, -1]
    p = start + R

    def step(tok, feat, layout):
        region = layout.region[0]  # (T, R) the tree's scratch slots each node sees
        mask = torch.cat([torch.ones(tok.shape[1], p, dtype=torch.bool), region], 1)
        return d(tok, feat, p + layout.offsets, cache, kv_len=p + region.shape[1], attn_mask=mask,
                 rope_pos=p + layout.rope[0])

    out = expand_tree(step, d.to_target_ids, root[None], bound[None, None], [p], k, depth, n, [max_rope])
    d.midlayer.fused = True
    return (*out, root, bound)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("source,fmt", [("toy", "int4"), ("toy", "fp32"), ("gguf", "Q8_0"), ("gguf", "Q4_1")])
def test_the_heads_tree_runs_as_one_op_with_the_same_bits(source, fmt, path, tmp_path):
    """`eagle3::draft_tree` (a catch-up and a whole dynamic tree in one C++ call) gives the tree
    (tokens, parents, depths, ancestor mask), root logits, boundary feature and draft-cache K/V
    that the head's forward and `expand_tree` give level by level from Python, on every path:
    float32 and packed embeddings, shapes from one level to the default's, RoPE positions capped
    near the cache's end."""
    d = head_on(source, fmt, tmp_path)
    H, V = d.config.hidden_size, d.config.vocab_size
    g = torch.Generator().manual_seed(11)
    start, R = 6, 3
    prefix = torch.randint(0, V, (1, start), generator=g), torch.randn(1, start, H, generator=g)
    tokens, feats = torch.randint(0, V, (R,), generator=g), torch.randn(R, H, generator=g)
    for k, depth, n, max_rope in [(3, 6, 12, 40), (2, 3, 6, 1), (4, 1, 3, 40), (3, 4, 9, 0)]:
        caches = []
        with torch.no_grad(), use_isa(path):
            for _ in range(2):
                caches.append(d.new_cache(1, 48))
                d(*prefix, torch.arange(start), caches[-1], kv_len=start)
            got = d.greedy_tree(tokens, feats, start, k, depth, n, max_rope, caches[0])
            want = reference_tree(d, tokens, feats, start, k, depth, n, max_rope, caches[1])
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (k, depth, n, max_rope)
        assert len(set(want[0][0].tolist())) > 1
        used = start + R + k * (depth - 1)  # the catch-up and every expanded level's slots
        for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
            assert torch.equal(a[:, :, :used], b[:, :, :used])


def test_the_one_op_chain_runs_in_generate_and_only_where_it_applies():
    """Greedy generation of the default drafts through `eagle3::draft_chain` (one call per round,
    none per plain step) with output identical to plain decoding; sampled rounds, a stock head
    and a head past its cache's end step from Python instead."""
    from torch.profiler import profile

    s = eagle3.load("default")
    ids = s.tokenizer.encode("Write a haiku about the sea.")

    def calls(**kw) -> tuple[int, dict]:
        with profile() as prof:
            r = s.generate(ids, 24, proposer="eagle", **kw)
        n = sum(e.count for e in prof.key_averages() if e.key == "eagle3::draft_chain")
        return n, r

    n, r = calls(num_draft_tokens=2)
    assert n == r.stats["rounds"] and r.token_ids == s.plain().generate(ids, 24).token_ids
    n, _ = calls(num_draft_tokens=2, temperature=0.8, seed=1)
    assert n == 0
    d = s.draft
    cache = d.new_cache(1, 8)
    x = torch.zeros(3, d.config.hidden_size)
    with torch.no_grad():
        assert d.greedy_chain(torch.ones(3, dtype=torch.long), x, 5, 2, cache) is None  # past the end
        assert d.greedy_chain(torch.ones(3, dtype=torch.long), x, 4, 2, cache) is not None
    assert eagle3.load("default", quantize="none").draft.chain_op_args() is None


def test_the_one_op_tree_runs_in_generate():
    """Tree rounds of the default (the head alone, and hybrid with text drafts grafted on) draft
    through `eagle3::draft_tree`, one call per round, with output identical to plain decoding."""
    from torch.profiler import profile

    s = eagle3.load("default")
    ids = s.tokenizer.encode("List the planets of the solar system, then list them again.")
    want = s.plain().generate(ids, 40).token_ids
    for proposer in ("eagle", "hybrid"):
        with profile() as prof:
            r = s.generate(ids, 40, proposer=proposer, tree=True)
        n = sum(e.count for e in prof.key_averages() if e.key == "eagle3::draft_tree")
        assert r.token_ids == want and r.stats["accepted_tokens"] > 0
        assert n == r.stats["rounds"], (proposer, n, r.stats["rounds"])


def test_the_one_op_tree_is_lossless_to_the_cache_end():
    """Trees of the default drafted through `eagle3::draft_tree` up to the cache's last slot
    (the tree shrinks to the room left, RoPE positions capped) give plain decoding's tokens."""
    from torch.profiler import profile

    s = eagle3.load("default", max_seq_len=64)
    plain = s.plain()
    for plen in (20, 40, 55):
        ids = s.tokenizer.encode("List the planets of the solar system, then list them again. " * 8)[:plen]
        n = 64 - plen
        with profile() as prof:
            r = s.generate(ids, n, proposer="eagle", tree=dict(top_k=3, depth=6, total_tokens=12),
                           stop_token_ids=[])
        calls = sum(e.count for e in prof.key_averages() if e.key == "eagle3::draft_tree")
        assert r.token_ids == plain.generate(ids, n, stop_token_ids=[]).token_ids
        assert len(r.token_ids) == n and calls > 0


@pytest.fixture(scope="module")
def ctx_dir(tmp_path_factory):
    """A target whose attention changes its output (tests/heads.py)."""
    from heads import save_context_target

    return save_context_target(str(tmp_path_factory.mktemp("kern") / "ctx"))


def scripted_spec(path: str, quantize, prompts: list[list[int]], n: int):
    """`path` in format `quantize` with a head scripted along its own greedy runs of `prompts`
    (drafts right after even tokens: accepted lengths vary), so verifies accept and roll back."""
    from eagle3.draft import attach_head
    from eagle3.speculator import Eagle3Speculator
    from heads import scripted_head

    t = eagle3.load(path, "none", quantize=quantize).target
    head = scripted_head(t, prompts, n, "mixed")
    attach_head(head, t)
    return Eagle3Speculator(t, head)


@pytest.mark.parametrize("quantize", [None, "bf16", "int8", "int4"])
def test_speculative_equals_plain_in_each_format(ctx_dir, quantize):
    torch.manual_seed(1)
    prompts = [torch.randint(1, 160, (int(torch.randint(3, 20, (1,))),)).tolist() for _ in range(4)]
    s = scripted_spec(ctx_dir, quantize, prompts, 40)
    plain = s.plain()
    accepted = 0
    for prompt in prompts:
        ref = plain.generate(prompt, 40).token_ids
        for kw in (dict(num_draft_tokens=1), dict(num_draft_tokens=3), dict(num_draft_tokens=6),
                   dict(tree=True)):
            r = s.generate(prompt, 40, **kw)
            assert r.token_ids == ref, (quantize, kw)
            accepted += r.stats["accepted_tokens"]
    assert accepted > 100  # drafts accepted and rolled back, in this format


def test_cli_quantize_errors(llama_dir):
    bad = subprocess.run([sys.executable, "-m", "eagle3", "generate", "--target", llama_dir,
                          "--draft", "none", "--prompt-ids", "1,2,3", "--quantize", "int3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "quantize must be one of" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    hf = subprocess.run([sys.executable, "-m", "eagle3", "generate", "--target", llama_dir,
                         "--draft", "none", "--prompt-ids", "1,2,3", "--quantize", "int4",
                         "--backend", "hf"], capture_output=True, text=True)
    assert hf.returncode == 2 and "native backend" in hf.stderr


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_engine_batches_in_a_format_equal_single_requests(ctx_dir, quantize):
    """The engine's ragged batches (paged cache, per-row masks) on the kernels: every request
    equals its own plain decoding, with a head whose drafts are accepted and rejected."""
    from eagle3.engine import Engine, EngineConfig

    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(1, 160, (int(n),), generator=g).tolist() for n in (3, 9, 17, 6, 12)]
    spec = scripted_spec(ctx_dir, quantize, ps, 24)
    engine = Engine(spec, EngineConfig(max_batch=3, num_draft_tokens=3))
    engine.start(background=False)
    reqs = [engine.submit(p, 24, stop_token_ids=[]) for p in ps]
    engine.run_until_idle()
    for r, p in zip(reqs, ps):
        assert r.token_ids == spec.plain().generate(p, 24, stop_token_ids=[]).token_ids
    m = engine.metrics()
    assert m["kv_used_tokens"] == 0 and m["spec_decode_num_accepted_tokens"] > 20


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_gguf_format_keeps_the_files_codes(qtype, tmp_path):
    """quantize='gguf': each layer holds the file's own codes (its dequantized weight equals
    gguf's dequantizer bit for bit where the type maps exactly), and decodes losslessly."""
    import gguf
    import numpy as np

    from eagle3.draft import attach_head
    from eagle3.kernels import QLinear
    from eagle3.speculator import Eagle3Speculator
    from gguf_files import write_gguf
    from heads import random_head

    wide = {"hidden_size": 256, "intermediate_size": 512} if qtype.endswith("_K") else {}
    hf = make_hf_model("llama", seed=8, **wide)
    path = str(tmp_path / f"m-{qtype}.gguf")
    write_gguf(hf, path, qtype=getattr(gguf.GGMLQuantizationType, qtype))
    t = eagle3.load(path, "none", quantize="gguf").target
    assert t.weight_format == "gguf" and not hasattr(t, "gguf_blocks")  # no codes ride on the model
    down = t.model.layers[0].mlp.down_proj
    assert isinstance(down, QLinear)
    expect = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4"}[qtype]
    assert down.fmt == expect and down.group == 32
    if qtype != "Q4_K":  # exact codes (Q4_K is requantized)
        r = gguf.GGUFReader(path)
        tensor = next(x for x in r.tensors if x.name == "blk.0.ffn_down.weight")
        ref = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        ref = torch.from_numpy(ref.astype(np.float32)).reshape(down.out_features, down.in_features)
        torch.testing.assert_close(down.dequantized(), ref, rtol=0, atol=0)
    assert_verify_rows_equal_decode_rows(t)
    head = random_head(t, taps=(1, 3, 5), seed=9)
    attach_head(head, t)
    s, plain = Eagle3Speculator(t, head), Eagle3Speculator(t)
    prompt = torch.randint(1, 160, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    want = plain.generate(prompt, 30).token_ids
    assert s.generate(prompt, 30, num_draft_tokens=4).token_ids == want
    assert s.generate(prompt, 30, tree=True).token_ids == want


@pytest.mark.parametrize("fmt,group", CASES)
def test_rows_read_from_the_codes_equal_the_dequantized_weight(fmt, group):
    """`QLinear.rows` (the token lookup of a tied LM head held as codes) gives the rows of
    `dequantized()` bit for bit, in any order and with repeats."""
    q = make_layer(fmt, linear(64, 128, seed=4), group)
    ids = torch.tensor([0, 63, 17, 16, 15, 17, 40])
    assert torch.equal(q.rows(ids), q.dequantized()[ids])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_tied_gguf_table_is_looked_up_in_its_codes(qtype, tmp_path):
    """A tied GGUF target on its codes keeps no float32 embedding table: tokens are looked up in
    the LM head's codes (the same values as the file dequantized), a head that ships no
    embedding shares that lookup, and decoding is unchanged and lossless."""
    import gguf

    from eagle3.draft import attach_head
    from eagle3.speculator import Eagle3Speculator
    from eagle3.targets.decoder import CodesEmbedding
    from gguf_files import write_gguf
    from heads import random_head

    path = str(tmp_path / f"tied-{qtype}.gguf")
    write_gguf(make_hf_model("llama_tied", seed=6), path, qtype=getattr(gguf.GGMLQuantizationType, qtype))
    codes = eagle3.load(path, "none", quantize="gguf").target
    table = eagle3.load(path, "none", quantize="fp32").target  # gguf's dequantized table
    assert isinstance(codes.model.embed_tokens, CodesEmbedding)
    assert not isinstance(table.model.embed_tokens, CodesEmbedding)
    assert "model.embed_tokens.weight" not in codes.state_dict()
    ids = torch.tensor([[0, 159, 7, 7, 80]])
    assert torch.equal(codes.embed(ids), table.embed(ids))
    head = random_head(codes, taps=(1, 3, 5), seed=9)
    attach_head(head, codes)
    assert head.embed_tokens is codes.model.embed_tokens
    s, plain = Eagle3Speculator(codes, head), Eagle3Speculator(codes)
    prompt = [5, 99, 31, 2, 140, 77]
    want = plain.generate(prompt, 24, stop_token_ids=[]).token_ids
    assert s.generate(prompt, 24, num_draft_tokens=3, stop_token_ids=[]).token_ids == want
    assert s.generate(prompt, 24, tree=True, stop_token_ids=[]).token_ids == want
    # A float table that the codes only approximate (a checkpoint quantized at load) stays.
    make_hf_model("llama_tied", seed=6).save_pretrained(tmp_path / "st")
    requantized = eagle3.load(str(tmp_path / "st"), "none", quantize="int8").target
    assert not requantized.embed_from_codes()
    assert not isinstance(requantized.model.embed_tokens, CodesEmbedding)
    # An untied file keeps its table: the LM head's codes are another tensor.
    untied = str(tmp_path / "untied.gguf")
    write_gguf(make_hf_model("llama", seed=6), untied, qtype=getattr(gguf.GGMLQuantizationType, qtype))
    assert not isinstance(eagle3.load(untied, "none", quantize="gguf").target.model.embed_tokens,
                          CodesEmbedding)


def test_auto_format_is_the_files_own_for_quantized_gguf(tmp_path, llama_dir):
    """quantize='auto' (the CLI's default): a GGUF stored quantized runs its own codes, a float
    GGUF and a safetensors checkpoint run float32; `eagle3 generate` with no --quantize gives
    the output of quantize='gguf' (each layer's codes equal to gguf's dequantizer checked above)."""
    import gguf

    from gguf_files import write_gguf

    hf = make_hf_model("llama", seed=8)
    q8, f32 = str(tmp_path / "q8.gguf"), str(tmp_path / "f32.gguf")
    write_gguf(hf, q8, qtype=gguf.GGMLQuantizationType.Q8_0)
    write_gguf(hf, f32, qtype=gguf.GGMLQuantizationType.F32)
    assert eagle3.load(q8, "none", quantize="auto").target.weight_format == "gguf"
    assert eagle3.load(f32, "none", quantize="auto").target.weight_format == "float32"
    assert eagle3.load(llama_dir, "none", quantize="auto").target.weight_format == "float32"
    assert eagle3.load(q8, "none").target.weight_format == "gguf"  # the API's default is auto too
    assert eagle3.load(q8, "none", quantize=None).target.weight_format == "float32"
    assert eagle3.load(q8, "none", quantize="auto", dtype="bfloat16").target.weight_format is None
    want = eagle3.load(q8, "none", quantize="gguf").generate([3, 14, 15, 92], 12, stop_token_ids=[]).token_ids
    p = subprocess.run([sys.executable, "-m", "eagle3", "generate", "--target", q8, "--draft", "none",
                        "--prompt-ids", "3,14,15,92", "--max-new-tokens", "12", "--stop-ids", "", "--json"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["token_ids"] == want


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_codes_only_load_equals_the_dequantizing_load(qtype, tmp_path):
    """quantize='gguf' loads the file's block-coded layers without dequantizing them (memory-free
    placeholders until the codes are packed): every packed buffer equals the one built after a
    full float32 load, and the output is the same."""
    import gguf

    from eagle3.kernels import prepare_target
    from eagle3.targets import read_gguf_target
    from eagle3.targets.decoder import is_placeholder
    from gguf_files import write_gguf

    hf = make_hf_model("llama", seed=8)
    path = str(tmp_path / "m.gguf")
    write_gguf(hf, path, qtype=getattr(gguf.GGMLQuantizationType, qtype))
    lazy, lazy_codes = read_gguf_target(path, codes_only=True)
    stubs = [n for n, p in lazy.named_parameters() if is_placeholder(p)]
    assert any("qkv_proj" in n for n in stubs) and any("down_proj" in n for n in stubs)
    assert "model.embed_tokens.weight" not in stubs  # the lookup reads the real table
    full, full_codes = read_gguf_target(path)
    for t, codes in ((lazy, lazy_codes), (full, full_codes)):
        prepare_target(t, "gguf", None, codes.layers())
    a, b = lazy.state_dict(), full.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not [n for n, p in lazy.named_parameters() if is_placeholder(p)]
    from eagle3.speculator import Eagle3Speculator

    prompt = [3, 14, 15, 92, 65]
    assert (Eagle3Speculator(lazy).generate(prompt, 16).token_ids
            == Eagle3Speculator(full).generate(prompt, 16).token_ids)


def test_a_fused_layer_of_q4_0_and_q4_1_parts_keeps_each_parts_weights():
    """q in Q4_0 (no offsets: w = (code - 8) d) and k, v in Q4_1 fused into one qkv layer: the Q4_0
    part takes the offset -8 d, so every row keeps the weights its GGUF type defines."""
    from eagle3.targets.gguf import _layer

    g = torch.Generator().manual_seed(3)
    codes = {n: torch.randint(0, 16, (rows, 64), generator=g, dtype=torch.uint8)
             for n, rows in (("q", 32), ("k", 16), ("v", 16))}
    d = {n: (torch.rand(c.shape[0], 2, generator=g) * 0.01).half().float() for n, c in codes.items()}
    m = {n: (-torch.rand(c.shape[0], 2, generator=g) * 0.05).half().float() for n, c in codes.items()}
    base = "model.layers.0.self_attn."
    blocks = {base + "q_proj.weight": ("int4", codes["q"], d["q"], None),
              base + "k_proj.weight": ("int4", codes["k"], d["k"], m["k"]),
              base + "v_proj.weight": ("int4", codes["v"], d["v"], m["v"])}
    types = {base + "q_proj.weight": "Q4_0", base + "k_proj.weight": "Q4_1", base + "v_proj.weight": "Q4_1"}
    layer = _layer(base + "qkv_proj", torch.nn.Linear(64, 64, bias=False), False, blocks, types)
    expand = lambda t: t.repeat_interleave(32, dim=1)  # noqa: E731
    want = torch.cat([(codes["q"].float() - 8) * expand(d["q"]),
                      codes["k"].float() * expand(d["k"]) + expand(m["k"]),
                      codes["v"].float() * expand(d["v"]) + expand(m["v"])])
    assert layer.fmt == "int4"
    torch.testing.assert_close(layer.dequantized(), want, rtol=0, atol=0)


def test_codes_only_names_takes_whole_layers_in_one_block_type():
    from eagle3.targets.gguf import codes_only_names

    L = "model.layers.0."
    named = [(L + "self_attn.q_proj.weight", "Q4_1", (64, 64)),
             (L + "self_attn.k_proj.weight", "Q4_1", (32, 64)),
             (L + "self_attn.v_proj.weight", "Q8_0", (32, 64)),  # mixed types: q/k/v dequantized
             (L + "self_attn.o_proj.weight", "Q4_0", (64, 64)),
             (L + "mlp.gate_proj.weight", "Q8_0", (128, 64)), (L + "mlp.up_proj.weight", "Q8_0", (128, 64)),
             (L + "mlp.down_proj.weight", "Q6_K", (64, 128)),  # not a block type kept as codes
             ("model.layers.1.mlp.down_proj.weight", "Q8_0", (24, 128)),  # 24 rows: no 16-row tiles
             ("model.embed_tokens.weight", "Q8_0", (160, 64)), ("lm_head.weight", "Q8_0", (160, 64))]
    assert codes_only_names(named) == {L + "self_attn.o_proj.weight", L + "mlp.gate_proj.weight",
                                       L + "mlp.up_proj.weight", "lm_head.weight"}


@pytest.mark.parametrize("kw,reason", [({}, None), ({"quantize": "int4"}, None),
                                       ({"quantize": "none"}, "quantize='none'"),
                                       ({"dtype": "bfloat16"}, "dtype bfloat16")])
def test_speculation_off_the_row_invariant_kernels_says_so_in_one_line(kw, reason, capsys):
    capsys.readouterr()
    spec = eagle3.load("default", **kw)
    err = capsys.readouterr().err
    assert spec.draft is not None
    if reason is None:
        assert "near-ties" not in err, err
    else:
        lines = [line for line in err.splitlines() if "near-ties" in line]
        assert len(lines) == 1 and reason in lines[0] and lines[0].startswith("eagle3: "), err
    capsys.readouterr()
    eagle3.load("default", "none", **kw)  # plain decoding: nothing to say
    assert "near-ties" not in capsys.readouterr().err
