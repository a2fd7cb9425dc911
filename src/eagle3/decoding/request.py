"""One generation request and its validation, shared by `generate`, the engine and the server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import Eagle3Error
from .proposers import PROPOSERS
from .sampling import SamplingParams, check_sampling
from .tree import TreeShape, parse_tree

MAX_NUM_DRAFT_TOKENS = 32
DEFAULT_PROPOSER = "hybrid"  # with a head on a runner that verifies trees (docs/suffix.md: never
# below the head alone)
SAMPLING_K = 2  # chain drafts for sampled requests under automatic K: a seed's output then
# never depends on timings or on the batch a request shares. 2: the fastest K for sampled
# chains of the default head (docs/decoding.md, "Top-k and top-p")


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request: prompt ids, length, sampling, stop ids and drafting choice."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    num_draft_tokens: int | None = None  # None: automatic
    tree: TreeShape | None = None
    proposer: str | None = None  # a `decoding.proposers` name ('eagle', 'suffix', 'hybrid');
    # None: the default (`resolve_proposer`)


def check_prompt(prompt_ids: Any, vocab_size: int) -> list[int]:
    """The prompt as a list of ints in the vocabulary."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.flatten().tolist()
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
        raise Eagle3Error("prompt_ids must be a sequence of integer token ids")
    ids = []
    for t in prompt_ids:
        if isinstance(t, bool) or not isinstance(t, int) and not (
                isinstance(t, float) and t.is_integer()):
            raise Eagle3Error("prompt_ids must be a sequence of integer token ids")
        ids.append(int(t))
    if not ids:
        raise Eagle3Error("the prompt is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise Eagle3Error(f"token id {bad[0]} is outside the target's vocabulary (0..{vocab_size - 1}); "
                          "check the tokenizer matches the target")
    return ids


def check_stop_ids(stop_token_ids: Any, eos_token_ids: Any) -> frozenset[int]:
    """The stop ids of a request: `stop_token_ids`, or the target's EOS ids when None."""
    try:
        return frozenset(int(t) for t in (eos_token_ids if stop_token_ids is None else stop_token_ids))
    except (TypeError, ValueError):
        raise Eagle3Error("stop_token_ids must be a list of integer token ids") from None


def check_num_draft_tokens(k: Any, plain_ok: bool = False) -> int | None:
    """An int K in 1..MAX_NUM_DRAFT_TOKENS (0 too with `plain_ok`: the engine's "no drafts"), or
    None for automatic ('auto' or None)."""
    if k is None or k == "auto":
        return None
    low = 0 if plain_ok else 1
    if not isinstance(k, int) or isinstance(k, bool) or not low <= k <= MAX_NUM_DRAFT_TOKENS:
        raise Eagle3Error(f"num_draft_tokens must be 'auto' or an integer in {low}..{MAX_NUM_DRAFT_TOKENS}, "
                          f"got {k!r}")
    return k


def check_generation(prompt_ids: Any, max_new_tokens: Any, *, vocab_size: int, max_len: int,
                     eos_token_ids: Any, temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0,
                     seed: Any = None, num_draft_tokens: Any = None, tree: Any = None,
                     stop_token_ids: Any = None, proposer: Any = None) -> GenerationRequest:
    """Validate a request at admission (one clear error each); see `Eagle3Speculator.generate`."""
    ids = check_prompt(prompt_ids, vocab_size)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise Eagle3Error(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if len(ids) + max_new_tokens > max_len:
        raise Eagle3Error(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                          f"target's context of {max_len} tokens (max_seq_len); shorten the prompt, "
                          "lower max_new_tokens or load with a larger max_seq_len")
    k = check_num_draft_tokens(num_draft_tokens)
    params = check_sampling(temperature, top_p, top_k, seed)
    shape = parse_tree(tree)
    if shape is not None and k is not None:
        raise Eagle3Error("num_draft_tokens sets a chain's length; with tree= set, leave it "
                          "None (the tree's depth and total_tokens size the draft)")
    stop = check_stop_ids(stop_token_ids, eos_token_ids)
    # the proposer's name and what it needs are checked against the speculator or engine
    # (`resolve_proposer`), which knows whether a head is there
    return GenerationRequest(ids, max_new_tokens, params, stop, k, shape, proposer)


def resolve_proposer(proposer: str | None, has_head: bool, trees: bool = True,
                     greedy: bool = True) -> str:
    """Who drafts (`decoding.proposers`): a registered name, checked against what it needs (a
    head, a runner that verifies trees). None: DEFAULT_PROPOSER for a greedy request with a head
    on a tree-capable runner, else 'eagle' (the head alone; without a head, plain decoding): a
    sampled chain grafted with text nodes loses its draft q (docs/suffix.md)."""
    if proposer is None:
        default = PROPOSERS[DEFAULT_PROPOSER]
        ok = has_head and (trees or not default.grafts) and (greedy or not default.greedy_only)
        return DEFAULT_PROPOSER if ok else "eagle"
    chosen = PROPOSERS.get(proposer) if isinstance(proposer, str) else None
    if chosen is None:
        raise Eagle3Error(f"proposer must be one of {', '.join(PROPOSERS)}, got {proposer!r}")
    if chosen.uses_head and not has_head:
        raise Eagle3Error(f"proposer '{proposer}' needs a draft head; load one, or use "
                          "proposer='suffix' (drafts from the text alone)")
    if chosen.grafts and not trees:
        raise Eagle3Error(f"proposer '{proposer}' verifies a tree, which the transformers adapter "
                          "cannot; load with backend='native' or use proposer 'eagle' or 'suffix'")
    return proposer
