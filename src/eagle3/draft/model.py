"""The EAGLE-3 draft head: `fc` over three target taps, then one Llama-style layer.

One step:
    residual = g                      (hidden_norm(g) if norm_before_residual)
    a = cat([input_layernorm(embed(tok)), hidden_norm(g)])       # (B, T, 2H)
    h = residual + o_proj(attn(q/k/v_proj(a)))                   # RoPE, causal
    h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                                    # (B, T, draft_vocab)
`h` (pre-norm) is the recurrent feature for the next step; `g` is either the
fused target feature `fc(taps)` or the previous step's `h`. Parameter names are
the official release's (`midlayer.*`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..kernels import FMT_ID, QLinear, fused_step_ok
from ..targets.cache import StaticKVCache, slots_upto
from ..targets.config import RopeConfig
from ..targets.decoder import (
    MLP,
    CodesEmbedding,
    OneOpLayer,
    RMSNorm,
    Rope,
    cached_attention,
    layer_op_args,
    one_op_ok,
)


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (embedding rows)
    draft_vocab_size: int  # lm_head rows
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    taps: tuple[int, ...] | None = None  # from the head's config, in our convention; None = default
    num_taps: int = 3
    extra: dict = field(default_factory=dict)  # format-specific keys kept for lossless round trips


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor, cache: StaticKVCache, kv_len: int) -> torch.Tensor:
        B, T, _ = x.shape  # x: (B, T, 2H)
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd)
        return self.o_proj(cached_attention(q, k, v, cos, sin, mask, input_pos, cache, 0, kv_len))


class DraftLayer(OneOpLayer):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.norm_before_residual = cfg.norm_before_residual
        self.fused = False

    def step_args(self) -> tuple | None:
        """`eagle3::decoder_layer`'s weights for the layer after `mix` (q/k/v_proj and
        gate/up_proj run as their concatenations), or None where it runs op by op (stock
        layers, GeGLU). Built once."""
        if self._step_args is None:
            attn, mlp = self.self_attn, self.mlp
            gate_up = [mlp.gate_up_proj] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]
            self._step_args = (not mlp.gelu and layer_op_args(
                self.post_attention_layernorm.weight, self.post_attention_layernorm.weight,
                [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], gate_up, [mlp.down_proj]])) or ()
        return self._step_args or None

    def mix(self, emb: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input a (B, T, 2H), embedding first; residual (B, T, H))."""
        gn = self.hidden_norm(g)
        residual = gn if self.norm_before_residual else g
        return torch.cat([self.input_layernorm(emb), gn], dim=-1), residual

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """h = residual + attention; h + MLP(norm(h)): the next feature (B, T, H)."""
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, emb: torch.Tensor, g: torch.Tensor, *attn_args) -> torch.Tensor:
        a, residual = self.mix(emb, g)
        if self._fused and one_op_ok(residual, *attn_args) and self.step_args():
            cos, sin, mask, input_pos, cache, kv_len = attn_args
            at = self.self_attn
            return torch.ops.eagle3.decoder_layer(
                residual, *self._step_args, cos, sin, cache.k[0], cache.v[0], input_pos, mask, kv_len,
                at.n_heads, at.n_kv, self.post_attention_layernorm.eps, at.hd ** -0.5, 0.0, a)
        return self.finish(residual, self.self_attn(a, *attn_args))


class Eagle3Draft(nn.Module):
    """EAGLE-3 head. `embed_tokens` is None until the loader gives it the target's table."""

    def __init__(self, cfg: DraftConfig, max_len: int = 4096, with_embedding: bool = True) -> None:
        super().__init__()
        # The target layers this head reads, as `draft.attach_head` resolved them (the config's
        # until then); passed to every target forward, never set on a target.
        self.tap_layers: tuple[int, ...] | None = tuple(cfg.taps) if cfg.taps else None
        H = cfg.hidden_size
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H) if with_embedding else None
        self.input_norm = (RMSNorm(cfg.num_taps * cfg.target_hidden_size, cfg.rms_norm_eps)
                           if cfg.norm_before_fc else None)
        self.fc = nn.Linear(cfg.num_taps * cfg.target_hidden_size, H, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # target_id = draft_id + d2t[draft_id]; t2d marks target ids in the draft vocab.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool)
                             if cfg.draft_vocab_size == cfg.vocab_size
                             else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.max_len = max_len
        # `kernels.use_fused_steps` (a target on the row-invariant path): the head's caches then
        # attend through the attention kernel, which beats SDPA's per-call cost at one query row.
        self.fused = False
        self._chain_args: tuple = ()  # `chain_op_args`: (what they were built from, the args)
        self.build_buffers()

    def build_buffers(self, max_len: int | None = None) -> None:
        """(Re)compute the RoPE table (needed after building on the meta device)."""
        self.max_len = max_len or self.max_len
        self.rope = Rope(self.config.rope, self.config.head_dim, self.max_len)

    @property
    def reduced_vocab(self) -> bool:
        return self.config.draft_vocab_size != self.config.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the head's activations and cache (its linear layers may be packed)."""
        return self.norm.weight.dtype

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> StaticKVCache:
        cfg = self.config
        w = self.norm.weight
        return StaticKVCache(1, batch_size, cfg.num_key_value_heads, max_len or self.max_len,
                             cfg.head_dim, dtype=w.dtype, device=w.device, exact=self.fused)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """Target taps (B, T, n*Ht) -> draft feature g (B, T, H)."""
        if self.input_norm is not None:
            taps = self.input_norm(taps)
        return self.fc(taps)

    def vocab_ids(self) -> torch.Tensor:
        """The target ids of the draft vocabulary, in draft-id order: (draft_vocab,)."""
        return self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids through the d2t offset table."""
        return draft_ids + self.d2t[draft_ids]

    def chain_op_args(self) -> tuple | None:
        """`eagle3::draft_chain`'s weights (after tokens, feats, start, k) up to its caches (and
        `eagle3::draft_tree`'s, after its tree arguments), or
        None where the head does not run as that op: its layer not one `decoder_layer` op, a
        stock LM head, an embedding other than a float32 table or a tied LM head's codes.
        Rebuilt when the modules it reads change (`.to()`, `fused`, a new embedding)."""
        layer = self.midlayer.step_args() if self.midlayer.fused else None
        key = (layer, self.embed_tokens, self.lm_head, self.rope)
        if self._chain_args and all(a is b for a, b in zip(self._chain_args[0], key, strict=True)):
            return self._chain_args[1]
        self._chain_args = (key, layer and self._build_chain_args(layer))
        return self._chain_args[1]

    def _build_chain_args(self, layer: tuple) -> tuple | None:
        emb, head, mid = self.embed_tokens, self.lm_head, self.midlayer
        if isinstance(emb, nn.Embedding) and emb.weight.dtype == torch.float32 and emb.weight.dim() == 2:
            embed, embed_fmt = [emb.weight.detach()], FMT_ID["float32"]
        elif isinstance(emb, CodesEmbedding) and emb.codes.fmt in ("int8", "int4"):
            src = emb.codes  # a tied LM head's codes
            embed, embed_fmt = [src.w, src.scale, src.offset], FMT_ID[src.fmt]
        else:
            return None
        norms = (mid.hidden_norm, mid.input_layernorm, mid.post_attention_layernorm, self.norm)
        if not isinstance(head, QLinear) or any(n.eps != self.norm.eps or n.gemma for n in norms):
            return None
        bias = head.bias.detach() if head.bias is not None else head.offset[:0]
        _, ln2, qkv, o, gate_up, down, fmts, ns = layer
        return (embed, embed_fmt, mid.hidden_norm.weight.detach(), mid.input_layernorm.weight.detach(),
                ln2.detach(), self.norm.weight.detach(), qkv, o, gate_up, down, fmts, ns,
                [head.w, head.scale, head.offset, bias], FMT_ID[head.fmt], self.d2t,
                self.rope.cos, self.rope.sin)

    def greedy_chain(self, tokens: torch.Tensor, feats: torch.Tensor, start: int, k: int,
                     cache: StaticKVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A lone row's catch-up over its backlog, tokens (R,) with fused features (R, H) at
        positions start.., then k greedy drafts, as one C++ op (`eagle3::draft_chain`): drafts (k,)
        in target ids, the root logits (Vd,) at the backlog's last row and its feature (H,), the
        bits this module's forward and `kernels.argmax` give step by step. None where the op does
        not apply (`chain_op_args`, a cache other than an exact static one, autograd, export)."""
        fits = start + tokens.shape[0] + k - 1 <= min(cache.max_len, self.rope.cos.shape[0])
        args = self._op_args(feats, cache) if fits else None
        return None if args is None else torch.ops.eagle3.draft_chain(tokens, feats, start, k, *args)

    def greedy_tree(self, tokens: torch.Tensor, feats: torch.Tensor, start: int, top_k: int, depth: int,
                    n: int, max_rope: int, cache: StaticKVCache) -> tuple[torch.Tensor, ...] | None:
        """A lone row's catch-up (as `greedy_chain`), then its dynamic tree of `n` nodes
        (`decoding.tree.expand_tree`: top_k children of the top_k best frontier nodes for
        `depth` levels, RoPE positions capped at `max_rope` past the backlog) as one C++ op
        (`eagle3::draft_tree`): tokens (1, n), parents (1, n), depth (1, n+1), ancestor mask
        (1, n+1, n+1), the root logits (Vd,) and boundary feature (H,), the bits this module's
        forward and `expand_tree` give level by level. None where the op does not apply."""
        p = start + tokens.shape[0]
        last_rope = p + min(max_rope, max(depth - 2, 0))  # the deepest expanded level's position
        fits = p + top_k * (depth - 1) <= cache.max_len and last_rope < self.rope.cos.shape[0]
        args = self._op_args(feats, cache) if fits else None
        return None if args is None else torch.ops.eagle3.draft_tree(
            tokens, feats, start, top_k, depth, n, max_rope, *args)

    def _op_args(self, feats: torch.Tensor, cache: StaticKVCache) -> tuple | None:
        """The drafting ops' arguments after their own (`chain_op_args`, the cache, the head's
        shapes), or None where they do not apply: a cache other than an exact static one of one
        row, autograd, export, a head that does not run as the ops."""
        if not (type(cache) is StaticKVCache and cache.exact and cache.k[0].shape[0] == 1
                and fused_step_ok(feats, self.norm.weight)):
            return None
        args = self.chain_op_args()
        if args is None:
            return None
        at = self.midlayer.self_attn
        return (*args, cache.k[0], cache.v[0], at.n_heads, at.n_kv, self.norm.eps, at.hd ** -0.5,
                self.config.norm_before_residual)

    def forward(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor,
                cache: StaticKVCache, *, kv_len: int | None = None,
                attn_mask: torch.Tensor | None = None, rope_pos: torch.Tensor | None = None,
                key_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (B, T) with features (B, T, H) at slots `input_pos` (T,).

        Returns (draft logits (B, T, draft_vocab), next feature h (B, T, H)).
        `attn_mask` (T, kv_len) bool replaces the causal mask and `rope_pos` (T,) the
        RoPE positions (default: the slots), for tree drafting, where nodes sharing a
        position sit in distinct slots; `key_slots` = arange(kv_len) may replace
        `kv_len` (see the target's forward).
        """
        if key_slots is None:
            key_slots = slots_upto(kv_len or cache.max_len, tokens.device)
        S = key_slots.shape[0]
        if attn_mask is None:
            attn_mask = key_slots[None, :] <= input_pos[:, None]
        cos, sin = self.rope(input_pos if rope_pos is None else rope_pos, feature.dtype)
        emb = self.embed_tokens(tokens)  # (B, T, H)
        h = self.midlayer(emb, feature, cos, sin, attn_mask, input_pos, cache, S)
        return self.lm_head(self.norm(h)), h
