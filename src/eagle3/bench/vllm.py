"""vLLM rows for `eagle3 bench --peers vllm`: vLLM's CPU build, plain and EAGLE-3 with our head.

vLLM lives in a virtual environment of its own (recipes/vllm/setup.sh writes build/vllm/venv;
$EAGLE3_VLLM names another directory holding such a `venv`). Each arm is a long-lived worker
process (`vllm_worker.py`, run by that environment's Python) holding one engine, so its start
(about a minute on 2 cores) is paid once and its requests interleave with ours, prompt by
prompt. Prompts go in as token ids and tokens come back, so `outputs_identical` compares
tokens as everywhere else. vLLM reads HF checkpoints: a GGUF target is dequantized once by
transformers' own GGUF loader (the oracle) into build/vllm/inputs/, and the head converted
to the speculators format vLLM loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from ..errors import Eagle3Error, brief
from ..files import atomic_dir
from .harness import Arm, Sample

SETUP_HINT = "run recipes/vllm/setup.sh first (docs/weight-formats.md, vLLM's CPU build)"
START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0
# After each read vLLM's shared-memory readers spin (sched_yield) for 1 s and its OpenMP threads
# for their block time, on the cores the next arm needs: each vLLM request waits this long
# after its reply (untimed) so that the next arm runs on idle cores.
SETTLE_S = 1.2


def root() -> Path:
    """The vLLM directory: $EAGLE3_VLLM, else build/vllm of this checkout."""
    env = os.environ.get("EAGLE3_VLLM")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "build" / "vllm"


def python() -> Path | None:
    """vLLM's Python interpreter, or None when its environment is absent."""
    path = root() / "venv" / "bin" / "python"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing() -> str | None:
    """Why the vLLM rows cannot run here, or None."""
    return None if python() is not None else f"vLLM's CPU build is not in {root()}/venv: {SETUP_HINT}"


def _key(*paths: str) -> str:
    """A cache key for inputs made from these files or directories (path, size, mtime)."""
    parts = []
    for p in paths:
        files = [p] if os.path.isfile(p) else sorted(str(f) for f in Path(p).rglob("*") if f.is_file())
        parts += [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def target_checkpoint(target: str, tokenizer_dir: str | None) -> str:
    """An HF checkpoint directory vLLM loads for `target`: a checkpoint as it is; a GGUF file
    dequantized (fp32) by transformers' GGUF loader, with the tokenizer eagle3 uses, cached."""
    from ..targets import target_path

    path, gguf = target_path(target)
    if gguf is None:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise Eagle3Error(f"--target {target}: vLLM needs a checkpoint directory or a GGUF file")
        return path
    out = root() / "inputs" / f"target-{_key(gguf)}"
    if (out / "config.json").is_file():
        return str(out)
    import torch
    from safetensors.torch import save_file

    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf),
                                                     gguf_file=os.path.basename(gguf),
                                                     torch_dtype=torch.float32)
    except ImportError as e:
        raise Eagle3Error(f"vLLM reads HF checkpoints, and converting {gguf} needs transformers "
                          f"and gguf ({brief(e)}): pip install 'eagle3[hf]' gguf") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp:
        # save_pretrained refuses a model loaded from GGUF: the tensors and a plain config
        tied = model.config.tie_word_embeddings
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(model).__name__]
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        for name in os.listdir(tokenizer_dir or ""):
            shutil.copy(os.path.join(tokenizer_dir, name), tmp)
    return str(out)


def head_checkpoint(head: str) -> str:
    """`head` in the speculators format vLLM loads (converted once, cached)."""
    from ..draft import convert_head

    out = root() / "inputs" / f"head-{_key(head)}"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_dir(out) as tmp:
            convert_head(head, tmp, "speculators")
    return str(out)


class Worker:
    """One vLLM engine in its own process (vllm_worker.py): `generate(ids)` -> its reply."""

    def __init__(self, name: str, config: dict) -> None:
        self.name = name
        self.speculates = bool(config.get("head"))
        self.log = tempfile.NamedTemporaryFile("w+", prefix="eagle3-vllm-", suffix=".log", delete=False)
        worker = Path(__file__).with_name("vllm_worker.py")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        libiomp = root() / "venv" / "lib" / "libiomp5.so"  # vLLM's CPU build wants Intel OpenMP
        if libiomp.is_file():
            env["LD_PRELOAD"] = str(libiomp)
        # A session of its own: vLLM's engine and CPU workers are its children, stopped as a group.
        # -I: the worker's own directory (which holds this module, vllm.py) stays off sys.path
        self.proc = subprocess.Popen([str(python()), "-I", str(worker), json.dumps(config)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, bufsize=1, start_new_session=True)
        self.load_seconds = float(self._reply(START_TIMEOUT_S, "start").get("load_seconds", 0.0))

    def _reply(self, timeout: float, what: str) -> dict:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        try:
            reply = json.loads(line) if line else None
        except json.JSONDecodeError:
            reply = None
        if not isinstance(reply, dict) or "error" in reply:
            why = (f"no answer within {timeout:.0f} s" if not ready else
                   reply["error"] if isinstance(reply, dict) else self._last_log_line())
            self.close()
            raise Eagle3Error(f"vLLM ({self.name}) failed to {what}: {why} (its log: {self.log.name})")
        return reply

    def _last_log_line(self) -> str:
        """The log's most telling line: its last error that is not a generic wrapper."""
        self.log.flush()
        lines = [ln.strip() for ln in Path(self.log.name).read_text(errors="replace").splitlines()
                 if ln.strip()]
        errors = [ln for ln in lines if "rror" in ln and "See root cause" not in ln]
        return ((errors or lines or ["(no output)"])[-1])[:240]

    def generate(self, ids: list[int]) -> dict:
        if self.proc.poll() is not None:
            raise Eagle3Error(f"vLLM ({self.name}) has exited: {self._last_log_line()} "
                              f"(its log: {self.log.name})")
        try:
            self.proc.stdin.write(json.dumps({"ids": ids}) + "\n")
            self.proc.stdin.flush()
        except OSError:
            self.close()
            raise Eagle3Error(f"vLLM ({self.name}) has exited: {self._last_log_line()} "
                              f"(its log: {self.log.name})") from None
        reply = self._reply(REQUEST_TIMEOUT_S, "generate")
        time.sleep(SETTLE_S)
        return reply

    def close(self) -> None:
        """Stop the engine (its whole process group); the log goes unless it ended in failure."""
        clean = False
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.close()
                clean = self.proc.wait(timeout=60) == 0
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.log.close()
        if clean:
            os.unlink(self.log.name)


def arm(worker: Worker) -> Arm:
    """An arm on `worker`; with a head, the Sample's stats carry vLLM's own speculation counts."""
    def run(ids: list[int]) -> Sample:
        r = worker.generate(ids)
        stats = None
        if worker.speculates:  # rounds = verify rounds, as ours: tau = 1 + accepted / drafts
            stats = {"peer_counts": True, "draft_tokens": r["draft_tokens"],
                     "accepted_tokens": r["accepted_tokens"], "rounds": r["drafts"]}
        return Sample(r["tokens"], float(r["seconds"]), stats)
    return run


def start(target: str, tokenizer_dir: str | None, head: str | None, k: int, max_tokens: int,
          stop_token_ids: list[int], threads: int, dtype: str = "float32") -> dict[str, Worker]:
    """The plain worker and, with `head`, the EAGLE-3 one (K = k), each started and warmed up."""
    from ..errors import notice

    config = {"target": target_checkpoint(target, tokenizer_dir), "dtype": dtype,
              "max_tokens": max_tokens, "stop_token_ids": stop_token_ids, "threads": threads}
    names = [("vllm plain", None)] + ([(f"vllm eagle3 K={k}", head_checkpoint(head))] if head else [])
    workers: dict[str, Worker] = {}
    try:
        for name, head_dir in names:
            notice(f"starting {name} (its engine compiles once: about a minute on 2 cores)")
            workers[name] = Worker(name, {**config, "head": head_dir, "k": k})
    except Eagle3Error:
        close(workers)
        raise
    except Exception as e:  # e.g. the interpreter cannot be run: no engine may outlive the bench
        close(workers)
        raise Eagle3Error(f"cannot start vLLM: {brief(e)}") from None
    return workers


def start_for(args, spec, ks: list[int], notes: list[str]) -> dict[str, Worker]:
    """`eagle3 bench`'s vLLM workers for its target, head and K (its first, else 3); none, with a
    note saying why, when they cannot run."""
    import torch

    why = missing()
    if why is None and spec.tokenizer is None:
        why = "the target has no tokenizer (vLLM loads one with the model)"
    if why is not None:
        notes.append(f"skipping vllm: {why}")
        return {}
    head = None
    if spec.draft is not None:
        from ..targets.default import default_head_dir

        head = args.draft or default_head_dir()
    k = ks[0] if len(ks) == 1 else 3
    return start(args.target, os.path.dirname(spec.tokenizer.path), head, k, args.max_new_tokens,
                 list(spec.target.config.eos_token_ids), torch.get_num_threads(), args.vllm_dtype)


def close(workers: dict[str, Worker]) -> None:
    for w in workers.values():
        w.close()
