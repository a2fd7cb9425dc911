"""Jobs that survive a kill: `train-draft` killed with SIGKILL at several points, then rerun with
the same command (`--resume`), ends with the uninterrupted run's head and loss log, bit for bit;
a full disk or an unwritable output directory is a one-line error before the long work, and a
failed write never damages the previous checkpoint.

The kills hit real subprocesses at moments chosen by polling their output files (a chunk,
the feature store, a checkpoint, a head directory); wherever they land, the result must be the
same. The target is tiny (a whole run takes a few seconds).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_hf_model
from eagle3 import Eagle3Error
from eagle3.files import atomic_dir, atomic_write, check_writable
from eagle3.targets import load_target
from eagle3.train import trainer
from eagle3.train.trainer import TrainArgs, train_draft

N_PROMPTS, CHUNK = 24, 4  # 6 regeneration chunks
EPOCHS, BATCH = 3, 4  # 5 steps an epoch, 15 in all: a tenth of the samples (2) are held out
HELD = N_PROMPTS // 10  # for the simulated tau (logged at the run's end), never trained on
TOTAL = EPOCHS * ((N_PROMPTS - HELD) // BATCH)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[str, str]:
    """A tiny random 8-layer Llama (peaked distribution) and a jsonl of 24 ragged prompts."""
    d = tmp_path_factory.mktemp("resume-target")
    model = make_hf_model("llama", num_hidden_layers=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(d / "model")
    g = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(N_PROMPTS):
        n = int(torch.randint(4, 12, (1,), generator=g))
        lines.append(json.dumps({"prompt_ids": torch.randint(1, 160, (n,), generator=g).tolist()}))
    (d / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return str(d / "model"), str(d / "prompts.jsonl")


def command(target: tuple[str, str], out: Path, *extra: str) -> list[str]:
    """The one command every run uses: the first run starts fresh, a rerun resumes."""
    return [sys.executable, "-m", "eagle3", "train-draft", "--target", target[0], "--data", target[1],
            "--out", str(out), "--draft-vocab", "100", "--ttt-steps", "3", "--response-len", "16",
            "--batch", str(BATCH), "--epochs", str(EPOCHS), "--warmup", "2", "--lr", "3e-3",
            "--ckpt-every", "2", "--regen-chunk", str(CHUNK), "--regen-batch", "4", "--threads", "1",
            "--quiet", "--resume", *extra]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def kill_when(cmd: list[str], ready, what: str) -> None:
    """Start `cmd`, SIGKILL it as soon as `ready()` holds (polled every ms); it must still run then."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV,
                         stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    try:
        while not ready():
            if p.poll() is not None:
                pytest.fail(f"the run ended (rc {p.returncode}) before {what}: "
                            f"{p.stderr.read().decode()[-2000:]}")
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.001)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=30)
        p.stderr.close()
    assert p.returncode == -signal.SIGKILL, f"the run ended by itself before the kill {what}"


def result(out: Path) -> tuple[dict, list]:
    """Both heads' tensors and the report's loss log."""
    from safetensors.torch import load_file

    heads = {name: load_file(out / name / "model.safetensors") for name in ("head", "head-speculators")}
    return heads, json.loads((out / "report.json").read_text())["log"]


def assert_same(out: Path, ref: Path) -> None:
    (heads, log), (ref_heads, ref_log) = result(out), result(ref)
    assert [r["loss"] for r in log] == [r["loss"] for r in ref_log]  # bitwise: floats compared exactly
    assert log == ref_log
    for name, tensors in ref_heads.items():
        assert heads[name].keys() == tensors.keys()
        for k, t in tensors.items():
            assert torch.equal(heads[name][k], t), f"{name}/{k} differs from the uninterrupted run"
    assert not [f for f in os.listdir(out) if ".partial-" in f], "a killed run's temporary remained"


def ckpt_step(out: Path) -> int:
    return torch.load(out / "checkpoint.pt", weights_only=False)["step"]


def chunks(out: Path) -> list[str]:
    d = out / "data"
    names = os.listdir(d) if d.is_dir() else []
    return sorted(f for f in names if f.startswith("regen-") and f.endswith(".pt"))


# -- kill -9, then the same command ----------------------------------------------------------------
@pytest.mark.slow
def test_online_run_killed_in_regeneration_training_and_saving_equals_the_uninterrupted_run(
        target, tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    run(command(target, ref))
    assert ckpt_step(ref) == TOTAL
    cmd = command(target, out)
    # 1. during regeneration: the first chunk is on disk, the others are not all there yet.
    kill_when(cmd, lambda: bool(chunks(out)), "during regeneration")
    assert len(chunks(out)) < N_PROMPTS // CHUNK, "regeneration had finished before the kill"
    assert not (out / "checkpoint.pt").exists()
    # 2. during training: a checkpoint exists and training has not finished.
    kill_when(cmd, lambda: (out / "checkpoint.pt").is_file(), "during training")
    assert ckpt_step(out) < TOTAL, "training had finished before the kill"
    # 3. while saving the heads, or at whatever point the run reached by the time the first head
    # directory appeared (the checkpoint is final then).
    kill_when(cmd, lambda: (out / "head").is_dir(), "while saving")
    run(cmd)
    assert_same(out, ref)


@pytest.mark.slow
def test_offline_features_run_killed_in_capture_and_training_equals_the_uninterrupted_run(
        target, tmp_path):
    """With the campaign's settings: a top-k store and a constant learning rate."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    extra = ("--features", "offline", "--store-topk", "16", "--schedule", "constant")
    run(command(target, ref, *extra))
    cmd = command(target, out, *extra)
    # During the feature capture: the memmaps exist; the completion marker comes last.
    kill_when(cmd, lambda: (out / "data" / "logits.npy").is_file(), "during feature capture")
    if not (out / "data" / "features.json").exists():  # killed before the capture completed
        assert not (out / "checkpoint.pt").exists()
    kill_when(cmd, lambda: (out / "checkpoint.pt").is_file(), "during training")
    assert ckpt_step(out) < TOTAL, "training had finished before the kill"
    run(cmd)
    assert_same(out, ref)


def test_a_half_written_feature_store_is_captured_again(target, tmp_path):
    """What a kill mid-capture leaves (memmaps, no marker), or a torn marker: never trusted."""
    out = tmp_path / "out"
    kw = dict(target=target[0], data=target[1], out=str(out), draft_vocab=100, ttt_steps=2, response_len=8,
              batch=4, max_steps=1, warmup=1, features="offline", progress=False)
    first = train_draft(TrainArgs(**kw))
    data = out / "data"
    taps = data / "taps.npy"
    good = taps.read_bytes()
    with open(taps, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        header = f.tell()
    for damage in ("no marker", "torn marker"):
        with open(taps, "r+b") as f:  # the data past the header zeroed, as after an early kill
            f.seek(header)
            f.write(bytes(len(good) - header))
        if damage == "no marker":
            (data / "features.json").unlink()
        else:
            (data / "features.json").write_text('{"key": "')
        again = train_draft(TrainArgs(**kw))
        assert taps.read_bytes() == good, damage
        assert again["log"] == first["log"], damage


# -- disks that are full or cannot be written ------------------------------------------------------
def cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3", *args], capture_output=True, text=True,
                          timeout=120, env=ENV, stdin=subprocess.DEVNULL)


def one_line_error(p: subprocess.CompletedProcess, match: str) -> None:
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("eagle3: error:")]
    assert len(lines) == 1 and match in lines[0], p.stderr[-2000:]


def test_unwritable_out_is_one_line_exit_2_before_any_work(target, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    p = cli(["train-draft", "--target", target[0], "--data", target[1], "--out", str(blocker / "out"),
             "--quiet"])
    one_line_error(p, f"cannot write to --out {blocker / 'out'}")
    assert "choose a writable directory" in p.stderr


def test_read_only_out_is_one_line_exit_2(target, tmp_path):
    """A directory nobody may write into: a chmod 0o555 one, or for root (whom file modes do not
    stop) sysfs, where no user can create directories."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        ro = Path("/sys/kernel")
    try:
        p = cli(["train-draft", "--target", target[0], "--data", target[1], "--out", str(ro / "out"),
                 "--quiet"])
    finally:
        ro.chmod(0o755)
    one_line_error(p, "cannot write to --out")


def test_full_disk_is_refused_before_regeneration(target, tmp_path, monkeypatch):
    """Free space below the estimate: a one-line error before the target regenerates anything."""
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10_000))
    out = tmp_path / "out"
    with pytest.raises(Eagle3Error, match="not enough free space for --out") as e:
        train_draft(TrainArgs(target=target[0], data=target[1], out=str(out), draft_vocab=100,
                              response_len=8, batch=4, max_steps=1, progress=False))
    assert "\n" not in str(e.value) and "10 KB free" in str(e.value)
    assert chunks(out) == [] and not (out / "checkpoint.pt").exists()


def test_check_writable_names_the_directory_and_the_fix(tmp_path, monkeypatch):
    check_writable(tmp_path / "new" / "dir", need_bytes=1)  # created
    assert (tmp_path / "new" / "dir").is_dir() and os.listdir(tmp_path / "new" / "dir") == []
    (tmp_path / "f").write_text("")
    with pytest.raises(Eagle3Error, match=r"cannot write to --out .*/f/x \(Not a directory\); choose"):
        check_writable(tmp_path / "f" / "x")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=5 * 10 ** 6))
    with pytest.raises(Eagle3Error, match=r"5 MB free, about 2 GB needed; free some disk space"):
        check_writable(tmp_path, need_bytes=2 * 10 ** 9)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint(target, tmp_path, monkeypatch, code):
    """The disk fills (or turns read-only) while the next checkpoint is written: a one-line error,
    the previous checkpoint unchanged byte for byte, no temporary left; --resume then continues."""
    out = tmp_path / "out"
    kw = dict(target=target[0], data=target[1], out=str(out), draft_vocab=100, ttt_steps=2, response_len=8,
              batch=4, max_steps=4, warmup=1, ckpt_every=2, progress=False)
    whole = train_draft(TrainArgs(**{**kw, "out": str(tmp_path / "whole")}))
    train_draft(TrainArgs(**kw, stop_after=2))
    before = (out / "checkpoint.pt").read_bytes()
    real_save = torch.save

    def save_then_fail(obj, f, *a, **k):  # some bytes reach the temporary file, then the error
        real_save({"partial": torch.zeros(1000)}, f)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(torch, "save", save_then_fail)
    with pytest.raises(Eagle3Error) as e:
        train_draft(TrainArgs(**kw, resume=True))
    msg = str(e.value)
    assert "\n" not in msg and str(out / "checkpoint.pt") in msg and os.strerror(code) in msg
    assert (out / "checkpoint.pt").read_bytes() == before
    assert not [f for f in os.listdir(out) if ".partial-" in f], "the temporary checkpoint remained"
    monkeypatch.setattr(torch, "save", real_save)
    assert train_draft(TrainArgs(**kw, resume=True))["log"] == whole["log"]


def test_atomic_write_and_dir_replace_whole_or_not_at_all(tmp_path):
    f = tmp_path / "a.txt"
    with atomic_write(f, "w") as h:
        h.write("one")
    with pytest.raises(RuntimeError):
        with atomic_write(f, "w") as h:
            h.write("two, cut short")
            raise RuntimeError("killed")
    assert f.read_text() == "one"
    d = tmp_path / "head"
    for text in ("v1", "v2"):
        with atomic_dir(d) as tmp:
            Path(tmp, "config.json").write_text(text)
    assert os.listdir(d) == ["config.json"] and (d / "config.json").read_text() == "v2"
    with pytest.raises(Eagle3Error, match="No space left on device"):
        with atomic_dir(d) as tmp:
            Path(tmp, "config.json").write_text("v3")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert (d / "config.json").read_text() == "v2"
    # A killed writer's temporaries (its pid is gone) are removed by the next writer.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f".a.txt.partial-{dead}-x").write_text("torn")
    (tmp_path / f".head.partial-{dead}-y").mkdir()
    with atomic_write(f, "w") as h:
        h.write("three")
    with atomic_dir(d) as tmp:
        Path(tmp, "config.json").write_text("v4")
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "head"]
    # Killed between moving the previous version aside and moving the new one in: nothing is at
    # `head`; the next writer first puts the previous version back, then replaces it whole.
    os.replace(d, tmp_path / f".head.previous-{dead}-z")
    with pytest.raises(RuntimeError):
        with atomic_dir(d) as tmp:
            assert (d / "config.json").read_text() == "v4"  # restored before anything else
            raise RuntimeError("killed again")
    assert (d / "config.json").read_text() == "v4" and sorted(os.listdir(tmp_path)) == ["a.txt", "head"]


# -- export --------------------------------------------------------------------------------------
# Lowering a program takes a minute or more here, so this subprocess replaces torch.export and the
# lowering by fixed program bytes and slows the tokenizer copies: the SIGKILL lands inside
# export_program's real write phase, which is what must be whole or absent.
EXPORT_SCRIPT = """
import shutil, sys, time
import eagle3
from eagle3.export import program
target, head, tok, out = sys.argv[1:5]
real_copy = shutil.copy
def slow_copy(*a, **kw):
    real_copy(*a, **kw)
    time.sleep(0.3)
program.export_methods = lambda spec, max_seq_len, max_draft_tokens: {}
program.lower = lambda programs, metadata: b"program bytes " * 100000
program.shutil.copy = slow_copy
spec = eagle3.load(target, head, max_seq_len=32)
program.export_program(spec, out, max_seq_len=32, max_draft_tokens=2, tokenizer_dir=tok, log=print)
"""


@pytest.mark.slow
def test_export_killed_while_writing_leaves_no_partial_out_and_a_rerun_succeeds(target, tmp_path):
    from eagle3.draft import save_head
    from eagle3.export.program import META_FILE, PROGRAM_FILE
    from heads import random_head

    head, tok, out = tmp_path / "head", tmp_path / "tok", tmp_path / "program"
    save_head(random_head(load_target(target[0], max_seq_len=32), seed=1), str(head), "speculators")
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tok / name).write_text("{}")
    cmd = [sys.executable, "-c", EXPORT_SCRIPT, target[0], str(head), str(tok), str(out)]
    partial = lambda: [p for p in tmp_path.iterdir() if p.name.startswith(".program.partial-")]  # noqa: E731
    kill_when(cmd, lambda: any((p / PROGRAM_FILE).is_file() for p in partial()), "while writing")
    assert not out.exists(), "a killed export left a partial output directory"
    run(cmd)
    assert sorted(os.listdir(out)) == sorted([PROGRAM_FILE, META_FILE, "tokenizer.json",
                                              "tokenizer_config.json", "special_tokens_map.json"])
    assert (out / PROGRAM_FILE).read_bytes() == b"program bytes " * 100000
    assert json.loads((out / META_FILE).read_text())["max_seq_len"] == 32
    assert partial() == [], "the killed export's temporary directory remained"


def test_full_disk_for_the_feature_store_is_refused_before_regeneration(target, tmp_path, monkeypatch):
    """--features offline: the store's size (from the prompts' lengths) is checked up front too."""
    usage = shutil.disk_usage(tmp_path)
    args = TrainArgs(target=target[0], data=target[1], out=str(tmp_path / "out"), draft_vocab=100,
                     response_len=8, batch=4, max_steps=1, progress=False, features="offline")
    room = trainer.output_bytes(load_target(target[0]).config, 100) + 1000  # enough for all but the store
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=room))
    with pytest.raises(Eagle3Error, match="not enough free space for --out"):
        train_draft(args)
    assert chunks(tmp_path / "out") == []


def test_a_damaged_checkpoint_is_a_one_line_error_on_resume(target, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"not a checkpoint")
    p = cli(["train-draft", "--target", target[0], "--data", target[1], "--out", str(out), "--quiet",
             "--draft-vocab", "100", "--response-len", "8", "--batch", "4", "--max-steps", "1", "--resume"])
    one_line_error(p, "cannot read the checkpoint")
    assert (out / "checkpoint.pt").read_bytes() == b"not a checkpoint"
