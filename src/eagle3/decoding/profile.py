"""Opt-in instrumentation of the decoding loops (used by `eagle3 bench`).

Off by default: `active()` then returns a profile whose hooks do nothing, so
normal decoding pays a few no-op calls per round. Inside
`with profiling() as prof:` the loops add into `prof`:

    prefill_seconds  the prompt's target forward (and the draft's prefill_prompt)
    draft_seconds    draft_chain + rebuild_after_verify, every round
    verify_seconds   target_verify up to its tokens on the host (plain decoding:
                     each one-token target forward)
    host_syncs       device -> host conversions the loop makes (`.tolist()`, `int(tensor)`)

On a GPU `toc` synchronises first, so the split is real (those extra waits are
the profiler's, not counted in `host_syncs`). The profile is per thread/context.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch


def sync(t: torch.Tensor | None) -> None:
    """Wait for `t`'s device (a no-op on the CPU)."""
    if t is not None and t.is_cuda:
        torch.cuda.synchronize(t.device)


@dataclass
class Profile:
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    host_syncs: int = 0
    _t: float = field(default=0.0, repr=False)

    def tic(self) -> None:
        """Start timing a phase."""
        self._t = time.perf_counter()

    def toc(self, phase: str, t: torch.Tensor | None = None, syncs: int = 0) -> None:
        """Add the time since the last tic/toc (once `t` is computed) to `<phase>_seconds`,
        and the phase's `syncs` host synchronisations to `host_syncs`."""
        sync(t)
        self.host_syncs += syncs
        now = time.perf_counter()
        name = f"{phase}_seconds"
        setattr(self, name, getattr(self, name) + now - self._t)
        self._t = now


class _Off(Profile):
    """The profile used when nobody is profiling: every hook is a no-op."""

    def tic(self) -> None:
        pass

    def toc(self, phase: str, t: torch.Tensor | None = None, syncs: int = 0) -> None:
        pass


_OFF = _Off()
_ACTIVE: ContextVar[Profile | None] = ContextVar("eagle3_profile", default=None)


def active() -> Profile:
    """The profile the decoding loops should fill (a no-op one unless inside `profiling()`)."""
    return _ACTIVE.get() or _OFF


@contextmanager
def profiling() -> Iterator[Profile]:
    """Profile the decoding loops run inside the block (this thread only)."""
    prof = Profile()
    token = _ACTIVE.set(prof)
    try:
        yield prof
    finally:
        _ACTIVE.reset(token)
