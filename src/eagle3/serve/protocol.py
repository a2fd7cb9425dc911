"""OpenAI request validation and error bodies for `eagle3 serve`.

Requests are plain JSON objects checked field by field: a field we do not know, or a
feature we do not implement (n > 1, logprobs, echo, penalties), is a 400 naming it,
never silently ignored. Errors have OpenAI's shape:
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..decoding.proposers import PROPOSERS

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
               429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError", 504: "TimeoutError"}

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256  # characters per stop string


@dataclass
class ServerLimits:
    """What one server accepts; every limit is answered with an OpenAI-style error.

    None means "as large as the model allows": the context for prompts and max_tokens,
    the engine's batch + queue for concurrent requests.
    """

    api_key: str | None = None  # every /v1/* route requires `Authorization: Bearer <key>` (401)
    protect_metrics: bool = False  # /metrics needs the key too
    max_body_bytes: int = 1 << 20  # 413 above
    max_prompt_tokens: int | None = None  # 400 above
    max_tokens: int | None = None  # the largest max_tokens a request may ask for (400 above)
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_length: int = MAX_STOP_LENGTH
    max_concurrent: int | None = None  # requests in flight (waiting, decoding, streaming); 429 above
    stream_stall_s: float = 30.0  # a streaming client that reads nothing this long is cut off

    def check(self) -> None:
        """One-line ValueError for a limit that makes no sense."""
        for name in ("max_body_bytes", "max_prompt_tokens", "max_tokens", "max_stop_strings",
                     "max_stop_length", "max_concurrent"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        s = self.stream_stall_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0 or not math.isfinite(s):
            raise ValueError(f"stream_stall_s must be a positive number of seconds, got {s!r}")
        key = self.api_key
        if key is not None and (not isinstance(key, str) or not key or key != key.strip()
                                or not key.isascii() or not key.isprintable() or " " in key):
            # headers arrive as bytes and the token is stripped: any other key could never match
            raise ValueError("api_key must be visible ASCII characters without spaces")
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                 "stream_options", "user", "logprobs", "presence_penalty", "frequency_penalty",
                 "proposer"}  # proposer: eagle3's own, who drafts (`decoding.suffix`)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}


class APIError(Exception):
    """An HTTP error answered with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        fallback = "InternalServerError" if status >= 500 else "BadRequestError"
        self.type = type or ERROR_TYPES.get(status, fallback)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerateParams:
    """A validated request: what to send to the engine and how to answer."""

    prompt_ids: list[int] | None = None  # completions (after encoding a text prompt)
    prompt_text: str | None = None  # completions with a text prompt (encoded by the caller)
    messages: list[dict[str, str]] | None = None  # chat (rendered by the caller)
    max_tokens: int | None = None  # None: the endpoint's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    proposer: str | None = None  # 'eagle' | 'suffix' | 'hybrid'; None: the server's default
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "the request body nests too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:  # JSON's \ud800-style escapes can spell unpaired surrogates, which no UTF-8 text holds
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff); "
                       "send valid Unicode text", code="invalid_json") from None
    return body


def quote(text: str, limit: int = 60) -> str:
    """A client's string inside an error message: escaped (one line, ASCII) and cut short."""
    q = json.dumps(text)
    return q if len(q) <= limit else q[:limit - 4] + '..."'


def _no_constant(name: str) -> None:
    """JSON has no NaN or Infinity; Python's parser accepts them unless told not to."""
    raise ValueError(f"{name} is not a JSON value")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    """A finite JSON number (a huge integer literal would overflow a float later)."""
    if isinstance(v, bool):
        return False
    return (isinstance(v, int) and abs(v) <= 1e300) or (isinstance(v, float) and math.isfinite(v))


def _get(body: dict, name: str, kind: str, default: Any = None) -> Any:
    """body[name] (None -> default) checked to be of `kind`: int | number | bool | str | dict."""
    v = body.get(name)
    if v is None:
        return default
    ok = {"int": _is_int, "number": _is_number, "bool": lambda x: isinstance(x, bool),
          "str": lambda x: isinstance(x, str), "dict": lambda x: isinstance(x, dict)}[kind](v)
    if not ok:
        noun = {"int": "an integer", "number": "a finite number", "bool": "a boolean", "str": "a string",
                "dict": "an object"}[kind]
        raise APIError(400, f"'{name}' must be {noun}, got {json.dumps(v)[:80]}", param=name)
    return v


def _unsupported(name: str, what: str) -> APIError:
    return APIError(400, f"'{name}': {what} is not supported by eagle3 serve", param=name, code="unsupported")


def _common(body: dict, allowed: set[str], model_name: str, limits: ServerLimits) -> GenerateParams:
    for name in body:
        if name not in allowed:
            known = ", ".join(sorted(allowed))
            raise APIError(400, f"unknown field {quote(name)}; supported fields: {known}", param=name,
                           code="unknown_field")
    model = _get(body, "model", "str", model_name)
    if model != model_name:
        raise APIError(404, f"the model {quote(model)} does not exist; this server serves '{model_name}'",
                       param="model", code="model_not_found")
    if _get(body, "n", "int", 1) != 1:
        raise _unsupported("n", "more than one choice (n > 1)")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, "number", 0) != 0:
            raise _unsupported(name, "a non-zero penalty")
    _get(body, "user", "str")
    p = GenerateParams(temperature=_get(body, "temperature", "number", 1.0),
                       top_p=_get(body, "top_p", "number", 1.0), seed=_get(body, "seed", "int"),
                       stream=_get(body, "stream", "bool", False))
    p.proposer = _get(body, "proposer", "str")
    if p.proposer is not None and p.proposer not in PROPOSERS:
        raise APIError(400, f"'proposer' must be one of {', '.join(PROPOSERS)}, got {quote(p.proposer)}",
                       param="proposer")
    top_k = _get(body, "top_k", "int", 0)
    p.top_k = 0 if top_k == -1 else top_k  # vLLM spells "off" -1
    p.max_tokens = _get(body, "max_tokens", "int")
    _check_max_tokens("max_tokens", p.max_tokens, limits)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    n, length = limits.max_stop_strings, limits.max_stop_length
    if (not isinstance(stops, list) or len(stops) > n
            or not all(isinstance(s, str) and 0 < len(s) <= length for s in stops)):
        raise APIError(400, f"'stop' must be a non-empty string or a list of up to {n} non-empty "
                       f"strings of at most {length} characters", param="stop")
    p.stop = stops
    options = _get(body, "stream_options", "dict")
    if options is not None:
        if not p.stream:
            raise APIError(400, "'stream_options' is only allowed with stream: true", param="stream_options")
        for name in options:
            if name != "include_usage":
                raise APIError(400, f"unknown field {quote('stream_options.' + name)}",
                               param="stream_options", code="unknown_field")
        p.include_usage = _get(options, "include_usage", "bool", False)
    return p


def _check_max_tokens(name: str, v: int | None, limits: ServerLimits) -> None:
    if v is not None and v < 1:
        raise APIError(400, f"'{name}' must be at least 1, got {v}", param=name)
    if v is not None and limits.max_tokens is not None and v > limits.max_tokens:
        raise APIError(400, f"'{name}' is {v}; this server allows at most {limits.max_tokens} "
                       "(--max-tokens)", param=name, code="max_tokens_too_large")


def check_prompt_length(n: int, limits: ServerLimits, param: str) -> None:
    """A 400 when an encoded prompt of `n` tokens is over the server's limit."""
    if limits.max_prompt_tokens is not None and n > limits.max_prompt_tokens:
        raise APIError(400, f"the {param} encode to {n} tokens; this server allows at most "
                       f"{limits.max_prompt_tokens} (--max-prompt-tokens); shorten it", param=param,
                       code="context_length_exceeded")


def parse_completion(body: dict, model_name: str, limits: ServerLimits | None = None) -> GenerateParams:
    """Validate a /v1/completions body (the prompt stays text or ids; see `prompt_text`)."""
    limits = limits or ServerLimits()
    p = _common(body, COMPLETION_FIELDS, model_name, limits)
    if p.max_tokens is None:  # OpenAI's default for completions
        p.max_tokens = min(16, limits.max_tokens or 16)
    if body.get("logprobs") not in (None, 0, False):
        raise _unsupported("logprobs", "returning log probabilities")
    if body.get("echo") not in (None, False):
        raise _unsupported("echo", "echoing the prompt")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' is empty", param="prompt")
        p.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        p.prompt_ids = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise APIError(400, "'prompt' is empty", param="prompt")
    elif prompt is None:
        raise APIError(400, "'prompt' is required (a string or a list of token ids)", param="prompt")
    elif isinstance(prompt, list) and all(isinstance(x, (str, list)) for x in prompt):
        raise _unsupported("prompt", "a batch of several prompts (send one request per prompt)")
    else:
        raise APIError(400, "'prompt' must be a string, a list of token ids, or a list holding one of "
                       "those", param="prompt")
    return p


def parse_chat(body: dict, model_name: str, limits: ServerLimits | None = None) -> GenerateParams:
    """Validate a /v1/chat/completions body (messages become plain {role, content} strings)."""
    limits = limits or ServerLimits()
    p = _common(body, CHAT_FIELDS, model_name, limits)
    alias = _get(body, "max_completion_tokens", "int")
    if alias is not None:
        if p.max_tokens is not None and p.max_tokens != alias:
            raise APIError(400, "'max_tokens' and 'max_completion_tokens' differ; give one",
                           param="max_completion_tokens")
        _check_max_tokens("max_completion_tokens", alias, limits)
        p.max_tokens = alias
    if body.get("logprobs") not in (None, False):
        raise _unsupported("logprobs", "returning log probabilities")
    if body.get("top_logprobs") not in (None, 0):
        raise _unsupported("top_logprobs", "returning log probabilities")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects",
                       param="messages")
    p.messages = [_message(m, i) for i, m in enumerate(messages)]
    return p


def _message(m: Any, i: int) -> dict[str, str]:
    """One chat message as {role, content[, name]} strings (text content parts are joined)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(400, f"{where} must be an object with a string 'role'", param="messages")
    content = m.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                   for c in content):
            raise _unsupported("messages", f"{where}: content parts other than text")
        content = "".join(c["text"] for c in content)
    if not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", param="messages")
    extra = set(m) - {"role", "content", "name"}
    if extra:
        names = ", ".join(quote(k) for k in sorted(extra)[:5])
        raise _unsupported("messages", f"{where}: the field(s) {names}")
    out = {"role": m["role"], "content": content}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out
