"""Loading targets: the `TARGETS` registry, `load_target` and the loaders behind it.

`load_target(path)` loads a checkpoint through its family's `TARGETS[model_type].load` (the
native PyTorch decoder) when the family is in `families.FAMILIES`, else the transformers
adapter `HFTarget` (with a notice), or whichever `backend=` asks for. A family's
`TargetSpec.max_forward_len` is the cache length (and the longest forward) a target gets when
the caller names none, `min_forward_len` + 1 the shortest cache it accepts; `eagle3 export`
bounds its methods by them (`forward_bounds`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import Eagle3Error, NotNative, notice
from .checkpoint import load_into, read_state_dict
from .config import DecoderConfig, parse_decoder_config, read_config_json
from .decoder import NativeTarget
from .families import FAMILIES, Family
from .gguf import GGUFCodes, find_gguf
from .hf import HFTarget
from .named import default_target_dir, resolve_target
from .protocol import TapTarget

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """None -> float32 (CPU default); strings like 'bf16' accepted."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise Eagle3Error(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _generation_eos(path: str) -> tuple[int, ...] | None:
    gen = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen):
        return None
    try:
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise Eagle3Error(f"{gen} is not a valid JSON object; fix or delete it") from None
    if eos is None:
        return None
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in ids):
        raise Eagle3Error(f"{gen}: eos_token_id must be an integer or a list of integers, got {eos!r}; "
                          "fix or delete the file")
    return tuple(ids)


def load_native(path: str, *, dtype: torch.dtype | str | None = None,
                max_seq_len: int | None = None, taps=None) -> NativeTarget:
    """Load a supported HF checkpoint directory into a `NativeTarget`."""
    raw = read_config_json(path)
    cfg = parse_decoder_config(raw, where=os.path.join(path, "config.json"), max_seq_len=max_seq_len)
    eos = _generation_eos(path)
    if eos is not None:
        cfg.eos_token_ids = eos
    return _build_native(cfg, read_state_dict(path), path, dtype, taps)


def read_gguf_target(path: str, *, dtype: torch.dtype | str | None = None,
                     max_seq_len: int | None = None, taps=None,
                     codes_only: bool = False) -> tuple[NativeTarget, GGUFCodes]:
    """Load a GGUF file (llama.cpp's format) into a `NativeTarget` (weights dequantized) and
    return it with the file's codes (`gguf.GGUFCodes`), which `quantize='gguf'` turns into
    weight formats holding them as they are. `codes_only`: the caller will run
    `quantize='gguf'`, so layers stored in those types are not dequantized at all
    (`gguf.state_dict`): the load peaks near the codes' size.
    """
    from .gguf import read_gguf, state_dict

    ckpt = read_gguf(path)
    cfg = parse_decoder_config(ckpt.config, where=path, max_seq_len=max_seq_len)
    codes = GGUFCodes({}, {}, bool(cfg.tie_word_embeddings))
    state, unused = state_dict(ckpt, codes.blocks, codes.types, codes_only=codes_only)
    if unused:
        notice(f"{path}: ignoring {len(unused)} GGUF tensor(s) with no native counterpart "
               f"(e.g. {unused[0]})")
    return _build_native(cfg, state, path, dtype, taps), codes


def load_gguf(path: str, *, dtype: torch.dtype | str | None = None,
              max_seq_len: int | None = None, taps=None) -> NativeTarget:
    """Load a GGUF file into a `NativeTarget` with float32 weights (`read_gguf_target` also
    returns the file's codes, for `quantize='gguf'`)."""
    return read_gguf_target(path, dtype=dtype, max_seq_len=max_seq_len, taps=taps)[0]


def check_sizes(cfg: DecoderConfig, state: dict[str, torch.Tensor], where: str) -> None:
    """The config's vocabulary, width and depth against the tensors, before any module is built:
    a corrupt config (10**9 layers, a huge hidden size) fails here instead of exhausting memory."""
    embed = state.get("model.embed_tokens.weight")
    if not isinstance(embed, torch.Tensor):
        raise Eagle3Error(f"{where} lacks tensor model.embed_tokens.weight: the weights are "
                          "incomplete or not a causal LM; re-download or re-convert the checkpoint")
    if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise Eagle3Error(f"{where}: model.embed_tokens.weight has shape {tuple(embed.shape)} but the "
                          f"config implies ({cfg.vocab_size}, {cfg.hidden_size}); the config and weights "
                          "disagree (fix the config, or re-download / re-convert the checkpoint)")
    found = {k.split(".")[2] for k in state if k.startswith("model.layers.")}
    if cfg.num_hidden_layers > len(found):
        raise Eagle3Error(f"{where}: the config says {cfg.num_hidden_layers} layers but the weights "
                          f"hold {len(found)}; fix the config, or re-download / re-convert the checkpoint")


def _build_native(cfg: DecoderConfig, state: dict[str, torch.Tensor], where: str, dtype,
                  taps) -> NativeTarget:
    dt = resolve_dtype(dtype)
    check_sizes(cfg, state, where)
    with torch.device("meta"):
        model = NativeTarget(cfg)
    optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    extra = load_into(model, state, where, dtype=dt, optional=optional,
                      ignore_suffixes=("rotary_emb.inv_freq", "lm_head.weight"))
    if extra:
        notice(f"{where}: ignoring {len(extra)} tensor(s) the model does not use "
               f"(e.g. {extra[0]})")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    state.clear()  # the model holds the tensors now: fusing then frees each layer's parts as it goes
    model.build_buffers()
    model.fuse_projections()
    if taps is not None:
        model.tap_layers = taps
    return model.eval().requires_grad_(False)


def load_hf(path: str, *, dtype: torch.dtype | str | None = None,
            max_seq_len: int | None = None, taps=None) -> HFTarget:
    """Load any checkpoint transformers can load, through the `HFTarget` adapter."""
    read_config_json(path)  # same clear errors as the native path
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise Eagle3Error("the transformers adapter needs transformers: "
                          "pip install 'eagle3[hf]'") from None
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its multi-line load reports would bury our one-line error
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
    except Exception as e:  # transformers and safetensors raise many unrelated types here
        reason = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise Eagle3Error(f"transformers could not load {path} ({reason}); check the checkpoint "
                          "is complete and matches its config.json") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return HFTarget(model, max_seq_len=max_seq_len, taps=taps)


def target_path(target: str) -> tuple[str, str | None]:
    """Where `target` (a checkpoint dir, a .gguf file or a directory holding one, a model name
    or 'default') lives: (path, its GGUF file or None), resolved as `load_target` does."""
    if target == "default":
        target = default_target_dir()
    path = resolve_target(target)
    exists = os.path.exists(path) or path.endswith(".gguf")
    return path, find_gguf(path) if exists else None


def _load_default(path: str | None = None, **kw) -> TapTarget:
    return load_target(default_target_dir(), **kw)


@dataclass(frozen=True)
class TargetSpec:
    """How to load one kind of target, and the forward lengths it accepts: `load_target` gives a
    target of this family a cache of `max_forward_len` slots (at most the checkpoint's
    max_position_embeddings) unless the caller asks for another `max_seq_len`, at least
    `min_forward_len` + 1; export bounds its methods by that length."""

    load: Callable[..., TapTarget]
    max_forward_len: int
    min_forward_len: int = 1
    description: str = ""


def family_spec(family: Family) -> TargetSpec:
    """A native family's registry entry: the native loader and the family's forward bounds."""
    return TargetSpec(load_native, family.max_forward_len, family.min_forward_len, family.description)


TARGETS: dict[str, TargetSpec] = {
    **{name: family_spec(f) for name, f in FAMILIES.items()},
    "hf": TargetSpec(load_hf, 4096, 1, "any transformers AutoModelForCausalLM (adapter)"),
    "gguf": TargetSpec(load_gguf, 4096, 1, "a GGUF file (llama.cpp): llama, qwen2, qwen3, gemma2, gemma3"),
    "default": TargetSpec(_load_default, 4096, 1, "the embedded default: SmolLM2-135M-Instruct (GGUF)"),
}


def register_family(family: Family) -> Family:
    """Add `family` to the table and the registry at run time (a family outside this package);
    one written in `families.py` is registered by its line in `FAMILIES`."""
    if family.model_type in TARGETS and family.model_type not in FAMILIES:
        raise Eagle3Error(f"'{family.model_type}' already names a target kind; pick another model_type")
    FAMILIES[family.model_type] = family
    TARGETS[family.model_type] = family_spec(family)
    return family


def forward_bounds(target: TapTarget) -> tuple[int, int]:
    """The cache lengths a loaded target accepts, (shortest, longest): its registry entry's
    `min_forward_len` + 1 (a prompt token and one more), and the length it was loaded with."""
    kind = target.config.model_type if isinstance(target, NativeTarget) else "hf"
    return TARGETS.get(kind, TARGETS["hf"]).min_forward_len + 1, target.config.max_seq_len


BACKENDS = ("auto", "native", "hf")


def load_target(target: str, *, dtype: torch.dtype | str | None = None, backend: str = "auto",
                max_seq_len: int | None = None, taps=None) -> TapTarget:
    """Load `target` (a checkpoint dir, a .gguf file, a registered model name or 'default').

    backend: 'auto' (native when the architecture is supported, else the
    transformers adapter), 'native', or 'hf'. A GGUF file loads with float32 weights
    (`open_target` also returns its codes).
    """
    return open_target(target, dtype=dtype, backend=backend, max_seq_len=max_seq_len, taps=taps)[0]


def open_target(target: str, *, dtype: torch.dtype | str | None = None, backend: str = "auto",
                max_seq_len: int | None = None, taps=None,
                gguf_codes_only: bool = False) -> tuple[TapTarget, GGUFCodes | None]:
    """`load_target`, returning the target with its GGUF file's codes (None for other files).
    gguf_codes_only: see `read_gguf_target(codes_only=)` (the caller then must prepare the
    target with quantize='gguf' and those codes)."""
    if backend not in BACKENDS:
        raise Eagle3Error(f"unknown backend '{backend}'; use one of {', '.join(BACKENDS)}")
    shortest = min(spec.min_forward_len for spec in TARGETS.values()) + 1
    if max_seq_len is not None and max_seq_len < shortest:
        raise Eagle3Error(f"max_seq_len must be >= {shortest}, got {max_seq_len}")

    def kw(kind: str) -> dict:  # the registry's bounds when the caller names no length
        spec = TARGETS[kind]
        if max_seq_len is not None and max_seq_len <= spec.min_forward_len:
            raise Eagle3Error(f"max_seq_len must be >= {spec.min_forward_len + 1} for {kind} targets, "
                              f"got {max_seq_len}")
        return dict(dtype=dtype, max_seq_len=max_seq_len or spec.max_forward_len, taps=taps)

    if target == "default":
        return open_target(default_target_dir(), backend=backend, gguf_codes_only=gguf_codes_only,
                           **kw("default"))
    target = resolve_target(target)
    gguf_file = find_gguf(target)
    if gguf_file is not None:
        if backend == "hf":
            raise Eagle3Error(f"{gguf_file} is a GGUF file, which loads natively only; drop "
                              "backend='hf' (--backend hf)")
        return read_gguf_target(gguf_file, codes_only=gguf_codes_only, **kw("gguf"))
    if target in TARGETS and not os.path.isdir(target):
        raise Eagle3Error(f"'{target}' is a target family, not a checkpoint: pass the checkpoint "
                          "directory (the family is read from its config.json)")
    return _open_checkpoint(target, read_config_json(target).get("model_type"), backend, kw), None


def _open_checkpoint(path: str, family: str | None, backend: str, kw: Callable[[str], dict]) -> TapTarget:
    """A checkpoint directory through its family's registered loader, or the transformers
    adapter when the family has none (or the native decoder cannot honour its config)."""
    if backend == "hf":
        return load_hf(path, **kw("hf"))
    if backend == "native" or family in FAMILIES:
        native = family in FAMILIES
        try:  # an unknown family under backend='native': load_native names the supported ones
            return (TARGETS[family].load if native else load_native)(path, **kw(family if native else "hf"))
        except NotNative as e:
            if backend == "native":
                raise
            notice(f"{e}; falling back to the transformers adapter")
            return load_hf(path, **kw("hf"))
    notice(f"model_type '{family}' has no native target; using the transformers "
           "adapter (slower)")
    return load_hf(path, **kw("hf"))
