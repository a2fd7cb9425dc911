"""`eagle3 serve` access and limits: the API key, request limits, the in-flight bound and the
slow-client guard, on a real server (uvicorn in a thread, the toy default model).

Every refusal must be an OpenAI-style error body with the documented status, and every
refused, cut-off or dropped request must leave the KV pool empty.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from eagle3.engine import Engine, EngineConfig  # noqa: E402
from eagle3.serve.protocol import ServerLimits  # noqa: E402
from servers import NAME, Server, answers, kv_idle, templated_spec, wait_until  # noqa: E402

spec = templated_spec  # the `spec` fixture: the toy default with a chat template

KEY = "s3cret-key"
PROMPT = "def parse_args(argv):"


@pytest.fixture(scope="module")
def engine(spec):
    eng = Engine(spec, EngineConfig(max_batch=4, num_draft_tokens=2)).start()  # fixed K: no calibration
    yield eng
    eng.stop()


def error_of(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def refused(url: str, headers: dict | None = None) -> dict[str, float]:
    """The server's refusal counters by reason, from /metrics."""
    text = requests.get(url + "/metrics", headers=headers, timeout=10).text
    return {s.labels["reason"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "eagle3:server_refused_requests_total"}


def test_api_key(engine, spec):
    want = spec.generate(spec.tokenizer.encode(PROMPT), 12).token_ids
    keyed = Server(engine, api_key=KEY, limits=ServerLimits(api_key=KEY, protect_metrics=True))
    open_metrics = Server(engine, api_key=KEY, limits=ServerLimits(api_key=KEY))
    try:
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        for auth in (None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer",
                     KEY):
            r = keyed.post("/v1/completions", body, headers={"Authorization": auth})
            e = error_of(r, 401)
            assert e["type"] == "AuthenticationError" and e["code"] == "invalid_api_key", auth
            assert r.headers["www-authenticate"] == "Bearer"
        chat = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
        for auth in (None, "Bearer wrong", KEY):  # every route, the chat one and a model's included
            for method, route, payload in (("GET", "/v1/models", None), ("GET", f"/v1/models/{NAME}", None),
                                           ("POST", "/v1/chat/completions", chat),
                                           ("GET", "/v1/nothing", None)):  # no route probing either
                r = requests.request(method, keyed.url + route, json=payload, timeout=10,
                                     headers={} if auth is None else {"Authorization": auth})
                assert error_of(r, 401)["code"] == "invalid_api_key", (auth, route)
        right = {"Authorization": f"Bearer {KEY}"}
        assert requests.get(f"{keyed.url}/v1/models/{NAME}", headers=right, timeout=10).json()["id"] == NAME
        r = requests.post(keyed.url + "/v1/chat/completions", json=chat, headers=right, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert requests.get(keyed.url + "/health", timeout=10).json() == {"status": "ok"}
        error_of(requests.get(keyed.url + "/metrics", timeout=10), 401)
        assert requests.get(open_metrics.url + "/metrics", timeout=10).status_code == 200
        r = keyed.post("/v1/completions", body)  # the right key
        assert r.status_code == 200 and r.json()["eagle3"]["token_ids"] == want
        assert keyed.client().models.list().data[0].id == NAME
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()
        counts = refused(keyed.url, {"Authorization": f"Bearer {KEY}"})
        assert counts["unauthorized"] >= 21, counts
    finally:
        keyed.close()
        open_metrics.close()
    assert kv_idle(engine)


def test_request_limits(engine):
    limits = ServerLimits(max_prompt_tokens=20, max_tokens=16, max_stop_strings=2, max_stop_length=5)
    srv = Server(engine, limits=limits)
    ok = {"model": NAME, "prompt": "x = 1\n", "max_tokens": 4, "temperature": 0}
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    try:
        e = error_of(srv.post("/v1/completions", {**ok, "prompt": "y" * 30}), 400)
        assert e["code"] == "context_length_exceeded" and "20" in e["message"]
        assert srv.post("/v1/completions", {**ok, "prompt": "y" * 20}).status_code == 200
        e = error_of(srv.post("/v1/completions", {**ok, "prompt": list(range(1, 22))}), 400)
        assert e["code"] == "context_length_exceeded"
        e = error_of(srv.post("/v1/completions", {**ok, "max_tokens": 17}), 400)
        assert e["code"] == "max_tokens_too_large" and e["param"] == "max_tokens"
        assert srv.post("/v1/completions", {**ok, "max_tokens": 16}).status_code == 200
        error_of(srv.post("/v1/completions", {**ok, "max_tokens": 10 ** 30}), 400)
        for stop in (["a", "b", "c"], "abcdef", ["ab", "abcdef"], [""], [1]):
            assert error_of(srv.post("/v1/completions", {**ok, "stop": stop}), 400)["param"] == "stop"
        assert srv.post("/v1/completions", {**ok, "stop": ["abcde", "\n\n"]}).status_code == 200
        error_of(srv.post("/v1/completions", {**ok, "n": 2}), 400)
        for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "temperature": Infinity}',
                    b'{"prompt": "x", "top_p": -Infinity}', b'{"prompt": "x", "temperature": 1e999}',
                    b"[" * 100_000 + b"]" * 100_000):
            error_of(srv.post("/v1/completions", raw), 400)
        # chat: the default max_tokens is capped by the limit, and the limit binds the alias too
        r = srv.post("/v1/chat/completions", chat)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16
        e = error_of(srv.post("/v1/chat/completions", {**chat, "max_completion_tokens": 17}), 400)
        assert e["param"] == "max_completion_tokens"
        long_chat = {**chat, "messages": [{"role": "user", "content": "z" * 40}]}
        e = error_of(srv.post("/v1/chat/completions", long_chat), 400)
        assert e["param"] == "messages" and e["code"] == "context_length_exceeded"
    finally:
        srv.close()
    assert kv_idle(engine)


def test_in_flight_bound(engine):
    """max_concurrent=1: while one request is in flight (here: still sending its body), the next
    POST is answered 429 at once; when it ends, the slot is free again."""
    srv = Server(engine, limits=ServerLimits(max_concurrent=1))
    body = json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    try:
        slow = socket.create_connection(("127.0.0.1", srv.port))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
        wait_until(lambda: srv.post("/v1/completions", body).status_code == 429, 10, "no 429")
        r = srv.post("/v1/completions", body)
        assert error_of(r, 429)["code"] == "too_many_requests" and r.headers["retry-after"] == "1"
        assert requests.get(srv.url + "/v1/models", timeout=10).status_code == 200  # GETs not counted
        slow.sendall(body[10:])  # the first one completes...
        assert slow.recv(65536).startswith(b"HTTP/1.1 200")
        slow.close()
        wait_until(lambda: srv.post("/v1/completions", body).status_code == 200, 10, "the slot stayed taken")
        assert refused(srv.url)["too_many_requests"] >= 2
    finally:
        srv.close()
    assert kv_idle(engine)


def test_stalled_stream_client_is_cut_off(spec):
    """A client that stops reading a stream is disconnected after stream_stall_s, its KV freed.

    Plain decoding streams one token per chunk; small socket buffers on both ends make the
    server's sends block after ~300 chunks, well before the 1000 tokens asked for.
    """
    engine = Engine(spec, EngineConfig(max_batch=1, speculate=False)).start()
    srv = Server(engine, limits=ServerLimits(stream_stall_s=0.5), sndbuf=4096)
    before = engine.metrics()
    body = json.dumps({"model": NAME, "prompt": "import os\n", "max_tokens": 1000, "temperature": 0,
                       "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    try:
        sock.connect(("127.0.0.1", srv.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_until(lambda: refused(srv.url).get("stalled_stream", 0) >= 1, 120, "the stalled client stayed")
        wait_until(lambda: kv_idle(engine), 10, "the stalled client's KV was not freed")
        after = engine.metrics()
        assert after["requests_aborted"] == before["requests_aborted"] + 1
        assert after["generation_tokens"] - before["generation_tokens"] < 1000
        received = b""
        sock.settimeout(10)
        while chunk := sock.recv(65536):  # the server closed the connection: EOF, no [DONE]
            received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
    finally:
        sock.close()
        srv.close()
        engine.stop()


def test_stalled_body_is_408_and_frees_its_slot(engine):
    """A client that sends half a body and then nothing gets 408 after stream_stall_s, and its
    in-flight slot (max_concurrent=1 here) is free again."""
    srv = Server(engine, limits=ServerLimits(max_concurrent=1, stream_stall_s=0.5))
    body = json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    try:
        slow = socket.create_connection(("127.0.0.1", srv.port))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
        slow.settimeout(30)
        reply = b""
        while b'"body_timeout"' not in reply and (chunk := slow.recv(65536)):  # head and body may split
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b'"body_timeout"' in reply, reply[:300]
        slow.close()
        assert srv.post("/v1/completions", body).status_code == 200
    finally:
        srv.close()
    assert kv_idle(engine)


def test_limits_are_checked():
    for bad in (ServerLimits(max_tokens=0), ServerLimits(max_prompt_tokens=-1),
                ServerLimits(stream_stall_s=0), ServerLimits(stream_stall_s=float("nan")),
                ServerLimits(api_key=""), ServerLimits(api_key="a\nb"), ServerLimits(max_concurrent=True),
                ServerLimits(api_key=" key"), ServerLimits(api_key="key "), ServerLimits(api_key="clé"),
                ServerLimits(api_key="two words")):
        with pytest.raises(ValueError):
            bad.check()


# -- the command line --------------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_API_KEY"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_cli_refuses_bad_limits():
    base = [sys.executable, "-m", "eagle3", "serve", "--port", "0"]
    cmds = [base + ["--protect-metrics"], base + ["--max-tokens", "0"],
            base + ["--stream-stall-timeout", "-1"], base + ["--api-key", " spaced "]]
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda c: subprocess.run(c, capture_output=True, text=True, env=_env(),
                                                      timeout=120), cmds))
    flags = ("--api-key", "--max-tokens", "--stream-stall-timeout", "--api-key")
    for p, flag in zip(done, flags, strict=True):
        assert p.returncode == 2 and p.stdout == "", p.stderr
        assert p.stderr.count("\n") == 1 and p.stderr.startswith("eagle3: error:") and flag in p.stderr


def _serve(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, list[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "eagle3", "serve", "--port", "0", "--max-batch", "2",
                             "--num-draft-tokens", "2", *args], stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    wait_until(lambda: any("serving" in x for x in lines) or proc.poll() is not None, 120, "no serving line")
    line = next(x for x in lines if "serving" in x)
    port = line.split(" on http://")[1].split(" ")[0].rsplit(":", 1)[1]
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: answers(url + "/health"), 30, "no /health")
    return proc, lines, url


def _stop(proc: subprocess.Popen, lines: list[str]) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    assert "Traceback" not in "".join(lines), "".join(lines)


@pytest.mark.slow
def test_cli_key_from_env_and_warning_on_open_bind():
    """0.0.0.0 without a key warns (one line); EAGLE3_API_KEY keys the server without a warning."""
    proc, lines, url = _serve(["--host", "0.0.0.0"], _env())
    try:
        warnings = [x for x in lines if x.startswith("eagle3: warning:")]
        assert len(warnings) == 1 and "--api-key" in warnings[0] and "0.0.0.0" in warnings[0]
        assert requests.get(url + "/v1/models", timeout=10).status_code == 200
        _stop(proc, lines)
    finally:
        proc.kill()
    proc, lines, url = _serve(["--host", "0.0.0.0"], _env(EAGLE3_API_KEY=KEY))
    try:
        assert not any("warning" in x for x in lines) and "API key required" in "".join(lines)
        error_of(requests.get(url + "/v1/models", timeout=10), 401)
        r = requests.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert r.status_code == 200
        assert requests.get(url + "/health", timeout=10).status_code == 200
        _stop(proc, lines)
    finally:
        proc.kill()
