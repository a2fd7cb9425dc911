"""Export to ExecuTorch: the lowered methods equal the eager ones, exported generation is lossless.

Lowering takes tens of seconds per program, so each program is built once per module.
Skipped, with the reason shown, only when the [export] extra (executorch) is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import eagle3  # noqa: E402
from conftest import make_hf_model  # noqa: E402
from eagle3.draft import attach_head, save_head  # noqa: E402
from eagle3.errors import Eagle3Error  # noqa: E402
from eagle3.export import export_program  # noqa: E402
from eagle3.speculator import Eagle3Speculator  # noqa: E402
from eagle3.targets import load_target  # noqa: E402
from heads import random_head, save_context_target, scripted_head  # noqa: E402

pytestmark = pytest.mark.slow
V, MAX_LEN, K = 160, 64, 4
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """Two programs: a target whose attention changes its output, with a head scripted along
    the greedy runs of the prompts below whose later drafts are right only after even tokens
    (accepted lengths vary), and a random target, int8-quantized, with a head scripted the
    same way along its float greedy runs (drafts accepted wherever int8 keeps those runs, so a
    quantized program that is not its own plain decoding can fail the lossless test)."""
    root = tmp_path_factory.mktemp("export")
    out = {}
    # 3 layers (taps 1, 2, 3): lowering time grows with the graph, and each program takes a while
    tdir = save_context_target(str(root / "ctx"), num_hidden_layers=3)
    target = load_target(tdir, max_seq_len=MAX_LEN)
    used = [[7], *prompts(6, 11), *prompts(2, 4), prompts(1, 9)[0], prompts(1, 2)[0]]
    save_head(scripted_head(target, used, MAX_LEN, "mixed"), str(root / "mixed_head"), "speculators",
              include_embedding=True)
    rdir = str(root / "random")
    make_hf_model("llama", seed=3, num_hidden_layers=3).save_pretrained(rdir)
    rt = load_target(rdir, max_seq_len=MAX_LEN)
    save_head(scripted_head(rt, used, MAX_LEN, "mixed"), str(root / "random_head"), "speculators",
              include_embedding=True)
    for name, t, h, q in (("mixed", tdir, "mixed_head", "none"), ("random", rdir, "random_head", "int8")):
        spec = eagle3.load(t, str(root / h), max_seq_len=MAX_LEN)
        meta = export_program(spec, str(root / f"{name}_program"), max_seq_len=MAX_LEN,
                              max_draft_tokens=K, quantize=q, log=lambda m: None)
        out[name] = {"target": t, "head": str(root / h), "program": str(root / f"{name}_program"),
                     "meta": meta, "eager": spec}  # `spec` now holds the quantized weights
    return out


def eager(p, draft=None) -> Eagle3Speculator:
    return eagle3.load(p["target"], draft or p["head"], max_seq_len=MAX_LEN)


def test_exported_methods_equal_eager_methods(programs):
    p = programs["mixed"]
    ref = eager(p)
    prog = eagle3.load(p["target"], backend="executorch", program=p["program"])
    ids = torch.tensor([prompts(1, 5)[0][:12]])
    n = ids.shape[1]
    pos = torch.arange(MAX_LEN)
    for spec in (ref, prog):
        spec.reset_caches()
    outs = []
    for spec in (ref, prog):
        tok, f0 = spec.prefill(ids, pos[:n], kv_len=n)
        vids, f1 = spec.target_verify(torch.tensor([[int(tok), 3, 5, 7, 9]]), pos[n:n + K + 1],
                                      kv_len=n + K + 1)
        dtok, h = spec.draft_decode(torch.cat([ids[:, 1:], tok.view(1, 1)], dim=1), f0, pos[:n], kv_len=n)
        step, h2 = spec.draft_decode(dtok[:, -1:], h[:, -1:], pos[n:n + 1], kv_len=n + 1)
        spec.target_cache.truncate(n + 1)
        dec, f2 = spec.decode(vids[:, :1], pos[n + 1:n + 2], kv_len=n + 2)
        outs.append((tok, f0, vids, f1, dtok, h, step, h2, dec, f2))
    for a, b in zip(*outs):
        assert a.shape == b.shape
        if a.dtype == torch.long:
            assert torch.equal(a, b)
        else:  # float rounding, relative to the tensor's scale (the scripted head's are large)
            torch.testing.assert_close(b, a, atol=1e-4 * max(1.0, float(a.abs().max()) / 100), rtol=1e-4)


@pytest.mark.parametrize("name", ["mixed", "random"])
def test_exported_generation_is_lossless(programs, name):
    """Greedy chain generation through the program equals plain greedy decoding, with drafts
    accepted at every length: the eager target's for the float program, the program's own for
    the quantized one (its verify rows must equal its decode rows wherever an accepted draft
    decides; on this tiny model no argmax is a near-tie, while on the default model quantized
    rounding flips a few, as docs/export.md measures)."""
    p = programs[name]
    prog = eagle3.load(p["target"], backend="executorch", program=p["program"])
    plain_prog = prog.plain()
    plain_eager = eager(p, "none")
    lengths = set()
    for i, prompt in enumerate([[7]] + prompts(6, 11)):  # a 1-token prompt: prefill is decode
        n = MAX_LEN - len(prompt) if i == 1 else 24  # one runs to the cache's end
        want = plain_prog.generate(prompt, n, stop_token_ids=[]).token_ids
        if name == "mixed":
            assert want == plain_eager.generate(prompt, n, stop_token_ids=[]).token_ids
        for k in (1, 2, K, "auto"):
            r = prog.generate(prompt, n, num_draft_tokens=k, stop_token_ids=[])
            assert r.token_ids == want, (prompt, k)
            lengths |= {a for a, c in enumerate(r.stats["accept_len_hist"]) if c}
    assert prog.costs is not None and prog.max_auto_k == K  # auto is capped by the program
    # rollbacks after every accepted length, and full acceptance: the int8 program's drafts too
    assert {1, 2, 3, K} <= lengths, (name, lengths)


def test_quantized_program_computes_its_eager_model(programs, capsys):
    """The int8 program equals the eager quantized model it was lowered from (up to the
    kernels' rounding), and the error against float32 is recorded."""
    p = programs["random"]
    err = p["meta"]["quantization_error"]
    assert err["mode"] == "int8" and err["probe_tokens"] > 16
    assert 0 < err["max_abs_logit_error"] < err["logit_scale"]
    assert err["argmax_agreement"] > 0.5
    ref = p["eager"]
    capsys.readouterr()
    prog = eagle3.load(p["target"], backend="executorch", program=p["program"])
    assert "int8-quantized" in capsys.readouterr().err  # the near-tie notice
    ids = torch.tensor([prompts(1, 8)[0] + list(range(1, 30))])[:, :MAX_LEN - K - 1]
    n = ids.shape[1]
    for spec in (ref, prog):
        spec.reset_caches()
    (t0, f0), (t1, f1) = (spec.prefill(ids, torch.arange(n), kv_len=n) for spec in (ref, prog))
    drafts = torch.tensor([[int(t0), 5, 6, 7, 8]])
    (v0, g0), (v1, g1) = (spec.target_verify(drafts, torch.arange(n, n + K + 1), kv_len=n + K + 1)
                          for spec in (ref, prog))
    scale = f0.abs().mean()
    assert (f1 - f0).abs().max() < 0.05 * scale and (g1 - g0).abs().max() < 0.05 * scale
    assert (v1 == v0).float().mean() >= 0.8


def test_bounds_and_unsupported_requests(programs):
    p = programs["mixed"]
    prog = eagle3.load(p["target"], backend="executorch", program=p["program"])
    prompt = prompts(1, 2)[0]
    with pytest.raises(Eagle3Error, match="max_draft_tokens"):
        prog.generate(prompt, 8, num_draft_tokens=K + 1)
    with pytest.raises(Eagle3Error, match="max_seq_len"):
        prog.generate(prompt, MAX_LEN)
    with pytest.raises(Eagle3Error, match="tree"):
        prog.generate(prompt, 8, tree=True)
    with pytest.raises(Eagle3Error, match="greedily"):
        prog.generate(prompt, 8, temperature=0.7)
    with pytest.raises(Eagle3Error, match="compile"):
        prog.compile()
    prog.reset_caches()
    with pytest.raises(Eagle3Error, match="exceeds the program's bound"):
        prog.target_verify(torch.ones(1, K + 2, dtype=torch.long), torch.arange(K + 2))
    with pytest.raises(Eagle3Error, match="gap"):
        prog.target_verify(torch.ones(1, 2, dtype=torch.long), torch.arange(5, 7))
    # a refused request leaves nothing behind: the next generation is still exact
    want = eager(p, "none").generate(prompt, 12, stop_token_ids=[]).token_ids
    assert prog.generate(prompt, 12, num_draft_tokens=2, stop_token_ids=[]).token_ids == want
    for kw, msg in (({}, "program=DIR"), ({"program": "/nonexistent"}, "not a directory"),
                    ({"program": p["target"]}, "program.pte")):
        with pytest.raises(Eagle3Error, match=msg):
            eagle3.load(p["target"], backend="executorch", **kw)


def test_unsupported_configurations_fail_clearly(tmp_path):
    def random_spec(name: str) -> Eagle3Speculator:
        d = str(tmp_path / name)
        make_hf_model(name, seed=1).save_pretrained(d)
        t = load_target(d, max_seq_len=MAX_LEN)
        head = random_head(t, taps=(1, 2, 3))
        attach_head(head, t)
        return Eagle3Speculator(t, head)

    with pytest.raises(Eagle3Error, match="soft-capping"):
        export_program(random_spec("gemma2"), str(tmp_path / "g_out"), max_seq_len=MAX_LEN,
                       log=lambda m: None)
    spec = random_spec("mistral")  # sliding window 7
    with pytest.raises(Eagle3Error, match="sliding window"):
        export_program(spec, str(tmp_path / "m_out"), max_seq_len=MAX_LEN, log=lambda m: None)
    with pytest.raises(Eagle3Error, match="draft head"):
        export_program(Eagle3Speculator(spec.target), str(tmp_path / "n_out"), max_seq_len=MAX_LEN)
    with pytest.raises(Eagle3Error, match="max_draft_tokens"):
        export_program(spec, str(tmp_path / "k_out"), max_seq_len=6, max_draft_tokens=5)
    assert not any(tmp_path.glob("*_out*"))  # nothing left behind


def test_failed_or_refused_export_leaves_nothing_behind(tmp_path, monkeypatch):
    from eagle3.export import program

    tdir = save_context_target(str(tmp_path / "t"), num_hidden_layers=3)
    t = load_target(tdir, max_seq_len=16)
    head = scripted_head(t, [[1, 2]], 4)
    attach_head(head, t)
    spec = Eagle3Speculator(t, head)
    (tmp_path / "file").write_text("x")
    with pytest.raises(Eagle3Error, match="is a file"):
        export_program(spec, str(tmp_path / "file"), log=lambda m: None)
    with pytest.raises(Eagle3Error, match="does not exist"):
        export_program(spec, str(tmp_path / "no" / "out"), log=lambda m: None)

    # A write that fails half-way (the disk fills while copying the tokenizer): the partial
    # directory goes, the error is one line. Lowering is skipped (its bytes are not read here).
    def disk_full(*a, **kw):
        raise OSError(28, "No space left on device")
    (tmp_path / "t" / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(program, "lower", lambda programs, metadata: b"program bytes")
    monkeypatch.setattr(program.shutil, "copy", disk_full)
    before = set(os.listdir(tmp_path))
    with pytest.raises(Eagle3Error, match="No space left on device"):
        export_program(spec, str(tmp_path / "out"), max_draft_tokens=2, tokenizer_dir=tdir,
                       log=lambda m: None)
    assert set(os.listdir(tmp_path)) == before


def test_cli_export_errors_generate_and_bench(programs, tmp_path):
    p = programs["mixed"]
    run = lambda *a: subprocess.run([sys.executable, "-m", "eagle3", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=600, stdin=subprocess.DEVNULL, env=ENV)
    r = run("export", "--target", p["target"], "--draft", p["head"], "--out", p["program"])
    assert r.returncode == 2 and "not empty" in r.stderr and "Traceback" not in r.stderr
    r = run("export", "--target", p["target"], "--draft", p["head"], "--out", str(tmp_path / "x"),
            "--max-seq-len", "8", "--max-draft-tokens", "9")
    assert r.returncode == 2 and "max_draft_tokens" in r.stderr and not (tmp_path / "x").exists()

    prompt = prompts(1, 9)[0]
    want = eager(p, "none").generate(prompt, 20, stop_token_ids=[]).token_ids
    r = run("generate", "--target", p["target"], "--backend", "executorch", "--program", p["program"],
            "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "20", "--stop-ids", "",
            "--num-draft-tokens", "3", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == want
    r = run("generate", "--target", p["target"], "--backend", "executorch", "--program", p["program"],
            "--prompt-ids", "1,2", "--tree")
    assert r.returncode == 2 and "tree" in r.stderr and "Traceback" not in r.stderr

    pfile = tmp_path / "p.jsonl"
    pfile.write_text("".join(json.dumps({"prompt_ids": q}) + "\n" for q in prompts(2, 4)))
    out = tmp_path / "bench.json"
    r = run("bench", "--target", p["target"], "--draft", p["head"], "--max-seq-len", str(MAX_LEN),
            "--backend", "eager,executorch", "--program", p["program"], "--prompts", str(pfile),
            "--max-new-tokens", "12", "--repeats", "1", "--num-draft-tokens", "auto,2",
            "--tree", "none", "--peers", "none", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["outputs_identical"] is True
    names = {(row["backend"], row["arm"], row["k"]) for row in rep["rows"]}
    assert names == {(b, a, k) for b in ("eager", "executorch")
                     for a, k in (("plain", None), ("eagle3", 2), ("eagle3", "auto"))}
    assert set(rep["cost_models"]) == {"eager", "executorch"}
    # the first draft is always right: tau >= 2 on both backends, the same on both
    taus = {row["backend"]: row["mean_accept_len"] for row in rep["rows"] if row["k"] == 2}
    assert taus["eager"] == taus["executorch"] >= 2.0
    assert [r.get("matches_first_backend_plain") for r in rep["rows"] if r["arm"] == "plain"] == [None, True]
