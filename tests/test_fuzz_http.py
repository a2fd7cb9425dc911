"""Hostile input against a real `eagle3 serve` app: property-based fuzzing with hypothesis.

Random and malformed JSON, wrong types, huge numbers, NaN/inf, unicode edge cases (lone
surrogates, NULs, RTL marks, emoji) in prompts, stop strings and chat messages, odd roles
and content parts, wrong API keys; then raw sockets that send half a request, hang up
mid-request or mid-stream, or send garbage. After every case: no 500, every error an
OpenAI-style JSON body without a traceback, no hung request, the KV pool empty. At the
end the server still answers greedy requests exactly as `generate` does.

Examples are derandomized, so CI runs the same cases every time; `FUZZ_EXAMPLES` scales them.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import requests
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from eagle3.engine import Engine, EngineConfig  # noqa: E402
from eagle3.serve.protocol import ServerLimits  # noqa: E402
from servers import NAME, Server, kv_idle, templated_spec, wait_until  # noqa: E402

spec = templated_spec  # the `spec` fixture: the toy default with a chat template

KEY = "fuzz-key"
MAX_TOKENS = 24
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ALLOWED = {200, 400, 401, 404, 413, 429}
STATS = {"http_cases": 0, "raw_cases": 0, "generated": 0}
CHECK_PROMPTS = ["def parse_args(argv):", "import os\n"]


@pytest.fixture(scope="module")
def want(spec):
    return {p: spec.generate(spec.tokenizer.encode(p), MAX_TOKENS).token_ids for p in CHECK_PROMPTS}


@pytest.fixture(scope="module")
def server(spec, want):
    engine = Engine(spec, EngineConfig(max_batch=4, num_draft_tokens=2, request_timeout_s=30)).start()
    limits = ServerLimits(api_key=KEY, max_tokens=MAX_TOKENS, max_prompt_tokens=256, max_body_bytes=64 << 10,
                          stream_stall_s=5)
    srv = Server(engine, api_key=KEY, limits=limits)
    yield srv
    srv.close()
    engine.stop()


# -- strategies ----------------------------------------------------------------------------------
EDGE_TEXT = st.sampled_from(["", "\x00", "\ud800", "\udfff", "a\ud83d", "\u202e\u200f", "\ufeff", "\ufffd",
                             "😀" * 3, "e\u0301" * 4, "\n" * 8, "<|assistant|>", "{{ 7*7 }}", "{% raw %}",
                             "data: [DONE]\n\n", "\r\n\r\n", "\\u0000", "x" * 300])
TEXT = st.one_of(st.text(st.characters(codec=None), max_size=40), EDGE_TEXT)
NUMBER = st.one_of(st.integers(-3, 40), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
                   st.sampled_from([0, 1, -1, 2 ** 63, 10 ** 400, 1e-300, 0.5, 1.0]))
JSON = st.recursive(st.none() | st.booleans() | NUMBER | TEXT,
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(TEXT, c, max_size=4), max_leaves=8)


def maybe(good, weird=JSON):
    """Mostly plausible values, sometimes anything."""
    return st.one_of(good, good, good, weird)


PROMPT = st.one_of(TEXT, st.lists(st.integers(-5, 600), max_size=12), st.lists(st.integers(), max_size=3),
                   st.lists(TEXT, min_size=1, max_size=2), JSON)
CONTENT = st.one_of(TEXT, st.none(), st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "text"]), "image_url": JSON}),
    JSON), max_size=3), JSON)
ROLE = maybe(st.sampled_from(["user", "system", "assistant", "tool", "developer", "", "USER"]), JSON)
MESSAGE = st.fixed_dictionaries({"role": ROLE},
                                optional={"content": CONTENT, "name": maybe(TEXT), "tool_calls": JSON})
GOOD_PROMPT = st.one_of(st.text(st.characters(codec="utf-8"), min_size=1, max_size=40),
                        st.lists(st.integers(1, 500), min_size=1, max_size=12))
GOOD_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                "content": st.text(max_size=30)}), min_size=1, max_size=3)
GOOD = {  # a valid request, optional fields drawn from valid values
    "max_tokens": st.integers(1, MAX_TOKENS), "temperature": st.sampled_from([0, 0.0, 0.7, 1.0]),
    "top_p": st.sampled_from([1.0, 0.9]), "top_k": st.sampled_from([0, -1, 5]),
    "seed": st.integers(0, 2 ** 63),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3)),
    "stream": st.booleans(), "user": st.text(max_size=8)}
FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "user",
          "stream_options", "logprobs", "echo", "presence_penalty", "frequency_penalty", "best_of", "prompt",
          "messages", "max_completion_tokens", "tools", "top_logprobs", TEXT]
WEIRD = {  # values aimed at one field, then anything
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=6)), "prompt": PROMPT,
    "messages": st.one_of(st.lists(MESSAGE, max_size=4), JSON),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": JSON, "x": JSON})}
MUTATION = st.tuples(st.one_of(st.sampled_from(FIELDS[:-1]), FIELDS[-1]),
                     st.one_of(NUMBER, TEXT, JSON, st.just("<delete>")))


@st.composite
def body_for(draw, chat: bool) -> dict:
    body = {"model": NAME, ("messages" if chat else "prompt"): draw(GOOD_MESSAGES if chat else GOOD_PROMPT)}
    body.update(draw(st.fixed_dictionaries({}, optional=GOOD)))
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    for field, value in draw(st.lists(MUTATION, max_size=3)):  # none for about a third of the cases
        if field in WEIRD and draw(st.booleans()):
            value = draw(WEIRD[field])
        if value == "<delete>":
            body.pop(field, None)
        else:
            body[field] = value
    return body


AUTH = st.sampled_from([f"Bearer {KEY}"] * 6 + [None, "Bearer", f"bearer {KEY}", "Bearer nope", KEY,
                                                 f"Bearer {KEY} extra", "Basic Zm9vOmJhcg=="])
GOOD_AUTH = {f"Bearer {KEY}", f"bearer {KEY}"}  # the scheme is case-insensitive (RFC 9110)


@st.composite
def request_bytes(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    body = draw(body_for("chat" in path))
    raw = json.dumps(body, allow_nan=True).encode()  # NaN / Infinity literals on purpose
    mutation = draw(st.sampled_from(["none"] * 6 + ["truncate", "garbage", "utf16", "not-object"]))
    if mutation == "truncate":
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    elif mutation == "garbage":
        raw = draw(st.binary(max_size=64))
    elif mutation == "utf16":
        raw = json.dumps(body).encode("utf-16")
    elif mutation == "not-object":
        raw = json.dumps([body]).encode()
    return path, raw


def without_generated_text(obj: dict) -> dict:
    """A response body less the model's own text: the toy target writes Python, so its output may
    well say 'Traceback'; only the server's fields must never carry one."""
    choices = []
    for c in obj.get("choices", []):
        c = {k: v for k, v in c.items() if k not in ("text", "message", "delta")}
        choices.append(c)
    return {**obj, "choices": choices}


def check_response(r: requests.Response, stream_lines: list[bytes] | None) -> None:
    text = b"\n".join(stream_lines).decode() if stream_lines is not None else r.text
    assert r.status_code in ALLOWED, (r.status_code, text[:500])
    if r.status_code != 200:
        assert "Traceback" not in text
        assert r.headers["content-type"].startswith("application/json"), r.headers
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"], err
        return
    if stream_lines is not None:
        events = [line for line in stream_lines if line.startswith(b"data: ")]
        assert events and events[-1] == b"data: [DONE]", stream_lines[-3:]
        for e in events[:-1]:
            obj = json.loads(e[6:])
            assert "error" not in obj or obj["error"]["message"], obj
            assert "Traceback" not in json.dumps(without_generated_text(obj))
    else:
        body = r.json()
        assert "Traceback" not in json.dumps(without_generated_text(body))
        assert body["usage"]["completion_tokens"] <= MAX_TOKENS
        STATS["generated"] += body["usage"]["completion_tokens"]


# -- the fuzzers ---------------------------------------------------------------------------------
@FUZZ
@given(case=request_bytes(), auth=AUTH)
def fuzz_a_request(server, case, auth):
    path, raw = case
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = auth
    STATS["http_cases"] += 1
    t0 = time.monotonic()
    with requests.post(server.url + path, data=raw, headers=headers, timeout=60, stream=True) as r:
        streamed = r.headers.get("content-type", "").startswith("text/event-stream")
        lines = list(r.iter_lines()) if streamed else None
        if not streamed:
            r.content  # noqa: B018 (read the body)
    check_response(r, lines)
    # the key decides 401 alone: a wrong or missing key is always refused, the right one never
    assert (r.status_code == 401) == (auth not in GOOD_AUTH), (auth, r.status_code)
    assert time.monotonic() - t0 < 60
    wait_until(lambda: kv_idle(server.engine), 10, "a fuzzed request kept KV slots")


def _http(path: str, body: bytes, key: str | None = KEY, length: int | None = None) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n")
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    return head.encode() + b"\r\n" + body


VALID = json.dumps({"model": NAME, "prompt": "import os\n", "max_tokens": MAX_TOKENS,
                    "temperature": 0}).encode()
STREAM = json.dumps({"model": NAME, "prompt": "class Foo:\n", "max_tokens": MAX_TOKENS, "temperature": 0.7,
                     "stream": True}).encode()


@FUZZ
@given(kind=st.sampled_from(["cut", "cut-declared", "hangup-after-body", "hangup-mid-stream", "shut-wr",
                             "garbage", "bad-header"]),
       cut=st.integers(0, 400), read=st.integers(0, 600), junk=st.binary(max_size=200))
def fuzz_a_connection(server, kind, cut, read, junk):
    """Half-sent requests, hang-ups mid-request and mid-stream, garbage on the wire."""
    STATS["raw_cases"] += 1
    full = _http("/v1/completions", STREAM if kind == "hangup-mid-stream" else VALID)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        if kind == "cut":  # the request cut anywhere, then the client hangs up
            sock.sendall(full[:cut % len(full)])
        elif kind == "cut-declared":  # promises more body than it sends
            sock.sendall(_http("/v1/completions", VALID[:cut % len(VALID)], length=len(VALID) + 50))
        elif kind == "hangup-after-body":  # a whole request, gone before the answer
            sock.sendall(full)
        elif kind == "hangup-mid-stream":
            sock.sendall(full)
            got = b""
            while len(got) < read and (chunk := sock.recv(256)):
                got += chunk
        elif kind == "shut-wr":  # half-close after part of the request: the server must answer or close
            sock.sendall(full[:cut % len(full)])
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(30)
            while sock.recv(65536):
                pass
        elif kind == "garbage":
            sock.sendall(junk + b"\r\n\r\n")
            sock.settimeout(30)
            reply = sock.recv(65536)
            assert not reply.startswith(b"HTTP/1.1 500"), reply[:200]
        else:  # header injection attempts and absurd lengths
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 99999999999999999999\r\nAuthorization: Bearer " + KEY.encode()
                         + b"\r\nX: \x00\x01" + junk + b"\r\n\r\n")
            sock.settimeout(30)
            reply = sock.recv(65536)
            assert not reply.startswith(b"HTTP/1.1 500"), reply[:200]
    except OSError:
        pass  # the server may close first: that is one of the allowed outcomes
    finally:
        sock.close()
    wait_until(lambda: kv_idle(server.engine), 15, f"a {kind} connection left KV behind")


# Each test fuzzes the server and then checks it on that same server (a separate check could
# run in another pytest-xdist worker, against a server nobody fuzzed).
def test_fuzzed_requests_then_still_exact(server, want):
    fuzz_a_request(server)
    assert STATS["http_cases"] >= EXAMPLES
    assert_still_exact(server, want)


def test_fuzzed_connections_then_still_exact(server, want):
    """Half-sent requests, hang-ups mid-request and mid-stream, garbage on the wire."""
    fuzz_a_connection(server)
    assert STATS["raw_cases"] >= EXAMPLES
    assert_still_exact(server, want)


def assert_still_exact(server, want):
    """Greedy answers still equal generate's, no request failed, no KV held."""
    m = server.engine.metrics()
    assert m["requests_failed"] == 0, m
    for prompt, ids in want.items():
        r = server.post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                            "temperature": 0})
        assert r.status_code == 200 and r.json()["eagle3"]["token_ids"] == ids
    assert kv_idle(server.engine)
    assert requests.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    print(f"\nfuzz: {STATS['http_cases']} HTTP cases, {STATS['raw_cases']} raw-connection cases, "
          f"{STATS['generated']} tokens generated, {m['requests_finished']} finished / "
          f"{m['requests_aborted']} aborted requests, KV idle after each")
