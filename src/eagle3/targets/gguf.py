"""GGUF checkpoints (llama.cpp's format) as native targets.

`read_gguf(path)` turns a GGUF file into what a Hugging Face checkpoint gives:
a `config.json`-style dict (parsed by `parse_decoder_config`, so both formats
share one set of checks) and a state dict under HF tensor names, dequantized
with the `gguf` package's own kernels. Three conversions undo what llama.cpp's
`convert_hf_to_gguf.py` does on the way in:
- Llama-family q/k rows are permuted (interleaved RoPE halves) -> un-permuted;
- Gemma norms are stored as `1 + w` -> `w` (the native decoder applies `1 + w`);
- tensor names `blk.N.attn_q` ... -> `model.layers.N.self_attn.q_proj` ...
The tokenizer is rebuilt with transformers' GGUF tokenizer conversion and cached
as `tokenizer.json` (see `gguf_tokenizer_dir`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import Eagle3Error
from .families import FAMILIES, gguf_families

QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# The norm around the MLP: Llama has one (post_attention_layernorm); Gemma's sandwich has four.
_LLAMA_FFN_NORMS = {"ffn_norm": "post_attention_layernorm"}
_GEMMA_FFN_NORMS = {"ffn_norm": "pre_feedforward_layernorm",
                    "post_attention_norm": "post_attention_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class GGUFCheckpoint:
    """A GGUF file read into HF terms."""

    path: str
    config: dict  # config.json-style, for parse_decoder_config
    reader: GGUFTensors  # the file's tensors, memory-mapped until `state_dict` reads them
    arch: str
    metadata: dict  # scalar metadata (tokenizer arrays left out)


@dataclass
class GGUFTensors:
    """What loading needs of a `gguf.GGUFReader` once the metadata is read: its tensors (name,
    type, shape, offset, memory-mapped data) and the file's mapping. The reader itself goes:
    its parsed metadata (a vocabulary as ~100k small arrays) holds ~150 MB for SmolLM2."""

    tensors: list
    data: np.memmap


LONG_ARRAY = 1024  # arrays longer than this are stepped over, not split into parts (`_reader`)


def _reader(path: str):
    """A `gguf.GGUFReader` of `path` that steps over long arrays (a vocabulary, its merges,
    scores and token types) instead of building a numpy view per element, which took most of a
    load of SmolLM2 (docs/targets.md): such a field's parts are its key, type, element type and length only,
    so its `contents()` is [] and `parts[4]` its length (as for any array field). Every other
    field and the tensors are the library's own parsing. Only what this module reads of a file
    matters here: the vocabulary goes to transformers' GGUF loader (`gguf_tokenizer_dir`)."""
    try:
        import gguf
    except ImportError:
        raise Eagle3Error("reading GGUF files needs the gguf package: pip install gguf") from None
    if not os.path.isfile(path):
        raise Eagle3Error(f"GGUF file {path} does not exist; pass an existing .gguf file")
    T = gguf.GGUFValueType

    class Reader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if raw_type != T.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item, n = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            number = self.gguf_scalar_to_np.get(T(item[0]))
            size = np.dtype(number).itemsize if number is not None else 0  # 0: strings, arrays
            if n[0] <= LONG_ARRAY or (item[0] != T.STRING and size == 0):
                return super()._get_field_parts(orig_offs, raw_type)  # short, or nested arrays
            raw, offs = memoryview(self.data), orig_offs + 12
            if size:
                offs += size * int(n[0])
            else:
                order = "<Q" if self.endianess == gguf.GGUFEndian.LITTLE else ">Q"
                for _ in range(int(n[0])):  # each string: a u64 length, then its bytes
                    offs += 8 + struct.unpack_from(order, raw, offs)[0]
            if offs > len(raw):
                raise ValueError("an array runs past the end of the file")
            return offs - orig_offs, [item, n], [], [T.ARRAY, T(item[0])]

    try:
        return Reader(path)
    except Exception as e:  # gguf raises ValueError, struct.error, IndexError, ... on bad files
        reason = (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise Eagle3Error(f"cannot read GGUF file {path} ({reason}): it is truncated or not a GGUF "
                          "file; re-download or re-convert it") from None


def _scalars(reader) -> dict:
    """Metadata fields as Python values, except the big tokenizer arrays."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in (
                "tokens", "merges", "scores", "token_type"):
            out[key] = int(field.parts[4][0])  # the array's length (key, type, item type, length)
            continue
        try:
            out[key] = field.contents()
        except Exception:  # a field whose type this gguf version cannot decode: not needed here
            continue
    return out


def read_gguf(path: str) -> GGUFCheckpoint:
    """Open `path` and translate its metadata into a config.json-style dict (no weights read)."""
    reader = _reader(path)
    meta = _scalars(reader)
    kind = meta.get("general.type", "model")
    if kind == "adapter" or "adapter.type" in meta:
        raise Eagle3Error(f"{path} is a {meta.get('adapter.type', 'LoRA')} adapter, not a model: "
                          "merge it into its base model first, or pass the base model's GGUF")
    arch = meta.get("general.architecture")
    if arch in ("clip", "mmproj") or kind == "mmproj":
        raise Eagle3Error(f"{path} is a vision projector (mmproj), not a language model: pass the "
                          "text model's GGUF")
    if arch not in gguf_families():
        raise Eagle3Error(f"{path}: GGUF architecture '{arch}' is not supported (supported: "
                          f"{', '.join(gguf_families())}); convert the Hugging Face checkpoint instead "
                          "and load it with backend='hf'")
    rows = {t.name: int(t.shape[-1]) for t in reader.tensors}
    if "rope_freqs.weight" in rows:
        raise Eagle3Error(f"{path} carries per-frequency RoPE factors (rope_freqs, Llama 3.1 style), "
                          "which the GGUF loader does not map yet; load the Hugging Face checkpoint")
    config = _hf_config(meta, arch, rows, path)
    return GGUFCheckpoint(path, config, GGUFTensors(list(reader.tensors), reader.data), arch, meta)


def _hf_config(meta: dict, arch: str, rows: dict[str, int], where: str) -> dict:
    """config.json keys from GGUF metadata; `rows`: each tensor's row count (its last GGUF dim)."""
    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    H = get("embedding_length")
    heads = get("attention.head_count")
    if H is None or heads is None or get("block_count") is None:
        raise Eagle3Error(f"{where}: GGUF metadata lacks {arch}.embedding_length / block_count / "
                          "attention.head_count; the file is incomplete: re-download or re-convert it")
    if isinstance(heads, list) or isinstance(get("attention.head_count_kv"), list):
        raise Eagle3Error(f"{where}: per-layer head counts are not supported by the native decoder")
    layers = int(get("block_count"))
    head_dim = int(get("attention.key_length") or H // heads)
    vocab = get("vocab_size") or meta.get("tokenizer.ggml.tokens") or rows.get("token_embd.weight")
    if not vocab:
        raise Eagle3Error(f"{where}: no token_embd.weight tensor and no vocabulary size; the file is "
                          "incomplete: re-download or re-convert it")
    family = gguf_families()[arch]
    cfg = {
        "model_type": family.model_type, "architectures": [f"{arch} (GGUF)"],
        "hidden_size": int(H), "intermediate_size": int(get("feed_forward_length") or 4 * H),
        "num_hidden_layers": layers, "num_attention_heads": int(heads),
        "num_key_value_heads": int(get("attention.head_count_kv") or heads), "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length") or 4096),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in rows,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if get("rope.dimension_count") not in (None, head_dim):
        raise Eagle3Error(f"{where}: partial rotary embeddings (rope.dimension_count "
                          f"{get('rope.dimension_count')} < head dim {head_dim}) are not supported")
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise Eagle3Error(f"{where}: RoPE scaling '{scaling}' is not supported by the GGUF loader")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    if get("attention.sliding_window"):
        cfg["sliding_window"] = int(get("attention.sliding_window"))
    cfg.update(family.gguf_config(get, cfg))
    return cfg


def _hf_name(name: str, gemma: bool) -> str | None:
    """HF tensor name for GGUF tensor `name`, or None when it has no counterpart."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    table = {**_LAYER_NAMES, **(_GEMMA_FFN_NORMS if gemma else _LLAMA_FFN_NORMS)}
    if parts[2] not in table:
        return None
    return f"model.layers.{parts[1]}.{table[parts[2]]}.{suffix}"


def _dequantize(tensor, where: str) -> torch.Tensor:
    import gguf

    qtype = tensor.tensor_type
    if qtype.name not in QUANT_TYPES:
        raise Eagle3Error(f"{where}: tensor {tensor.name} has quantization type {qtype.name}, which "
                          f"the loader does not support (supported: {', '.join(QUANT_TYPES)}); "
                          "re-quantize with llama-quantize to one of them")
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists ne0 (the row length) first
    try:
        data = np.asarray(tensor.data)
        if qtype.name == "BF16":  # stored as raw uint16 / uint8 words
            arr = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float()
        elif qtype.name in ("F32", "F16"):
            arr = torch.from_numpy(data.astype(np.float32))
        else:
            arr = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False))
        return arr.reshape(shape)
    except (ValueError, TypeError, RuntimeError) as e:  # short data: the file was cut
        raise Eagle3Error(f"{where}: tensor {tensor.name} cannot be decoded ({str(e)[:80]}); the "
                          "file is truncated or corrupt: re-download or re-convert it") from None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: rows (heads, 2, hd/2) were stored as (heads, hd/2, 2)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# GGUF block types whose codes a weight format holds as they are (groups of 32 along a row):
# Q8_0 w = d q (int8); Q4_0 w = d (q - 8) and Q4_1 w = d q + m (int4, offset -8 d or m).
BLOCK_FORMATS = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}


def block_codes(tensor, where: str = "GGUF file"
                ) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A Q8_0 / Q4_0 / Q4_1 tensor's codes as stored: (format, codes (N, K), scales (N, K/32),
    offsets (N, K/32) or None), so that `format`'s formula gives llama.cpp's weights."""
    qtype = tensor.tensor_type.name
    N, K = (int(n) for n in reversed(tensor.shape))
    block = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[qtype]
    raw = np.asarray(tensor.data)
    if N <= 0 or K <= 0 or K % 32 or raw.size != N * (K // 32) * block:
        raise Eagle3Error(f"{where}: tensor {tensor.name} ({qtype}, shape {K} x {N}) does not hold whole "
                          "blocks of 32; the file is truncated or corrupt: re-download or re-convert it")
    raw = raw.reshape(N, -1)  # (N, bytes per row)
    blocks = raw.reshape(N, K // 32, -1)  # (N, K/32, bytes per block)
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    if qtype == "Q8_0":
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(N, K)
        return "int8", codes, d, None
    nib = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]  # (N, K/32, 16) bytes
    q = np.concatenate([nib & 15, nib >> 4], axis=-1)  # element j: low nibble of byte j, j+16: high
    codes = torch.from_numpy(q.astype(np.uint8)).reshape(N, K)
    if qtype == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        return "int4", codes, d, m
    return "int4", codes, d, None  # Q4_0: w = (code - 8) * d, no offsets stored


def codes_only_names(named: list[tuple[str, str, tuple[int, int]]]) -> set[str]:
    """The linear weights `quantize='gguf'` will build from their codes alone, given
    (HF name, GGUF type, (N, K)): every part of a (fused) layer stored in one block type whose
    shape the packed layout holds. A tied embedding table is one too: the LM head is built from
    its codes, and the token lookup reads them (`NativeTarget.embed_from_codes`); an untied
    table is not (no layer holds its codes)."""
    from ..kernels import check_shape
    from .decoder import FUSED_PARTS

    part_of = {p: fused for fused, parts in FUSED_PARTS.items() for p in parts}
    groups: dict[str, list[tuple[str, str, tuple[int, int]]]] = {}
    tied = not any(name == "lm_head.weight" for name, _, _ in named)
    for name, kind, shape in named:
        base, _, leaf = name.removesuffix(".weight").rpartition(".")
        linear = name.startswith("model.layers.") and leaf.endswith("_proj")
        if not (linear or name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight")):
            continue
        groups.setdefault(f"{base}.{part_of.get(leaf, leaf)}", []).append((name, kind, shape))
    keep = set()
    for members in groups.values():
        kinds = {kind for _, kind, _ in members}
        if len(kinds) != 1 or next(iter(kinds)) not in BLOCK_FORMATS:
            continue
        try:
            for _, kind, (n, k) in members:
                check_shape(n, k, BLOCK_FORMATS[kind], 32)
        except Eagle3Error:
            continue
        keep.update(name for name, _, _ in members)
    return keep


def _codes_later(ckpt: GGUFCheckpoint, tensor, heads: int) -> Callable[[], tuple]:
    """`block_codes(tensor)` (rows un-permuted for `heads` > 0), read when called: the loader
    packs one layer at a time, so the file's codes are never all unpacked at once, and the
    file's pages a tensor was read from leave the process's memory once it is read."""
    def read() -> tuple:
        fmt, *parts = block_codes(tensor, ckpt.path)
        _drop_pages(ckpt.reader, tensor)
        if heads:
            parts = [p if p is None else _unpermute(p, heads) for p in parts]
        return (fmt, *parts)
    return read


def _drop_pages(reader, tensor) -> None:
    """Unmap the pages of `tensor`'s bytes from this process (they stay in the page cache and
    come back on the next read): a read-only mapping's pages otherwise count as resident
    memory until the reader goes. Best effort: nothing happens where madvise is missing."""
    mm = getattr(getattr(reader, "data", None), "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(tensor.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, int(tensor.data_offset) + int(tensor.n_bytes) - start)
    except (OSError, ValueError):
        pass


def state_dict(ckpt: GGUFCheckpoint, blocks: dict | None = None, types: dict | None = None,
               codes_only: bool = False) -> tuple[dict[str, torch.Tensor], list[str]]:
    """HF-named float32 tensors, and the GGUF tensors that map to nothing. `blocks`, when
    given, also receives {HF name: `block_codes(...)`} for the tensors stored as Q8_0/Q4_0/Q4_1,
    and `types` {HF name: GGUF type name} for all. `codes_only` (with `blocks`): the layers
    `codes_only_names` picks get a memory-free `decoder.placeholder` instead of their
    dequantized weights (`quantize='gguf'` builds them from the codes; loading then never
    holds the model in float32)."""
    from .decoder import placeholder

    family = FAMILIES[ckpt.config["model_type"]]
    gemma = family.gemma
    n_head, n_kv = ckpt.config["num_attention_heads"], ckpt.config["num_key_value_heads"]
    state, unused = {}, []
    named = [(t, _hf_name(t.name, gemma)) for t in ckpt.reader.tensors]
    stub = set()
    if codes_only and blocks is not None:
        shapes = [(name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)))
                  for t, name in named if name is not None and len(t.shape) == 2]
        stub = codes_only_names(shapes)
    for t, name in named:
        if name is None:
            unused.append(t.name)
            continue
        if name in stub:
            permute = family.gguf_permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight"))
            heads = n_head if "q_proj" in name else n_kv
            N, K = (int(n) for n in reversed(t.shape))
            if permute and N % (2 * heads):  # a shape that does not split into heads: the full path says so
                stub.discard(name)
            else:
                if types is not None:
                    types[name] = t.tensor_type.name
                blocks[name] = _codes_later(ckpt, t, heads if permute else 0)
                state[name] = placeholder(N, K)
                continue
        w = _dequantize(t, ckpt.path)
        if types is not None:
            types[name] = t.tensor_type.name
        permute = family.gguf_permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight"))
        heads = n_head if "q_proj" in name else n_kv
        if permute and (w.dim() != 2 or w.shape[0] % (2 * heads)):
            raise Eagle3Error(f"{ckpt.path}: tensor {t.name} has shape {tuple(w.shape)}, which does "
                              f"not split into {heads} heads; the file is corrupt: re-download or "
                              "re-convert it")
        if blocks is not None and t.tensor_type.name in BLOCK_FORMATS and w.dim() == 2:
            fmt, *parts = block_codes(t, ckpt.path)
            if permute:  # llama.cpp's permutation moves whole rows: move the codes with them
                parts = [p if p is None else _unpermute(p, heads) for p in parts]
            blocks[name] = (fmt, *parts)
        _drop_pages(ckpt.reader, t)  # read for the last time
        if permute:
            w = _unpermute(w, heads)
        if gemma and name.endswith("norm.weight"):
            w = w - 1.0
        state[name] = w
    return state, unused


def find_gguf(path: str) -> str | None:
    """`path` itself when it is a .gguf file; the one .gguf in directory `path` (no config.json)."""
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise Eagle3Error(f"GGUF file {path} does not exist; pass an existing .gguf file, a "
                              "checkpoint directory or a model name (eagle3 models)")
        return path
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(found) > 1:
            raise Eagle3Error(f"{path} holds {len(found)} .gguf files ({', '.join(found[:3])}); pass "
                              "the file itself")
        if found:
            return os.path.join(path, found[0])
    return None


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "eagle3"


def gguf_tokenizer_dir(path: str) -> str | None:
    """A directory with `tokenizer.json` + `tokenizer_config.json` converted from GGUF `path`.

    Converted once with transformers (the GGUF loader's own conversion) and cached under
    ~/.cache/eagle3/gguf-tokenizers keyed by the file's path, size and mtime. None when the
    file has no vocabulary.
    """
    st = os.stat(path)
    key = hashlib.sha256(json.dumps([os.path.abspath(path), st.st_size, st.st_mtime_ns]).encode())
    out = _cache_root() / "gguf-tokenizers" / key.hexdigest()[:20]
    if (out / "tokenizer.json").is_file():
        return str(out)
    reader = _reader(path)
    if "tokenizer.ggml.tokens" not in reader.fields:
        return None
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise Eagle3Error("building a tokenizer from GGUF needs transformers: "
                          "pip install 'eagle3[hf]'") from None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
    except Exception as e:  # transformers raises many types for vocabularies it cannot convert
        reason = (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise Eagle3Error(f"{path}: cannot build its tokenizer ({reason}); pass token ids "
                          "(--prompt-ids) or a checkpoint with tokenizer.json") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    meta = {k: reader.fields[k].contents() for k in ("tokenizer.chat_template",) if k in reader.fields}
    cfg = {"chat_template": meta.get("tokenizer.chat_template"),
           "bos_token": tok.bos_token, "eos_token": tok.eos_token}
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.backend_tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v}))
    try:
        os.replace(tmp, out)
    except OSError:  # another process won the race: its copy is the same
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def check_built(target) -> None:
    """After `quantize='gguf'`: no layer may still hold a `codes_only` placeholder."""
    from .decoder import is_placeholder

    left = [n for n, p in target.named_parameters() if is_placeholder(p)]
    if left:
        raise RuntimeError(f"internal error: {len(left)} layer(s) kept no weights (e.g. {left[0]})")


@dataclass
class GGUFCodes:
    """A GGUF file's codes as its loader read them (`load.read_gguf_target`): `blocks` {HF name:
    `block_codes(...)` or a thunk giving them} for Q8_0 / Q4_0 / Q4_1 tensors, `types` {HF name:
    GGUF type name} for all; `tied`: the LM head shares the embedding table."""

    blocks: dict
    types: dict
    tied: bool

    @property
    def stored_quantized(self) -> bool:
        """Whether the file holds linear weights stored quantized."""
        return any(not str(t).startswith(("F32", "F16", "BF16")) for t in self.types.values())

    def layers(self) -> Callable:
        """A `kernels.quantize_model` layer builder that puts each linear layer in the format
        nearest its GGUF type (`quantize='gguf'`); each layer's codes are handed over once."""
        return lambda path, lin: _layer(path, lin, self.tied, self.blocks, self.types)


def _layer(path: str, lin, tied: bool, blocks: dict, types: dict):
    """The format nearest a GGUF layer's type: Q8_0 / Q4_0 / Q4_1 codes as stored; other
    4-bit types requantized to int4 (groups of 32), 5..8-bit ones to int8 (groups of 32),
    float types kept in float32."""
    from ..kernels import QLinear, check_shape
    from .decoder import weight_sources

    names = weight_sources(path, tied)
    bias = None if lin.bias is None else lin.bias.detach()
    got = [blocks.pop(n, None) for n in names]  # each layer's codes once, freed once packed
    got = [g() if callable(g) else g for g in got]
    if all(g is not None for g in got) and len({g[0] for g in got}) == 1:
        fmt = got[0][0]
        if any(g[3] is None for g in got) and any(g[3] is not None for g in got):
            got = [g if g[3] is not None else (*g[:3], -8 * g[2]) for g in got]  # Q4_0 as Q4_1
        cat = lambda i: None if got[0][i] is None else torch.cat([g[i] for g in got])  # noqa: E731
        try:
            return QLinear.from_codes(fmt, cat(1), cat(2), cat(3), bias=bias)
        except Eagle3Error:
            pass  # a shape the packed layout cannot hold: float32 below
    kinds = [types.get(n, "F32") for n in names]
    fmt = ("int4" if any(k.startswith("Q4") for k in kinds)
           else "int8" if any(k.startswith(("Q5", "Q6", "Q8")) for k in kinds) else "float32")
    N, K = lin.weight.shape
    try:
        check_shape(N, K, fmt, 32 if fmt != "float32" else None)
    except Eagle3Error:
        fmt = "float32"
    return QLinear.quantize(lin, fmt, 32 if fmt != "float32" else None)
