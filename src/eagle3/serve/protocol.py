"""OpenAI request validation and error bodies for `eagle3 serve`.

Requests are plain JSON objects checked field by field: a field we do not know, or a
feature we do not implement (n > 1, logprobs, echo, penalties), is a 400 naming it,
never silently ignored. Errors have OpenAI's shape:
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               413: "RequestTooLargeError", 429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError", 504: "TimeoutError"}

MAX_STOP_STRINGS = 4
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                 "stream_options", "user", "logprobs", "presence_penalty", "frequency_penalty"}
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
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(body: dict, name: str, kind: str, default: Any = None) -> Any:
    """body[name] (None -> default) checked to be of `kind`: int | number | bool | str | dict."""
    v = body.get(name)
    if v is None:
        return default
    ok = {"int": _is_int, "number": _is_number, "bool": lambda x: isinstance(x, bool),
          "str": lambda x: isinstance(x, str), "dict": lambda x: isinstance(x, dict)}[kind](v)
    if not ok:
        noun = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
                "dict": "an object"}[kind]
        raise APIError(400, f"'{name}' must be {noun}, got {json.dumps(v)[:80]}", param=name)
    return v


def _unsupported(name: str, what: str) -> APIError:
    return APIError(400, f"'{name}': {what} is not supported by eagle3 serve", param=name, code="unsupported")


def _common(body: dict, allowed: set[str], model_name: str) -> GenerateParams:
    for name in body:
        if name not in allowed:
            raise APIError(400, f"unknown field '{name}'; supported fields: {', '.join(sorted(allowed))}",
                           param=name, code="unknown_field")
    model = _get(body, "model", "str", model_name)
    if model != model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'",
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
    top_k = _get(body, "top_k", "int", 0)
    p.top_k = 0 if top_k == -1 else top_k  # vLLM spells "off" -1
    p.max_tokens = _get(body, "max_tokens", "int")
    if p.max_tokens is not None and p.max_tokens < 1:
        raise APIError(400, f"'max_tokens' must be at least 1, got {p.max_tokens}", param="max_tokens")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise APIError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} "
                       "non-empty strings", param="stop")
    p.stop = stops
    options = _get(body, "stream_options", "dict")
    if options is not None:
        if not p.stream:
            raise APIError(400, "'stream_options' is only allowed with stream: true", param="stream_options")
        for name in options:
            if name != "include_usage":
                raise APIError(400, f"unknown field 'stream_options.{name}'", param="stream_options",
                               code="unknown_field")
        p.include_usage = _get(options, "include_usage", "bool", False)
    return p


def parse_completion(body: dict, model_name: str) -> GenerateParams:
    """Validate a /v1/completions body (the prompt stays text or ids; see `prompt_text`)."""
    p = _common(body, COMPLETION_FIELDS, model_name)
    if p.max_tokens is None:
        p.max_tokens = 16  # OpenAI's default for completions
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


def parse_chat(body: dict, model_name: str) -> GenerateParams:
    """Validate a /v1/chat/completions body (messages become plain {role, content} strings)."""
    p = _common(body, CHAT_FIELDS, model_name)
    alias = _get(body, "max_completion_tokens", "int")
    if alias is not None:
        if p.max_tokens is not None and p.max_tokens != alias:
            raise APIError(400, "'max_tokens' and 'max_completion_tokens' differ; give one",
                           param="max_completion_tokens")
        if alias < 1:
            raise APIError(400, f"'max_completion_tokens' must be at least 1, got {alias}",
                           param="max_completion_tokens")
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
        raise _unsupported("messages", f"{where}: the field(s) {', '.join(sorted(extra))}")
    out = {"role": m["role"], "content": content}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out
