"""`Eagle3Speculator`: a target plus (optionally) an EAGLE-3 draft head.

It checks a request, picks the plan, and runs `decoding.round` on its backend
(`decoding.backend.StaticBackend` by default: one sequence, preallocated caches;
compiled by `compile()`). The four ExecuTorch contract methods work on the same
caches (batch dimension kept):

    prefill(tokens, input_pos)               -> (token (B,), feature (B, T, H))
    target_verify(tokens, input_pos)         -> (verify_ids (B, T), feature (B, T, H))
    draft_decode(tokens, feature, input_pos) -> (target_ids (B, T), next_feature (B, T, H))
    decode(tokens, input_pos)                -> (token (B,), feature (B, 1, H))

Features are the fused H-wide draft features `fc(taps)`. The optional `kv_len` (a
Python int) bounds attention to the live slots, an eager speed-up; without it the
whole static cache is masked by position.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .decoding.backend import StaticBackend
from .decoding.costs import AUTO_MAX_K, Acceptance, Observed, RoundCosts, choose_plan, repick_now
from .decoding.request import (  # noqa: F401  (re-exported: the public request checks)
    MAX_NUM_DRAFT_TOKENS,
    SAMPLING_K,
    GenerationRequest,
    check_generation,
    check_num_draft_tokens,
    check_stop_ids,
)
from .decoding.round import SequenceState, empty_stats, prefill, run_round, size_stats
from .decoding.sampling import Sampler
from .decoding.tree import MAX_TREE_DRAFT_SLOTS
from .decoding.types import Plan
from .errors import Eagle3Error, notice
from .kernels import argmax
from .targets.protocol import TapTarget, validate_taps

CALIBRATION_CONTEXT = 128  # cache length the cost model is measured at
PROBE_EVERY = 32  # plain rounds of automatic K between probes of the head (K=1)
EXPLORE_PLAIN = 8  # plain rounds automatic K runs once per speculator to time them
PLAIN_SETTLE = 3  # plain rounds after drafting ones that are not timed: the head's forwards evicted
#                   part of the target from the caches, and the next few steps refill them


@dataclass
class GenerationResult:
    """Generated token ids (prompt excluded) and vLLM-compatible speculation stats."""

    token_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)


class Eagle3Speculator:
    """A target (`TapTarget`) and an optional EAGLE-3 draft head (with an embedding)."""

    def __init__(self, target: TapTarget, draft: Any = None, tokenizer: Any = None,
                 backend: Any = None) -> None:
        if draft is not None and getattr(draft, "embed_tokens", None) is None:
            raise Eagle3Error("the draft head has no embedding; attach it to the target first "
                              "(eagle3.draft.attach_head) so it shares the target's table")
        self.target = target
        self.draft = draft
        # The head's taps (`attach_head` resolves them; a head never attached has its config's,
        # else the target's default), passed to every forward: several speculators may share
        # one target.
        self.taps = None
        if draft is not None:
            self.taps = tuple(draft.tap_layers or target.tap_layers)
            layers = getattr(target.config, "num_hidden_layers", None)  # None: a program's stand-in
            if layers is not None:
                self.taps = validate_taps(self.taps, layers)
        self.tokenizer = tokenizer
        self._backend = backend
        self._warned_low_acceptance = False
        self.costs: RoundCosts | None = None  # measured by calibrate()
        self.acceptance = Acceptance(self.max_auto_k)
        self.observed = Observed()  # measured round times against the cost model's

    @property
    def max_seq_len(self) -> int:
        return self.target.config.max_seq_len

    @property
    def backend(self) -> Any:
        """The backend the rounds run on (created, with its caches, on first use)."""
        if self._backend is None:
            self._backend = StaticBackend(self.target, self.draft, self.taps,
                                          MAX_TREE_DRAFT_SLOTS if self.draft is not None else 0)
        return self._backend

    @property
    def compiled(self) -> bool:
        return bool(getattr(self.backend, "compiled", False))

    @property
    def target_cache(self) -> Any:
        return self.backend.target_cache

    @property
    def draft_cache(self) -> Any:
        return self.backend.draft_cache

    def reset_caches(self) -> None:
        """Start a new sequence for the contract methods: forget the caches' contents."""
        self.target_cache.truncate(0)
        if self.draft_cache is not None:
            self.draft_cache.truncate(0)

    # -- the ExecuTorch contract ---------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int | None,
                 **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = tokens.shape[1]
        self.target_cache.claim(kv_len - T if kv_len is not None else int(input_pos[0]), T)
        if self.taps is not None:
            kw["taps"] = self.taps
        logits, taps = self.target.forward_logits_taps(tokens, input_pos, self.target_cache,
                                                       kv_len=kv_len, **kw)
        return argmax(logits), (self.draft.fuse(taps) if taps is not None else None)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, input_pos: torch.Tensor, *,
                kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward over the prompt: next greedy token (B,) and features (B, T, H)."""
        ids, feature = self._forward(tokens, input_pos, kv_len, last_only=True,
                                     with_taps=self.draft is not None)
        return ids[:, -1], feature

    @torch.no_grad()
    def target_verify(self, tokens: torch.Tensor, input_pos: torch.Tensor, *,
                      kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward over [anchor, drafts]: verify_ids[i] = greedy token after token i."""
        return self._forward(tokens, input_pos, kv_len, with_taps=self.draft is not None)

    @torch.no_grad()
    def draft_decode(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor, *,
                     kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft forward: T>1 seeds the draft cache, T=1 steps. Returns target ids and next features."""
        if self.draft is None:
            raise Eagle3Error("this speculator has no draft head (loaded with draft='none')")
        T = tokens.shape[1]
        self.draft_cache.claim(kv_len - T if kv_len is not None else int(input_pos[0]), T)
        logits, h = self.draft(tokens, feature, input_pos, self.draft_cache, kv_len=kv_len)
        return self.draft.to_target_ids(argmax(logits)), h

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor, *,
               kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One plain target step: next greedy token (B,) and its feature (None without a head)."""
        ids, feature = self._forward(tokens, input_pos, kv_len, with_taps=self.draft is not None)
        return ids[:, -1], feature

    # -- backends and policy ---------------------------------------------------------------------
    def compile(self) -> Eagle3Speculator:
        """Run the target and draft steps through `torch.compile` (native targets only).

        Each distinct step shape compiles once (seconds to tens of seconds on a small CPU;
        inductor caches kernels on disk for later processes). Forgets the cost model,
        which `calibrate()` then measures again on the compiled steps.
        """
        self.backend.compile()
        self.costs, self.observed = None, Observed()
        return self

    @property
    def max_auto_k(self) -> int:
        """The largest K that num_draft_tokens='auto' may choose."""
        return min(AUTO_MAX_K, getattr(self._backend, "max_draft_tokens", AUTO_MAX_K))

    def plain(self) -> Eagle3Speculator:
        """A speculator for plain decoding over the same target (and kind of backend), without the head."""
        plain = Eagle3Speculator(self.target, None, self.tokenizer)
        return plain.compile() if self.compiled else plain

    @contextmanager
    def _probe_rows(self, B: int, positions: Any):
        yield [SequenceState("probe", [0], 1, frozenset())] if B == 1 else None

    def calibrate(self) -> RoundCosts:
        """Measure the cost model on this machine and backend (`eagle3.load` does, for a head:
        about a second on SmolLM2 here); automatic K needs it. Once per speculator, and again
        after `compile()`, when it also compiles every K's chain and verify, so a generation
        never compiles. A speculator built by hand and never calibrated measures it on its
        first automatic generation, before that generation's clock starts."""
        if self.costs is None:
            max_T = max(1, min(self.max_auto_k + 1, self.max_seq_len - 3))  # a tiny context: fewer
            context = max(1, min(CALIBRATION_CONTEXT, self.max_seq_len - max_T - 2))
            self.backend.warm(max_T - 1, context)  # compiled: no compiling inside a generation
            self.costs = RoundCosts.measure(self.backend, self._probe_rows, [1], max_T, context)
        return self.costs

    @property
    def target_device(self) -> torch.device:
        return self.backend.device

    # -- generation ------------------------------------------------------------------------------
    def check(self, prompt_ids: Any, max_new_tokens: Any, **kw: Any) -> GenerationRequest:
        """Validate a request for this speculator (`decoding.request.check_generation`, plus
        what this target and head can honour)."""
        cfg = self.target.config
        req = check_generation(prompt_ids, max_new_tokens, vocab_size=cfg.vocab_size,
                               max_len=cfg.max_seq_len, eos_token_ids=cfg.eos_token_ids, **kw)
        speculative = self.draft is not None
        if speculative and (req.tree is not None or not req.sampling.greedy) and not getattr(
                self.backend, "supports_trees", False):
            raise Eagle3Error("tree drafting and speculative sampling need a native target (the "
                              "transformers adapter takes no tree mask); load with backend='native' "
                              "or use greedy chain drafting")
        if speculative and req.tree is not None and req.tree.top_k > self.draft.config.draft_vocab_size:
            raise Eagle3Error(f"tree top_k {req.tree.top_k} exceeds the head's draft vocabulary "
                              f"({self.draft.config.draft_vocab_size} tokens); lower top_k")
        return req

    def generate(self, prompt_ids: Any, max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 num_draft_tokens: int | None = None, tree: Any = None,
                 stop_token_ids: Any = None) -> GenerationResult:
        """Generate up to `max_new_tokens` tokens after `prompt_ids`.

        Greedy (temperature 0): token-identical to plain decoding with the target
        alone. Sampling (temperature > 0, then top_k, then top_p as in
        transformers): speculation is lossless in distribution, and a `seed`
        makes the output reproducible for the same settings (each drafting mode
        draws its random numbers differently). Stops after the first token in
        `stop_token_ids` (default: the target's EOS ids; `[]` never stops).
        `tree`: True for the default tree (`decoding.tree.DEFAULT_TREE`), a dict
        of top_k / depth / total_tokens for another shape, None/False for a chain.
        `num_draft_tokens` = K for chain drafting; None or 'auto' picks K (1..8)
        or plain decoding from the cost model (`calibrate()`, which `eagle3.load`
        runs) and the acceptance seen so far, again after 2, 4 and every 8 drafting rounds
        (plain rounds re-probe the head with K=1 every PROBE_EVERY rounds); when sampling, 'auto'
        is K = SAMPLING_K (4), so that a seed's output does not depend on timings.
        """
        req = self.check(prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k, seed=seed, num_draft_tokens=num_draft_tokens, tree=tree,
                         stop_token_ids=stop_token_ids)
        return self.run(req)

    def _first_plan(self, req: GenerationRequest) -> tuple[Plan, bool]:
        """The plan for the first round and whether it is automatic (re-chosen as we go)."""
        if self.draft is None:
            return Plan(), False
        if req.tree is not None:
            return Plan(tree=req.tree), False
        if not req.sampling.greedy:
            return Plan(req.num_draft_tokens or SAMPLING_K), False
        if req.num_draft_tokens is not None:
            return Plan(req.num_draft_tokens), False
        self.calibrate()
        return self._auto_plan(), True

    def _auto_plan(self) -> Plan:
        # Plain decoding is a candidate: where the head's acceptance does not pay for its rounds,
        # automatic K decodes plainly (re-probing the head now and then, in `run`).
        return choose_plan(self.costs, self.acceptance, 1, self.max_auto_k, observed=self.observed)

    @torch.no_grad()
    def run(self, req: GenerationRequest) -> GenerationResult:
        """Decode a checked request (`check`) on this speculator's backend."""
        plan, automatic = self._first_plan(req)
        sampler = None if req.sampling.greedy else Sampler(req.sampling, self.target_device)
        seq = SequenceState("generate", req.prompt, req.max_new_tokens, req.stop_ids, sampler,
                       drafts=self.draft is not None)
        stats = seq.stats
        if self.draft is not None:
            size_stats(stats, plan.tree.depth if plan.tree is not None else
                       (self.max_auto_k if automatic else plan.k))
            if plan.tree is not None:
                stats["tree"] = plan.tree.as_dict()
            else:
                stats["num_draft_tokens"] = plan.k
        backend = self.backend
        t0 = time.perf_counter()
        prefill(backend, seq)
        plain_rounds = explore = 0
        explored = False
        plain_streak = 0  # plain rounds in a row, this one included
        while not seq.done:
            t_round = time.perf_counter()
            typical = seq.draft_len > 0  # the first drafting round also runs the head over the prompt
            (v,) = run_round(backend, [seq], plan)
            plain_streak = plain_streak + 1 if not plan.drafts else 0
            if v.error is not None:
                raise Eagle3Error(f"generation failed: {v.error}")
            if automatic and v.depths:
                self.acceptance.record(len(v.depths), len(v.path))
                if len(v.depths) == plan.k and typical:  # a full round (not one cut at the end)
                    self.observed.record(1, plan, (time.perf_counter() - t_round) * 1e3,
                                         self.costs.round_ms(1, plan))
                if repick_now(stats["rounds"]):
                    plan = self._auto_plan()
                    if plan.drafts and not explored and not self.observed.seen(1, Plan()):
                        # Plain rounds were never timed here: the calibration's few forwards can
                        # misjudge them on a busy machine, and only a run puts them right.
                        plan, explore, explored = Plan(), EXPLORE_PLAIN, True
                    stats["num_draft_tokens"] = plan.k
            elif automatic and not plan.drafts:
                # Plain rounds teach nothing about the head (the draft's backlog is kept, so it
                # can resume): every PROBE_EVERY of them, REPICK_EVERY rounds of K=1 measure
                # its acceptance on this text again before the next choice.
                plain_rounds += 1
                if plain_streak > PLAIN_SETTLE:  # steady plain decoding, as plain would run
                    self.observed.record(1, plan, (time.perf_counter() - t_round) * 1e3,
                                         self.costs.round_ms(1, plan))
                if explore:
                    explore -= 1
                    if not explore:
                        plan = self._auto_plan()
                elif plain_rounds % PROBE_EVERY == 0:
                    plan = Plan(1)
                stats["num_draft_tokens"] = plan.k
        stats["seconds"] = time.perf_counter() - t0
        if self.draft is not None:
            self._check_acceptance(stats)
        return GenerationResult(seq.out, stats)

    def _check_acceptance(self, stats: dict) -> None:
        # A head paired with the wrong taps (e.g. SGLang's +1 ids) drafts garbage silently.
        # Judged on the first draft position (a tree verifies many nodes, accepts one path).
        if self._warned_low_acceptance or stats["rounds"] < 32:
            return
        rate = stats["accepted_per_position"][0] / stats["rounds"]
        if rate < 0.05:
            self._warned_low_acceptance = True
            notice(f"draft acceptance is near zero ({rate:.1%}): the head may belong to another "
                   f"target or use other taps (now {list(self.taps or ())}); check its "
                   "eagle_aux_hidden_state_layer_ids (SGLang-captured ids are off by one)")


__all__ = ["Eagle3Speculator", "GenerationResult", "empty_stats"]
