"""The `executorch` backend: the shifted runner over an exported program's methods.

`ExecutorchSpeculator` is an `Eagle3Speculator` whose four contract methods call the
program (`executorch.runtime`) instead of PyTorch modules; the decoding loops
(`decoding.chain`, `decoding.plain`) are the same code as the eager backend's. The
program owns the KV caches; the runner keeps one `kv.SlotBook` per cache to check
that every call writes contiguous slots (the exported attention is causal from its
first position) and to rewind after a verify.

Greedy plain decoding and greedy chain drafting run here; trees (the exported
verify takes no tree mask), sampling (the methods return ids, not logits) and
torch.compile are refused with one-line errors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import Eagle3Error, notice
from ..kv import SlotBook
from ..speculator import Eagle3Speculator, GenerationResult
from .program import FORMAT_VERSION, META_FILE, PROGRAM_FILE


@dataclass(frozen=True)
class ProgramConfig:
    """What the runner reads of a target's config, from the program's metadata."""

    vocab_size: int
    max_seq_len: int
    eos_token_ids: tuple[int, ...]


class ProgramTarget:
    """Host-side stand-in for the target inside a program: its config, taps and cache rewinds."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.config = ProgramConfig(meta["vocab_size"], meta["max_seq_len"], tuple(meta["eos_token_ids"]))
        self.tap_layers = tuple(meta["taps"])
        self.embedding_weight = torch.empty(0)  # device probe: the program runs on the CPU

    def truncate_cache(self, cache: SlotBook, length: int) -> None:
        cache.truncate(length)


@dataclass(frozen=True)
class ProgramHeadConfig:
    draft_vocab_size: int


class ProgramHead:
    """Host-side stand-in for the head inside a program."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.config = ProgramHeadConfig(meta["draft_vocab_size"])
        self.embed_tokens = True  # the program's head shares the target's table


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
    return meta


class ExecutorchSpeculator(Eagle3Speculator):
    """An exported program (`eagle3 export`) behind the `Eagle3Speculator` API; CPU, greedy."""

    def __init__(self, program_dir: str, tokenizer: Any = None, *, speculate: bool = True,
                 _loaded: tuple[Any, dict, dict] | None = None) -> None:
        if _loaded is None:
            meta = read_metadata(program_dir)
            try:
                from executorch.runtime import Runtime

                from .kv import load_custom_ops
            except ImportError:
                raise Eagle3Error("the executorch backend needs ExecuTorch: pip install "
                                  "'eagle3[export]'") from None
            load_custom_ops()  # the llama:: kernels the program calls
            try:
                program = Runtime.get().load_program(os.path.join(program_dir, PROGRAM_FILE))
            except (RuntimeError, ValueError) as e:
                raise Eagle3Error(f"{program_dir}/{PROGRAM_FILE} is not a loadable ExecuTorch program "
                                  f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                                  "export again") from None
            missing = [m for m in meta["methods"] if m not in program.method_names]
            if missing:
                raise Eagle3Error(f"{program_dir}/{PROGRAM_FILE} lacks method {missing[0]}; export again")
            methods = {name: program.load_method(name) for name in meta["methods"]}
            _loaded = (program, methods, meta)
        self._program, self.methods, self.meta = _loaded
        if speculate and self.meta.get("quantize", "none") != "none":
            notice(f"{program_dir} is {self.meta['quantize']}-quantized: its int8 activations round "
                   "differently for 1 and K+1 tokens, so speculative output can differ from this "
                   "program's plain decoding at near-ties (README, Export); use an fp32 program "
                   "for identical output")
        self.program_dir = program_dir
        super().__init__(ProgramTarget(self.meta), ProgramHead(self.meta) if speculate else None,
                         tokenizer)
        self.taps = None  # fixed inside the program

    # -- state -------------------------------------------------------------------------------------
    def reset_caches(self) -> None:
        if self.target_cache is None:
            self.target_cache = SlotBook(self.max_seq_len)
            self.draft_cache = SlotBook(self.max_seq_len)
        self.target_cache.truncate(0)
        self.draft_cache.truncate(0)

    @property
    def max_draft_tokens(self) -> int:
        return self.meta["max_draft_tokens"]

    @property
    def max_auto_k(self) -> int:
        return min(super().max_auto_k, self.max_draft_tokens)

    def plain(self) -> ExecutorchSpeculator:
        return ExecutorchSpeculator(self.program_dir, self.tokenizer, speculate=False,
                                    _loaded=(self._program, self.methods, self.meta))

    def compile(self) -> Eagle3Speculator:
        raise Eagle3Error("compile applies to the eager backend; an ExecuTorch program is already "
                          "lowered (drop compile or use backend='native')")

    # -- the steps, through the program -------------------------------------------------------------
    @staticmethod
    def _claim(book: SlotBook, input_pos: torch.Tensor, T: int) -> None:
        """The exported attention is causal from input_pos[0]: positions must be consecutive."""
        if T > 1 and not bool((input_pos.diff() == 1).all()):
            raise Eagle3Error("an exported program takes consecutive positions (start, start+1, ...); "
                              "tree-shaped or gapped input_pos needs the eager backend")
        book.claim(int(input_pos[0]), T)

    def _run(self, name: str, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return self.methods[name].execute([x.contiguous() for x in inputs])

    def _target(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int | None, *,
                with_taps: bool = True, last_only: bool = False,
                compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._caches()
        T = tokens.shape[1]
        if T > self.max_draft_tokens + 1 and not last_only:
            raise Eagle3Error(f"target_verify over {T} tokens exceeds the program's bound "
                              f"({self.max_draft_tokens + 1}); export with --max-draft-tokens {T - 1}")
        self._claim(self.target_cache, input_pos, T)
        if T == 1 and not with_taps:  # plain decoding
            return self._run("plain_decode", tokens, input_pos)[0].view(1, 1), None
        if T == 1:
            tok, feature = self._run("decode", tokens, input_pos)
            return tok.view(1, 1), feature
        if last_only:
            tok, feature = self._run("prefill", tokens, input_pos)
            return tok.view(1, 1), feature
        ids, feature = self._run("target_verify", tokens, input_pos)
        return ids, feature

    def _draft(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor,
               kv_len: int | None, *, compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        if self.draft is None:
            raise Eagle3Error("this speculator has no draft head (plain decoding)")
        self._caches()
        T = tokens.shape[1]
        self._claim(self.draft_cache, input_pos, T)
        return self._run("draft_step" if T == 1 else "draft_decode", tokens, feature, input_pos)

    # -- generation -------------------------------------------------------------------------------
    def generate(self, prompt_ids: Any, max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 num_draft_tokens: int | None = None, tree: Any = None,
                 stop_token_ids: Any = None) -> GenerationResult:
        """As `Eagle3Speculator.generate`, greedy only; K up to the program's max_draft_tokens."""
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
    from ..tokenizer import load_tokenizer

    if tokenizer is None and isinstance(program_dir, str) and os.path.isdir(program_dir):
        tokenizer = load_tokenizer(program_dir)
    return ExecutorchSpeculator(program_dir, tokenizer, speculate=speculate)
