"""llama.cpp, the peer: where its sources and binaries are, and heads converted for it.

`scripts/build_llama_cpp.sh` (`make llama.cpp`) unpacks llama.cpp from the
llama-cpp-python source distribution into build/llama.cpp and builds its tools into
build/llama.cpp/cmake/bin; `EAGLE3_LLAMA_CPP` names another such directory (tools in
its cmake/bin or bin). Heads are converted
by llama.cpp's own `convert_hf_to_gguf.py` (with its vendored gguf-py), so what llama.cpp
loads is exactly what its authors write.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import Eagle3Error

BUILD_HINT = "run `make llama.cpp` (scripts/build_llama_cpp.sh) first"


def root() -> Path:
    """The llama.cpp directory: $EAGLE3_LLAMA_CPP, else build/llama.cpp of this checkout."""
    env = os.environ.get("EAGLE3_LLAMA_CPP")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "build" / "llama.cpp"


def sources() -> Path | None:
    """llama.cpp's source tree (vendored in the unpacked sdist), or None."""
    found = sorted(glob.glob(str(root() / "llama_cpp_python-*" / "vendor" / "llama.cpp")))
    return Path(found[-1]) if found else None


def binary(name: str) -> Path | None:
    """A built llama.cpp tool (e.g. 'llama-bench'), or None."""
    for path in (root() / "cmake" / "bin" / name, root() / "bin" / name):
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def _target_dir(target: str, out: str) -> str:
    """An HF-style directory (config.json + tokenizer) describing `target` for the converter."""
    from ..targets import target_path
    from ..targets.gguf import gguf_tokenizer_dir, read_gguf

    path, gguf_file = target_path(target)
    if gguf_file is None:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise Eagle3Error(f"--target {target}: not a checkpoint directory, .gguf file or model "
                              "name; pass the head's target")
        return path
    cfg = dict(read_gguf(gguf_file).config)
    cfg.setdefault("architectures", ["LlamaForCausalLM"])
    tok = gguf_tokenizer_dir(gguf_file)
    if tok is None:
        raise Eagle3Error(f"{gguf_file} has no vocabulary; llama.cpp heads carry the target's")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in os.listdir(tok):
        shutil.copy(os.path.join(tok, name), out)
    return out


def head_to_gguf(head: str, out: str, target: str, outtype: str = "f32") -> str:
    """Convert EAGLE-3 head directory `head` (any format) for target `target` into llama.cpp's
    GGUF at `out`, with llama.cpp's converter; written to a temporary file, then renamed."""
    from . import convert_head

    src = sources()
    if src is None or not (src / "convert_hf_to_gguf.py").is_file():
        raise Eagle3Error(f"llama.cpp's sources are not under {root()}; {BUILD_HINT}")
    if not out.endswith(".gguf"):
        raise Eagle3Error(f"the output of --to gguf is a file: name it *.gguf, got {out}")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise Eagle3Error(f"cannot write {out}: {parent} is not a writable directory")
    with tempfile.TemporaryDirectory(prefix="eagle3-gguf-") as tmp:
        official = os.path.join(tmp, "head")  # the converter reads the official layout
        convert_head(head, official, "official")
        tdir = _target_dir(target, os.path.join(tmp, "target"))
        part = os.path.join(parent, f".{os.path.basename(out)}.tmp{os.getpid()}")
        cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), official, "--target-model-dir",
               tdir, "--outfile", part, "--outtype", outtype]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            if os.path.exists(part):
                os.unlink(part)
            last = [ln for ln in run.stderr.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
            raise Eagle3Error(f"llama.cpp's converter failed on {head}: {last[0][:200]}")
        os.replace(part, out)
    return out
