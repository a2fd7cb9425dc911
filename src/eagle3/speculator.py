"""`Eagle3Speculator`: a target plus (optionally) an EAGLE-3 draft head.

The four methods follow ExecuTorch's `Eagle3Speculator` contract and hold the
KV caches as state (batch dimension kept):

    prefill(tokens, input_pos)               -> (token (B,), feature (B, T, H))
    target_verify(tokens, input_pos)         -> (verify_ids (B, T), feature (B, T, H))
    draft_decode(tokens, feature, input_pos) -> (target_ids (B, T), next_feature (B, T, H))
    decode(tokens, input_pos)                -> (token (B,), feature (B, 1, H))

Features are the fused H-wide draft features `fc(taps)`. The optional
`kv_len` (a Python int) bounds attention to the live slots, an eager speed-up;
without it the whole static cache is masked by position (export-friendly: no
control flow on tensor values). `generate` is the user-facing entry point.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .decoding.autok import AUTO_MAX_K, AutoK, measure_cost, warm_auto_graphs
from .decoding.chain import chain_generate
from .decoding.plain import plain_greedy
from .decoding.sampling import Sampler, check_sampling
from .decoding.tree import MAX_TREE_DRAFT_SLOTS, parse_tree, speculative_generate
from .errors import Eagle3Error, notice
from .targets.protocol import TapTarget

MAX_NUM_DRAFT_TOKENS = 32
SAMPLING_K = 4  # chain drafts under sampling with num_draft_tokens='auto' (reproducible seeds)


@dataclass
class GenerationResult:
    """Generated token ids (prompt excluded) and vLLM-compatible speculation stats."""

    token_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)


def empty_stats() -> dict[str, Any]:
    return {"rounds": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": [],
            "mean_accept_len": 1.0, "accept_len_hist": [], "target_forwards": 0, "seconds": 0.0}


def check_request(prompt_ids: Any, max_new_tokens: Any, vocab_size: int, max_len: int) -> list[int]:
    """Validate a request at admission; return the prompt as a list of ints."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.flatten().tolist()
    try:
        ids = [int(t) for t in prompt_ids]
    except (TypeError, ValueError):
        raise Eagle3Error("prompt_ids must be a sequence of integer token ids") from None
    if not ids:
        raise Eagle3Error("the prompt is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise Eagle3Error(f"token id {bad[0]} is outside the target's vocabulary (0..{vocab_size - 1}); "
                          "check the tokenizer matches the target")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise Eagle3Error(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if len(ids) + max_new_tokens > max_len:
        raise Eagle3Error(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                          f"target's max_seq_len {max_len}; shorten the prompt, lower "
                          "max_new_tokens or load with a larger max_seq_len")
    return ids


def check_stop_ids(stop_token_ids: Any, eos_token_ids: Any) -> frozenset[int]:
    """The stop ids of a request: `stop_token_ids`, or the target's EOS ids when None."""
    try:
        return frozenset(int(t) for t in (eos_token_ids if stop_token_ids is None else stop_token_ids))
    except (TypeError, ValueError):
        raise Eagle3Error("stop_token_ids must be a list of integer token ids") from None


def check_num_draft_tokens(k: Any) -> int | None:
    """An int K in 1..MAX_NUM_DRAFT_TOKENS, or None for automatic ('auto' or None)."""
    if k is None or k == "auto":
        return None
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_DRAFT_TOKENS:
        raise Eagle3Error(f"num_draft_tokens must be 'auto' or an integer in 1..{MAX_NUM_DRAFT_TOKENS}, "
                          f"got {k!r}")
    return k


class Eagle3Speculator:
    """A target (`TapTarget`) and an optional EAGLE-3 draft head (with an embedding)."""

    def __init__(self, target: TapTarget, draft: Any = None, tokenizer: Any = None) -> None:
        if draft is not None and getattr(draft, "embed_tokens", None) is None:
            raise Eagle3Error("the draft head has no embedding; attach it to the target first "
                              "(eagle3.draft.attach_head) so it shares the target's table")
        self.target = target
        self.draft = draft
        # The taps this head was attached with; re-applied per sequence, since
        # several speculators may share one target.
        self.taps = tuple(target.tap_layers) if draft is not None else None
        self.tokenizer = tokenizer
        self.target_cache: Any = None
        self.draft_cache: Any = None
        self._warned_low_acceptance = False
        self.compiled: Any = None  # set by compile()
        self.auto: AutoK | None = None  # acceptance counts + cost model, for num_draft_tokens='auto'

    @property
    def max_seq_len(self) -> int:
        return self.target.config.max_seq_len

    def reset_caches(self) -> None:
        """Start a new sequence: allocate the caches once, then just forget their contents."""
        if self.taps is not None:
            self.target.tap_layers = self.taps
        if self.target_cache is None:
            self.target_cache = self.target.new_cache(1, self.max_seq_len)
        self.target.truncate_cache(self.target_cache, 0)
        if self.draft is not None:
            if self.draft_cache is None:
                # Room past max_seq_len for a tree's scratch slots, allocated once: a cache
                # that grew later would make compiled steps recompile for its new size.
                self.draft_cache = self.draft.new_cache(1, self.max_seq_len + MAX_TREE_DRAFT_SLOTS)
            self.draft_cache.truncate(0)

    def _caches(self) -> None:
        if self.target_cache is None or (self.draft is not None and self.draft_cache is None):
            self.reset_caches()

    # -- the ExecuTorch contract ---------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, input_pos: torch.Tensor, *,
                kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward over the prompt: next greedy token (B,) and features (B, T, H)."""
        self._caches()
        ids, feature = self._target(tokens, input_pos, kv_len, last_only=True, compiled=False)
        return ids[:, -1], feature

    @torch.no_grad()
    def target_verify(self, tokens: torch.Tensor, input_pos: torch.Tensor, *,
                      kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward over [anchor, drafts]: verify_ids[i] = greedy token after token i."""
        self._caches()
        return self._target(tokens, input_pos, kv_len)

    @torch.no_grad()
    def draft_decode(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor, *,
                     kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft forward: T>1 seeds the draft cache, T=1 steps. Returns target ids and next features."""
        return self._draft(tokens, feature, input_pos, kv_len)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor, *,
               kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One plain target step: next greedy token (B,) and its feature (None without a head)."""
        self._caches()
        ids, feature = self._target(tokens, input_pos, kv_len, with_taps=self.draft is not None)
        return ids[:, -1], feature

    # -- the steps behind the contract (compiled when `compile()` was called) -------------------
    def _target(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int | None, *,
                with_taps: bool = True, last_only: bool = False,
                compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy ids (B, T|1) and fused features (B, T, H) (None without taps)."""
        if compiled and self.compiled is not None:
            return self.compiled.target(tokens, input_pos, kv_len or self.target_cache.max_len,
                                        with_taps, last_only)
        logits, taps = self.target.forward_logits_taps(tokens, input_pos, self.target_cache,
                                                       kv_len=kv_len, last_only=last_only,
                                                       with_taps=with_taps)
        return logits.argmax(-1), self._fuse(taps)

    def _draft(self, tokens: torch.Tensor, feature: torch.Tensor, input_pos: torch.Tensor,
               kv_len: int | None, *, compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        if self.draft is None:
            raise Eagle3Error("this speculator has no draft head (loaded with draft='none')")
        self._caches()
        if not torch.compiler.is_compiling():  # host-side contiguity check; export skips it
            T = tokens.shape[1]
            self.draft_cache.claim(kv_len - T if kv_len is not None else int(input_pos[0]), T)
        if compiled and self.compiled is not None:
            return self.compiled.draft(tokens, feature, input_pos, kv_len or self.draft_cache.max_len)
        logits, h = self.draft(tokens, feature, input_pos, self.draft_cache, kv_len=kv_len)
        return self.draft.to_target_ids(logits.argmax(-1)), h

    def compile(self) -> Eagle3Speculator:
        """Run verify / decode / draft steps through `torch.compile` (native targets only).

        Each distinct step shape compiles once (seconds to tens of seconds on a
        small CPU; inductor caches kernels on disk for later processes); the
        prompt's prefill stays eager. Forgets the automatic-K cost model, which
        is then measured again on the compiled steps.
        """
        from .decoding.compiled import CompiledSteps

        self.compiled = CompiledSteps(self)
        self.auto = None
        return self

    @property
    def max_auto_k(self) -> int:
        """The largest K that num_draft_tokens='auto' may choose."""
        return AUTO_MAX_K

    def plain(self) -> Eagle3Speculator:
        """A speculator for plain decoding over the same target (and backend), without the head."""
        plain = Eagle3Speculator(self.target, None, self.tokenizer)
        return plain.compile() if self.compiled is not None else plain

    def _fuse(self, taps: torch.Tensor | None) -> torch.Tensor | None:
        return self.draft.fuse(taps) if self.draft is not None and taps is not None else taps

    # -- generation ------------------------------------------------------------------------------
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
        from the measured cost model and the acceptance seen so far, again every
        few rounds (`decoding.autok`); when sampling, 'auto' is K = SAMPLING_K (4),
        so that a seed's output does not depend on timings.
        """
        cfg = self.target.config
        ids = check_request(prompt_ids, max_new_tokens, cfg.vocab_size, cfg.max_seq_len)
        k = check_num_draft_tokens(num_draft_tokens)
        params = check_sampling(temperature, top_p, top_k, seed)
        shape = parse_tree(tree)
        if shape is not None and k is not None:
            raise Eagle3Error("num_draft_tokens sets a chain's length; with tree= set, leave it "
                              "None (the tree's depth and total_tokens size the draft)")
        stop = check_stop_ids(stop_token_ids, cfg.eos_token_ids)
        if self.draft is not None and (shape is not None or not params.greedy) and not hasattr(
                self.target, "compact_cache"):
            raise Eagle3Error("tree drafting and speculative sampling need a native target (the "
                              "transformers adapter takes no tree mask); load with backend='native' "
                              "or use greedy chain drafting")
        if shape is not None and self.draft is not None and shape.top_k > self.draft.config.draft_vocab_size:
            raise Eagle3Error(f"tree top_k {shape.top_k} exceeds the head's draft vocabulary "
                              f"({self.draft.config.draft_vocab_size} tokens); lower top_k")
        sampler = None if params.greedy else Sampler(params, self.target_device)
        stats = empty_stats()
        t0 = time.perf_counter()
        if self.draft is None:
            self.reset_caches()
            if sampler is None:
                step = lambda tok, pos, n: self._target(tok, pos, n, with_taps=False,  # noqa: E731
                                                        last_only=True)[0]
                prefill = lambda tok, pos, n: self._target(tok, pos, n, with_taps=False,  # noqa: E731
                                                           last_only=True, compiled=False)[0]
                tokens, stats["target_forwards"] = plain_greedy(
                    self.target, ids, max_new_tokens, stop, cache=self.target_cache, step=step,
                    prefill=prefill)
            else:
                tokens, stats["target_forwards"] = plain_greedy(
                    self.target, ids, max_new_tokens, stop, cache=self.target_cache,
                    pick=lambda lg: sampler.sample(sampler.probs(lg)))
        else:
            if shape is not None:
                stats["tree"] = shape.as_dict()
                propose = lambda d, logits, h, n: d.draft_tree(logits, h, shape, n)  # noqa: E731
                tokens = speculative_generate(self, ids, max_new_tokens, stop, stats, propose,
                                              shape.total_tokens, shape.depth, sampler, shape)
            else:
                if k is None and sampler is None and self.auto is None:  # measure the costs once
                    max_k = self.max_auto_k
                    probe = ids[:max(1, self.max_seq_len - max_k - 2)]  # room for every size
                    self.auto = AutoK(measure_cost(self, probe, list(range(2, max_k + 2)), repeats=5),
                                      max_k)
                    if self.compiled is not None:
                        warm_auto_graphs(self, ids[:max(1, self.max_seq_len - 2 * AUTO_MAX_K - 2)])
                if sampler is None:
                    tokens = chain_generate(self, ids, max_new_tokens, k, stop, stats, self.auto)
                else:
                    tokens = self._chain_sample(ids, max_new_tokens, k, stop, stats, sampler)
            if stats["rounds"]:
                stats["mean_accept_len"] = 1.0 + stats["accepted_tokens"] / stats["rounds"]
            self._check_acceptance(stats)
        stats["seconds"] = time.perf_counter() - t0
        return GenerationResult(tokens, stats)

    def _chain_sample(self, ids: list[int], max_new_tokens: int, k: int | None,
                      stop: frozenset[int], stats: dict, sampler: Sampler) -> list[int]:
        """Chain speculative sampling. 'auto' drafts SAMPLING_K: a K chosen from timings would
        make a seeded output depend on the machine's load (each K draws differently)."""
        k = k or SAMPLING_K
        stats["num_draft_tokens"] = k
        propose = lambda d, logits, h, n: d.sample_chain(logits, h, min(k, n), sampler)  # noqa: E731
        return speculative_generate(self, ids, max_new_tokens, stop, stats, propose, k, k, sampler)

    @property
    def target_device(self) -> torch.device:
        w = getattr(self.target, "embedding_weight", None)
        return w.device if w is not None else torch.device("cpu")

    def _check_acceptance(self, stats: dict) -> None:
        # A head paired with the wrong taps (e.g. SGLang's +1 ids) drafts garbage silently.
        # Judged on the first draft position (a tree verifies many nodes, accepts one path).
        if self._warned_low_acceptance or stats["rounds"] < 32:
            return
        rate = stats["accepted_per_position"][0] / stats["rounds"]
        if rate < 0.05:
            self._warned_low_acceptance = True
            notice(f"draft acceptance is near zero ({rate:.1%}): the head may belong to another "
                   f"target or use other taps (now {list(self.target.tap_layers)}); check its "
                   "eagle_aux_hidden_state_layer_ids (SGLang-captured ids are off by one)")
