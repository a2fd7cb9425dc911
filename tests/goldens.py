"""Golden outputs: what the row-invariant kernels must compute, bit for bit, on every machine.

`record(target)` runs a target through its exact kernels only (no prompt forward on the stock
float kernels, whose bits depend on the machine's BLAS): the prompt as one 8-row forward, 12
greedy 1-row steps after it, a 3-token chain verify and a 5-node tree verify at the prompt's
end; it returns the greedy ids and a SHA-256 digest of every logit and tap row's float32 bits.
`tests/data/goldens.json` holds the records of seeded random checkpoints of each family in
each weight format and of the real default target; `tests/test_goldens.py` recomputes them
on every kernel path the CPU has. `recipes/goldens.py` rewrites the file: a change that moves
the bits on purpose regenerates it and says so in its commit.

The checkpoints' weights are drawn here as float64 uniforms from torch's CPU generator
(integer bits only: no vectorized normal or transcendental whose bits could depend on the
CPU), so they are the same on every machine and under any transformers version.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

import torch

GOLDENS = Path(__file__).parent / "data" / "goldens.json"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")  # conftest VARIANTS
FORMATS = ("fp32", "bf16", "int8", "int4")
PROMPT = [5, 17, 3, 99, 42, 8, 120, 64]
STEPS = 12
MAX_LEN = 48


def checkpoint(name: str, path: str) -> str:
    """A seeded random checkpoint of family `name` at `path` (conftest's config for it)."""
    from conftest import make_hf_model

    model = make_hf_model(name, seed=0)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            u = torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1  # uniform in [-1, 1)
            if p.dim() == 1:  # norms near their identity (w or 1 + w), biases small
                base = 0.0 if "gemma" in name or "bias" in n else 1.0
                p.copy_((base + 0.2 * u).float())
            else:
                p.copy_((u * (3.0 / p.shape[-1]) ** 0.5 * 2).float())  # ~2x unit variance per row
    model.save_pretrained(path)
    return path


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


@torch.no_grad()
def record(t) -> dict:
    """Greedy ids and the digests of the prompt rows (logits and taps), the greedy steps, a
    chain verify and a tree verify, all through `t`'s exact kernels."""
    assert t.exact, "goldens are for the row-invariant kernels"
    n = len(PROMPT)
    prompt = torch.tensor([PROMPT])
    cache = t.new_cache(1, MAX_LEN)
    logits, taps = t(prompt, torch.arange(n), cache, kv_len=n)
    out = {"prompt": digest(logits, taps)}
    ids, rows = [], []
    last = logits[0, -1]
    for i in range(STEPS):
        ids.append(int(last.argmax()))
        step, _ = t(torch.tensor([[ids[-1]]]), torch.tensor([n + i]), cache, kv_len=n + i + 1)
        last = step[0, 0]
        rows.append(last)
    out["ids"], out["steps"] = ids, digest(torch.stack(rows))
    for kind in ("chain", "tree"):
        c = t.new_cache(1, MAX_LEN)
        t(prompt, torch.arange(n), c, kv_len=n)
        if kind == "chain":
            v, vt = t(torch.tensor([[ids[0], 7, 11]]), torch.arange(n, n + 3), c, kv_len=n + 3)
        else:  # root -> a, root -> b, a -> c, c -> d: nodes at depths 0, 1, 1, 2, 3
            parents, depth = [-1, 0, 0, 1, 3], [0, 1, 1, 2, 3]
            mask = torch.zeros(5, n + 5, dtype=torch.bool)
            mask[:, :n] = True
            for j in range(5):
                a = j
                while a >= 0:
                    mask[j, n + a] = True
                    a = parents[a]
            v, vt = t(torch.tensor([[ids[0], 7, 11, 13, 2]]), torch.arange(n, n + 5), c, kv_len=n + 5,
                      attn_mask=mask, rope_pos=torch.tensor(depth) + n)
        out[kind] = digest(v, vt)
    return out


def cases(root: Path) -> dict[str, tuple[str, str]]:
    """{case name: (checkpoint dir, weight format)} for the random families, written under root."""
    out = {}
    for name in FAMILIES:
        path = checkpoint(name, str(root / name))
        for fmt in FORMATS:
            out[f"{name}-{fmt}"] = (path, fmt)
    return out


def load(path: str, fmt: str):
    import eagle3

    t = eagle3.load(path, "none", quantize=fmt, max_seq_len=MAX_LEN, calibrate=False).target
    t.tap_layers = (1, 2, 3)
    return t


def read() -> dict:
    return json.loads(GOLDENS.read_text())
