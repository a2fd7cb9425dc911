"""A target whose attention matters, and heads scripted to agree with it (real `Eagle3Draft`s).

`save_context_target` saves a random model with every projection real and nonzero whose
greedy runs are long and varied and depend on the context, so a wrong K/V row, mask, RoPE
position, rollback or tree compaction changes the tokens it produces (tests/test_punish.py
plants such bugs and sees them caught).

`scripted_head` builds a head that drafts that target's greedy continuation of given prompts,
right or wrong where asked:
    full    -> every draft accepted (accepted length == K each round)
    partial -> first draft accepted, the rest rejected (accepted length 1)
    zero    -> first draft rejected (accepted length 0)
    second  -> every first draft's runner-up is right, its top choice wrong: a tree
               accepts one token per round through a second child (tree tests)
    mixed   -> first draft accepted, each later one right only after an even token:
               accepted lengths vary from round to round
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3.draft import Eagle3Draft
from eagle3.draft.model import DraftConfig


@torch.no_grad()
def random_head(target: Any, *, draft_vocab_size: int | None = None, seed: int = 0,
                scale: float = 0.05, taps: tuple[int, ...] | None = None) -> Eagle3Draft:
    """A seeded random head for `target` (a `TapTarget`); reduced vocab when draft_vocab_size < V."""
    tcfg = target.config
    H = tcfg.hidden_size
    heads = max(1, H // 32)
    V = tcfg.vocab_size
    dv = draft_vocab_size or V
    cfg = DraftConfig(hidden_size=H, intermediate_size=2 * H, num_attention_heads=heads,
                      num_key_value_heads=heads, head_dim=H // heads, vocab_size=V,
                      draft_vocab_size=dv, target_hidden_size=H, taps=taps)
    g = torch.Generator().manual_seed(seed)
    head = Eagle3Draft(cfg, max_len=tcfg.max_seq_len, with_embedding=False)
    for p in head.parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    if dv < V:
        used = torch.sort(torch.randperm(V, generator=g)[:dv]).values
        head.d2t.copy_(used - torch.arange(dv))
        head.t2d.zero_()
        head.t2d[used] = True
    return head.eval()


# -- a target whose attention matters, and heads scripted along its greedy runs ---------------------

# How much of each layer's attention and MLP output the context target keeps, per family: enough
# that context changes about one greedy token in six (so a wrong K/V row, mask, RoPE position or
# rollback changes the output), little enough that the runs stay varied rather than looping.
CONTEXT_EPS = {"llama": 0.04, "qwen2": 0.04, "gemma2": 0.3}


def save_context_target(path: str, name: str = "llama", eps: float | None = None, seed: int = 2,
                        **overrides) -> str:
    """Save a random `name` model at `path` whose attention and MLP are real (every projection
    random and nonzero) and matter: `lm_head` sends each token's embedding direction to the next
    token on one cycle through the vocabulary (so greedy runs are long and varied, margins wide),
    and the layers' outputs, scaled by `eps`, bend that path wherever the context says so.
    Returns `path`."""
    from conftest import make_hf_model

    m = make_hf_model(name, seed=seed, **{"tie_word_embeddings": False, "hidden_size": 128,
                                          "num_attention_heads": 4, "head_dim": 32, **overrides})
    V = m.config.vocab_size
    order = torch.randperm(V, generator=torch.Generator().manual_seed(seed + 5))
    nxt = torch.empty(V, dtype=torch.long)
    nxt[order] = order.roll(-1)  # one cycle through all V tokens
    with torch.no_grad():
        E = m.get_input_embeddings().weight
        m.lm_head.weight.copy_((E / E.norm(dim=-1, keepdim=True).clamp_min(1e-6))[torch.argsort(nxt)])
        e = CONTEXT_EPS.get(name, 0.3 if "gemma" in name else 0.04) if eps is None else eps
        for n, p in m.named_parameters():
            if n.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")) \
                    and "gemma" in name:  # Gemma normalises each output before adding it: (1 + w) * e
                p.copy_((1 + p) * e - 1)
            elif n.endswith(("o_proj.weight", "down_proj.weight")) and "gemma" not in name:
                p.mul_(e)
    m.save_pretrained(path)
    return path


def random_prompts(n: int, seed: int, vocab: int = 160, low: int = 2, high: int = 16) -> list[list[int]]:
    """n seeded prompts of low..high-1 tokens drawn from 1..vocab-1."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@torch.no_grad()
def greedy_runs(target, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """Each prompt followed by `n_new` greedy tokens (fewer where the target's `max_seq_len` ends
    it), recomputed from scratch for every token (a fresh cache per forward: no rollback, no
    speculation, nothing the tests check)."""
    runs = []
    for p in prompts:
        seq = list(p)
        for _ in range(min(n_new, target.config.max_seq_len - len(p))):
            logits, _ = target.forward_logits_taps(torch.tensor([seq]), torch.arange(len(seq)),
                                                   target.new_cache(), last_only=True, with_taps=False)
            seq.append(int(logits[0, -1].argmax()))
        runs.append(seq)
    return runs


@torch.no_grad()
def scripted_head(target, prompts: list[list[int]], n_new: int, mode: str = "full",
                  draft_vocab: list[int] | None = None, taps: tuple[int, int, int] = (1, 2, 3),
                  seed: int = 0, own_embedding: bool = True, hidden: int | None = None,
                  norm_before_residual: bool = True) -> Eagle3Draft:
    """A real `Eagle3Draft` that drafts `target`'s greedy continuation of `prompts` (up to
    `n_new` tokens each), right or wrong per `mode` (the modes of `forced_head`).

    It is a lookup along the runs, so the target may be any model, attention and all. Each
    slot t of a run holds a key: the target's taps there (a run's rows are distinct wherever
    the continuation differs), mapped by `fc` (a ridge inverse of the keys) near a code of its
    own. Bank A reads that code and writes token code + position code of x[t+2]; bank B reads a
    position code q and writes those of x[q+1]; `lm_head` reads token codes only. So the head's
    first draft in a round is right iff its key is, and each later one iff bank B's entry is.
    Off the runs (other prompts, beyond `n_new`) it drafts noise: rejections, never errors.
    Its width `hidden` defaults to 256 for up to 300 codes, else 512 (random codes stay nearly
    orthogonal; a narrower head keeps its step cheap next to the target's, as automatic K
    expects of a real head). A head sharing the target's embedding (`own_embedding=False`) is
    as wide as the target, which holds codes for a few short runs only. With
    `norm_before_residual=False` (the residual is the raw previous feature, which bank B
    cancels) lookup noise builds up: exact for short chains only.
    """
    assert mode in ("full", "partial", "zero", "second", "mixed")
    g = torch.Generator().manual_seed(seed)
    V, Ht = target.config.vocab_size, target.config.hidden_size
    runs = greedy_runs(target, prompts, n_new)
    keys, a_vals, b_keys, b_vals = [], [], [], []  # per key: tap rows; value (token, code index)
    code_of = {}  # (run, position) -> position code index
    for r, (p, seq) in enumerate(zip(prompts, runs)):
        for q in range(len(p) + 1, len(seq)):
            code_of[(r, q)] = len(code_of)
    n_codes = len(code_of)
    for r, (p, seq) in enumerate(zip(prompts, runs)):
        _, tp = target.forward_logits_taps(torch.tensor([seq]), torch.arange(len(seq)), target.new_cache(),
                                           taps=taps)
        for t in range(len(p) - 1, len(seq) - 2):
            keys.append(tp[0, t])
            a_vals.append((seq[t + 2], code_of[(r, t + 2)]))
        for q in range(len(p) + 1, len(seq) - 1):
            b_keys.append(code_of[(r, q)])
            b_vals.append((seq[q + 1], code_of[(r, q + 1)], seq[q]))
    vocab = torch.tensor(sorted(draft_vocab)) if draft_vocab is not None else torch.arange(V)
    dv = vocab.numel()
    nA, nB = len(keys), len(b_keys)
    H = (hidden or (256 if nA + n_codes <= 300 else 512)) if own_embedding else Ht
    cfg = DraftConfig(hidden_size=H, intermediate_size=max(1, nA + nB), num_attention_heads=2,
                      num_key_value_heads=2, head_dim=H // 2, vocab_size=V, draft_vocab_size=dv,
                      target_hidden_size=Ht, taps=taps, norm_before_residual=norm_before_residual)
    head = Eagle3Draft(cfg, max_len=target.config.max_seq_len, with_embedding=own_embedding)
    for p in head.parameters():
        p.zero_()
    for norm in (head.midlayer.input_layernorm, head.midlayer.hidden_norm,
                 head.midlayer.post_attention_layernorm, head.norm):
        norm.weight.fill_(1.0)
    if own_embedding:
        head.embed_tokens.weight.copy_(torch.randn(V, H, generator=g))
    unit = lambda x: x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # noqa: E731
    tok_code = unit(torch.randn(V, H, generator=g))
    pos_code = unit(torch.randn(n_codes, H, generator=g))
    key_code = unit(torch.randn(nA, H, generator=g))
    # fc sends key i's taps to key_code[i]: a ridge inverse over the keys, so taps that differ
    # only in their context still land on different codes.
    if nA:  # (a run of one or two tokens drafts nothing)
        M = unit(torch.stack(keys).double())  # (nA, 3Ht)
        coef = torch.linalg.solve(M @ M.T + 1e-7 * torch.eye(nA, dtype=torch.double), M)
        scale = torch.stack(keys).double().norm(dim=-1, keepdim=True)
        head.fc.weight.copy_((key_code.double().T @ (coef / scale)).float())
    alpha, rms = 4.0 * H ** 0.5, H ** 0.5  # gate = alpha * cosine; silu(gate) * gate sharpens it
    mlp = head.midlayer.mlp

    in_vocab = set(vocab.tolist())

    def wrong(t: int) -> int:  # a representable token != t
        while True:
            c = int(vocab[int(torch.randint(0, dv, (1,), generator=g))])
            if c != t:
                return c

    def value(tok: int, code: int) -> torch.Tensor:
        return unit(tok_code[tok] + pos_code[code])

    for i in range(nA):
        tok, code = a_vals[i]
        right = tok in in_vocab
        mlp.gate_proj.weight[i] = mlp.up_proj.weight[i] = key_code[i] * alpha / rms
        good = mode in ("full", "partial", "mixed")
        mlp.down_proj.weight[:, i] = value(tok if good and right else wrong(tok), code)
        if mode == "second":  # the right token at 0.8 of a wrong one: ranked second
            mlp.down_proj.weight[:, i] += 0.8 * tok_code[tok] / 2 ** 0.5
    for j in range(nB):
        tok, code, prev = b_vals[j]
        # Its input is a value, unit(token code + position code): its cosine with the position
        # code is 1 / sqrt(2), scaled back to 1 so both banks fire alike (and bank B's output
        # cancels the residual it reads exactly where that is asked for).
        row = pos_code[b_keys[j]] * 2 ** 0.5 * alpha / rms
        mlp.gate_proj.weight[nA + j] = mlp.up_proj.weight[nA + j] = row
        good = mode == "full" or (mode == "mixed" and prev % 2 == 0)
        mlp.down_proj.weight[:, nA + j] = value(tok if good else wrong(tok), code)
        if not norm_before_residual:  # cancel the residual: the previous output this row reads
            mlp.down_proj.weight[:, nA + j] -= value(prev, b_keys[j])
    head.lm_head.weight.copy_(tok_code[vocab] * 10.0)
    head.d2t.copy_(vocab - torch.arange(dv))
    head.t2d.zero_()
    head.t2d[vocab] = True
    return head.eval()
