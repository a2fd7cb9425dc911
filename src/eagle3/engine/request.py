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

from ..decoding.round import SequenceState
from ..decoding.sampling import SamplingParams
from ..decoding.types import SpecStats


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
    finish_reason: str | None = None
    error: str | None = None
    abort_reason: str | None = None  # set by another thread; applied at the next round boundary
    seq: SequenceState | None = None  # the decoding state (engine thread; `decoding.round`)
    # -- timing and counters --
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def token_ids(self) -> list[int]:
        """The tokens generated so far."""
        return self.seq.out if self.seq is not None else []

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request is finished, aborted or failed; False on timeout."""
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def set_done(self) -> None:
        """Wake every `wait()`er: the engine calls this once the request's state is final."""
        self._done.set()

    @property
    def metrics(self) -> dict[str, Any]:
        """Latencies (seconds) and vLLM-named speculation counters for this request."""
        t0 = self.arrival
        n = len(self.token_ids)
        st = self.seq.stats if self.seq is not None else SpecStats()
        drafts = st.rounds
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
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": st.draft_tokens,
            "spec_decode_num_accepted_tokens": st.accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(st.accepted_per_position),
            "suffix_draft_tokens": st.suffix_draft_tokens,  # of them, the text's own (`decoding.suffix`)
            "suffix_accepted_tokens": st.suffix_accepted_tokens,
            "accept_len_hist": list(st.accept_len_hist),
            "mean_accept_len": st.mean_accept_len if drafts else None,
        }
