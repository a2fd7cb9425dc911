"""`Eagle3Speculator`: a target plus (optionally) an EAGLE-3 draft head.

It checks a request, picks the plan, and runs `decoding.round` on its runner
(`decoding.runner.StaticRunner` by default: one sequence, preallocated caches;
compiled by `compile()`). The four ExecuTorch contract methods (`prefill`,
`target_verify`, `draft_decode`, `decode`) book their slots and run
`contract.SpeculatorMethods` on the same caches (batch dimension kept): the one
implementation, which `eagle3 export` also lowers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .decoding.contract import SpeculatorMethods
from .decoding.costs import AUTO_MAX_K, Acceptance, Observed, RoundCosts
from .decoding.driver import Driver
from .decoding.planner import Adaptive, Planner
from .decoding.proposers import PROPOSERS
from .decoding.request import (  # noqa: F401  (re-exported: the public request checks)
    MAX_NUM_DRAFT_TOKENS,
    SAMPLING_K,
    GenerationRequest,
    check_generation,
    check_num_draft_tokens,
    check_stop_ids,
    resolve_proposer,
)
from .decoding.round import prefill
from .decoding.runner import StaticRunner
from .decoding.tree import MAX_TREE_DRAFT_SLOTS
from .decoding.types import SpecStats
from .errors import Eagle3Error, notice
from .targets.protocol import TapTarget, validate_taps

CALIBRATION_CONTEXT = 128  # cache length the cost model is measured at


@dataclass
class GenerationResult:
    """Generated token ids (prompt excluded) and vLLM-compatible speculation stats."""

    token_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)


class Eagle3Speculator:
    """A target (`TapTarget`) and an optional EAGLE-3 draft head (with an embedding)."""

    def __init__(self, target: TapTarget, draft: Any = None, tokenizer: Any = None,
                 runner: Any = None) -> None:
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
        self._runner = runner
        self._driver: Driver | None = None
        self._contract: Any = None
        self._warned_low_acceptance = False
        self.planner = Planner(self.max_auto_k)  # automatic K: costs measured by calibrate()

    # The planner's state, as attributes of the speculator (tests and reports read them).
    @property
    def costs(self) -> RoundCosts | None:
        return self.planner.costs

    @costs.setter
    def costs(self, costs: RoundCosts | None) -> None:
        self.planner.costs = costs

    @property
    def acceptance(self) -> Acceptance:
        return self.planner.acceptance

    @property
    def observed(self) -> Observed:
        return self.planner.observed

    @property
    def max_seq_len(self) -> int:
        return self.target.config.max_seq_len

    @property
    def runner(self) -> Any:
        """The runner the rounds run on (`decoding.runner.Runner`: the models' forwards, caches
        and drafting; created, with its caches, on first use)."""
        if self._runner is None:
            self._runner = StaticRunner(self.target, self.draft, self.taps,
                                        MAX_TREE_DRAFT_SLOTS if self.draft is not None else 0)
        return self._runner

    @property
    def driver(self) -> Driver:
        """The rounds' driver (`decoding.driver`) on this runner and planner."""
        if self._driver is None or self._driver.runner is not self.runner:
            self._driver = Driver(self.runner, self.planner)
        return self._driver

    @property
    def compiled(self) -> bool:
        return bool(getattr(self.runner, "compiled", False))

    @property
    def target_cache(self) -> Any:
        return self.runner.target_cache

    @property
    def draft_cache(self) -> Any:
        return self.runner.draft_cache

    def reset_caches(self) -> None:
        """Start a new sequence for the contract methods: forget the caches' contents."""
        self.target_cache.truncate(0)
        if self.draft_cache is not None:
            self.draft_cache.truncate(0)

    # -- the ExecuTorch contract (one implementation: contract.SpeculatorMethods) -----------------
    @property
    def contract(self) -> Any:
        """The four contract methods over this speculator's caches (`contract.SpeculatorMethods`;
        an exported program answers them from its lowered graphs)."""
        if self._contract is None:
            self._contract = SpeculatorMethods(self.target, self.draft, self.taps, self.target_cache,
                                              self.draft_cache)
        return self._contract

    def _claim(self, cache: Any, input_pos: torch.Tensor, T: int, kv_len: int | None) -> None:
        """Book the slots a contract call writes (host side), refusing a gap in the cache."""
        cache.claim(kv_len - T if kv_len is not None else int(input_pos[0]), T)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, input_pos: torch.Tensor, *,
                kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward over the prompt: next greedy token (B,) and features (B, T, H)."""
        self._claim(self.target_cache, input_pos, tokens.shape[1], kv_len)
        return self.contract.prefill(tokens, input_pos, kv_len)

    @torch.no_grad()
    def target_verify(self, tokens: torch.Tensor, input_pos: torch.Tensor, *,
                      kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward over [anchor, drafts]: verify_ids[i] = greedy token after token i."""
        self._claim(self.target_cache, input_pos, tokens.shape[1], kv_len)
        return self.contract.target_verify(tokens, input_pos, kv_len)

    @torch.no_grad()
    def draft_decode(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor, *,
                     kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft forward: T>1 seeds the draft cache, T=1 steps. Returns target ids and next features."""
        if self.draft is None:
            raise Eagle3Error("this speculator has no draft head (loaded with draft='none')")
        self._claim(self.draft_cache, input_pos, tokens.shape[1], kv_len)
        return self.contract.draft_decode(tokens, feature, input_pos, kv_len)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor, *,
               kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One plain target step: next greedy token (B,) and its feature (None without a head)."""
        self._claim(self.target_cache, input_pos, tokens.shape[1], kv_len)
        return self.contract.decode(tokens, input_pos, kv_len)

    # -- the runner and policy ---------------------------------------------------------------------
    def compile(self) -> Eagle3Speculator:
        """Run the target and draft steps through `torch.compile` (native targets only).

        Each distinct step shape compiles once (seconds to tens of seconds on a small CPU;
        inductor caches kernels on disk for later processes). Forgets the cost model,
        which `calibrate()` then measures again on the compiled steps.
        """
        self.runner.compile()
        self.planner.forget_costs()
        return self

    @property
    def max_auto_k(self) -> int:
        """The largest K that num_draft_tokens='auto' may choose."""
        return min(AUTO_MAX_K, getattr(self._runner, "max_draft_tokens", AUTO_MAX_K))

    def plain(self) -> Eagle3Speculator:
        """A speculator for plain decoding over the same target (and kind of runner), without the head."""
        plain = Eagle3Speculator(self.target, None, self.tokenizer)
        return plain.compile() if self.compiled else plain

    def calibrate(self) -> RoundCosts:
        """Measure the cost model on this machine and runner (`eagle3.load` does, for a head:
        a few dozen forwards); automatic K needs it. Once per speculator, and again
        after `compile()`, when it also compiles every K's chain and verify, so a generation
        never compiles. A speculator built by hand and never calibrated measures it on its
        first automatic generation, before that generation's clock starts."""
        if self.costs is None:
            max_T = max(1, min(self.max_auto_k + 1, self.max_seq_len - 3))  # a tiny context: fewer
            context = max(1, min(CALIBRATION_CONTEXT, self.max_seq_len - max_T - 2))
            self.runner.warm(max_T - 1, context)  # compiled: no compiling inside a generation
            self.planner.measure(self.runner, [1], max_T, context)
        return self.costs

    @property
    def target_device(self) -> torch.device:
        return self.runner.device

    # -- generation ------------------------------------------------------------------------------
    def check(self, prompt_ids: Any, max_new_tokens: Any, **kw: Any) -> GenerationRequest:
        """Validate a request for this speculator (`decoding.request.check_generation`, plus
        what this target and head can honour)."""
        cfg = self.target.config
        req = check_generation(prompt_ids, max_new_tokens, vocab_size=cfg.vocab_size,
                               max_len=cfg.max_seq_len, eos_token_ids=cfg.eos_token_ids, **kw)
        speculative = self.draft is not None
        if speculative and (req.tree is not None or not req.sampling.greedy) and not getattr(
                self.runner, "supports_trees", False):
            raise Eagle3Error("tree drafting and speculative sampling need a native target (the "
                              "transformers adapter takes no tree mask); load with backend='native' "
                              "or use greedy chain drafting")
        proposer = resolve_proposer(req.proposer, speculative, getattr(self.runner, "supports_trees", False),
                                    req.sampling.greedy)
        req = replace(req, proposer=proposer)
        if speculative and req.tree is not None and req.tree.top_k > self.draft.config.draft_vocab_size:
            raise Eagle3Error(f"tree top_k {req.tree.top_k} exceeds the head's draft vocabulary "
                              f"({self.draft.config.draft_vocab_size} tokens); lower top_k")
        return req

    def generate(self, prompt_ids: Any, max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 num_draft_tokens: int | None = None, tree: Any = None,
                 stop_token_ids: Any = None, proposer: str | None = None) -> GenerationResult:
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
        is K = SAMPLING_K (2), so that a seed's output does not depend on timings.
        `proposer`: who drafts (`decoding.suffix`): 'eagle' (the head), 'suffix' (continuations
        of earlier matches in the prompt and output: no head needed), 'hybrid' (both, merged
        in one verified tree); None: 'hybrid' for greedy requests with a head on a native runner,
        'eagle' when sampling or on the transformers adapter, plain decoding without a head.
        """
        req = self.check(prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k, seed=seed, num_draft_tokens=num_draft_tokens, tree=tree,
                         stop_token_ids=stop_token_ids, proposer=proposer)
        return self.run(req)

    @torch.no_grad()
    def run(self, req: GenerationRequest) -> GenerationResult:
        """Decode a checked request (`check`) on this speculator's runner: the engine's driver
        (`decoding.driver`) at batch 1, the plan's schedule chosen by the planner."""
        head = self.draft is not None and PROPOSERS[req.proposer].uses_head
        schedule = self.planner.schedule(drafts=head, k=req.num_draft_tokens, tree=req.tree,
                                         greedy=req.sampling.greedy)
        seq = self.driver.start("generate", req, schedule)
        if schedule.automatic or seq.suffix is not None:  # measured before the clock
            self.calibrate()
        plan = schedule.plan(1, seq.suffix is not None)
        stats = seq.stats
        if head:
            stats.size(plan.tree.depth if plan.tree is not None else
                       (self.max_auto_k if schedule.automatic else plan.k))
            if plan.tree is not None:
                stats.tree = plan.tree.as_dict()
            else:
                stats.num_draft_tokens = plan.k
        t0 = time.perf_counter()
        prefill(self.runner, seq)
        while not seq.done:
            _, (v,) = self.driver.round([seq], schedule)
            if v.error is not None:
                raise Eagle3Error(f"generation failed: {v.error}")
            if isinstance(schedule, Adaptive):
                stats.num_draft_tokens = schedule.next.k
        stats.seconds = time.perf_counter() - t0
        if head:
            self._check_acceptance(stats)
        return GenerationResult(seq.out, stats.as_dict())

    def _check_acceptance(self, stats: SpecStats) -> None:
        # A head paired with the wrong taps (e.g. SGLang's +1 ids) drafts garbage silently.
        # Judged on the first draft position (a tree verifies many nodes, accepts one path).
        if self._warned_low_acceptance or stats.rounds < 32:
            return
        rate = stats.accepted_per_position[0] / stats.rounds
        if rate < 0.05:
            self._warned_low_acceptance = True
            notice(f"draft acceptance is near zero ({rate:.1%}): the head may belong to another "
                   f"target or use other taps (now {list(self.taps or ())}); check its "
                   "eagle_aux_hidden_state_layer_ids (SGLang-captured ids are off by one)")


__all__ = ["Eagle3Speculator", "GenerationResult"]
