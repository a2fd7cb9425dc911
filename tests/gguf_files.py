"""Write tiny GGUF files from transformers models, as llama.cpp's `convert_hf_to_gguf.py` does.

The test's own HF -> GGUF mapping (names, Llama q/k row permutation, Gemma's `1 + w`
norms, metadata keys), independent of `eagle3.targets.gguf`, which maps back; the
oracle is transformers' GGUF loader reading the same file.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
        "gemma3_text": "gemma3"}
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
LLAMA_NORMS = {"post_attention_layernorm": "ffn_norm"}
GEMMA_NORMS = {"pre_feedforward_layernorm": "ffn_norm", "post_attention_layernorm": "post_attention_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
BLOCK = {Q.Q8_0: 32, Q.Q4_0: 32, Q.Q4_1: 32, Q.Q5_0: 32, Q.Q5_1: 32, Q.Q4_K: 256, Q.Q5_K: 256,
         Q.Q6_K: 256}


def gguf_name(hf: str, gemma: bool) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.N.<module...>.weight
    module, suffix = ".".join(parts[3:-1]), parts[-1]
    table = {**LAYER, **(GEMMA_NORMS if gemma else LLAMA_NORMS)}
    return f"blk.{parts[2]}.{table[module]}.{suffix}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k permutation (rotary halves interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with sane fp16 scales (gguf-py quantizes no K types)."""
    size = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    d = np.full((rows, cols // 256, 1), 0.002, np.float16).view(np.uint8)  # (.., 2) bytes
    if qtype == Q.Q6_K:  # ql, qh, int8 scales, then d at the end
        blocks[..., -2:] = d
    else:  # d, dmin first
        blocks[..., 0:2] = d
        blocks[..., 2:4] = np.full((rows, cols // 256, 1), 0.001, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(model, path: str, *, qtype=Q.F32, tokenizer=None, chat_template: str | None = None,
               kquant_seed: int = 0, general_type: str | None = None, arch: str | None = None) -> None:
    """Write `model` (a transformers causal LM) to `path` as GGUF.

    Weights of 2-D tensors whose rows fit `qtype`'s block are stored as `qtype`; K-quant
    types get random blocks (the oracle reads the same bytes). tokenizer: a `tokenizers`
    BPE tokenizer stored as a GPT-2 vocabulary.
    """
    cfg = model.config
    model_type = cfg.model_type
    arch = arch or ARCH[model_type]
    gemma = model_type.startswith("gemma")
    w = gguf.GGUFWriter(path, arch)
    if general_type:
        w.add_type(general_type)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if "full_attention" in rope:
        rope = rope["full_attention"]
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None) and gemma:
        w.add_sliding_window(cfg.sliding_window)
    if model_type == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        tokens += [f"[PAD{i}]" for i in range(cfg.vocab_size - len(tokens))]
        import json

        merges = json.loads(tokenizer.to_str())["model"]["merges"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([1] * len(tokens))
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(kquant_seed)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue
        data = t.detach().float().numpy().copy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = permute(data, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if gemma and name.endswith("norm.weight"):
            data = data + 1.0
        gname = gguf_name(name, gemma)
        if data.ndim == 2 and qtype in BLOCK and data.shape[1] % BLOCK[qtype] == 0:
            if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
                raw = random_kquant(data.shape[0], data.shape[1], qtype, rng)
            else:
                raw = gguf.quants.quantize(data, qtype)
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
        elif data.ndim == 2 and qtype in (Q.F16, Q.BF16):
            raw = gguf.quants.quantize(data, qtype)
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            w.add_tensor(gname, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def oracle(path: str, dtype=torch.float32):
    """transformers' own GGUF loader on `path`."""
    import os

    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype).eval()
