"""`eagle3.load`: the one-call entry point."""

from __future__ import annotations

import os

import torch

from .errors import Eagle3Error, notice
from .kernels import WeightFormat
from .speculator import Eagle3Speculator
from .targets import open_target, prepare_loaded, resolve_dtype
from .targets.decoder import NativeTarget
from .targets.tokenizer import load_tokenizer


def load(target: str, draft: str | None = None, *, dtype: torch.dtype | str | None = None,
         backend: str = "auto", max_seq_len: int | None = None, taps=None,
         compile: bool = False, program: str | None = None,
         device: str | torch.device | None = None, quantize: str | None = "auto",
         calibrate: bool = True) -> Eagle3Speculator:
    """Load a target (checkpoint dir, or 'default') and an optional EAGLE-3 head.

    draft: a head directory; None (the default head for 'default', else no
    speculation); or 'none' (plain decoding). backend: 'auto' | 'native' | 'hf' |
    'executorch' (an exported program: `program` = the `eagle3 export --out` directory,
    which holds the target and head; `target` then only names the tokenizer when the
    program directory has none, and draft='none' decodes plainly).
    taps: target layers feeding the head (default: the head config's ids, else
    (2, L//2, L-3)); tap k = hidden state entering layer k. compile: run the
    decode / verify / draft steps through torch.compile (`Eagle3Speculator.compile`;
    native backend only; the calibration below then compiles every K's chain and verify:
    minutes the first time, inductor's disk cache after). calibrate: with a head, measure
    the cost model automatic K uses before returning (`Eagle3Speculator.calibrate`, about a
    second eager); False leaves it to `calibrate()` or the first automatic generation (the
    engine measures its own, so `eagle3 serve` and `export` skip it). device: where the target and
    head run ('cpu' default, 'cuda', 'cuda:1', ...); every tensor the decoding round builds
    lives there too.
    quantize: the native target's weight format (`kernels.prepare_target`): 'auto' (the
    default, here and on the command line: the fastest exact path, i.e. 'gguf' for a GGUF
    file stored quantized when the kernels run here on a float32 CPU target, else float32);
    None / 'fp32' = float32 through the row-invariant kernels (what transformers is checked
    against); 'bf16', 'int8', 'int4' (blocks of 32; 'int4-g64', 'int8-g64' set the group);
    'gguf' (a .gguf target's codes as stored); 'none' = stock PyTorch layers. Every format
    but 'none' gives speculative output bit-identical to plain decoding. The head takes the
    same format when quantized.
    """
    if not isinstance(target, str) or not target:
        raise Eagle3Error("target must be a checkpoint directory or 'default'")
    dev = resolve_device(device)
    fmt = WeightFormat.parse(quantize)  # once: a bad name fails before any loading
    if backend == "executorch" or program is not None:
        _check_program_args(fmt, dev)
        return calibrated(_load_program(target, draft, dtype, backend, max_seq_len, taps, compile,
                                        program), calibrate)
    draft = _check_draft(target, draft, backend, compile)
    # Decided once, before loading: whether a GGUF's own codes will be used; then its
    # quantized layers are never built in float32.
    codes_only = dev.type == "cpu" and fmt.takes_codes(resolve_dtype(dtype) == torch.float32)
    tgt, codes = open_target(target, dtype=dtype, backend=backend, max_seq_len=max_seq_len,
                             gguf_codes_only=codes_only)
    head = _load_head(draft, dtype, tgt, taps)
    fmt = prepare_loaded(tgt, fmt, codes, head, codes_only=codes_only, device=dev)
    if isinstance(tgt, NativeTarget):
        return_freed_memory()
    if head is not None and not getattr(tgt, "exact", False):
        notice(f"{inexact_reason(tgt, fmt, dev)}: the verify forward over K+1 tokens may round "
               "differently from a 1-token step, so speculative output can differ from plain "
               "decoding at near-ties; a float32 native target on the CPU (quantize None, fp32, "
               "bf16, int8, int4 or gguf) is bit-identical")
    spec = Eagle3Speculator(tgt, head, load_tokenizer(target))
    return calibrated(spec.compile() if compile else spec, calibrate)


def _check_program_args(fmt: WeightFormat, dev: torch.device) -> None:
    """What an exported program fixes at export: its weight format and device."""
    if fmt.named and fmt.fmt is not None:
        raise Eagle3Error("an exported program's weight format is chosen at export "
                          "(eagle3 export --quantize); drop quantize")
    if dev.type != "cpu":
        raise Eagle3Error("an exported program runs on the CPU; drop device (--device)")


def _check_draft(target: str, draft: object, backend: str, compile: bool) -> str | None:
    """One-line errors for the eager path's arguments before anything loads; returns the head
    directory to load (the default head for 'default' when none is named), or None."""
    from .targets.default import default_head_dir

    if draft is not None and not isinstance(draft, str):
        raise Eagle3Error("draft must be a head directory, 'none' or None")
    if compile and backend == "hf":
        raise Eagle3Error("compile needs the native backend (backend='hf' runs the target through "
                          "transformers); use backend='native' or 'auto', or drop compile")
    if draft is None and target == "default":
        draft = default_head_dir()
    if draft in (None, "none"):
        return None
    if not os.path.isdir(draft):
        raise Eagle3Error(f"draft head '{draft}' is not a directory: pass an EAGLE-3 head "
                          "directory (config.json + weights) or 'none'")
    if not os.path.isfile(os.path.join(draft, "config.json")):
        raise Eagle3Error(f"draft head {draft} has no config.json: pass an EAGLE-3 head "
                          "directory (official, SGLang or speculators format) or 'none'")
    return draft


def _load_head(draft: str | None, dtype: torch.dtype | str | None, target: object,
               taps: object) -> torch.nn.Module | None:
    """The head in `draft` (None: no speculation), its caches as long as the target's, attached
    to the target (its embedding table and taps: `draft.attach_head`)."""
    if draft is None:
        return None
    from .draft import attach_head, load_head

    head = load_head(draft, dtype=resolve_dtype(dtype), max_len=target.config.max_seq_len)[1]
    attach_head(head, target, where=f"head {draft}", taps=taps)
    return head


def calibrated(spec: Eagle3Speculator, calibrate: bool) -> Eagle3Speculator:
    """`spec` with automatic K's cost model measured when it has a head and `calibrate` is set:
    at load, never inside a timed generation."""
    if spec.draft is not None and calibrate:
        spec.calibrate()
    return spec


def inexact_reason(target: object, fmt: WeightFormat, device: torch.device) -> str:
    """Why a loaded target runs stock (not row-invariant) kernels, in a few words."""
    if not isinstance(target, NativeTarget):
        return "the transformers adapter runs stock PyTorch kernels"
    if fmt.fmt is None:
        return "quantize='none' runs stock PyTorch layers"
    if device.type != "cpu":
        return f"on {device.type} the target runs stock PyTorch kernels"
    if target.embedding_weight.dtype != torch.float32:
        return f"dtype {str(target.embedding_weight.dtype).removeprefix('torch.')} runs stock PyTorch kernels"
    return "the row-invariant kernels are not built here, so stock PyTorch kernels run"


def return_freed_memory() -> None:
    """Hand the heap pages freed while loading (dequantized and unfused copies) back to the OS.

    glibc keeps large freed blocks for reuse, so without this a loaded GGUF target stays
    ~500 MB above what it holds; elsewhere this does nothing."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch device that exists here; one-line errors otherwise."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise Eagle3Error(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise Eagle3Error(f"device {device!r}: CUDA is not available on this machine; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise Eagle3Error(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA "
                              "device(s)")
    elif dev.type != "cpu":
        raise Eagle3Error(f"device {device!r} is not supported; use cpu or cuda")
    return dev


def _load_program(target, draft, dtype, backend, max_seq_len, taps, compile, program) -> Eagle3Speculator:
    from .export.runtime import load_program

    if backend != "executorch":
        raise Eagle3Error("program= runs an exported program: pass backend='executorch' with it")
    if program is None:
        raise Eagle3Error("backend 'executorch' needs program=DIR (--program DIR on the command line), the "
                          "--out directory of `eagle3 export`")
    if compile:
        raise Eagle3Error("compile applies to the eager backend; an exported program is already lowered")
    if taps is not None or max_seq_len is not None:
        raise Eagle3Error("taps and max_seq_len are fixed when a program is exported; "
                          "export again to change them")
    if dtype is not None and resolve_dtype(dtype) != torch.float32:
        raise Eagle3Error("exported programs run in float32 (weight-only quantization is chosen at "
                          "export); drop dtype")
    if draft not in (None, "none"):
        raise Eagle3Error("the exported program holds its head: pass draft=None (speculate) or "
                          "'none' (plain decoding)")
    tokenizer = None
    if not os.path.isfile(os.path.join(str(program), "tokenizer.json")):
        try:
            tokenizer = load_tokenizer(target)
        except Eagle3Error:  # `target` only names a tokenizer here, and may name none
            tokenizer = None
    return load_program(program, tokenizer, speculate=draft != "none")
