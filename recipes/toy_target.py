"""Recipe: the toy code model (test fixture, models/toy/target), a small Llama trained on Python source.

    python recipes/toy_target.py --out models/toy/target --minutes 40

Steps (each cached under --work, so a rerun or an interrupted run resumes):
1. corpus   the interpreter's standard library .py files (found with sysconfig,
            site-packages and test directories excluded), deduplicated by
            content, split by file: 1 in 20 files held out. The sorted file
            list's SHA-256 is recorded in the model card.
2. tokenizer byte-level BPE (vocab 4096, `<|endoftext|>` = id 0 between files),
            saved as tokenizer.json that PreTrainedTokenizerFast loads.
3. model    Llama, 8 layers x 256 wide (GQA 4/2 heads, tied embeddings,
            ~6.5M parameters): deep and narrow so an EAGLE-3 head step costs a
            fraction of a target forward. AdamW, warmup + cosine, grad clip 1.
            Checkpoints every --ckpt-every steps; held-out loss logged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

EOS = "<|endoftext|>"


def corpus_files() -> tuple[list[Path], list[Path], str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    seen, keep = set(), []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if "site-packages" in rel or any(p in ("test", "tests", "idle_test") for p in f.parts):
            continue
        data = f.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        keep.append(f)
    names = "\n".join(f.relative_to(root).as_posix() for f in keep)
    list_hash = hashlib.sha256(names.encode()).hexdigest()
    held = [f for f in keep if int(hashlib.md5(f.name.encode()).hexdigest(), 16) % 20 == 0]
    train = [f for f in keep if f not in set(held)]
    return train, held, list_hash


def read(f: Path) -> str:
    return f.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(f) for f in files), trainer)
    tok.save(str(out))
    return tok


def encode(tok, files: list[Path]) -> np.ndarray:
    ids: list[int] = []
    for f in files:
        ids.extend(tok.encode(read(f)).ids)
        ids.append(0)
    return np.array(ids, dtype=np.uint16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/toy/target")
    ap.add_argument("--work", default="out/default_target")
    ap.add_argument("--minutes", type=float, default=40.0, help="training time budget")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--planned-steps", type=int, default=1800, help="cosine schedule length")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import transformers as tf
    from tokenizers import Tokenizer

    torch.set_num_threads(args.threads)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    train_files, held_files, list_hash = corpus_files()
    tok_path = work / "tokenizer.json"
    if not tok_path.exists():
        print(f"training tokenizer on {len(train_files)} files", flush=True)
        train_tokenizer(train_files, 4096, tok_path)
    tok = Tokenizer.from_file(str(tok_path))
    if not (work / "train.npy").exists():
        np.save(work / "held.npy", encode(tok, held_files))
        np.save(work / "train.npy", encode(tok, train_files))
    train = np.load(work / "train.npy")
    held = np.load(work / "held.npy")
    print(f"corpus: {len(train_files)} train / {len(held_files)} held-out files, "
          f"{len(train)} / {len(held)} tokens, list sha256 {list_hash[:16]}", flush=True)

    cfg = tf.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=640, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step, log = 0, []
    ckpt = work / "ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, log = state["step"], state["log"]
        random.setstate(state["py_random"])
        print(f"resumed at step {step}", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    def lr_at(s: int) -> float:
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        frac = min(1.0, (s - args.warmup) / max(1, args.planned_steps - args.warmup))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def batch(data: np.ndarray, rng: random.Random, n: int) -> torch.Tensor:
        starts = [rng.randrange(0, len(data) - args.seq - 1) for _ in range(n)]
        return torch.from_numpy(np.stack([data[s:s + args.seq + 1] for s in starts]).astype(np.int64))

    @torch.no_grad()
    def held_loss() -> float:
        model.eval()
        rng = random.Random(1234)
        tot = 0.0
        for _ in range(6):
            b = batch(held, rng, 8)
            logits = model(input_ids=b[:, :-1]).logits
            tot += torch.nn.functional.cross_entropy(logits.reshape(-1, 4096), b[:, 1:].reshape(-1)).item()
        model.train()
        return tot / 6

    rng = random.Random(step + 1)
    t_start = time.time()
    model.train()
    tokens_seen = 0
    while step < args.max_steps and (time.time() - t_start) < args.minutes * 60:
        b = batch(train, rng, args.batch)
        logits = model(input_ids=b[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 4096), b[:, 1:].reshape(-1))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += b.numel()
        if step % 20 == 0:
            el = time.time() - t_start
            print(f"step {step} loss {loss.item():.3f} lr {lr_at(step):.2e} "
                  f"{tokens_seen / el:.0f} tok/s", flush=True)
        if step % args.ckpt_every == 0:
            hl = held_loss()
            log.append({"step": step, "train_loss": loss.item(), "held_out_loss": hl})
            print(f"step {step} held-out loss {hl:.3f}", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log,
                        "py_random": rng.getstate()}, str(ckpt) + ".tmp")
            os.replace(str(ckpt) + ".tmp", ckpt)

    hl = held_loss()
    log.append({"step": step, "train_loss": loss.item(), "held_out_loss": hl})
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log,
                "py_random": rng.getstate()}, ckpt)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out)
    hf_tok = tf.PreTrainedTokenizerFast(tokenizer_file=str(tok_path), eos_token=EOS, pad_token=EOS)
    hf_tok.save_pretrained(out)
    with open(out / "training.json", "w") as f:
        json.dump({"parameters": n_params, "steps": step, "tokens_per_step": args.batch * args.seq,
                   "train_files": len(train_files), "held_out_files": len(held_files),
                   "train_tokens": int(len(train)), "held_out_tokens": int(len(held)),
                   "file_list_sha256": list_hash, "python": sys.version.split()[0],
                   "final_held_out_loss": hl, "log": log}, f, indent=1)
    plot_losses(log, out.parent / "target-loss.png")
    print(f"saved {out} (held-out loss {hl:.3f})", flush=True)
    return 0


def plot_losses(log: list[dict], path: Path) -> None:
    """Train and held-out loss per step, as PNG (the model card's curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["train_loss"] for r in log], label="train (batch)")
    ax.plot(steps, [r["held_out_loss"] for r in log], label="held-out files")
    ax.set_xlabel(f"step ({log[0].get('tokens_per_step', 2048) if log else 2048} tokens/step)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("default target: training curve")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
