"""The engine: many requests at once, each speculating, over one KV pool.

A scheduler thread repeats one step:

    1. apply aborts and timeouts (waiting or running), freeing every page they held
    2. admit waiting requests in arrival order while a batch slot and their worst-case KV
       fit (continuous batching: new requests join between rounds); prefill each
    3. run one round for the whole batch (`decoding.round.run_round`, the same round
       `generate` runs at batch 1): batched drafts (chains or trees, greedy or sampled rows),
       one batched verify, per-row acceptance; the plan (plain, K, or the tree) chosen for
       this batch size by the cost model (`decoding.costs`)
    4. hand each request its new tokens (`on_event`); finish the ones that are done

A failure inside one request's handling (its callback, its sampler) fails that
request alone. A failure inside a batched forward fails the requests of that batch
(their pages are freed) and the engine carries on.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from ..decoding.costs import AUTO_MAX_K, Acceptance, RoundCosts, probe_batch_sizes
from ..decoding.driver import Driver
from ..decoding.planner import Planner
from ..decoding.request import SAMPLING_K, check_generation, check_num_draft_tokens, resolve_proposer
from ..decoding.round import prefill
from ..decoding.tree import TreeShape, parse_tree
from ..errors import Eagle3Error, brief, notice
from .paged import PagedRunner, PagePool
from .request import DONE, Request, RequestState
from .stats import EngineStats


class EngineError(Eagle3Error):
    """A request the engine refuses; `status` is the HTTP status a server should answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class EngineConfig:
    max_batch: int = 8  # requests decoded together
    max_queue: int = 64  # waiting requests beyond this are refused (429)
    max_kv_tokens: int | None = None  # KV pool size in tokens (default: max_batch * max_seq_len)
    speculate: bool = True  # False: plain batched decoding even with a head
    num_draft_tokens: int | None = None  # None: the plan per batch size from the cost model
    tree: Any = None  # a tree shape (True: the default) the cost model may pick
    auto_plan: bool = True  # False with a tree: every round drafts the tree
    proposer: str | None = None  # requests' default proposer (`decoding.suffix`); None: 'hybrid'
    # with a head that speculates, plain decoding without one
    request_timeout_s: float | None = None  # default per-request deadline
    page_size: int = 16


class Engine:
    """Continuous-batching speculative engine over an eager native `Eagle3Speculator`."""

    def __init__(self, spec: Any, config: EngineConfig | None = None) -> None:
        self.spec = spec
        self.config = cfg = replace(config or EngineConfig())  # normalized below: a copy
        check_engine_target(spec)
        for name in ("max_batch", "max_queue", "page_size"):
            if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 1:
                raise Eagle3Error(f"{name} must be a positive integer, got {getattr(cfg, name)!r}")
        t = cfg.request_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise Eagle3Error(f"request_timeout_s must be a positive number of seconds or None, got {t!r}")
        k = cfg.num_draft_tokens = check_num_draft_tokens(cfg.num_draft_tokens, plain_ok=True)
        self.tree: TreeShape | None = parse_tree(cfg.tree)
        if self.tree is not None and k is not None:
            raise Eagle3Error("num_draft_tokens fixes a chain; with a tree, leave it None")
        self.speculate = cfg.speculate and spec.draft is not None and k != 0
        self.kmax = (k or AUTO_MAX_K) if self.speculate else 0
        self.max_model_len = spec.max_seq_len
        kv_tokens = cfg.max_batch * self.max_model_len if cfg.max_kv_tokens is None else cfg.max_kv_tokens
        if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int) or kv_tokens < 1:
            raise Eagle3Error(f"max_kv_tokens must be a positive integer, got {cfg.max_kv_tokens!r}")
        self.pool = PagePool(-(-kv_tokens // cfg.page_size), cfg.page_size)
        self.runner = PagedRunner(spec.target, spec.draft if self.speculate else None, spec.taps,
                                    self.pool)
        self.planner = Planner(self.kmax, self.tree)  # automatic plans, over all requests
        self.schedule = self.planner.schedule(drafts=self.speculate, k=k, tree=self.tree,
                                              automatic=cfg.auto_plan, batched=True)
        self.driver = Driver(self.runner, self.planner)  # the rounds, as `generate` runs them
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Condition()
        self.thread: threading.Thread | None = None
        self.manual = False  # started without a thread: the caller steps
        self.stopping = False
        self.ids = itertools.count(1)
        self.stats = EngineStats()  # read by metrics() under the lock

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, background: bool = True) -> Engine:
        """Measure the cost model (automatic K only) and start the scheduler thread.

        `background=False` starts no thread: the caller drives `step()` / `run_until_idle()`
        (benchmarks and tests that want a known batch composition).
        """
        if self.thread is not None or self.manual:
            return self
        self.prepare()
        self.stopping = False
        if background:
            self.thread = threading.Thread(target=self._loop, name="eagle3-engine", daemon=True)
            self.thread.start()
        else:
            self.manual = True
        return self

    def run_until_idle(self) -> None:
        """Step until no request is waiting or running (without a background thread)."""
        while self.step() or self.waiting:
            pass

    @property
    def costs(self) -> RoundCosts | None:
        """The cost model the planner measured (`prepare`); None before, or without automatic plans."""
        return self.planner.costs

    @property
    def acceptance(self) -> Acceptance:
        return self.planner.acceptance

    @property
    def k_history(self) -> dict[int, dict[Any, int]]:
        """Rounds per plan (K, or "tree") per batch size (`EngineStats.k_history`)."""
        return self.stats.k_history

    @property
    def automatic(self) -> bool:
        """Whether the cost model picks each round's plan."""
        return self.schedule.automatic

    @property
    def _extra(self) -> int:
        """Positions past a request's last token a round may write (drafts, tree scratch)."""
        if not self.speculate:
            return 0
        extra = max(self.kmax, SAMPLING_K)
        if self.tree is not None:
            extra = max(extra, self.tree.total_tokens, self.tree.draft_slots)
        return extra

    def prepare(self) -> None:
        """Measure the batch costs once (needed before stepping with an automatic plan)."""
        if self.automatic and self.costs is None:
            max_T = max(self.kmax, self.tree.total_tokens if self.tree is not None else 0) + 1
            context = max(1, min(128, self.max_model_len // 2) - max_T - 2)
            self.planner.measure(self.runner, probe_batch_sizes(self.config.max_batch), max_T, context)
            if not self.costs.verify:
                raise Eagle3Error("the KV pool is too small to measure even one request's costs; "
                                  "raise max_kv_tokens or pass a fixed num_draft_tokens")

    def stop(self) -> None:
        """Abort every request and stop the scheduler thread (idempotent)."""
        with self.lock:
            self.stopping = True
            for r in [*self.waiting, *self.running]:
                r.abort_reason = r.abort_reason or "abort"
            self.lock.notify_all()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.manual = False
        self._apply_aborts()  # when the thread never ran

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer (None when the speculator was built without one)."""
        return self.spec.tokenizer

    @property
    def kv_bytes(self) -> int:
        """Memory held by the KV pool (target layers and the head's layer)."""
        return self.runner.kv_bytes

    @property
    def is_running(self) -> bool:
        alive = self.manual or (self.thread is not None and self.thread.is_alive())
        return alive and not self.stopping

    # -- requests -------------------------------------------------------------------------------
    def submit(self, prompt_ids: Any, max_tokens: Any, *, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, stop_token_ids: Any = None,
               on_event: Any = None, timeout_s: float | None = None,
               proposer: str | None = None) -> Request:
        """Queue a request (see the module docstring); raises EngineError with an HTTP status."""
        if not self.is_running:
            raise EngineError("the engine is not running (start it, or it is shutting down)", 503)
        cfg = self.spec.target.config
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or timeout_s <= 0):
            raise EngineError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        try:  # the same checks as generate (`decoding.request`)
            req = check_generation(prompt_ids, max_tokens, vocab_size=cfg.vocab_size,
                                   max_len=self.max_model_len, eos_token_ids=cfg.eos_token_ids,
                                   temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                   stop_token_ids=stop_token_ids)
            req = replace(req, proposer=resolve_proposer(proposer or self.config.proposer, self.speculate,
                                                         greedy=req.sampling.greedy))
        except Eagle3Error as e:
            raise EngineError(str(e).replace("max_new_tokens", "max_tokens")) from None
        prompt_ids = req.prompt
        need = self._worst_case(len(prompt_ids), max_tokens)
        if self.pool.pages_for(need) > self.pool.num_pages:
            raise EngineError(f"the request needs {need} KV slots but the pool holds "
                              f"{self.pool.total_tokens}; lower max_tokens or raise the KV pool "
                              "(--max-kv-tokens)", 413)
        with self.lock:
            if self.stopping:  # checked again under the lock: stop() may have run meanwhile
                raise EngineError("the engine is shutting down", 503)
            if len(self.waiting) >= self.config.max_queue:
                raise EngineError(f"too many requests waiting ({len(self.waiting)}); retry later", 429)
            r = Request(f"req-{next(self.ids)}", list(prompt_ids), max_tokens, req.sampling,
                        req.stop_ids, on_event,
                        timeout_s if timeout_s is not None else self.config.request_timeout_s)
            r.seq = self.driver.start(r.id, req, self.schedule)
            self.waiting.append(r)
            self.lock.notify_all()
        return r

    def abort(self, request: Request | str, reason: str = "abort") -> None:
        """Stop a request; its pages are freed at the next round boundary. No-op once done.

        `reason` becomes its finish_reason; "stop" (a stop string found by the consumer)
        finishes it normally (FINISHED), any other reason aborts it (ABORTED).
        """
        with self.lock:
            for r in [*self.waiting, *self.running]:
                if r is request or r.id == request:
                    r.abort_reason = r.abort_reason or reason
            self.lock.notify_all()

    def _worst_case(self, prompt_len: int, max_tokens: int) -> int:
        # The draft's speculative positions may run past max_model_len (the target's never do).
        return prompt_len + max_tokens + self._extra + 1

    # -- the scheduler ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and not self.waiting and not self.running:
                    self.lock.wait()
                if self.stopping:
                    break
            try:
                self.step()
            except Exception:  # a bug in the scheduler itself: fail everyone, keep serving
                notice("engine step failed:\n" + traceback.format_exc())
                for r in list(self.running):
                    self._finish(r, RequestState.FAILED, "error", error="internal engine error")
        self._apply_aborts()

    def step(self) -> bool:
        """One scheduler iteration (aborts, admission, one round); False when there was nothing to do."""
        self._apply_aborts()
        self._admit()
        if not self.running:
            return False
        batch = list(self.running)
        try:
            plan, verdicts = self.driver.round([r.seq for r in batch], self.schedule)
        except Exception as e:  # a batched forward failed: its requests fail, the engine goes on
            notice(f"a batched round failed ({type(e).__name__}: {e}); failing its {len(batch)} requests")
            for r in batch:
                self._finish(r, RequestState.FAILED, "error", error=brief(e))
            return True
        with self.lock:  # counters for metrics(), which other threads read: consistent per round
            self.stats.round(plan, {r.id: r.metrics for r in batch})
        now = time.perf_counter()
        for r, v in zip(batch, verdicts, strict=True):
            if v.error is not None:  # this request's own handling failed: it alone fails
                self._finish(r, RequestState.FAILED, "error", error=v.error)
                continue
            if v.new:
                r.last_token_at = now
            if v.done:
                self._finish(r, RequestState.FINISHED, self._reason(r), v.new)
            elif v.new:
                self._emit(r, v.new)
        return True

    def _admit(self) -> None:
        while len(self.running) < self.config.max_batch:
            with self.lock:
                if not self.waiting:
                    return
                r = self.waiting[0]
                need = self._worst_case(len(r.prompt_ids), r.max_tokens)
                if not self.pool.can_admit(need):
                    return  # first come, first served: it waits for pages to free up
                self.waiting.popleft()
                self.pool.admit(r.id, need)
                r.state = RequestState.RUNNING
                self.running.append(r)
            r.admitted_at = time.perf_counter()
            try:
                first = self._prefill(r)
            except Exception as e:
                self._finish(r, RequestState.FAILED, "error",
                             error=f"prefill failed: {brief(e)}")
                continue
            r.first_token_at = r.last_token_at = time.perf_counter()
            if r.seq.done:
                self._finish(r, RequestState.FINISHED, self._reason(r), [first])
            else:
                self._emit(r, [first])

    def _prefill(self, r: Request) -> int:
        return prefill(self.runner, r.seq)

    def _emit(self, r: Request, new: list[int]) -> None:
        if r.on_event is None:
            return
        try:
            r.on_event(r, new, False)
        except Exception as e:  # the request's own consumer failed: it alone fails
            self._finish(r, RequestState.FAILED, "error", error=brief(e))

    @staticmethod
    def _reason(r: Request) -> str:
        return "stop" if r.token_ids and r.token_ids[-1] in r.stop_ids else "length"

    def _apply_aborts(self) -> None:
        now = time.perf_counter()
        with self.lock:
            doomed = []
            for r in [*self.waiting, *self.running]:
                if r.abort_reason is None and r.timeout_s is not None and now - r.arrival > r.timeout_s:
                    r.abort_reason = "timeout"
                if r.abort_reason is not None:
                    doomed.append(r)
        for r in doomed:  # "stop": the consumer found a stop string, a normal finish
            state = RequestState.FINISHED if r.abort_reason == "stop" else RequestState.ABORTED
            self._finish(r, state, r.abort_reason)

    def _finish(self, r: Request, state: RequestState, reason: str, new: list[int] | None = None,
                error: str | None = None) -> None:
        """Retire a request: free its pages, record it, tell its consumer (once)."""
        with self.lock:
            if r.state in DONE:
                return
            if r in self.waiting:
                self.waiting.remove(r)
            if r in self.running:
                self.running.remove(r)
            self.pool.release(r.id)
            r.state, r.finish_reason, r.error = state, reason, error
            r.finished_at = time.perf_counter()
            if r.seq is not None:  # drop the tensors it holds
                r.seq.pending_ids, r.seq.pending_feats, r.seq.root, r.seq.boundary = [], [], None, None
                r.seq.suffix = None  # its suffix index
            m = r.metrics
            if r.admitted_at is None:  # never prefilled
                m["prompt_tokens"] = 0
            self.stats.finish({RequestState.FINISHED: "finished", RequestState.ABORTED: "aborted",
                               RequestState.FAILED: "failed"}[state], m)
        if r.on_event is not None:
            try:
                r.on_event(r, list(new or []), True)
            except Exception as e:  # nothing left to fail; note it
                notice(f"request {r.id}: its final callback raised {type(e).__name__}: {e}")
        r.set_done()

    # -- metrics ----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Counters (over all requests, live) and gauges, with vLLM's names."""
        with self.lock:
            out = self.stats.counters(self.running)
            out["num_running"] = len(self.running)
            out["num_waiting"] = len(self.waiting)
            out["kv_used_tokens"] = self.pool.used_tokens
            out["kv_total_tokens"] = self.pool.total_tokens
            out["kv_usage"] = self.pool.used_tokens / self.pool.total_tokens
            out["speculation"] = self.speculate
        return out


def check_engine_target(spec: Any) -> None:
    """The engine runs eager native targets; refuse the rest in one line."""
    from ..targets.decoder import NativeTarget

    if not isinstance(spec.target, NativeTarget):
        raise Eagle3Error("the engine needs a native target (backend 'native' or 'auto'); the transformers "
                          "adapter has no batched paged cache, and an exported program holds its own caches")
