"""eagle3's next-token distributions against llama.cpp's own on the same GGUF (issue 26, point 4).

    .venv/bin/python recipes/llamacpp_logits.py [N_CHUNKS] [N_CTX] > docs/bench/llamacpp-logits.json

llama.cpp's `llama-perplexity --kl-divergence-base FILE` (built by scripts/build_llama_cpp.sh)
reads a text in chunks of N_CTX tokens and saves, for the second half of each chunk, its
log-probabilities over the whole vocabulary (16 bits over the top 16 nats; lower ones stored
as that floor; `bench.llamacpp.read_saved_logits`). The text: the held-out ShareGPT prompts'
first turns. This recipe runs eagle3's target over the same tokens (each chunk from an empty
cache, in one call, the first token replaced by BOS where llama.cpp does that) and compares,
at every saved position, per eagle3 format and for transformers' GGUF loader (float32, the
oracle): KL(llama.cpp || other) over the tokens above llama.cpp's floor, the absolute
difference of the log-probability llama.cpp gives its top token, and top-1 agreement. The
same numbers between eagle3's formats and transformers say how far apart the references are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

import eagle3
from eagle3.bench.llamacpp import read_saved_logits
from eagle3.bench.prompts import prompt_set
from eagle3.draft.llamacpp import binary
from eagle3.targets.gguf import read_gguf
from eagle3.targets.named import default_target_dir
from eagle3.train.data import prompt_from_record


def saved_logits(gguf: str, text: str, n_ctx: int, n_chunks: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        txt, out = os.path.join(tmp, "text.txt"), os.path.join(tmp, "logits.bin")
        with open(txt, "w", encoding="utf-8") as f:
            f.write(text)
        cmd = [str(binary("llama-perplexity")), "-m", gguf, "-f", txt, "-c", str(n_ctx),
               "--chunks", str(n_chunks), "-t", "2", "-b", str(n_ctx), "--kl-divergence-base", out]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"llama-perplexity failed: {run.stderr.strip().splitlines()[-1:]}")
        return read_saved_logits(out)


def compare(ref: np.ndarray, floor: np.ndarray, other: np.ndarray) -> dict:
    """ref, other (P, V) log-probs; floor (P,): ref's floor. Over positions P."""
    above = ref > floor[:, None] + 1e-6
    p = np.exp(ref) * above
    kl = (p * (ref - other)).sum(-1) / p.sum(-1) + np.log(  # both renormalised over `above`
        (np.exp(other) * above).sum(-1) / p.sum(-1))
    top = ref.argmax(-1)
    rows = np.arange(len(top))
    d_top = np.abs(ref[rows, top] - other[rows, top])
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top_logprob_abs_diff_mean": float(d_top.mean()), "top_logprob_abs_diff_max": float(d_top.max()),
            "top1_agreement": float((other.argmax(-1) == top).mean())}


@torch.no_grad()
def eagle3_log_probs(quantize: str, chunks: np.ndarray, first: int) -> np.ndarray:
    t = eagle3.load("default", "none", quantize=quantize).target
    out = []
    for ids in chunks:
        n = len(ids)
        logits, _ = t(torch.tensor([ids.tolist()]), torch.arange(n), t.new_cache(1, n), kv_len=n)
        out.append(torch.log_softmax(logits[0, first:n - 1].double(), -1).numpy())
    return np.concatenate(out)


@torch.no_grad()
def transformers_log_probs(gguf: str, chunks: np.ndarray, first: int) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                             torch_dtype=torch.float32).eval()
    out = []
    for ids in chunks:
        logits = m(torch.tensor([ids.tolist()])).logits[0, first:len(ids) - 1]
        out.append(torch.log_softmax(logits.double(), -1).numpy())
    return np.concatenate(out)


def main() -> None:
    n_chunks = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    n_ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    torch.set_num_threads(2)
    spec = eagle3.load("default", "none")
    gguf = default_target_dir()
    tok = spec.tokenizer
    texts = [tok.decode(prompt_from_record(rec, tok, where))
             for where, rec in prompt_set("sharegpt-heldout", None)]
    saved = saved_logits(gguf, "\n\n".join(texts), n_ctx, n_chunks)
    first, chunks = saved["first"], saved["tokens"].copy()
    meta = read_gguf(gguf).metadata
    if meta.get("tokenizer.ggml.add_bos_token"):
        chunks[:, 0] = meta["tokenizer.ggml.bos_token_id"]
    ref = saved["log_probs"].reshape(-1, saved["n_vocab"]).astype(np.float64)
    floor = saved["floor"].reshape(-1).astype(np.float64)
    others = {f"eagle3 {q}": eagle3_log_probs(q, chunks, first) for q in ("gguf", "fp32")}
    others["transformers (GGUF loader, fp32)"] = transformers_log_probs(gguf, chunks, first)
    out = {"gguf": os.path.basename(gguf), "chunks": int(len(chunks)), "n_ctx": n_ctx,
           "positions": int(len(ref)), "reference": "llama.cpp llama-perplexity (batched prompt)",
           "against_llama_cpp": {k: compare(ref, floor, v) for k, v in others.items()}}
    tf = others["transformers (GGUF loader, fp32)"]
    tf_floor = tf.max(-1) - 16
    out["against_transformers"] = {k: compare(tf, tf_floor, v) for k, v in others.items()
                                   if not k.startswith("transformers")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
