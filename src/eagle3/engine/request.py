"""A request's lifecycle, its decoding state inside the engine, and its metrics.

    WAITING --admit--> RUNNING --> FINISHED (stop id / max_tokens)
       |                  |------> FINISHED (abort(reason="stop"): a stop string)
       |                  |------> ABORTED  (abort(), timeout, shutdown)
       '------------------'------> FAILED   (an exception in this request's handling)
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..decoding.sampling import Sampler, SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


DONE = (RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED)


@dataclass(eq=False)  # matched by identity
class Request:
    """One generation request. The engine thread owns every field but `abort_reason`."""

    id: str
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop_ids: frozenset[int]
    on_event: Callable[[Request, list[int], bool], None] | None = None
    timeout_s: float | None = None
    state: RequestState = RequestState.WAITING
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    abort_reason: str | None = None  # set by another thread; applied at the next round boundary
    # -- decoding state (engine thread) --
    sampler: Sampler | None = None
    target_len: int = 0  # positions with target K/V; the anchor (last token) is at target_len
    draft_len: int = 0  # draft slots filled
    pending_ids: list[int] = field(default_factory=list)  # tokens the draft has not seen yet
    pending_feats: list[torch.Tensor] = field(default_factory=list)  # their target features (n, H)
    first_draft: int | None = None  # d1 for the next round (valid while nothing is pending)
    boundary: torch.Tensor | None = None  # (H,) the draft feature that follows d1
    # -- timing and counters --
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    accept_len_hist: list[int] = field(default_factory=list)  # rounds by accepted length 0..K
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def anchor(self) -> int:
        return self.token_ids[-1]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request is finished, aborted or failed; False on timeout."""
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def metrics(self) -> dict[str, Any]:
        """Latencies (seconds) and vLLM-named speculation counters for this request."""
        t0 = self.arrival
        n = len(self.token_ids)
        itl = None
        if n > 1 and self.first_token_at is not None and self.last_token_at is not None:
            itl = (self.last_token_at - self.first_token_at) / (n - 1)
        return {
            "queue_s": None if self.admitted_at is None else self.admitted_at - t0,
            "ttft_s": None if self.first_token_at is None else self.first_token_at - t0,
            "itl_s": itl,
            "e2e_s": None if self.finished_at is None else self.finished_at - t0,
            "prompt_tokens": len(self.prompt_ids),
            "generation_tokens": n,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "accept_len_hist": list(self.accept_len_hist),
            "mean_accept_len": 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else None,
        }
