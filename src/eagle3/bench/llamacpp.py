"""llama.cpp rows for `eagle3 bench --peers llama.cpp` (built by `make llama.cpp`).

Each arm runs one llama.cpp tool per prompt on the same GGUF file: `llama-completion` for
plain greedy decoding, `llama-speculative-simple --spec-type draft-eagle3` with our head
converted by llama.cpp's own converter (`eagle3.draft.llamacpp.head_to_gguf`). Prompts go in as
text (our tokenizer's decoding of the prompt ids; llama.cpp parses the special tokens of
a chat template itself) and the generated text comes back through our tokenizer, so
`outputs_identical` compares tokens as everywhere else. Seconds are llama.cpp's own
prompt + decode timings (model loading excluded), as ours exclude loading. `cost_ratios`
reads `llama-bench`'s prompt-processing speed at M tokens against its 1-token decode.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from typing import Any

from ..draft.llamacpp import BUILD_HINT, binary
from ..errors import Eagle3Error
from .harness import Arm, Sample

TOOLS = ("llama-completion", "llama-speculative-simple", "llama-bench")


def missing() -> str | None:
    """Why the llama.cpp rows cannot run here, or None."""
    absent = [t for t in TOOLS if binary(t) is None]
    return f"llama.cpp tools missing ({', '.join(absent)}): {BUILD_HINT}" if absent else None


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    run = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if run.returncode != 0:
        last = [ln for ln in run.stderr.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise Eagle3Error(f"llama.cpp {what} failed: {last[0][:200]}")
    return run


def _number(pattern: str, text: str) -> float:
    """The number `pattern`'s group captures in llama.cpp's log, or a one-line error."""
    m = re.search(pattern, text)
    if m is None:
        raise Eagle3Error(f"llama.cpp's output has no line matching {pattern!r}; "
                          "rebuild it with scripts/build_llama_cpp.sh")
    return float(m.group(1))


def completion_arm(gguf: str, max_new_tokens: int, threads: int, decode: Callable[[list[int]], str],
                   encode: Callable[[str], list[int]]) -> Arm:
    """Plain greedy decoding with `llama-completion`."""
    tool = str(binary("llama-completion"))

    def run(ids: list[int]) -> Sample:
        cmd = [tool, "-m", gguf, "-p", decode(ids), "-n", str(max_new_tokens), "--temp", "0",
               "-t", str(threads), "-no-cnv", "--no-display-prompt", "-c", "4096", "--no-warmup"]
        out = _run(cmd, "llama-completion")
        prompt_ms = _number(r"prompt eval time =\s+([\d.]+) ms", out.stderr)
        eval_ms = _number(r"\beval time =\s+([\d.]+) ms", out.stderr.split("prompt eval time")[-1])
        return Sample(encode(out.stdout), (prompt_ms + eval_ms) / 1e3)
    return run


def eagle3_arm(gguf: str, head_gguf: str, max_new_tokens: int, k: int, threads: int,
               decode: Callable[[list[int]], str], encode: Callable[[str], list[int]]) -> Arm:
    """llama.cpp's EAGLE-3 (`llama-speculative-simple`, up to k drafts per round); the Sample's
    stats carry its drafted / accepted counts and tau = tokens / target rounds."""
    tool = str(binary("llama-speculative-simple"))

    def run(ids: list[int]) -> Sample:
        prompt = decode(ids)
        cmd = [tool, "-m", gguf, "-md", head_gguf, "--spec-type", "draft-eagle3", "-p", prompt,
               "-n", str(max_new_tokens), "--temp", "0", "-t", str(threads),
               "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "-c", "4096"]
        out = _run(cmd, "llama-speculative-simple")
        log = out.stderr
        enc = _number(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log)
        dec = _number(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", log)
        n_predict, drafted, accepted = (int(_number(rf"{key}\s*=\s*(\d+)", log))
                                        for key in ("n_predict", "n_drafted", "n_accept"))
        text = out.stdout
        # the tool echoes the prompt before the generated text
        i = text.find(prompt)
        text = text[i + len(prompt):] if i >= 0 else text
        rounds = max(n_predict - accepted, 1)
        stats = {"peer_counts": True, "draft_tokens": drafted, "accepted_tokens": accepted,
                 "rounds": rounds, "mean_accept_len": n_predict / rounds}
        return Sample(encode(text.strip("\n")), enc + dec, stats)
    return run


def cost_ratios(gguf: str, threads: int, ms: tuple[int, ...] = (2, 4, 8)) -> dict[str, Any]:
    """cost(M)/cost(1) of llama.cpp's forward: `llama-bench` pp M (M tokens in one batch)
    against tg (one token at a time), same run; plus its plain tokens/s."""
    tool = str(binary("llama-bench"))
    cmd = [tool, "-m", gguf, "-t", str(threads), "-p", ",".join(map(str, ms)), "-n", "32",
           "-r", "3", "-o", "json"]
    rows = json.loads(_run(cmd, "llama-bench").stdout)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    ratios = {f"cost_{r['n_prompt']}_over_1": (r["n_prompt"] / r["avg_ts"]) * tg
              for r in rows if r["n_prompt"] > 0}
    return {"llama_bench_tg_tokens_per_s": tg, **ratios}


def read_saved_logits(path: str) -> dict[str, Any]:
    """A `llama-perplexity --kl-divergence-base FILE` file: {"n_ctx", "n_vocab", "tokens"
    (n_chunk x n_ctx token ids as llama.cpp tokenized the text), "first" (the first position
    of a chunk whose distribution is saved), "log_probs" (n_chunk, n_ctx - 1 - first, n_vocab)
    float32 log-probabilities, "floor" (n_chunk, n_ctx - 1 - first): the value stored for every
    token more than 16 nats below the top one)}. llama.cpp keeps each position's log-probs in
    16 bits over the top 16 nats (resolution 16 / 65535)."""
    import numpy as np

    with open(path, "rb") as f:
        raw = f.read()
    if raw[:8] != b"_logits_":
        raise Eagle3Error(f"{path} is not a llama-perplexity logits file (no _logits_ magic)")
    n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(raw, np.int32, 3, 8))
    at = 20
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, at).reshape(n_chunk, n_ctx)
    at += 4 * n_chunk * n_ctx
    first = n_ctx // 2
    n_pos, nv = n_ctx - 1 - first, 2 * ((n_vocab + 1) // 2) + 4
    want = at + 2 * n_chunk * n_pos * nv
    if len(raw) != want:
        raise Eagle3Error(f"{path} holds {len(raw)} bytes, {want} expected for {n_chunk} chunks of "
                          f"{n_ctx} tokens over {n_vocab}: truncated or another format")
    rec = np.frombuffer(raw, np.uint16, n_chunk * n_pos * nv, at).reshape(n_chunk, n_pos, nv)
    head = rec[..., :4].copy().view(np.float32)  # (.., 2): scale, the floor's log-prob
    scale, floor = head[..., 0], head[..., 1]
    q = rec[..., 4:4 + n_vocab].astype(np.float32)
    log_probs = floor[..., None] + scale[..., None] * q
    return {"n_ctx": n_ctx, "n_vocab": n_vocab, "tokens": tokens, "first": first,
            "log_probs": log_probs, "floor": floor}


def arms_for(target: str, draft: str | None, spec: Any, max_new_tokens: int, ks: list[int],
             notes: list[str]) -> dict:
    """llama.cpp plain and EAGLE-3 (our head, converted by llama.cpp's converter) on the same
    GGUF file; none, with a note saying why, when they cannot run."""
    import os
    import tempfile

    import torch

    from ..draft.llamacpp import head_to_gguf
    from ..targets import target_path

    why = missing()
    if why is None:
        gguf = target_path(target)[1]
        if gguf is None:
            why = f"--target {target} is not a GGUF file (llama.cpp runs GGUF targets)"
        elif spec.tokenizer is None:
            why = "the target has no tokenizer (llama.cpp takes prompts as text)"
    if why is not None:
        notes.append(f"skipping llama.cpp: {why}")
        return {}
    threads = torch.get_num_threads()
    tok = spec.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    arms = {"llama.cpp plain": completion_arm(gguf, max_new_tokens, threads, decode, tok.encode)}
    if spec.draft is not None:
        head = draft
        if head is None:
            from ..targets.default import default_head_dir

            head = default_head_dir()
        head_gguf = os.path.join(tempfile.mkdtemp(prefix="eagle3-bench-"), "head.gguf")
        head_to_gguf(head, head_gguf, target)
        k = ks[0] if len(ks) == 1 else 3
        arms[f"llama.cpp eagle3 K={k}"] = eagle3_arm(gguf, head_gguf, max_new_tokens, k, threads,
                                                     decode, tok.encode)
    return arms
