"""`eagle3 bench --memory`: load time and peak resident memory of one generation, each side in a
fresh process, against the bytes that must be resident (weights + KV cache).

eagle3: a child Python process imports eagle3, loads the target and head
(`eagle3.load`, the weight format of the row), generates, and reports its own peak RSS
(VmHWM, Linux), the RSS after `import torch, eagle3` (the interpreter's share, which no
model choice changes), the load's wall time, and the bytes of its weights and caches.
It runs twice and the second run is reported: "warm" (file cache and compiled-kernel
cache filled). llama.cpp: `llama-completion` on the same GGUF under `/usr/bin/time`
(peak RSS) with its own "load time" line, also the second of two runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

from ..errors import Eagle3Error

CHILD = r"""
import json, sys, time
import torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
import eagle3

def peak_mb():  # this process image's high-water mark (getrusage's would include the parent's)
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024

base_mb = peak_mb()
t0 = time.perf_counter()
spec = eagle3.load(args["target"], args["draft"], quantize=args["quantize"], max_seq_len=args["max_seq_len"])
load_s = time.perf_counter() - t0
ids = spec.tokenizer.encode(args["prompt"]) if spec.tokenizer is not None else [1, 2, 3]
out = spec.generate(ids, args["max_new_tokens"])

def tensor_bytes(obj, depth=0):
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if depth > 2 or obj is None or isinstance(obj, (str, int, float, bool)):
        return 0
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
        vars(obj).values() if hasattr(obj, "__dict__") else ()
    return sum(tensor_bytes(x, depth + 1) for x in items)

from eagle3.kernels import weight_bytes
weights = weight_bytes(*(m for m in (spec.target, spec.draft) if isinstance(m, torch.nn.Module)))
backend = spec.runner
kv = tensor_bytes(backend.target_cache) + tensor_bytes(getattr(backend, "draft_cache", None))
costs = getattr(spec, "costs", None)  # the cost model eagle3.load measured (a part of load_s)
print(json.dumps({"load_s": load_s, "calibrate_s": costs.seconds if costs is not None else 0.0,
                  "peak_rss_mb": peak_mb(), "import_rss_mb": base_mb,
                  "weights_mb": weights / 2**20, "kv_cache_mb": kv / 2**20, "max_seq_len": spec.max_seq_len,
                  "weight_format": getattr(spec.target, "weight_format", None),
                  "generated": len(out.token_ids)}))
"""


def _ratios(row: dict[str, Any]) -> dict[str, Any]:
    need = row["weights_mb"] + row["kv_cache_mb"]
    row["resident_need_mb"] = need
    row["peak_over_need"] = row["peak_rss_mb"] / need if need else None
    if "import_rss_mb" in row and need:  # the model's own share: the peak minus what importing cost
        row["peak_over_need_without_import"] = (row["peak_rss_mb"] - row["import_rss_mb"]) / need
    return row


def eagle3_memory(target: str, draft: str | None, quantize: str | None, prompt: str, max_new_tokens: int,
                  threads: int, max_seq_len: int | None = None, runs: int = 2) -> dict[str, Any]:
    """Load time and peak RSS of one `eagle3.load` + `generate` in a fresh process (the last of
    `runs`), with the weights' and caches' bytes."""
    arg = json.dumps({"target": target, "draft": draft, "quantize": quantize, "prompt": prompt,
                      "max_new_tokens": max_new_tokens, "threads": threads, "max_seq_len": max_seq_len})
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    for _ in range(runs):
        run = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True, env=env)
        if run.returncode != 0:
            last = [ln for ln in run.stderr.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
            raise Eagle3Error(f"the memory probe failed: {last[0][:200]}")
    return _ratios(json.loads(run.stdout.strip().splitlines()[-1]))


def llamacpp_memory(tool: str, gguf: str, prompt: str, max_new_tokens: int, threads: int, ctx: int,
                    runs: int = 2) -> dict[str, Any]:
    """`llama-completion` on `gguf`: its peak RSS (/usr/bin/time) and its own load time, with the
    GGUF's size and the KV cache llama.cpp reports allocating."""
    timer = shutil.which("time") or "/usr/bin/time"
    if not os.path.exists(timer):
        raise Eagle3Error("--memory needs /usr/bin/time for llama.cpp's peak RSS (apt install time)")
    cmd = [timer, "-f", "MAXRSS_KB %M", tool, "-m", gguf, "-p", prompt, "-n", str(max_new_tokens),
           "--temp", "0", "-t", str(threads), "-no-cnv", "--no-display-prompt", "-c", str(ctx), "--no-warmup",
           "-v"]  # verbose: the KV cache's size line
    for _ in range(runs):
        run = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
        if run.returncode != 0:
            raise Eagle3Error(f"llama-completion failed under --memory (exit {run.returncode})")
    log = run.stderr
    rss = re.search(r"MAXRSS_KB (\d+)", log)
    load = re.search(r"load time =\s+([\d.]+) ms", log)
    kv = re.findall(r"llama_kv_cache: size =\s+([\d.]+) MiB", log)
    if rss is None or load is None or not kv:
        raise Eagle3Error("llama.cpp's log has no load time or KV cache size, or the timer no peak RSS; "
                          "rebuild llama.cpp (scripts/build_llama_cpp.sh)")
    return _ratios({"load_s": float(load.group(1)) / 1e3, "peak_rss_mb": int(rss.group(1)) / 1024,
                    "weights_mb": os.path.getsize(gguf) / 2**20,
                    "kv_cache_mb": float(kv[-1]), "max_seq_len": ctx})


def memory_rows(target: str, draft: str | None, spec: Any, formats: list, prompt_ids: list[int],
                max_new_tokens: int, with_llama_cpp: bool) -> dict:
    """`--memory`: one fresh-process measurement per weight format, and llama.cpp's ."""
    import torch

    from ..draft.llamacpp import binary
    from ..targets import target_path
    from . import llamacpp as lc

    threads = torch.get_num_threads()
    text = spec.tokenizer.decode(prompt_ids, skip_special_tokens=False) if spec.tokenizer else ""
    draft = None if draft in (None, "default") else draft
    rows = {}
    for fmt in formats:  # named by the format the load resolved ("auto" -> gguf or float32)
        row = eagle3_memory(target, draft, fmt, text, max_new_tokens, threads,
                            max_seq_len=spec.max_seq_len)
        rows[f"eagle3 {row['weight_format'] or 'stock'}"] = row
    gguf = target_path(target)[1]
    if with_llama_cpp and gguf is not None and lc.missing() is None:
        rows["llama.cpp"] = llamacpp_memory(str(binary("llama-completion")), gguf, text, max_new_tokens,
                                            threads, spec.max_seq_len)
    return rows


def markdown_memory(rows: dict[str, dict[str, Any]]) -> str:
    """The --memory table."""
    lines = ["| engine | load s (warm) | of which calibration s | peak RSS MiB | weights MiB | KV MiB | "
             "peak / (weights + KV) | after import MiB |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        imp = f"{r['import_rss_mb']:.0f}" if "import_rss_mb" in r else "-"
        cal = f"{r['calibrate_s']:.2f}" if "calibrate_s" in r else "-"
        lines.append(f"| {name} | {r['load_s']:.2f} | {cal} | {r['peak_rss_mb']:.0f} | "
                     f"{r['weights_mb']:.0f} | {r['kv_cache_mb']:.0f} | {r['peak_over_need']:.2f}x | {imp} |")
    return "\n".join(lines)
