"""Each kernel path's speed on this CPU: the weight stream alone, and the default target's forward.

    .venv/bin/python recipes/kernel_paths.py [THREADS] > docs/bench/kernel-paths-<cpu>.json

For every instruction-set path the CPU runs (`kernels.isa_paths()`):
- `stream`: the SmolLM2-135M linear layers (30 x qkv 576->960, o 576->576, gate_up 576->3072,
  down 1536->576 in int4 = Q4_1, and the tied 576->49152 LM head in int8 = Q8_0; ~97 MB, more
  than the last-level cache), called back to back through the op for M = 1..24 rows: ms per
  pass, effective GB/s, and cost(M) / cost(1);
- `forward`: the default target (its GGUF codes) over T = 1..24 new tokens at position 64, eager,
  no taps: ms per forward and cost(T) / cost(1), which is the verify cost a K = T - 1 round pays.
Medians of 15 runs (3 for the scalar path) after warm-up, the paths interleaved run by run.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import eagle3
from eagle3.kernels import BLOCK, FMT_ID, QLinear, cpu_name, isa_paths, use_isa

ROWS = (1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 24)
RUNS = 15


def smollm2_layers() -> list[QLinear]:
    torch.manual_seed(0)
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30
    layers = [QLinear.quantize(torch.nn.Linear(k, n, bias=False), "int4") for k, n in shapes]
    return layers + [QLinear.quantize(torch.nn.Linear(576, 49152, bias=False), "int8")]


def stream_pass(layers: list[QLinear], xs: dict[int, torch.Tensor]) -> None:
    op = torch.ops.eagle3.wlinear
    for q in layers:
        op(xs[q.in_features], q.w, q.scale, q.offset, FMT_ID[q.fmt], BLOCK, q.out_features)


def read_bandwidth(nbytes: int, runs: int = 9) -> float:
    """GB/s of `torch.sum` over a float32 buffer of `nbytes` (a plain streaming read)."""
    buf = torch.ones(nbytes // 4)
    buf.sum()
    return round(nbytes / statistics.median(timed(buf.sum) for _ in range(runs)) / 1e9, 2)


def by_type(layers: list[QLinear], x: dict[int, torch.Tensor]) -> dict:
    """GB/s of each layer type's layers called back to back at M = 1 (medians of RUNS)."""
    names = ("qkv", "o", "gate_up", "down")
    groups = {n: layers[i:-1:4] for i, n in enumerate(names)} | {"lm_head": layers[-1:]}
    out = {}
    for name, group in groups.items():
        nbytes = sum(q.nbytes for q in group)
        stream_pass(group, x)
        ms = statistics.median(timed(lambda: stream_pass(group, x)) for _ in range(RUNS)) * 1e3  # noqa: B023
        out[name] = {"bytes": nbytes, "ms": round(ms, 3), "GB_per_s": round(nbytes / ms / 1e6, 2)}
    return out


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.no_grad()
def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.set_num_threads(threads)
    paths = isa_paths()
    layers = smollm2_layers()
    nbytes = sum(q.nbytes for q in layers)
    target = eagle3.load("default", "none", quantize="auto").target
    cache = target.new_cache(1, 128)
    target(torch.arange(1, 65)[None], torch.arange(64), cache, kv_len=64, with_taps=False, prefill=True)

    def forward(T: int) -> None:
        target(torch.arange(1, T + 1)[None], torch.arange(64, 64 + T), cache, kv_len=64 + T, with_taps=False)

    out: dict = {"cpu": cpu_name(), "threads": threads, "stream_bytes": nbytes, "paths": {}}
    samples = {(p, kind, m): [] for p in paths for kind in ("stream", "forward") for m in ROWS}
    xs = {m: {k: torch.randn(m, k) for k in (576, 1536)} for m in ROWS}
    for p in paths:  # warm-up
        with use_isa(p):
            for m in ROWS:
                for _ in range(3 if p != "scalar" else 1):
                    stream_pass(layers, xs[m])
                    forward(m)
    for r in range(RUNS):
        for p in paths:
            if p == "scalar" and r >= 3:  # ~10x slower: three runs tell its cost
                continue
            with use_isa(p):
                for m in ROWS:
                    samples[(p, "stream", m)].append(timed(lambda: stream_pass(layers, xs[m])))  # noqa: B023
                    samples[(p, "forward", m)].append(timed(lambda: forward(m)))  # noqa: B023
    for p in paths:
        row: dict = {}
        for kind in ("stream", "forward"):
            ms = {m: statistics.median(samples[(p, kind, m)]) * 1e3 for m in ROWS}
            row[kind] = {"ms": {str(m): round(v, 3) for m, v in ms.items()},
                         "cost_ratio": {str(m): round(v / ms[1], 3) for m, v in ms.items()}}
            if kind == "stream":
                row[kind]["GB_per_s_at_1"] = round(nbytes / ms[1] / 1e6, 2)
        out["paths"][p] = row
    out["read_GB_per_s"] = {"96MB": read_bandwidth(96 << 20), "400MB": read_bandwidth(400 << 20)}
    with use_isa(paths[0]):
        out["by_type"] = {"path": paths[0], **by_type(layers, xs[1])}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
