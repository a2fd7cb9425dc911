"""Native decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3) and Gemma 2/3.

Plain PyTorch in the spirit of nanoGPT / gpt-fast. Parameter names follow the
Hugging Face checkpoints, so a state dict loads as is. One forward serves
prefill, decode, chain verify and (with `attn_mask`) tree verify; it writes the
new K/V into a `StaticKVCache` and returns logits plus the requested taps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import FMT_ID, QLinear, fused_step_ok, project
from .cache import StaticKVCache, slots_upto
from .config import DecoderConfig, RopeConfig, rope_inv_freq
from .protocol import TapLayers


class RMSNorm(nn.Module):
    """RMSNorm; Gemma scales by (1 + w) in float32, Llama by w after casting back."""

    def __init__(self, dim: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.eps, self.gemma = eps, gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.fused = False  # `kernels.use_fused_steps`: one C++ op (rounds like it, not like torch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and fused_step_ok(x, self.weight):  # one kernel, each row alone
            return torch.ops.eagle3.rms_norm(x, self.weight, self.eps, self.gemma)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (h * (1.0 + self.weight.float())).type_as(x)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope(nn.Module):
    """cos/sin tables (S, hd) for one RoPE config, indexed by position."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int) -> None:
        super().__init__()
        inv = rope_inv_freq(rope, head_dim)  # (hd/2,)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (S, hd)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[pos].to(dtype), self.sin[pos].to(dtype)  # (T, hd) each


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.layer, self.hd = layer, hd
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.scale = cfg.attn_scale or hd ** -0.5
        self.softcap = cfg.attn_softcap
        self.q_proj = nn.Linear(H, self.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(H, self.n_kv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(H, self.n_kv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=cfg.o_bias)
        self.qkv_proj: nn.Linear | None = None  # set by fuse()
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.gemma)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.gemma)
        else:
            self.q_norm = self.k_norm = None

    def fuse(self) -> None:
        """Replace q/k/v_proj by one `qkv_proj` (same numbers, one matmul instead of three)."""
        self.qkv_proj = _fused_linear([self.q_proj, self.k_proj, self.v_proj])
        self.q_proj = self.k_proj = self.v_proj = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor, cache: StaticKVCache, kv_len: int,
                stock: bool = False) -> torch.Tensor:
        B, T, _ = x.shape
        if self.qkv_proj is not None:
            q, k, v = project(self.qkv_proj, x, stock).split(
                [self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        else:
            q, k, v = (project(p, x, stock) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(B, T, self.n_heads, self.hd)
        k = k.view(B, T, self.n_kv, self.hd)
        v = v.view(B, T, self.n_kv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = cached_attention(q, k, v, cos, sin, mask, input_pos, cache, self.layer, kv_len,
                               self.scale, self.softcap, stock)
        return project(self.o_proj, out, stock)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, mask: torch.Tensor, input_pos: torch.Tensor,
                     cache: StaticKVCache, layer: int, kv_len: int, scale: float | None = None,
                     softcap: float | None = None, stock: bool = False) -> torch.Tensor:
    """RoPE, then the cache's one attention entry point (`attend`: write K/V at `input_pos`,
    attend over slots [0, kv_len) under `mask`), whatever the cache: static (`cache.StaticKVCache`),
    paged (`engine.paged.PagedKV`) or an exported program's (`export.cache.ExportKVCache`).

    q (B, T, nh, hd), k/v (B, T, nkv, hd), mask (T, kv_len) bool -> (B, T, nh*hd).
    The engine's ragged batches pass per-row cos/sin (B, T, hd), a (B, 1, T, kv_len)
    mask and (B, T) write slots, which its paged cache interprets. `stock`: a prompt's
    forward, which may take SDPA on a row-invariant cache (`QLinear.forward` says why).
    """
    hd = q.shape[-1]
    if fused_step_ok(q, k, cos) and q.stride(-1) == k.stride(-1) == 1:
        # The same multiplies and adds as below, in place, in one op per tensor: the same bits.
        cos, sin = cos.contiguous(), sin.contiguous()
        torch.ops.eagle3.rope_(q, cos, sin)
        torch.ops.eagle3.rope_(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh|nkv, T, hd)
        return cache.attend(layer, q, k, v, input_pos, mask, kv_len, scale or hd ** -0.5, softcap,
                            stock)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh|nkv, T, hd)
    if cos.dim() == 3:  # per-row positions (B, T, hd): the engine's ragged batches
        cos, sin = cos[:, None], sin[:, None]
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    return cache.attend(layer, q, k, v, input_pos, mask, kv_len, scale or hd ** -0.5, softcap, stock)


class MLP(nn.Module):
    """Gated MLP: SwiGLU (Llama) or GeGLU with tanh GELU (Gemma)."""

    def __init__(self, hidden: int, inter: int, bias: bool = False, gelu: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.gelu = gelu
        self.gate_up_proj: nn.Linear | None = None  # set by fuse()
        self.fused = False  # `kernels.use_fused_steps`: SwiGLU in one C++ op

    def fuse(self) -> None:
        """Replace gate/up_proj by one `gate_up_proj` (one matmul instead of two)."""
        self.gate_up_proj = _fused_linear([self.gate_proj, self.up_proj])
        self.gate_proj = self.up_proj = None

    def forward(self, x: torch.Tensor, stock: bool = False) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = project(self.gate_up_proj, x, stock)  # (..., 2I)
            if self.fused and not self.gelu and fused_step_ok(gate_up):
                return project(self.down_proj, torch.ops.eagle3.silu_mul(gate_up), stock)
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = project(self.gate_proj, x, stock), project(self.up_proj, x, stock)
            if self.fused and not self.gelu and fused_step_ok(gate):  # as `eagle3::decoder_layer`
                return project(self.down_proj, torch.ops.eagle3.silu_mul(torch.cat([gate, up], dim=-1)),
                               stock)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return project(self.down_proj, gate * up, stock)


# The checkpoint weights each fused projection concatenates (rows in this order).
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def weight_sources(module_path: str, tied: bool) -> list[str]:
    """The checkpoint tensor names a (possibly fused) linear layer of a `NativeTarget` holds."""
    base, _, leaf = module_path.rpartition(".")
    if leaf in FUSED_PARTS:
        return [f"{base}.{p}.weight" for p in FUSED_PARTS[leaf]]
    if module_path == "lm_head" and tied:
        return ["model.embed_tokens.weight"]
    return [f"{module_path}.weight"]


def placeholder(n: int, k: int) -> torch.Tensor:
    """A (n, k) float32 weight that takes no memory (every element is one zero): it stands for a
    layer whose real weights arrive later as a GGUF file's codes (`targets.gguf`)."""
    return torch.zeros((), dtype=torch.float32).expand(n, k)


def is_placeholder(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.numel() > 1 and t.stride() == (0, 0)


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of `parts`' outputs."""
    bias = parts[0].bias is not None
    if all(is_placeholder(p.weight) for p in parts):  # codes to come: stay free of memory
        n, k = sum(p.weight.shape[0] for p in parts), parts[0].weight.shape[1]
        with torch.device("meta"):
            fused = nn.Linear(k, n, bias=False)
        fused.weight = nn.Parameter(placeholder(n, k), requires_grad=False)
        if bias:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        return fused
    w = torch.cat([p.weight for p in parts])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=bias, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(w)
        if bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused.requires_grad_(parts[0].weight.requires_grad)


class OneOpLayer(nn.Module):
    """A layer that may run as one `eagle3::decoder_layer` (`kernels.use_fused_steps` sets
    `fused`); `step_args()` builds the op's weights once, and the flag's setter and `.to()`
    (which replaces the tensors they hold) forget them."""

    @property
    def fused(self) -> bool:
        return self._fused

    @fused.setter
    def fused(self, on: bool) -> None:
        self._fused, self._step_args = on, None

    def _apply(self, fn, recurse=True):
        self._step_args = None
        return super()._apply(fn, recurse)

    def step_args(self) -> tuple | None:  # pragma: no cover - each layer builds its own
        raise NotImplementedError


class Block(OneOpLayer):
    """Pre-norm decoder layer; Gemma adds post-attention and post-MLP norms (sandwich)."""

    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        eps, gemma = cfg.rms_norm_eps, cfg.gemma
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.act == "gelu_tanh")
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, gemma)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, gemma)
        self.gemma = gemma
        self.fused = False
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, gemma)

    def step_args(self) -> tuple | None:
        """What `eagle3::decoder_layer` takes besides the activations, cache and positions, or
        None where this layer is not a plain pre-norm SwiGLU layer with fused projections in
        `QLinear`s (it then runs op by op). Built once (the flag's setter and `.to()` reset it)."""
        if self._step_args is None:
            attn, mlp = self.self_attn, self.mlp
            plain = not (self.gemma or attn.q_norm is not None or mlp.gelu)
            self._step_args = plain and layer_op_args(
                self.input_layernorm.weight, self.post_attention_layernorm.weight,
                [[attn.qkv_proj], [attn.o_proj], [mlp.gate_up_proj], [mlp.down_proj]]) or ()
        return self._step_args or None

    def one_op(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
               input_pos: torch.Tensor, cache: StaticKVCache, kv_len: int) -> torch.Tensor:
        """This layer as `eagle3::decoder_layer` (callers check `step_args()` and `one_op_ok`)."""
        a = self.self_attn
        return torch.ops.eagle3.decoder_layer(
            h, *self._step_args, cos, sin, cache.k[a.layer], cache.v[a.layer], input_pos, mask,
            kv_len, a.n_heads, a.n_kv, self.input_layernorm.eps, a.scale, a.softcap or 0.0)

    def forward(self, h: torch.Tensor, *attn_args, stock: bool = False) -> torch.Tensor:
        """`stock`: a prompt's forward (stock float kernels; `QLinear.forward` says why)."""
        if not stock and self._fused and one_op_ok(h, *attn_args) and self.step_args():
            return self.one_op(h, *attn_args)
        a = self.self_attn(self.input_layernorm(h), *attn_args, stock=stock)
        if self.gemma:
            h = h + self.post_attention_layernorm(a)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), stock))
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h), stock)


def layer_op_args(ln1: torch.Tensor, ln2: torch.Tensor, projections: list[list[nn.Module]]
                  ) -> tuple | None:
    """`eagle3::decoder_layer`'s weights: the two norms' weights, then per projection (qkv, o,
    gate_up, down) [w, scale, offset, bias], their formats and out_features; None unless every
    projection is `QLinear`s of one format. A projection given as several layers (an EAGLE-3
    head's q/k/v_proj) runs as their concatenation, which computes each part's outputs as that
    part would: each output column depends on its own weights only, and the packed layouts
    hold columns in whole groups of 16, so concatenating the buffers concatenates the layers."""
    parts, fmts, ns = [], [], []
    for layers in projections:
        first = layers[0]
        if (not all(isinstance(m, QLinear) and m.fmt == first.fmt and m.in_features == first.in_features
                    and bool(m.offset.numel()) == bool(first.offset.numel())
                    and (m.bias is None) == (first.bias is None) for m in layers)):
            return None
        cat = (lambda ts: ts[0]) if len(layers) == 1 else (lambda ts: torch.cat([t.reshape(-1) for t in ts]))
        bias = cat([m.bias for m in layers]) if first.bias is not None else first.offset[:0]
        parts.append([cat([m.w for m in layers]), cat([m.scale for m in layers]),
                      cat([m.offset for m in layers]), bias])
        fmts.append(FMT_ID[first.fmt])
        ns.append(sum(m.out_features for m in layers))
    return (ln1, ln2, *parts, fmts, ns)


def one_op_ok(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
              input_pos: torch.Tensor, cache: object, kv_len: int) -> bool:
    """Whether a forward's layers may run as `eagle3::decoder_layer`: a row-invariant static
    cache, one position per token (not the engine's per-row ones), outside autograd and
    compilation (a prompt's forward, `stock`, never asks)."""
    return (type(cache) is StaticKVCache and cache.exact and cos.dim() == 2 and mask.dim() == 2
            and cos.is_contiguous() and sin.is_contiguous() and fused_step_ok(h, cos))


def embedding(vocab: int, hidden: int) -> nn.Embedding:
    """`nn.Embedding(vocab, hidden)`; on the meta device (a model about to be loaded) without
    its random normal init, whose first call in a process pays PyTorch's lazy imports for
    nothing."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
    return nn.Embedding(vocab, hidden)


class Backbone(nn.Module):
    """Holds the parameters under HF's `model.` prefix."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)


def table_embedding(table: torch.Tensor) -> nn.Embedding:
    """An `nn.Embedding` over `table` (V, H) itself, not a copy."""
    emb = nn.Embedding(*table.shape, device="meta")
    emb.weight = table if isinstance(table, nn.Parameter) else nn.Parameter(table, requires_grad=False)
    return emb


class CodesEmbedding(nn.Module):
    """The token lookup of a tied target whose LM head holds packed codes (`QLinear`): rows
    dequantized from those codes as needed (`QLinear.rows`), instead of a float32 table
    (113 MB for SmolLM2's 49152 x 576). Holds no weights of its own: the LM head's are read
    where they live, so the state dict names them once. `weight` is an empty float32 tensor
    on the codes' device, for callers that probe the table's dtype and device."""

    def __init__(self, lm_head: QLinear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = lm_head.out_features, lm_head.in_features
        self._source = [lm_head]  # a list: not a submodule, so not saved or moved twice
        self.register_buffer("weight", torch.empty(0, device=lm_head.w.device), persistent=False)

    @property
    def codes(self) -> QLinear:
        """The LM head whose codes this lookup reads."""
        return self._source[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self._source[0].rows(tokens.reshape(-1))  # (B*T, H)
        return rows.view(*tokens.shape, self.embedding_dim)


class NativeTarget(TapLayers, nn.Module):
    """A `TapTarget` implemented in plain PyTorch with a static KV cache."""

    def __init__(self, cfg: DecoderConfig, taps: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.build_buffers()
        self.windows = sorted(set(cfg.layer_windows), key=lambda w: -1 if w is None else w)
        self.layer_window_idx = [self.windows.index(w) for w in cfg.layer_windows]
        self.embed_scale = math.sqrt(cfg.hidden_size) if cfg.gemma else None
        # Row-invariant kernels (`kernels.prepare_target`): verify rows == decode rows bitwise.
        self.exact = False
        self.weight_format: str | None = None  # a `kernels.FORMATS` name once prepared
        # The KV cache's dtype (None: the weights' dtype), chosen with the weight format
        # (`WeightFormat.kv_dtype`, set by `targets.prepare_loaded`): bf16 for the packed formats,
        # half the cache's memory and reads, each element rounded alone (row-invariant), an error
        # far below int8 activations' (docs/weight-formats.md, "KV cache in bf16").
        self.kv_dtype: torch.dtype | None = None
        if taps is not None:
            self.tap_layers = taps

    def build_buffers(self) -> None:
        """(Re)compute the RoPE tables; needed after building the module on the meta device."""
        cfg = self.config
        ropes = sorted(set(cfg.layer_rope), key=repr)
        self.ropes = nn.ModuleList(Rope(r, cfg.head_dim, cfg.max_seq_len) for r in ropes)
        self.layer_rope_idx = [ropes.index(r) for r in cfg.layer_rope]

    def fuse_projections(self) -> NativeTarget:
        """Fuse q/k/v and gate/up projections for inference (fewer, larger matmuls).

        Call after loading weights; the fused model computes the same function.
        """
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    # -- protocol -------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Raw embedding rows (B, T, H), without Gemma's sqrt(H) scale: what a draft head consumes."""
        return self.model.embed_tokens(tokens)

    @property
    def embedding_weight(self) -> torch.Tensor:
        """The raw token embedding table (V, H), shared with heads that ship none; an empty
        tensor of its dtype and device once the lookup reads the LM head's codes
        (`embed_from_codes`)."""
        return self.model.embed_tokens.weight

    def shared_embedding(self) -> nn.Module:
        """The token lookup a head that ships no embedding shares: this target's own module
        when it reads codes, else an `nn.Embedding` over the same table (no copy)."""
        if isinstance(self.model.embed_tokens, CodesEmbedding):
            return self.model.embed_tokens
        return table_embedding(self.model.embed_tokens.weight)

    @torch.no_grad()
    def embed_from_codes(self, *heads: nn.Module | None) -> bool:
        """For a tied target whose LM head holds packed codes equal to its float32 table (a GGUF
        file's Q8_0 / Q4_0 / Q4_1 token_embd, loaded with its codes): look tokens up in those
        codes and free the table; heads sharing the table share the new lookup. A table loaded
        in float32 is checked against the codes row block by row block first, so no embedding
        value changes; a `placeholder` table (the loader kept only the file's codes) is taken
        as those codes. Returns whether it did."""
        head, table = self.lm_head, self.model.embed_tokens.weight
        if (not isinstance(head, QLinear) or head.fmt not in ("int8", "int4")
                or isinstance(self.model.embed_tokens, CodesEmbedding)
                or tuple(table.shape) != (head.out_features, head.in_features)):
            return False
        for i in range(0, 0 if is_placeholder(table) else table.shape[0], 4096):
            ids = torch.arange(i, min(i + 4096, table.shape[0]), device=table.device)
            if not torch.equal(head.rows(ids), table[i:i + 4096].float()):
                return False
        codes = CodesEmbedding(head)
        for h in heads:
            if h is not None and getattr(h, "embed_tokens", None) is not None and \
                    h.embed_tokens.weight.untyped_storage().data_ptr() == table.untyped_storage().data_ptr():
                h.embed_tokens = codes
        self.model.embed_tokens = codes
        return True

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> StaticKVCache:
        cfg = self.config
        return StaticKVCache(cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads,
                             max_len or cfg.max_seq_len, cfg.head_dim,
                             dtype=self.kv_dtype or self.embedding_weight.dtype,
                             device=self.embedding_weight.device,
                             exact=self.exact)

    def compact_cache(self, cache: StaticKVCache, src_slots: torch.Tensor, dst_start: int) -> None:
        """Move the K/V at `src_slots` (N,) to slots dst_start.. (an accepted tree path)."""
        cache.compact(src_slots, dst_start)

    def forward_logits_taps(self, tokens: torch.Tensor, input_pos: torch.Tensor,
                            cache: StaticKVCache, *, kv_len: int | None = None,
                            attn_mask: torch.Tensor | None = None,
                            rope_pos: torch.Tensor | None = None, last_only: bool = False,
                            with_taps: bool = True, key_slots: torch.Tensor | None = None,
                            key_pos: torch.Tensor | None = None,
                            taps: tuple[int, ...] | None = None, prefill: bool = False,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens (B, T) at slots `input_pos` (T,); see `TapTarget` for the arguments.

        `key_slots` = arange(kv_len), an alternative to `kv_len` for compiled callers: its
        length can be marked dynamic, so one compiled graph serves every cache length.
        `key_pos` (kv_len,): the positions of the keys in those slots, for sliding windows
        (default: the slots themselves; a tree's node slots run ahead of their positions).
        `taps`: the layers to tap (default `tap_layers`), so speculators sharing one target
        never change its state. The engine's paged backend (`engine/paged.py`) calls this with
        per-row (B, T) write slots as `input_pos`, (B, T) `rope_pos`, a (B, 1, T, S)
        `attn_mask`, (B, S) `key_pos` and its paged cache. `prefill`: a prompt's forward, whose
        float32 layers and attention may take PyTorch's stock kernels (`QLinear.forward`).
        """
        if key_slots is None:
            key_slots = slots_upto(kv_len or cache.max_len, tokens.device)
        S = key_slots.shape[0]
        h = self.model.embed_tokens(tokens)  # (B, T, H)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        rp = input_pos if rope_pos is None else rope_pos
        # One (T, S) mask per distinct window; True = may attend. Windows compare positions,
        # not slots: a tree node's slot runs ahead of its position.
        kp = key_slots if key_pos is None else key_pos
        masks = []
        for w in self.windows:
            m = key_slots[None, :] <= input_pos[:, None] if attn_mask is None else attn_mask
            if w is not None:
                if rp.dim() == 2:  # per-row positions (B, T), keys (B, S): (B, 1, T, S)
                    m = m & (kp[:, None, None, :] > rp[:, None, :, None] - w)
                else:
                    m = m & (kp[None, :] > rp[:, None] - w)
            masks.append(m)
        rot = [r(rp, h.dtype) for r in self.ropes]

        want = set(self.tap_layers if taps is None else taps) if with_taps else set()
        taps = []
        # Decided once per forward, not per layer: the one-op layers skip the module call.
        one_op = self.exact and not prefill and one_op_ok(h, *rot[0], masks[0], input_pos, cache, S)
        for i, layer in enumerate(self.model.layers):
            if i in want:
                taps.append(h)
            cos, sin = rot[self.layer_rope_idx[i]]
            args = (cos, sin, masks[self.layer_window_idx[i]], input_pos, cache, S)
            h = (layer.one_op(h, *args) if one_op and layer.fused and layer.step_args()
                 else layer(h, *args, stock=prefill))
        if self.config.num_hidden_layers in want:  # tap L is the final normed state
            h = self.model.norm(h)
            taps.append(h)
            # contiguous: a strided (B, 1, H) view made the projection a batched matmul
            # against B copies of the output matrix (docs/training.md)
            h = h[:, -1:].contiguous() if last_only else h
        else:
            h = self.model.norm(h[:, -1:] if last_only else h)
        logits = project(self.lm_head, h, prefill)  # (B, T|1, V)
        if self.config.final_softcap:
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits, (torch.cat(taps, dim=-1) if taps else None)

    forward = forward_logits_taps
