"""Write tests/data/goldens.json: the bits the row-invariant kernels must reproduce everywhere.

    .venv/bin/python recipes/goldens.py            # record, check every kernel path, write
    .venv/bin/python recipes/goldens.py --check    # compare with the file, write nothing

Records (`tests/goldens.py`: greedy ids and digests of the logits and taps of a prompt, greedy
steps, a chain and a tree verify, exact kernels only) for seeded random checkpoints of each
family in each weight format and for the real default target, on every kernel path this CPU
runs, each under PyTorch's own CPU dispatch levels AVX2 and AVX-512 (ATEN_CPU_CAPABILITY: the
RoPE tables and Gemma's GeGLU, which eagle3 leaves to PyTorch, must not move the bits either).
Every combination must agree before anything is written. A change that moves the bits on purpose reruns this
and says so in its commit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def records() -> dict:
    """{'random': {case: {path: record}}, 'default': {path: record}} in this process."""
    import eagle3
    import goldens
    from eagle3.kernels import isa_paths, use_isa

    out: dict = {"random": {}, "default": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for case, (path, fmt) in goldens.cases(Path(tmp)).items():
            t = goldens.load(path, fmt)
            out["random"][case] = {}
            for isa in isa_paths():
                with use_isa(isa):
                    out["random"][case][isa] = goldens.record(t)
    t = eagle3.load("default", "none", max_seq_len=goldens.MAX_LEN, calibrate=False).target
    for isa in isa_paths():
        with use_isa(isa):
            out["default"][isa] = goldens.record(t)
    return out


def agreed(runs: dict[str, dict]) -> dict:
    """The one record of each case that every (capability, path) run gave; exits on a split."""
    first = next(iter(runs.values()))
    result: dict = {"random": {}, "default": None}
    for case in first["random"]:
        seen = {json.dumps(r["random"][case][isa], sort_keys=True): (cap, isa)
                for cap, r in runs.items() for isa in r["random"][case]}
        if len(seen) != 1:
            sys.exit(f"{case}: the kernel paths / capabilities disagree: {sorted(seen.values())}")
        result["random"][case] = json.loads(next(iter(seen)))
    seen = {json.dumps(r["default"][isa], sort_keys=True): (cap, isa) for cap, r in runs.items()
            for isa in r["default"]}
    if len(seen) != 1:
        sys.exit(f"default: the kernel paths / capabilities disagree: {sorted(seen.values())}")
    result["default"] = json.loads(next(iter(seen)))
    return result


def main() -> None:
    if os.environ.get("EAGLE3_GOLDENS_CHILD"):
        print(json.dumps(records()))
        return
    import torch

    import goldens
    from eagle3.kernels import cpu_name

    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    # Not "default": PyTorch's unvectorized level computes GeGLU's tanh with the system's own
    # tanh, which gives Gemma other bits than its AVX2 and AVX-512 levels (which agree); every
    # x86-64 CPU these kernels target has AVX2, and PyTorch then runs one of those two.
    caps = [c for c, f in (("avx2", "avx2"), ("avx512", "avx512f")) if f in flags]
    runs = {}
    for cap in caps:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": cap, "EAGLE3_GOLDENS_CHILD": "1",
               "PYTHONWARNINGS": "ignore"}
        done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"capability {cap}: {done.stderr.strip().splitlines()[-1]}")
        runs[cap] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"ATEN_CPU_CAPABILITY={cap}: done", file=sys.stderr)
    result = agreed(runs)
    if "--check" in sys.argv:
        same = result == {k: goldens.read()[k] for k in ("random", "default")}
        print("goldens reproduced" if same else "goldens DIFFER from tests/data/goldens.json")
        sys.exit(0 if same else 1)
    paths = sorted(next(iter(runs[caps[0]]["random"].values())))
    result["written_on"] = {"cpu": cpu_name(), "torch": torch.__version__, "capabilities": caps,
                            "paths": paths}
    goldens.GOLDENS.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {goldens.GOLDENS.relative_to(ROOT)}: {len(result['random'])} random cases and the default")


if __name__ == "__main__":
    main()
