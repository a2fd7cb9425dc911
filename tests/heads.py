"""Heads that agree or disagree with a target on purpose (real `Eagle3Draft` modules).

The target is made a deterministic bigram model by zeroing every layer's
`o_proj` and `down_proj`: the residual stream stays the (scaled) embedding, so
greedy decoding follows next = f(current). Its taps at position t are all
proportional to the embedding of x_t.

The head ignores its input token (its `o_proj` is zero) and runs a two-bank MLP
lookup: bank A reads a target feature (embedding direction of x_t) and writes
the codebook vector of f(f(x_t)) = x_{t+2} (what the draft must predict at
slot t); bank B reads its own previous output (codebook vector of y) and
writes the codebook vector of f(y). `lm_head` rows are the codebook vectors.
Corrupting a bank forces rejections exactly where wanted:
    full    -> every draft accepted (accepted length == K each round)
    partial -> first draft accepted, the rest rejected (accepted length 1)
    zero    -> first draft rejected (accepted length 0)
    second  -> every prediction's runner-up is right, its top choice wrong: a tree
               accepts one token per round through a second child (tree tests)
    mixed   -> first draft accepted, each later one right only after an even token:
               accepted lengths vary from round to round
"""

from __future__ import annotations

import torch

from eagle3.draft import Eagle3Draft
from eagle3.draft.model import DraftConfig


def make_bigram(model) -> None:
    """Zero the attention and MLP outputs of every layer of a transformers model, in place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "o_proj.bias", "down_proj.bias")):
                p.zero_()


def save_bigram_target(path: str, name: str = "llama", **overrides) -> str:
    """Save a bigram `name` model at `path` (untied, so greedy paths vary; wide, so the
    forced heads' lookups have a wide margin: noise ~ sqrt(V) / H). Returns `path`."""
    from conftest import make_hf_model

    m = make_hf_model(name, seed=2, **{"tie_word_embeddings": False, "hidden_size": 128,
                                       "num_attention_heads": 4, "head_dim": 32, **overrides})
    make_bigram(m)
    m.save_pretrained(path)
    return path


@torch.no_grad()
def bigram_table(target) -> torch.Tensor:
    """f (V,): the target's greedy next token after each single token."""
    V = target.config.vocab_size
    cache = target.new_cache(V, 1)
    logits, _ = target.forward_logits_taps(torch.arange(V)[:, None], torch.zeros(1, dtype=torch.long),
                                           cache, kv_len=1, with_taps=False)
    return logits[:, -1].argmax(-1)


@torch.no_grad()
def forced_head(target, mode: str = "full", draft_vocab: list[int] | None = None,
                taps: tuple[int, int, int] = (1, 2, 3), seed: int = 0,
                own_embedding: bool = False, norm_before_residual: bool = True) -> Eagle3Draft:
    """A head that agrees with bigram `target` per `mode` ('full' | 'partial' | 'zero').

    With `norm_before_residual` the residual is the normed feature (norm sqrt(H)),
    negligible next to the bank outputs, so long chains stay exact. Without it,
    bank B cancels the residual it reads; lookup noise then builds up over
    chains of more than ~3 steps, so 'full' is exact only for short chains.
    """
    assert mode in ("full", "partial", "zero", "second", "mixed")
    g = torch.Generator().manual_seed(seed)
    V, H = target.config.vocab_size, target.config.hidden_size
    f = bigram_table(target)
    f2 = f[f]
    vocab = torch.tensor(sorted(draft_vocab)) if draft_vocab is not None else torch.arange(V)
    dv = vocab.numel()
    cfg = DraftConfig(hidden_size=H, intermediate_size=2 * V, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=H // 2, vocab_size=V, draft_vocab_size=dv,
                      target_hidden_size=H, taps=taps, norm_before_residual=norm_before_residual)
    head = Eagle3Draft(cfg, max_len=target.config.max_seq_len, with_embedding=own_embedding)
    for p in head.parameters():
        p.zero_()
    for norm in (head.midlayer.input_layernorm, head.midlayer.hidden_norm,
                 head.midlayer.post_attention_layernorm, head.norm):
        norm.weight.fill_(1.0)
    if own_embedding:
        head.embed_tokens.weight.copy_(torch.randn(V, H, generator=g))
    # Target features: what tap `taps[0]` holds for each token (the embedding, scaled for Gemma).
    target.tap_layers = taps
    cache = target.new_cache(V, 1)
    _, feats = target.forward_logits_taps(torch.arange(V)[:, None], torch.zeros(1, dtype=torch.long),
                                          cache, kv_len=1)
    E = feats[:, 0, :H]  # (V, H) = tap taps[0]
    head.fc.weight[:, :H] = torch.eye(H)
    code = torch.randn(V, H, generator=g)  # codebook: one random direction per target token
    unit = lambda x: x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # noqa: E731
    alpha = 4.0 * H ** 0.5  # gate = alpha * cosine; silu(gate) * gate sharpens the match
    rms = H ** 0.5  # post_attention_layernorm output has norm sqrt(H)
    A, B = head.midlayer.mlp, head.midlayer.mlp
    A.gate_proj.weight[:V] = unit(E) * alpha / rms
    A.up_proj.weight[:V] = unit(E) * alpha / rms
    B.gate_proj.weight[V:] = unit(code) * alpha / rms
    B.up_proj.weight[V:] = unit(code) * alpha / rms

    in_vocab = torch.zeros(V, dtype=torch.bool)
    in_vocab[vocab] = True

    def wrong(t: torch.Tensor) -> torch.Tensor:  # a representable token != t
        cand = vocab[torch.randint(0, dv, t.shape, generator=g)]
        return torch.where(cand == t, vocab[(torch.searchsorted(vocab, cand) + 1) % dv], cand)

    bank_a = f2 if mode in ("full", "partial", "mixed") else wrong(f2)
    bank_b = (f if mode == "full" else
              torch.where(torch.arange(V) % 2 == 0, f, wrong(f)) if mode == "mixed" else wrong(f))
    A.down_proj.weight[:, :V] = unit(code[bank_a]).T
    B.down_proj.weight[:, V:] = unit(code[bank_b]).T
    if mode == "second":  # the right code at 0.8 of a wrong one: logits rank it second
        A.down_proj.weight[:, :V] += 0.8 * unit(code[f2]).T
    if not norm_before_residual:
        # Cancel the residual bank B reads (its own previous output), so the new
        # prediction is not mixed with the old one.
        B.down_proj.weight[:, V:] -= unit(code).T
    head.lm_head.weight.copy_(unit(code[vocab]) * 10.0)
    head.d2t.copy_(vocab - torch.arange(dv))
    head.t2d.zero_()
    head.t2d[vocab] = True
    return head.eval()
