"""The `executorch` backend: the speculative round over an exported program's methods.

`ProgramRunner` implements `decoding.runner.Runner` with the program's methods
(`executorch.runtime`), so `generate` runs the same round (`decoding.round`) as the
eager backend. The program owns the KV caches and returns token ids rather than
logits: the runner hands them to the round as one-hot scores, so greedy acceptance
reads them unchanged. Both it and `ExecutorchSpeculator` (an `Eagle3Speculator` over
that runner) call the program through `LoweredMethods`, the contract's four methods as
lowered, with one `cache.SlotBook` per cache checking that every call writes contiguous
slots (the exported attention is causal from its first position).

Greedy plain decoding and greedy chain drafting run here; trees (the exported
verify takes no tree mask), sampling (the methods return ids, not logits) and
torch.compile are refused with one-line errors.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch

from ..decoding.drafting import EagerDrafting
from ..decoding.layout import Layout
from ..decoding.runner import one_row
from ..errors import Eagle3Error, notice
from ..speculator import Eagle3Speculator, GenerationResult
from ..targets.cache import SlotBook
from .program import CONTRACT_METHODS, EXTRA_METHODS, FORMAT_VERSION, META_FILE, PROGRAM_FILE

# Bounds on the metadata's sizes: beyond them the file is corrupt (the runner allocates
# (tokens, vocab_size) score tables and per-position bookkeeping from these numbers).
MAX_VOCAB = 2**24
MAX_SEQ_LEN = 2**24


@dataclass(frozen=True)
class ProgramConfig:
    """What the runner reads of a target's config, from the program's metadata."""

    vocab_size: int
    max_seq_len: int
    eos_token_ids: tuple[int, ...]


class ProgramTarget:
    """Host-side stand-in for the target inside a program: its config, taps and slot books."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.config = ProgramConfig(meta["vocab_size"], meta["max_seq_len"], tuple(meta["eos_token_ids"]))
        self.tap_layers = tuple(meta["taps"])
        self.embedding_weight = torch.empty(0)  # device probe: the program runs on the CPU

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> SlotBook:
        return SlotBook(max_len or self.config.max_seq_len)


@dataclass(frozen=True)
class ProgramHeadConfig:
    draft_vocab_size: int


class ProgramHead:
    """Host-side stand-in for the head inside a program."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.config = ProgramHeadConfig(meta["draft_vocab_size"])
        self.embed_tokens = True  # the program's head shares the target's table
        self.tap_layers = tuple(meta["taps"])  # fixed inside the program

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> SlotBook:
        return SlotBook(max_len)


class LoweredMethods:
    """The contract's four methods (`contract.SpeculatorMethods`) answered by the graphs that
    `eagle3 export` lowered from them: the same signatures, greedy ids instead of logits.
    A one-token prefill or decode runs the program's `decode` (its prefill takes 2+ tokens) and a
    one-token draft its `draft_step`; without a head, decode is `plain_decode` (no feature)."""

    def __init__(self, run: Any, max_draft_tokens: int, speculate: bool) -> None:
        self.run, self.max_draft_tokens, self.speculate = run, max_draft_tokens, speculate

    def _target(self, name: str, tokens: torch.Tensor, input_pos: torch.Tensor):
        if tokens.shape[1] == 1:
            name = "decode" if self.speculate else "plain_decode"
        out = self.run(name, tokens, input_pos)
        return out[0], (out[1] if len(out) > 1 else None)

    def prefill(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int | None = None):
        ids, feature = self._target("prefill", tokens, input_pos)
        return ids.view(-1)[-1:], feature

    def check_verify(self, T: int) -> None:
        """A verify over T tokens fits the program's bound (checked before any slot is booked)."""
        if T > self.max_draft_tokens + 1:
            raise Eagle3Error(f"target_verify over {T} tokens exceeds the program's bound "
                              f"({self.max_draft_tokens + 1}); export with --max-draft-tokens {T - 1}")

    def target_verify(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int | None = None):
        self.check_verify(tokens.shape[1])
        ids, feature = self._target("target_verify", tokens, input_pos)
        return ids.view(1, -1), feature

    def draft_decode(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor,
                     kv_len: int | None = None):
        ids, h = self.run("draft_step" if tokens.shape[1] == 1 else "draft_decode", tokens, feature,
                          input_pos)
        return ids.view(1, -1), h

    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int | None = None):
        ids, feature = self._target("decode", tokens, input_pos)
        return ids.view(-1), feature


class ProgramRunner(EagerDrafting):
    """`decoding.runner.Runner` over a program's methods: one sequence, chains, greedy."""

    def __init__(self, methods: dict[str, Any], meta: dict[str, Any], speculate: bool) -> None:
        self.methods = methods
        self.device = torch.device("cpu")
        self.max_len = meta["max_seq_len"]
        self.vocab_size = meta["vocab_size"]
        self.max_draft_tokens = meta["max_draft_tokens"]
        self.has_draft = speculate
        self.supports_trees = False
        self.target_cache = SlotBook(self.max_len)  # the contract methods' checks
        self.draft_cache = SlotBook(self.max_len) if speculate else None
        self.contract = LoweredMethods(self.run, self.max_draft_tokens, speculate)

    def run(self, name: str, *inputs: torch.Tensor) -> list[torch.Tensor]:
        try:
            out = self.methods[name].execute([x.contiguous() for x in inputs])
        except RuntimeError as e:  # the program disagrees with its metadata, or is corrupt
            raise Eagle3Error(f"the exported program failed in method {name} ({_first_line(e)}); "
                              "the program.pte or its metadata is corrupt: export again") from None
        ids = out[0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise Eagle3Error(f"the exported program's method {name} returned token ids outside its "
                              f"vocabulary (0..{self.vocab_size - 1}); the program.pte or its metadata "
                              "is corrupt: export again")
        return out

    def _positions(self, layout: Layout, T: int) -> torch.Tensor:
        if not layout.causal or len(layout.starts) != 1:
            raise Eagle3Error("an exported program takes one sequence at consecutive positions; "
                              "trees and batches need the eager backend")
        return torch.arange(layout.starts[0], layout.starts[0] + T)

    def _scores(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (1, T) as one-hot scores (1, T, V): the round takes their argmax."""
        return torch.nn.functional.one_hot(ids.view(1, -1), self.vocab_size).float()

    def target(self, seqs: list[Any], tokens: torch.Tensor, layout: Layout, *,
               with_features: bool = True, last_only: bool = False,
               prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = tokens.shape[1]
        pos = self._positions(layout, T)
        if T == 1 and not with_features:  # plain decoding
            return self._scores(self.run("plain_decode", tokens, pos)[0]), None
        verify = self.contract.prefill if last_only else self.contract.target_verify
        ids, feature = verify(tokens, pos)
        return self._scores(ids), feature

    def features(self, taps: torch.Tensor) -> torch.Tensor:
        return taps  # the program's target_verify returns the draft's features already

    def draft(self, seqs: list[Any], tokens: torch.Tensor, features: torch.Tensor,
              layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        ids, h = self.contract.draft_decode(tokens, features, self._positions(layout, tokens.shape[1]))
        return self._scores(ids), h

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids  # the draft's scores are over target ids already

    def compact(self, seq: Any, src: list[int], dst: int) -> None:
        raise Eagle3Error("an exported program verifies chains only")

    def probe_rows(self, B: int, positions: int):
        return one_row(B, positions)

    def reserve(self, seq: Any, n_positions: int) -> None:
        pass


def read_metadata(program_dir: str) -> dict[str, Any]:
    """The program's metadata, checked; one-line errors for a wrong directory."""
    if not isinstance(program_dir, str) or not os.path.isdir(program_dir):
        raise Eagle3Error(f"program {program_dir!r} is not a directory: pass the --out directory of "
                          "`eagle3 export`")
    for name in (PROGRAM_FILE, META_FILE):
        if not os.path.isfile(os.path.join(program_dir, name)):
            raise Eagle3Error(f"{program_dir} has no {name}: pass the --out directory of `eagle3 export`")
    try:
        with open(os.path.join(program_dir, META_FILE)) as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise ValueError
    except (OSError, ValueError):
        raise Eagle3Error(f"{program_dir}/{META_FILE} is not readable JSON; export again") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise Eagle3Error(f"{program_dir} was written by another eagle3 export format "
                          f"({meta.get('format_version')}, this eagle3 reads {FORMAT_VERSION}); export again")
    missing = [k for k in ("max_seq_len", "max_draft_tokens", "vocab_size", "draft_vocab_size", "taps",
                           "eos_token_ids", "methods") if k not in meta]
    if missing:
        raise Eagle3Error(f"{program_dir}/{META_FILE} lacks '{missing[0]}'; export again")
    _check_metadata(meta, f"{program_dir}/{META_FILE}")
    return meta


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _check_metadata(meta: dict[str, Any], where: str) -> None:
    """Types and ranges of the values the runner uses, so a corrupt file fails here, not mid-run."""
    def bad(key: str, want: str) -> Eagle3Error:
        return Eagle3Error(f"{where}: '{key}' must be {want}, got {str(meta.get(key))[:40]}; the "
                           "metadata is corrupt: export again")

    if not _is_int(meta["max_seq_len"], 2, MAX_SEQ_LEN):
        raise bad("max_seq_len", f"an integer in 2..{MAX_SEQ_LEN}")
    if not _is_int(meta["max_draft_tokens"], 1, meta["max_seq_len"]):
        raise bad("max_draft_tokens", "a positive integer below max_seq_len")
    if not _is_int(meta["vocab_size"], 1, MAX_VOCAB):
        raise bad("vocab_size", f"an integer in 1..{MAX_VOCAB}")
    if not _is_int(meta["draft_vocab_size"], 1, meta["vocab_size"]):
        raise bad("draft_vocab_size", "a positive integer up to vocab_size")
    for key in ("taps", "eos_token_ids"):
        if not isinstance(meta[key], list) or not all(_is_int(t, -2**31, 2**31) for t in meta[key]):
            raise bad(key, "a list of integers")
    if not meta["taps"]:
        raise bad("taps", "a non-empty list of integers")
    methods = meta["methods"]
    needed = (*CONTRACT_METHODS, *EXTRA_METHODS)
    if not isinstance(methods, list) or any(m not in methods for m in needed):
        raise bad("methods", f"a list naming {', '.join(needed)}")
    if not isinstance(meta.get("quantize", "none"), str):
        raise bad("quantize", "a weight format name")


def _load_methods(runtime: Any, program_dir: str, names: list[str]) -> tuple[Any, dict[str, Any]]:
    """The program and its methods. ExecuTorch logs its verification failures to stderr from
    native code: they are kept out of the terminal and the first one goes into the error."""
    path = os.path.join(program_dir, PROGRAM_FILE)
    with _native_stderr() as log:
        try:
            program = runtime.load_program(path)
            missing = [m for m in names if m not in program.method_names]
            methods = {} if missing else {name: program.load_method(name) for name in names}
        except (RuntimeError, ValueError) as e:
            log.failed = True
            detail = f"{_first_line(e)}; {log.first_line()}" if log.first_line() else _first_line(e)
            raise Eagle3Error(f"{path} is not a loadable ExecuTorch program ({detail}): the file is "
                              "truncated or corrupt; export again") from None
    if missing:
        raise Eagle3Error(f"{path} lacks method {missing[0]}; export again")
    return program, methods


class _native_stderr:
    """Redirect file descriptor 2 to a temporary file; on success replay what was written."""

    def __enter__(self) -> _native_stderr:
        import sys
        import tempfile

        sys.stderr.flush()
        self.failed = False
        self.file = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def first_line(self) -> str:
        self.file.seek(0)
        lines = self.file.read().decode(errors="replace").splitlines()
        return next((ln.strip()[:120] for ln in lines if ln.strip()), "")

    def __exit__(self, *exc: object) -> None:
        os.dup2(self.saved, 2)
        os.close(self.saved)
        if not self.failed:  # nothing went wrong that the error names: keep what was logged
            self.file.seek(0)
            os.write(2, self.file.read())
        self.file.close()


def check_pte(path: str) -> None:
    """The .pte's identifier and extended header against the file's size, before native code
    reads it: a truncated or foreign file fails here with a one-line error."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(40)
    except OSError as e:
        raise Eagle3Error(f"cannot read {path} ({e.strerror or e}); export again") from None
    problem = None
    if len(head) < 40 or head[4:6] != b"ET" or head[8:12] != b"eh00":
        problem = "no ExecuTorch header"
    else:
        header_len, program_size, base, data_size = struct.unpack("<IQQQ", head[12:40])
        data_size = data_size if header_len >= 32 else 0  # older headers lack the segment size
        if program_size > size or (base and (base < program_size or base + data_size > size)):
            problem = f"its header describes {max(program_size, base + data_size)} bytes, the file has {size}"
    if problem:
        raise Eagle3Error(f"{path} is not a complete ExecuTorch program ({problem}): the file is "
                          "truncated or corrupt; export again")


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:120]


class ExecutorchSpeculator(Eagle3Speculator):
    """An exported program (`eagle3 export`) behind the `Eagle3Speculator` API; CPU, greedy."""

    def __init__(self, program_dir: str, tokenizer: Any = None, *, speculate: bool = True,
                 _loaded: tuple[Any, dict, dict] | None = None) -> None:
        if _loaded is None:
            meta = read_metadata(program_dir)
            try:
                from executorch.runtime import Runtime

                from .cache import load_custom_ops
            except ImportError:
                raise Eagle3Error("the executorch backend needs ExecuTorch: pip install "
                                  "'eagle3[export]'") from None
            load_custom_ops()  # the llama:: kernels the program calls
            check_pte(os.path.join(program_dir, PROGRAM_FILE))
            _loaded = (*_load_methods(Runtime.get(), program_dir, meta["methods"]), meta)
        self._program, self.lowered, self.meta = _loaded
        if speculate:  # XNNPACK's kernels are not row-invariant (docs/export.md)
            quantized = self.meta.get("quantize", "none") != "none"
            how = (f"is {self.meta['quantize']}-quantized: its int8 activations round differently"
                   if quantized else "runs XNNPACK's fp32 kernels, which round slightly differently")
            notice(f"{program_dir} {how} for 1 and K+1 tokens, so speculative output can differ from "
                   "this program's plain decoding at near-ties; the eager backend is bit-identical")
        self.program_dir = program_dir
        super().__init__(ProgramTarget(self.meta), ProgramHead(self.meta) if speculate else None,
                         tokenizer, runner=ProgramRunner(self.lowered, self.meta, speculate))
        self.taps = None  # fixed inside the program

    @property
    def max_draft_tokens(self) -> int:
        return self.meta["max_draft_tokens"]

    def plain(self) -> ExecutorchSpeculator:
        return ExecutorchSpeculator(self.program_dir, self.tokenizer, speculate=False,
                                    _loaded=(self._program, self.lowered, self.meta))

    def compile(self) -> Eagle3Speculator:
        raise Eagle3Error("compile applies to the eager backend; an ExecuTorch program is already "
                          "lowered (drop compile or use backend='native')")

    # -- the ExecuTorch contract, through the program's lowered methods -----------------------------
    @property
    def contract(self) -> LoweredMethods:
        return self.runner.contract

    @torch.no_grad()
    def target_verify(self, tokens: torch.Tensor, input_pos: torch.Tensor, *,
                      kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.contract.check_verify(tokens.shape[1])  # a refused call books no slots
        return super().target_verify(tokens, input_pos, kv_len=kv_len)

    def _claim(self, cache: Any, input_pos: torch.Tensor, T: int, kv_len: int | None) -> None:
        """The exported attention is causal from input_pos[0]: positions must be consecutive."""
        if T > 1 and not bool((input_pos.diff() == 1).all()):
            raise Eagle3Error("an exported program takes consecutive positions (start, start+1, ...); "
                              "tree-shaped or gapped input_pos needs the eager backend")
        cache.claim(int(input_pos[0]), T)

    # -- generation -------------------------------------------------------------------------------
    def generate(self, prompt_ids: Any, max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 num_draft_tokens: int | None = None, tree: Any = None,
                 stop_token_ids: Any = None, proposer: str | None = None) -> GenerationResult:
        """As `Eagle3Speculator.generate`, greedy only; K up to the program's max_draft_tokens;
        the head drafts (proposer None or 'eagle')."""
        if proposer not in (None, "eagle"):
            raise Eagle3Error(f"the executorch backend drafts with the head only (its verify is "
                              f"exported for up to {self.max_draft_tokens} chain drafts); drop "
                              f"proposer '{proposer}' or use backend='native'")
        if temperature != 0.0 or top_p != 1.0 or top_k != 0:
            raise Eagle3Error("the executorch backend decodes greedily (its methods return token ids, "
                              "not logits); use temperature 0 or backend='native' to sample")
        if tree not in (None, False):
            raise Eagle3Error("the executorch backend drafts chains (the exported verify takes no tree "
                              "mask); drop tree= or use backend='native'")
        if isinstance(num_draft_tokens, int) and not isinstance(num_draft_tokens, bool) and \
                num_draft_tokens > self.max_draft_tokens:
            raise Eagle3Error(f"num_draft_tokens {num_draft_tokens} exceeds the program's "
                              f"max_draft_tokens {self.max_draft_tokens}; export again with "
                              f"--max-draft-tokens {num_draft_tokens}")
        return super().generate(prompt_ids, max_new_tokens, num_draft_tokens=num_draft_tokens,
                                stop_token_ids=stop_token_ids)


def load_program(program_dir: str, tokenizer: Any = None, *, speculate: bool = True) -> ExecutorchSpeculator:
    """`eagle3.load(..., backend='executorch', program=DIR)`: the tokenizer from DIR when it has one."""
    from ..targets.tokenizer import load_tokenizer

    if tokenizer is None and isinstance(program_dir, str) and os.path.isdir(program_dir):
        tokenizer = load_tokenizer(program_dir)
    return ExecutorchSpeculator(program_dir, tokenizer, speculate=speculate)
