"""The OpenAI-compatible HTTP app: `build_app(engine, model_name) -> FastAPI`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both optionally streamed
as server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus).

Each request is one `engine.submit(...)`; the engine thread hands its tokens to the
event loop with `loop.call_soon_threadsafe`, and `Generation` turns them into text
(incremental detokenisation that never splits a UTF-8 character, stop strings cut
out of the text and held back while they might still be starting). A client that
goes away, or a handler that is cancelled, aborts its engine request, which frees
its KV slots.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from ..errors import Eagle3Error
from .metrics import ServerMetrics
from .protocol import APIError, GenerateParams, parse_chat, parse_completion, parse_json

DEFAULT_MAX_BODY_BYTES = 1 << 20
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


class Generation:
    """One engine request seen from the event loop: text pieces, then the outcome."""

    def __init__(self, engine: Any, metrics: ServerMetrics, prompt_ids: list[int], max_tokens: int,
                 p: GenerateParams) -> None:
        self.engine, self.metrics = engine, metrics
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.text = TextStream(engine.spec.tokenizer, p.stop)
        self.token_ids: list[int] = []  # generated ids, as counted in usage (a stop id included)
        self.prompt_tokens = len(prompt_ids)
        self.finish_reason: str | None = None
        self.error: APIError | None = None
        self.done = False  # the engine's final event was consumed
        self.cancelled = False  # we aborted it (client gone)
        try:
            self.req = engine.submit(prompt_ids, max_tokens, temperature=p.temperature, top_p=p.top_p,
                                     top_k=p.top_k, seed=p.seed, on_event=self._on_event)
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
                "mean_accept_len": 1.0 + accepted / drafts if drafts else None, "ttft_s": m.get("ttft_s")}


class GenerationStream(StreamingResponse):
    """A streamed answer that aborts its generation however the response ends."""

    def __init__(self, gen: Generation, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 when it is over `limit` bytes (by Content-Length or by its actual size)."""
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        too_big = too_big or size > limit
        if not too_big:
            chunks.append(chunk)
        elif size > DRAIN_LIMIT:
            break
    if too_big:
        raise APIError(413, f"the request body is over {limit} bytes (--max-body-bytes)",
                       code="body_too_large")
    return b"".join(chunks)


async def _abort_on_disconnect(request: Request, gen: Generation) -> None:
    """For non-streamed answers: abort the generation when the client hangs up."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)
    gen.close()


def build_app(engine: Any, model_name: str, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """An OpenAI-compatible app serving `engine` (started by the caller) as `model_name`."""
    app = FastAPI(title="eagle3", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(engine)
    app.state.engine, app.state.metrics = engine, metrics

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
            raise APIError(404, f"the model '{model_id}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        p = parse_completion(parse_json(await _read_body(request, max_body_bytes)), model_name)
        ids = p.prompt_ids
        if p.prompt_text is not None:
            tok = engine.spec.tokenizer
            if tok is None:
                raise APIError(400, "this model ships no tokenizer, so a text prompt cannot be encoded; "
                               "send 'prompt' as a list of token ids", param="prompt")
            ids = tok.encode(p.prompt_text)
            if not ids:
                raise APIError(400, "'prompt' encodes to no tokens", param="prompt")
        return await _answer(request, False, ids, p.max_tokens, p)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        p = parse_chat(parse_json(await _read_body(request, max_body_bytes)), model_name)
        tok = engine.spec.tokenizer
        if tok is None:
            raise APIError(400, "this model ships no tokenizer, so chat messages cannot be encoded; use "
                           "/v1/completions with token ids", param="messages")
        try:
            ids = tok.apply_chat_template(p.messages)
        except Eagle3Error as e:
            raise APIError(400, str(e), param="messages") from None
        max_tokens = p.max_tokens
        if max_tokens is None:  # default: the rest of the context
            max_tokens = engine.max_model_len - len(ids)
            if max_tokens < 1:
                raise APIError(400, f"the messages ({len(ids)} tokens) fill the model's context of "
                               f"{engine.max_model_len} tokens; shorten them", param="messages")
        return await _answer(request, True, ids, max_tokens, p)

    async def _answer(request: Request, chat: bool, ids: list[int], max_tokens: int,
                      p: GenerateParams) -> Response:
        gen = Generation(engine, metrics, ids, max_tokens, p)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": model_name}
        if p.stream:
            return GenerationStream(gen, _stream(gen, head, chat, p.include_usage))
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

    async def _stream(gen: Generation, head: dict, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        obj = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if include_usage else {}

        def chunk(text: str | None, finish_reason: str | None = None, **more: Any) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                if text == "" and finish_reason is None:  # the first chunk names the role
                    delta = {"role": "assistant", "content": ""}
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            return _sse({**obj, "choices": [c], **extra, **more})

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

    return app
