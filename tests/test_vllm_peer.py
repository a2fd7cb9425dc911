"""vLLM as a peer in `eagle3 bench --peers vllm`: skipped with a visible reason where its
environment is absent, a one-line error where it is broken, and, where recipes/vllm/setup.sh
has built it, real rows (plain and EAGLE-3 with our head) on the real default.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagle3.bench import vllm


def bench(tmp_path, *extra: str, env: dict | None = None, timeout: int = 600,
          default: str = "toy") -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    if default == "real":
        env = {k: v for k, v in env.items() if not k.startswith("EAGLE3_DEFAULT")}
    return subprocess.run([sys.executable, "-m", "eagle3", "bench", "--max-new-tokens", "8",
                           "--num-draft-tokens", "2", "--tree", "none", "--repeats", "1",
                           "--limit", "1", "--json", str(tmp_path / "b.json"), *extra],
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_absent_vllm_is_skipped_with_the_reason(tmp_path):
    run = bench(tmp_path, "--peers", "vllm", env={"EAGLE3_VLLM": str(tmp_path / "nowhere")})
    assert run.returncode == 0, run.stderr[-500:]
    assert "skipping vllm: vLLM's CPU build is not in" in run.stderr
    assert "recipes/vllm/setup.sh" in run.stderr
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["peers"] == {} and report["rows"]
    assert any("skipping vllm" in n for n in report["notes"])


def test_broken_vllm_is_a_one_line_error(tmp_path):
    # An environment whose Python runs but whose vLLM fails at start (as a broken install does).
    py = tmp_path / "vllm" / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\necho 'ImportError: libtorch_cpu.so: cannot open shared object file' >&2\n"
                  "exit 1\n")
    py.chmod(0o755)
    run = bench(tmp_path, "--peers", "vllm", env={"EAGLE3_VLLM": str(tmp_path / "vllm")})
    assert run.returncode == 2
    err = [ln for ln in run.stderr.splitlines() if ln.startswith("eagle3: error")]
    assert len(err) == 1 and "Traceback" not in run.stderr
    assert "vLLM (vllm plain) failed to start" in err[0] and "libtorch_cpu.so" in err[0]
    assert not (tmp_path / "b.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(vllm.missing() is not None, reason=vllm.missing() or "")
def test_bench_runs_vllm_plain_and_eagle3_on_the_default(tmp_path):

    run = bench(tmp_path, "--prompts", "sharegpt-heldout", "--limit", "2", "--quantize", "fp32",
                "--peers", "vllm", default="real", timeout=1200)
    assert run.returncode == 0, run.stderr[-800:]
    peers = json.loads((tmp_path / "b.json").read_text())["peers"]
    assert set(peers) == {"vllm plain", "vllm eagle3 K=2"}
    for p in peers.values():
        assert p["tokens"] > 0 and p["tokens_per_s"] > 0 and p["load_seconds"] > 0
    # fp32 on both sides and the same prompt ids: vLLM's greedy tokens are ours (measured 8 of 8
    # equal over 64 tokens; only a near-tie between kernels could part them).
    assert peers["vllm plain"]["outputs_identical"] is True
    spec = peers["vllm eagle3 K=2"]
    assert spec["draft_tokens"] > 0 and spec["mean_accept_len"] >= 1.0
