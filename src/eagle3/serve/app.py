"""The OpenAI-compatible HTTP app: `build_app(engine, model_name) -> FastAPI`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both optionally streamed
as server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus).

`ServerLimits` says what the server accepts (API key, sizes, counts); `Gate` checks the
key and counts requests in flight before any handler runs.

Each request is one `engine.submit(...)`; the engine thread hands its tokens to the
event loop with `loop.call_soon_threadsafe`, and `ServedGeneration` turns them into text
(incremental detokenisation that never splits a UTF-8 character, stop strings cut
out of the text and held back while they might still be starting). A client that
goes away, or a handler that is cancelled, aborts its engine request, which frees
its KV slots; so does a streaming client that stops reading (`stream_stall_s`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from ..engine import Engine
from ..errors import Eagle3Error, notice
from .metrics import ServerMetrics
from .protocol import (
    APIError,
    GenerateParams,
    ServerLimits,
    check_prompt_length,
    parse_chat,
    parse_completion,
    parse_json,
    quote,
)

DEFAULT_MAX_BODY_BYTES = ServerLimits.max_body_bytes
DRAIN_LIMIT = 64 << 20  # an oversized body is read (and dropped) up to here, so the client sees the 413


class TextStream:
    """Generated ids -> text, one id at a time, with stop strings.

    Windowed incremental decoding (as vLLM's detokenizer): the new text is
    decode(ids[prefix:]) minus decode(ids[prefix:read]); text ending in U+FFFD (a
    character split across tokens) waits for the next id. `take()` returns the text
    that is final: it withholds a tail that could still grow into a stop string.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tok = tokenizer
        self.stop = stop
        self.text = ""
        self.stopped = False  # a stop string was found; the text ends before it
        self._ids: list[int] = []
        self._prefix = self._read = self._sent = 0

    def add(self, token_id: int) -> None:
        self._ids.append(token_id)
        self._decode(final=False)

    def flush(self) -> None:
        """At the end: decode whatever was held back (even a dangling U+FFFD)."""
        self._decode(final=True)

    def _decode(self, final: bool) -> None:
        if self.tok is None or self.stopped or self._read == len(self._ids):
            return
        before = self.tok.decode(self._ids[self._prefix:self._read])
        after = self.tok.decode(self._ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return
        start = len(self.text)
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        if self.stop:
            lo = max(0, start - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True

    def take(self) -> str:
        """The text not handed out yet that can no longer change."""
        end = len(self.text)
        if not self.stopped:
            end -= max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])),
                       default=0)
        piece = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return piece


class ServedGeneration:
    """One engine request seen from the event loop: text pieces, then the outcome."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, prompt_ids: list[int], max_tokens: int,
                 p: GenerateParams) -> None:
        self.engine, self.metrics = engine, metrics
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.text = TextStream(engine.tokenizer, p.stop)
        self.token_ids: list[int] = []  # generated ids, as counted in usage (a stop id included)
        self.prompt_tokens = len(prompt_ids)
        self.finish_reason: str | None = None
        self.error: APIError | None = None
        self.done = False  # the engine's final event was consumed
        self.cancelled = False  # we aborted it (client gone)
        try:
            self.req = engine.submit(prompt_ids, max_tokens, temperature=p.temperature, top_p=p.top_p,
                                     top_k=p.top_k, seed=p.seed, on_event=self._on_event,
                                     proposer=p.proposer)
        except Eagle3Error as e:  # EngineError carries the HTTP status
            raise APIError(getattr(e, "status", 400), str(e)) from None

    def _on_event(self, req: Any, new: list[int], finished: bool) -> None:
        """Engine thread: pass the ids to the event loop (and time the request once it ends)."""
        event = (list(new), finished, None, None)
        if finished:
            event = (list(new), True, req.finish_reason, req.error)
            self.metrics.observe(req.metrics)
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
            pass

    async def deltas(self) -> AsyncIterator[str]:
        """Text pieces as they become final; afterwards `finish_reason` or `error` is set."""
        while not self.done:
            new, finished, reason, error = await self.events.get()
            stop_id = None
            if finished and reason == "stop" and not self.text.stopped and new:
                stop_id = new.pop()  # the engine's stop id ends the ids: counted, not shown
            for t in new:
                if self.text.stopped:
                    break
                self.token_ids.append(t)
                self.text.add(t)
                if self.text.stopped:
                    self.engine.abort(self.req, reason="stop")
            if stop_id is not None and not self.text.stopped:
                self.token_ids.append(stop_id)
            if finished:
                self.done = True
                self.text.flush()
                self._outcome(reason, error)
            piece = self.text.take()
            if piece:
                yield piece

    def _outcome(self, reason: str | None, error: str | None) -> None:
        if self.text.stopped or reason in ("stop", "length"):
            self.finish_reason = "stop" if self.text.stopped else reason
        elif reason == "timeout":
            self.error = APIError(504, "the request timed out (--request-timeout); retry with fewer "
                                  "max_tokens or a longer timeout")
        elif reason == "abort" and self.cancelled:
            self.error = APIError(499, "the client went away")  # nobody reads this one
        elif reason == "abort":
            self.error = APIError(503, "the request was aborted: the server is shutting down")
        else:
            self.error = APIError(500, f"generation failed: {error or reason}")

    def close(self) -> None:
        """Abort the engine request unless it already ended (client gone, handler cancelled)."""
        if not self.done:
            self.cancelled = True
            self.engine.abort(self.req)

    def usage(self) -> dict[str, int]:
        n = len(self.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n}

    def stats(self) -> dict[str, Any]:
        """Our extra numbers, under the response's `eagle3` key."""
        m = self.req.metrics
        drafts, accepted = m.get("spec_decode_num_drafts", 0), m.get("spec_decode_num_accepted_tokens", 0)
        return {"spec_decode_num_drafts": drafts, "spec_decode_num_accepted_tokens": accepted,
                "mean_accept_len": 1.0 + accepted / drafts if drafts else None, "ttft_s": m.get("ttft_s"),
                # of the drafted and accepted tokens, those only the text proposed (`decoding.suffix`)
                "suffix_draft_tokens": m.get("suffix_draft_tokens", 0),
                "suffix_accepted_tokens": m.get("suffix_accepted_tokens", 0)}


class ClientStalled(Exception):
    """A streaming client read nothing for `stream_stall_s` seconds."""


class GenerationStream(StreamingResponse):
    """A streamed answer that aborts its generation however the response ends.

    Every send must finish within `stall_s`: a send only waits when the socket's buffers
    are full, i.e. when the client has stopped reading. Such a client is cut off (its
    connection closed, its request aborted and its KV freed) instead of holding pages.
    """

    def __init__(self, gen: ServedGeneration, content: AsyncIterator[str], stall_s: float) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen, self.stall_s = gen, stall_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def guarded_send(message: Any) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_s)
            except asyncio.TimeoutError:
                raise ClientStalled from None

        try:
            await super().__call__(scope, receive, guarded_send)
        except ClientStalled:  # returning with the response unfinished makes uvicorn drop the connection
            self.gen.metrics.refused.labels("stalled_stream").inc()
            notice(f"a streaming client read nothing for {self.stall_s:g} s; its request was aborted")
        finally:
            self.gen.close()


class _QuietIncomplete(logging.Filter):
    """uvicorn logs an error for a response we cut off on purpose (a stalled client)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "without completing response" not in record.getMessage()


logging.getLogger("uvicorn.error").addFilter(_QuietIncomplete())


class Gate:
    """ASGI middleware in front of every route: the API key, then the in-flight bound.

    /v1/* (and /metrics when `protect_metrics`) need `Authorization: Bearer <key>`; the
    key is compared through sha256 digests with `hmac.compare_digest`, so the time taken
    says nothing about the key. POSTs to /v1/* count as in flight until their response
    ends (streams included); one more than `max_concurrent` is answered 429 at once.
    """

    def __init__(self, app: Any, limits: ServerLimits, max_concurrent: int, metrics: ServerMetrics) -> None:
        self.app, self.limits, self.max_concurrent, self.metrics = app, limits, max_concurrent, metrics
        key = limits.api_key
        self.key_digest = hashlib.sha256(key.encode()).digest() if key else None
        self.in_flight = 0

    def _guarded(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or (path == "/metrics"
                                                             and self.limits.protect_metrics)

    def _authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                given = value
        scheme, _, token = given.partition(b" ")
        digest = hashlib.sha256(token.strip()).digest()
        return hmac.compare_digest(digest, self.key_digest) and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self.key_digest is not None and self._guarded(path) and not self._authorized(scope):
            err = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                           "with the key the server was started with (--api-key)", code="invalid_api_key")
            self.metrics.refused.labels("unauthorized").inc()
            await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                scope, receive, send)
            return
        if scope.get("method") != "POST" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_concurrent:
            err = APIError(429, f"the server is handling {self.in_flight} requests, its limit "
                           "(--max-concurrent); retry later", code="too_many_requests")
            self.metrics.refused.labels("too_many_requests").inc()
            await JSONResponse(err.body(), status_code=429, headers={"Retry-After": "1"})(
                scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _read_body(request: Request, limit: int, stall_s: float) -> bytes:
    """The body, or a 413 when it is over `limit` bytes (by Content-Length or by its actual size),
    or a 408 when the client sends nothing for `stall_s` seconds (it would hold an in-flight slot)."""
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), stall_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body stalled: nothing arrived for {stall_s:g} s "
                               "(--stream-stall-timeout)", code="body_timeout") from None
            size += len(chunk)
            too_big = too_big or size > limit
            if not too_big:
                chunks.append(chunk)
            elif size > DRAIN_LIMIT:
                break
    except ClientDisconnect:  # nobody will read the answer; no traceback in the log either
        raise APIError(400, "the client went away before sending its whole body",
                       code="client_disconnected") from None
    if too_big:
        raise APIError(413, f"the request body is over {limit} bytes (--max-body-bytes)",
                       code="body_too_large")
    return b"".join(chunks)


async def _abort_on_disconnect(request: Request, gen: ServedGeneration) -> None:
    """For non-streamed answers: abort the generation when the client hangs up."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)
    gen.close()


@dataclasses.dataclass(frozen=True)
class _Served:
    """What the generation routes share: the engine, its metrics, the served name, the limits."""

    engine: Engine
    metrics: ServerMetrics
    model_name: str
    limits: ServerLimits


def build_app(engine: Engine, model_name: str, *, limits: ServerLimits | None = None,
              max_body_bytes: int | None = None) -> FastAPI:
    """An OpenAI-compatible app serving `engine` (started by the caller) as `model_name`.

    `limits` (default `ServerLimits()`: no key, context-sized prompts) says what it accepts;
    `max_body_bytes` overrides its body limit.
    """
    limits = _checked_limits(limits, max_body_bytes)
    app = FastAPI(title="eagle3", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(engine)
    max_concurrent = limits.max_concurrent or engine.config.max_batch + engine.config.max_queue
    app.add_middleware(Gate, limits=limits, max_concurrent=max_concurrent, metrics=metrics)
    app.state.engine, app.state.metrics, app.state.limits = engine, metrics, limits
    _add_error_handlers(app)
    _add_info_routes(app, engine, metrics, model_name)
    _add_generation_routes(app, _Served(engine, metrics, model_name, limits))
    return app


def _checked_limits(limits: ServerLimits | None, max_body_bytes: int | None) -> ServerLimits:
    """`limits` (default `ServerLimits()`) with `max_body_bytes` applied, checked: a one-line error."""
    limits = limits or ServerLimits()
    if max_body_bytes is not None:
        limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)
    try:
        limits.check()
    except ValueError as e:
        raise Eagle3Error(str(e)) from None
    return limits


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style JSON body: ours, Starlette's (404, 405) and unexpected ones."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        err = APIError(500, f"internal server error ({type(exc).__name__}); see the server log")
        return JSONResponse(err.body(), status_code=500)


def _add_info_routes(app: FastAPI, engine: Engine, metrics: ServerMetrics, model_name: str) -> None:
    """GET /health, /v1/models, /v1/models/{id} and /metrics."""

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.is_running
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "eagle3",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"the model {quote(model_id)} does not exist; this server serves "
                           f"'{model_name}'", param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)


def _add_generation_routes(app: FastAPI, served: _Served) -> None:
    """POST /v1/completions and /v1/chat/completions."""
    limits = served.limits

    def body(request: Request):
        return _read_body(request, limits.max_body_bytes, limits.stream_stall_s)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        p = parse_completion(parse_json(await body(request)), served.model_name, limits)
        ids = _completion_prompt_ids(served.engine, p, limits)
        return await _answer(served, request, False, ids, p.max_tokens, p)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        p = parse_chat(parse_json(await body(request)), served.model_name, limits)
        ids = _chat_prompt_ids(served.engine, p, limits)
        max_tokens = p.max_tokens
        if max_tokens is None:
            max_tokens = _rest_of_context(served.engine, limits, len(ids))
        return await _answer(served, request, True, ids, max_tokens, p)


def _completion_prompt_ids(engine: Engine, p: GenerateParams, limits: ServerLimits) -> list[int]:
    """A completion's prompt as ids (a text prompt encoded), its length checked."""
    ids = p.prompt_ids
    if p.prompt_text is not None:
        tok = engine.tokenizer
        if tok is None:
            raise APIError(400, "this model ships no tokenizer, so a text prompt cannot be encoded; "
                           "send 'prompt' as a list of token ids", param="prompt")
        ids = tok.encode(p.prompt_text)
        if not ids:
            raise APIError(400, "'prompt' encodes to no tokens", param="prompt")
    check_prompt_length(len(ids), limits, "prompt")
    return ids


def _chat_prompt_ids(engine: Engine, p: GenerateParams, limits: ServerLimits) -> list[int]:
    """A chat's messages through the model's chat template, their length checked."""
    tok = engine.tokenizer
    if tok is None:
        raise APIError(400, "this model ships no tokenizer, so chat messages cannot be encoded; use "
                       "/v1/completions with token ids", param="messages")
    try:
        ids = tok.apply_chat_template(p.messages)
    except Eagle3Error as e:
        raise APIError(400, str(e), param="messages") from None
    check_prompt_length(len(ids), limits, "messages")
    return ids


def _rest_of_context(engine: Engine, limits: ServerLimits, prompt_tokens: int) -> int:
    """A chat's default max_tokens: the rest of the context (within the server's limit)."""
    max_tokens = min(engine.max_model_len - prompt_tokens, limits.max_tokens or engine.max_model_len)
    if max_tokens < 1:
        raise APIError(400, f"the messages ({prompt_tokens} tokens) fill the model's context of "
                       f"{engine.max_model_len} tokens; shorten them", param="messages")
    return max_tokens


async def _answer(served: _Served, request: Request, chat: bool, ids: list[int], max_tokens: int,
                  p: GenerateParams) -> Response:
    """Submit one generation; answer with a stream of chunks or, once it ends, one JSON body."""
    gen = ServedGeneration(served.engine, served.metrics, ids, max_tokens, p)
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
            "model": served.model_name}
    if p.stream:
        return GenerationStream(gen, _stream(gen, head, chat, p.include_usage), served.limits.stream_stall_s)
    watcher = asyncio.ensure_future(_abort_on_disconnect(request, gen))
    try:
        text = "".join([piece async for piece in gen.deltas()])
    finally:
        watcher.cancel()
        gen.close()
    if gen.error is not None:
        raise gen.error
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice.update(logprobs=None, finish_reason=gen.finish_reason)
    return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                         "choices": [choice], "usage": gen.usage(),
                         "eagle3": {**gen.stats(), "token_ids": gen.token_ids}})


async def _stream(gen: ServedGeneration, head: dict, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer: (chat: a role chunk,) text chunks, the final
    chunk (or the error), the usage chunk when asked for, and [DONE]."""
    obj = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if include_usage else {}

    def chunk(text: str | None, finish_reason: str | None = None, **more: Any) -> str:
        return _sse({**obj, "choices": [_stream_choice(chat, text, finish_reason)], **extra, **more})

    try:
        if chat:
            yield chunk("")
        async for piece in gen.deltas():
            yield chunk(piece)
        if gen.error is not None:
            yield _sse(gen.error.body())
        else:
            yield chunk(None, gen.finish_reason, eagle3=gen.stats())
            if include_usage:
                yield _sse({**obj, "choices": [], "usage": gen.usage()})
        yield "data: [DONE]\n\n"
    finally:
        gen.close()


def _stream_choice(chat: bool, text: str | None, finish_reason: str | None) -> dict[str, Any]:
    """One streamed chunk's choice: a chat delta (the first, text "", names the role) or a text piece."""
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    delta = {} if text is None else {"content": text}
    if text == "" and finish_reason is None:
        delta = {"role": "assistant", "content": ""}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
