"""`eagle3 export`: torch.export the speculator's methods and lower them to one ExecuTorch program.

The program holds the four methods of ExecuTorch's `Eagle3Speculator` contract
(`contract.SpeculatorMethods`, the same code the eager speculator runs) over shared
state, the caches being mutable buffers that every method reads and writes in place
(`share_mutable_buffers`), plus `draft_step` (draft_decode of one token, static) and
`plain_decode` (decode without the taps: plain decoding):

    prefill(tokens (1, T), input_pos (T,))       -> (token (1,), feature (1, T, H))      T: 2..max_len
    target_verify(tokens (1, T), input_pos (T,)) -> (verify_ids (1, T), feature (1, T, H)) T: 2..K+1
    draft_decode(tokens, feature, input_pos)     -> (target_ids (1, T), next_feature)      T: 1..max_len
    decode(tokens (1, 1), input_pos (1,))        -> (token (1,), feature (1, 1, H))

Lengths are dynamic within those bounds (one graph per method); the metadata (bounds,
taps, vocabularies, d2t, stop ids) is baked in as constant methods and written beside
the program as `eagle3_program.json`, with the target's tokenizer files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from typing import Any

import torch
from torch import nn

from ..decoding.contract import CONTRACT_METHODS, SpeculatorMethods
from ..errors import Eagle3Error
from ..files import atomic_dir, check_writable
from .cache import ExportKVCache

PROGRAM_FILE = "program.pte"
META_FILE = "eagle3_program.json"
FORMAT_VERSION = 1
QUANTIZE_MODES = ("none", "int8", "int4")
EXTRA_METHODS = ("draft_step", "plain_decode")


class SpeculatorProgram(SpeculatorMethods):
    """The contract's methods (`contract.SpeculatorMethods`, the eager reference itself) over
    export caches, plus two methods for speed; its methods are what gets exported."""

    def __init__(self, target: Any, draft: Any, taps: tuple[int, ...], max_seq_len: int) -> None:
        cfg, dcfg = target.config, draft.config
        dtype = target.lm_head.weight.dtype
        super().__init__(target, draft, taps,
                         ExportKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, max_seq_len,
                                       cfg.head_dim, dtype),
                         ExportKVCache(1, dcfg.num_key_value_heads, max_seq_len, dcfg.head_dim, dtype))

    # Beyond the contract, for speed. plain_decode: a plain decoding step without the taps and
    # the head's fc, so that the program's own plain decoding is a fair baseline.
    def plain_decode(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        logits, _ = self.target.forward_logits_taps(tokens, input_pos, self.target_cache,
                                                    last_only=True, with_taps=False)
        return logits[:, -1].argmax(-1)

    # draft_step: a method whose input length changes re-plans its XNNPACK
    # graphs (docs/export.md), and draft steps alternate with multi-token rebuilds every round.
    def draft_step(self, tokens: torch.Tensor, feature: torch.Tensor,
                   input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_decode of one token: a method of its own, so its shapes never change."""
        return self.draft_decode(tokens, feature, input_pos)


class _Method(nn.Module):
    """`forward` = one method of the shared program (same buffer names in every method)."""

    def __init__(self, program: SpeculatorProgram, name: str) -> None:
        super().__init__()
        self.program, self.name = program, name

    def forward(self, *args: torch.Tensor):
        return getattr(self.program, self.name)(*args)


def check_exportable(spec: Any, max_seq_len: int, max_draft_tokens: int) -> None:
    """Refuse, with a one-line reason, what the exported kernels cannot compute exactly."""
    from ..targets import forward_bounds
    from ..targets.decoder import NativeTarget

    target = spec.target
    if spec.draft is None:
        raise Eagle3Error("export needs a draft head: pass --draft (plain decoding alone is not exported)")
    if not isinstance(target, NativeTarget):
        raise Eagle3Error("export needs a native target (this one runs through transformers); "
                          "load with backend='native'")
    cfg = target.config
    if cfg.final_softcap or cfg.attn_softcap:
        raise Eagle3Error(f"export does not support attention soft-capping ({cfg.model_type}): the "
                          "exported attention kernel has none; use the eager or compiled backend")
    windows = [w for w in cfg.layer_windows if w is not None and w < max_seq_len]
    if windows:
        raise Eagle3Error(f"export does not support sliding windows shorter than the cache (window "
                          f"{min(windows)} < max_seq_len {max_seq_len}); export with --max-seq-len "
                          f"{min(windows)} or less")
    if spec.target.lm_head.weight.dtype != torch.float32:
        raise Eagle3Error("export runs in float32: load the target without dtype (or dtype='fp32')")
    shortest, longest = forward_bounds(target)  # the family's registered bounds
    if not shortest <= max_seq_len <= longest:
        raise Eagle3Error(f"max_seq_len must be in {shortest}..{longest} (the target's), got {max_seq_len}")
    if not 1 <= max_draft_tokens < max_seq_len - 1:
        raise Eagle3Error(f"max_draft_tokens must be in 1..{max_seq_len - 2}, got {max_draft_tokens}")


def export_methods(spec: Any, max_seq_len: int, max_draft_tokens: int) -> dict[str, Any]:
    """torch.export each method with dynamic lengths (`spec` passed `check_exportable`);
    returns {name: ExportedProgram}."""
    from torch.export import Dim, export

    program = SpeculatorProgram(spec.target, spec.draft, spec.taps, max_seq_len).eval()
    H = spec.draft.config.hidden_size
    T_prefill = Dim("T_prefill", min=2, max=max_seq_len)
    T_verify = Dim("T_verify", min=2, max=max_draft_tokens + 1)
    T_draft = Dim("T_draft", min=1, max=max_seq_len)
    tok = lambda n: torch.zeros(1, n, dtype=torch.long)  # noqa: E731
    pos = lambda n: torch.arange(n)  # noqa: E731
    examples = {
        "prefill": ((tok(4), pos(4)), ({1: T_prefill}, {0: T_prefill})),
        "target_verify": ((tok(2), pos(2)), ({1: T_verify}, {0: T_verify})),
        "draft_decode": ((tok(3), torch.zeros(1, 3, H), pos(3)),
                         ({1: T_draft}, {1: T_draft}, {0: T_draft})),
        "decode": ((tok(1), pos(1)), None),
        "draft_step": ((tok(1), torch.zeros(1, 1, H), pos(1)), None),
        "plain_decode": ((tok(1), pos(1)), None),
    }
    out = {}
    with torch.no_grad():
        for name, (args, dims) in examples.items():
            # strict=True: non-strict export of dynamic lengths was seen to fail to lower with
            # this executorch ("expected compiled_fn to be GraphModule")
            out[name] = export(_Method(program, name), args,
                               dynamic_shapes=None if dims is None else {"args": dims}, strict=True)
    return out


def lower(programs: dict[str, Any], metadata: dict[str, Any]) -> bytes:
    """Lower the exported methods to one ExecuTorch program (XNNPACK), caches shared; its bytes."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    constants = {
        "max_seq_len": metadata["max_seq_len"], "max_draft_tokens": metadata["max_draft_tokens"],
        "vocab_size": metadata["vocab_size"], "hidden_size": metadata["hidden_size"],
        "taps": torch.tensor(metadata["taps"]), "d2t": torch.tensor(metadata["d2t"]),
    }
    edge = to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()],
                                       constant_methods=constants)
    et = edge.to_executorch(ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=True),
        emit_mutable_buffer_names=True))
    return et.buffer


def check_out_dir(out_dir: str) -> None:
    """--out must be a new or empty directory in an existing, writable parent (checked before
    minutes of lowering)."""
    if not isinstance(out_dir, str) or not out_dir:
        raise Eagle3Error("give an output directory (--out DIR)")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise Eagle3Error(f"--out {out_dir} is a file; choose a new directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise Eagle3Error(f"output directory {out_dir} exists and is not empty; choose a new --out")
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise Eagle3Error(f"the parent of --out ({parent}) does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise Eagle3Error(f"cannot write to {parent}; choose a writable --out")


def _weight_bytes(spec: Any) -> int:
    from ..kernels import weight_bytes

    return weight_bytes(*(m for m in (spec.target, spec.draft) if isinstance(m, nn.Module)))


def export_program(spec: Any, out_dir: str, *, max_seq_len: int | None = None,
                   max_draft_tokens: int = 8, quantize: str = "none", source: dict | None = None,
                   tokenizer_dir: str | None = None, log=print) -> dict[str, Any]:
    """Export `spec` (a target + head) to `out_dir`/program.pte + metadata; returns the metadata.

    Writes into a temporary directory beside `out_dir`, renamed into place when complete: a
    failed export leaves nothing behind. `quantize` quantizes `spec`'s weights in place;
    float32 layers on the row-invariant kernels become stock PyTorch layers first.
    """
    if quantize not in QUANTIZE_MODES:
        raise Eagle3Error(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {quantize!r}")
    if importlib.util.find_spec("executorch") is None:
        raise Eagle3Error("export needs ExecuTorch: pip install 'eagle3[export]' (executorch from PyPI)")
    cfg = spec.target.config
    max_seq_len = max_seq_len or cfg.max_seq_len
    from ..kernels import to_stock_layers

    for model in (spec.target, spec.draft):  # the program lowers stock layers
        if model is not None:
            to_stock_layers(model)
    check_exportable(spec, max_seq_len, max_draft_tokens)
    check_out_dir(out_dir)
    # The program holds the weights (at most float32): room for them before minutes of lowering.
    check_writable(os.path.dirname(os.path.abspath(out_dir)), need_bytes=_weight_bytes(spec) + (1 << 20),
                   what="the parent of --out")
    from .quantize import quantize_weights

    metadata = {
        "format_version": FORMAT_VERSION, "max_seq_len": max_seq_len,
        "max_draft_tokens": max_draft_tokens, "min_prefill_len": 2,
        "vocab_size": cfg.vocab_size, "hidden_size": spec.draft.config.hidden_size,
        "draft_vocab_size": spec.draft.config.draft_vocab_size,
        "taps": list(spec.taps), "d2t": spec.draft.d2t.tolist(),
        "eos_token_ids": list(cfg.eos_token_ids), "quantize": quantize,
        "methods": [*CONTRACT_METHODS, *EXTRA_METHODS],
        "source": source or {},
    }
    t0 = time.perf_counter()
    if quantize != "none":
        log(f"quantizing linear layers ({quantize} weights, int8 dynamic activations) ...")
        metadata["quantization_error"] = err = quantize_weights(spec, quantize)
        log(f"{quantize}: max |logit error| {err['max_abs_logit_error']:.4f}, mean "
            f"{err['mean_abs_logit_error']:.4f} (mean |logit| {err['logit_scale']:.2f}), argmax agreement "
            f"{err['argmax_agreement']:.1%} over {err['probe_tokens']} tokens")
    log(f"exporting {len(metadata['methods'])} methods (max_seq_len {max_seq_len}, verify up to "
        f"{max_draft_tokens + 1} tokens) ...")
    programs = export_methods(spec, max_seq_len, max_draft_tokens)
    log(f"lowering to ExecuTorch + XNNPACK (a minute or more) ... [{time.perf_counter() - t0:.0f} s]")
    data = lower(programs, metadata)
    # Filled in a temporary directory beside out_dir, fsynced and renamed into place when complete:
    # a failed or killed export leaves no partial OUT (and the next export removes its leftovers).
    with atomic_dir(out_dir) as tmp:
        with open(os.path.join(tmp, PROGRAM_FILE), "wb") as f:
            f.write(data)
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(metadata, f, indent=1)
        if tokenizer_dir:
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if os.path.isfile(os.path.join(tokenizer_dir, name)):
                    shutil.copy(os.path.join(tokenizer_dir, name), tmp)
    log(f"wrote {os.path.join(out_dir, PROGRAM_FILE)} ({len(data) / 1e6:.1f} MB) in "
        f"{time.perf_counter() - t0:.0f} s")
    return metadata
