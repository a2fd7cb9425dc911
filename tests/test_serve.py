"""`eagle3 serve`: a real server on 127.0.0.1 (uvicorn in a thread) and real clients.

The model is the embedded default (8 layers, H=256, a trained head, a byte-level
tokenizer; EOS id 0), with a chat template added for the chat tests. Greedy answers
must equal `Eagle3Speculator.generate` on the same prompt, token for token, whether
streamed, concurrent, or cut by stop strings; aborted and disconnected requests must
give their KV slots back.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import eagle3  # noqa: E402
from eagle3.engine import Engine, EngineConfig  # noqa: E402
from eagle3.serve.app import ServedGeneration, TextStream  # noqa: E402
from eagle3.serve.metrics import ServerMetrics  # noqa: E402
from eagle3.serve.protocol import APIError, GenerateParams  # noqa: E402
from servers import Server, answers, kv_idle, templated_spec, wait_until  # noqa: E402

spec = templated_spec  # the `spec` fixture: the toy default with a chat template

NAME = "eagle3-default"
N = 32  # max_tokens of the greedy checks
PROMPTS = ["def parse_args(argv):", "import os\n", "class Foo:\n", "x = 1\n", "# comment\n", "\n\n",
           "return None\n", "}\n"]
EOS_PROMPT = "if __name__ == '__main__':\n    run()\n"  # the default model answers EOS at once
CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def parse_args(argv):"}]
LONG = {"prompt": "import os\n", "max_tokens": 900, "temperature": 0}  # seconds of decoding


@pytest.fixture(scope="module")
def want(spec):
    """Greedy reference outputs (token ids), computed before any engine runs."""
    tok = spec.tokenizer
    out = {p: spec.generate(tok.encode(p), N).token_ids for p in PROMPTS}
    out["chat"] = spec.generate(tok.apply_chat_template(CHAT), N).token_ids
    out["eos"] = spec.generate(tok.encode(EOS_PROMPT), N).token_ids
    assert out["eos"] == [0]  # stop id first: text "", finish "stop"
    return out


@pytest.fixture(scope="module")
def server(spec, want):
    # a fixed K: the tests below assert drafting rounds, which automatic K may skip under load
    engine = Engine(spec, EngineConfig(max_batch=8, num_draft_tokens=2)).start()
    srv = Server(engine)
    yield srv
    srv.close()
    engine.stop()


def text_of(spec, ids: list[int]) -> str:
    return spec.tokenizer.decode([t for t in ids if t != 0])


# -- completions and chat through the official client -------------------------------------------
def test_completions_greedy(server, spec, want):
    """Every prompt form (text, ids, a batch of one of either) gives the reference output."""
    client = server.client()
    enc = spec.tokenizer.encode
    forms = [(PROMPTS[0], PROMPTS[0]), (enc(PROMPTS[1]), PROMPTS[1]), ([PROMPTS[2]], PROMPTS[2]),
             ([enc(PROMPTS[3])], PROMPTS[3])]
    for prompt, key in forms:
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=N, temperature=0)
        assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == NAME
        assert r.choices[0].text == text_of(spec, want[key]) and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == N and r.usage.total_tokens == r.usage.prompt_tokens + N
        assert r.usage.prompt_tokens == len(enc(key))
        extra = r.to_dict()["eagle3"]
        assert extra["token_ids"] == want[key]
        assert extra["spec_decode_num_drafts"] > 0 and extra["ttft_s"] > 0 and extra["mean_accept_len"] >= 1


def test_eos_is_not_text(server, spec, want):
    r = server.client().completions.create(model=NAME, prompt=EOS_PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 1 and r.to_dict()["eagle3"]["token_ids"] == [0]


def test_completions_streaming(server, spec, want):
    p = PROMPTS[0]
    stream = server.client().completions.create(model=NAME, prompt=p, max_tokens=N, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert len(chunks) > 3  # it really streamed
    assert "".join(c.choices[0].text for c in chunks[:-1]) == text_of(spec, want[p])
    assert chunks[-2].to_dict()["eagle3"]["spec_decode_num_drafts"] > 0


def test_chat(server, spec, want):
    client = server.client()
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=N, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text_of(spec, want["chat"])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == N

    stream = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=N, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == text_of(spec, want["chat"])
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == N


def test_chat_default_max_tokens_and_stop(server, spec, want):
    """No max_tokens: the rest of the context; a stop string taken from the reference ends it."""
    text = text_of(spec, want["chat"])
    stop = text[len(text) // 2:len(text) // 2 + 3]
    r = server.client().chat.completions.create(model=NAME, messages=CHAT, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.find(stop)]


def test_chat_without_template(server, spec, monkeypatch):
    monkeypatch.setattr(spec, "tokenizer", spec.plain_tokenizer)
    r = server.post("/v1/chat/completions", {"model": NAME, "messages": CHAT})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(server, spec, want, stream):
    ids = want[PROMPTS[0]]
    text = text_of(spec, ids)
    stop = "module"
    assert stop in text
    cut = text[:text.find(stop)]
    n = next(k for k in range(1, len(ids) + 1) if stop in spec.tokenizer.decode(ids[:k]))
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": N, "temperature": 0, "stop": ["zzz", stop],
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        r = server.post("/v1/completions", body, stream=True)
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        got = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
        usage = chunks[-1]["usage"]
    else:
        out = server.post("/v1/completions", body).json()
        got, usage = out["choices"][0]["text"], out["usage"]
        assert out["choices"][0]["finish_reason"] == "stop"
    assert got == cut and usage["completion_tokens"] == n
    wait_until(lambda: kv_idle(server.engine), 10, "the stopped request kept its KV")


def test_seeded_sampling_repeats(server):
    client = server.client()
    texts = [client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=N, temperature=0.8,
                                       seed=1234).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1] and texts[0]


# -- concurrency, aborts, disconnects ----------------------------------------------------------
def test_concurrent_streams_with_aborts(server, spec, want):
    client = server.client()
    before = server.engine.metrics()["requests_aborted"]
    jobs = [(PROMPTS[i], i % 2 == 1) for i in range(6)]  # odd ones hang up after a few chunks
    results: dict[int, tuple[str, str | None]] = {}

    def run(i: int) -> None:
        prompt, hang_up = jobs[i]
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=600 if hang_up else N,
                                           temperature=0, stream=True)
        pieces, reason = [], None
        for k, c in enumerate(stream):
            pieces.append(c.choices[0].text)
            reason = c.choices[0].finish_reason
            if hang_up and k == 2:
                stream.close()
                break
        results[i] = ("".join(pieces), reason)

    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(run, range(len(jobs))))
    for i, (prompt, hang_up) in enumerate(jobs):
        if not hang_up:
            assert results[i] == (text_of(spec, want[prompt]), "length"), i
    wait_until(lambda: kv_idle(server.engine), 10, "aborted streams kept their KV")
    assert server.engine.metrics()["requests_aborted"] >= before + 3


def test_non_streaming_disconnect_aborts(server):
    before = server.engine.metrics()["requests_aborted"]
    body = json.dumps({"model": NAME, **LONG}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    wait_until(lambda: server.engine.metrics()["num_running"] == 1, 10, "the request never started")
    sock.close()
    wait_until(lambda: kv_idle(server.engine), 3, "a hung-up request kept decoding")
    assert server.engine.metrics()["requests_aborted"] == before + 1


# -- errors ------------------------------------------------------------------------------------
def _error(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_errors(server):
    ok = {"model": NAME, "prompt": "hello", "max_tokens": 4}
    assert _error(server.post("/v1/completions", b"{not json"), 400)["code"] == "invalid_json"
    assert _error(server.post("/v1/completions", b"[1, 2]"), 400)["code"] == "invalid_json"
    e = _error(server.post("/v1/completions", {**ok, "best_of": 2}), 400)
    assert e["param"] == "best_of" and "best_of" in e["message"]
    e = _error(server.post("/v1/chat/completions", {"model": NAME, "messages": CHAT, "tools": []}), 400)
    assert e["param"] == "tools"
    e = _error(server.post("/v1/completions", {**ok, "model": "gpt-4"}), 404)
    assert e["type"] == "NotFoundError" and e["code"] == "model_not_found"
    e = _error(server.post("/v1/completions", {**ok, "max_tokens": 5000}), 400)
    assert "context" in e["message"]
    for prompt in ("", [], [""], None, [["a"]], ["a", "b"]):
        _error(server.post("/v1/completions", {**ok, "prompt": prompt}), 400)
    for bad in ({"n": 2}, {"logprobs": 3}, {"echo": True}, {"presence_penalty": 0.5}, {"temperature": "hot"},
                {"max_tokens": 0}, {"stop": ["a"] * 5}, {"stream_options": {"include_usage": True}},
                {"temperature": -1}, {"top_p": 0}, {"prompt": [10 ** 9]}):
        _error(server.post("/v1/completions", {**ok, **bad}), 400)
    _error(server.post("/v1/chat/completions", {"model": NAME, "messages": []}), 400)
    _error(server.post("/v1/chat/completions", {"model": NAME, "messages": CHAT, "logprobs": True}), 400)
    big = json.dumps({**ok, "prompt": "x" * (2 << 20)}).encode()
    assert _error(server.post("/v1/completions", big), 413)["code"] == "body_too_large"
    chunked = server.post("/v1/completions", iter([big[i:i + 65536] for i in range(0, len(big), 65536)]))
    _error(chunked, 413)  # no Content-Length: the size read counts
    _error(requests.get(server.url + "/v1/nothing", timeout=10), 404)
    _error(requests.get(server.url + "/v1/completions", timeout=10), 405)
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=NAME, prompt="x", max_tokens=2, n=2)
    assert kv_idle(server.engine)


def test_internal_error_is_json(server, spec, monkeypatch):
    def broken(text):
        raise RuntimeError("boom")

    monkeypatch.setattr(spec.tokenizer, "encode", broken)
    e = _error(server.post("/v1/completions", {"model": NAME, "prompt": "hi"}), 500)
    assert e["type"] == "InternalServerError" and "Traceback" not in e["message"]


def test_models_health_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    assert server.client().models.retrieve(NAME).id == NAME
    r = requests.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    server.client().completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    text = requests.get(server.url + "/metrics", timeout=10).text
    values = {s.name + str(sorted(s.labels.items())): s.value
              for fam in text_string_to_metric_families(text) for s in fam.samples}
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "generation_tokens_total"):
        assert values[f"eagle3:{name}[]"] > 0, name
    for name in ("suffix_draft_tokens_total", "suffix_accepted_tokens_total"):  # present (0 here)
        assert f"eagle3:{name}[]" in values, name
    assert values["eagle3:spec_decode_num_accepted_tokens_per_pos_total[('position', '0')]"] > 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"eagle3:{name}[]" in values
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_queue_time_seconds",
                 "e2e_request_latency_seconds"):
        assert values[f"eagle3:{name}_count[]"] > 0, name


def test_queue_full_and_stopped_engine():
    """max_batch=1, max_queue=1: a third long request is refused (429); stopping the engine ends the
    running and the waiting one with 503, and /health says 503."""
    cfg = EngineConfig(max_batch=1, max_queue=1, num_draft_tokens=2)  # fixed K: no cost model to measure
    engine = Engine(eagle3.load("default"), cfg).start()
    srv = Server(engine)
    try:
        statuses: dict[str, int] = {}

        def post(tag: str) -> None:
            statuses[tag] = srv.post("/v1/completions", {"model": NAME, **LONG}).status_code

        a = threading.Thread(target=post, args=("a",))
        a.start()
        wait_until(lambda: engine.metrics()["num_running"] == 1, 10, "a never ran")
        b = threading.Thread(target=post, args=("b",))
        b.start()
        wait_until(lambda: engine.metrics()["num_waiting"] == 1, 10, "b never queued")
        with pytest.raises(openai.RateLimitError):
            srv.client().completions.create(model=NAME, **LONG)
        engine.stop()
        a.join(30)
        b.join(30)
        assert statuses == {"a": 503, "b": 503}
        assert requests.get(srv.url + "/health", timeout=10).status_code == 503
        _error(srv.post("/v1/completions", {"model": NAME, "prompt": "x"}), 503)
    finally:
        srv.close()
        engine.stop()


# -- the pieces, without a server ----------------------------------------------------------------
def test_text_stream_utf8_and_stop_holdback(spec):
    tok = spec.tokenizer
    text = "naïve 漢字 🙂 done, the END here"
    ids = tok.encode(text)
    ts = TextStream(tok, [])
    pieces = []
    for t in ids:
        ts.add(t)
        pieces.append(ts.take())
    ts.flush()
    pieces.append(ts.take())
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)

    ts = TextStream(tok, ["END", "xyz"])
    pieces = []
    for t in ids:
        ts.add(t)
        piece = ts.take()
        pieces.append(piece)
        assert not "".join(pieces).endswith(("E", "EN", "x", "xy")) or ts.stopped
    ts.flush()
    pieces.append(ts.take())
    assert "".join(pieces) == "naïve 漢字 🙂 done, the " and ts.stopped


class FakeRequest:
    finish_reason = None
    error = None
    metrics = {"ttft_s": 0.01, "e2e_s": 0.1, "queue_s": None, "itl_s": 0.01}


class FakeEngine:
    """Just enough engine to drive `ServedGeneration` by hand: on_event is called from the test."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.aborted: list[str] = []
        self.req = FakeRequest()

    def submit(self, prompt_ids, max_tokens, *, on_event, **kw):
        self.on_event = on_event
        return self.req

    def abort(self, req, reason="abort"):
        self.aborted.append(reason)

    def metrics(self):
        return {}

    def finish(self, new: list[int], reason: str) -> None:
        self.req.finish_reason = reason
        self.on_event(self.req, new, True)


def _collect(engine, stop: list[str], script) -> ServedGeneration:
    async def main() -> ServedGeneration:
        gen = ServedGeneration(engine, ServerMetrics(engine), [1, 2, 3], 100, GenerateParams(stop=stop))
        script(gen)
        gen.text_out = "".join([p async for p in gen.deltas()])
        return gen

    return asyncio.run(main())


def test_generation_eos_mid_stream(spec):
    """A stop id inside the final event is counted in usage but is not text."""
    tok = spec.tokenizer
    ids = tok.encode("hello world")
    eng = FakeEngine(tok)
    gen = _collect(eng, [], lambda g: (eng.on_event(eng.req, ids[:1], False),
                                       eng.finish([*ids[1:], 0], "stop")))
    assert gen.text_out == "hello world" and gen.finish_reason == "stop"
    assert gen.token_ids == [*ids, 0] and gen.usage()["completion_tokens"] == len(ids) + 1


def test_generation_stop_string_across_events(spec):
    """A stop string split over two events: text before it, engine aborted with reason 'stop', later
    ids (the engine's remaining round) ignored, the engine's own reason overridden."""
    tok = spec.tokenizer
    ids = tok.encode("alpha beta gamma delta")
    k = next(i for i in range(1, len(ids)) if "gam" in tok.decode(ids[:i])) - 1
    eng = FakeEngine(tok)
    gen = _collect(eng, ["gamma"], lambda g: (eng.on_event(eng.req, ids[:k], False),
                                              eng.on_event(eng.req, ids[k:], False),
                                              eng.finish([5, 6], "length")))
    assert gen.text_out == "alpha beta " and gen.finish_reason == "stop"
    assert eng.aborted == ["stop"]
    assert tok.decode(gen.token_ids).endswith("gamma")


def test_generation_failures_become_errors(spec):
    for reason, status in (("timeout", 504), ("abort", 503), ("error", 500)):
        eng = FakeEngine(spec.tokenizer)
        gen = _collect(eng, [], lambda g, eng=eng, reason=reason: eng.finish([7], reason))
        assert isinstance(gen.error, APIError) and gen.error.status == status and gen.finish_reason is None


# -- the command line --------------------------------------------------------------------------
def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def test_cli_help_and_refusals():
    cmds = [[sys.executable, "-m", "eagle3", "serve", "--help"],
            [sys.executable, "-m", "eagle3", "serve", "--backend", "executorch", "--port", "0"]]
    with ThreadPoolExecutor(2) as pool:
        helped, refused = pool.map(lambda c: subprocess.run(c, capture_output=True, text=True, env=_env(),
                                                            timeout=120), cmds)
    assert helped.returncode == 0, helped.stderr
    for opt in ("--target", "--draft", "--host", "--port", "--max-batch", "--max-queue", "--max-kv-tokens",
                "--no-speculate", "--num-draft-tokens", "--model-name", "--request-timeout",
                "--max-body-bytes", "--max-seq-len"):
        assert opt in helped.stdout, opt
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("eagle3: error:"), refused.stderr


@pytest.mark.slow
def test_cli_serve_process(want, spec):
    """`python -m eagle3 serve` answers a completion, then exits 0 on SIGINT."""
    proc = subprocess.Popen([sys.executable, "-m", "eagle3", "serve", "--port", "0", "--max-batch", "2",
                             "--num-draft-tokens", "3"], stderr=subprocess.PIPE, text=True, env=_env())
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("serving" in line for line in lines) or proc.poll() is not None, 120,
                   "no serving line")
        line = next(line for line in lines if "serving" in line)
        assert line.startswith(f"eagle3: serving {NAME} on http://127.0.0.1:")
        assert "(speculation on, API key off)" in line
        url = line.split(" on ")[1].split(" ")[0]
        wait_until(lambda: answers(url + "/health"), 30, "no /health")
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=N, temperature=0)
        assert r.choices[0].text == text_of(spec, want[PROMPTS[0]])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    assert "Traceback" not in "".join(lines), "".join(lines)


# -- load ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bounded_load(server, spec, want):
    """24 requests, 8 at a time (half streamed), max_tokens 32: all correct within 120 s, KV freed."""
    client = server.client()

    def one(i: int) -> bool:
        p = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            chunks = client.completions.create(model=NAME, prompt=p, max_tokens=N, temperature=0, stream=True)
            text = "".join(c.choices[0].text for c in chunks)
        else:
            r = client.completions.create(model=NAME, prompt=p, max_tokens=N, temperature=0)
            text = r.choices[0].text
        return text == text_of(spec, want[p])

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        ok = list(pool.map(one, range(24)))
    assert all(ok) and time.monotonic() - t0 < 120
    wait_until(lambda: kv_idle(server.engine), 10, "KV not freed after the load")


def test_every_sampling_parameter_reaches_the_server(server, spec):
    """temperature, top_p, top_k (an extra field, as vLLM takes it) and seed each change the
    answer, and each answer equals generate's with the same parameters: one the server
    dropped or renamed would fail."""
    ids = spec.tokenizer.encode(PROMPTS[1])
    base = dict(temperature=1.0, top_p=1.0, top_k=0, seed=7)
    variants = [base, {**base, "temperature": 0.4}, {**base, "top_p": 0.6}, {**base, "top_k": 3},
                {**base, "seed": 8}]
    outs = []
    for kw in variants:
        r = requests.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": ids,
                                                                 "max_tokens": 24, **kw}, timeout=60)
        assert r.status_code == 200, r.text
        outs.append(r.json()["eagle3"]["token_ids"])
    for kw, out in zip(variants, outs):
        want = spec.generate(ids, 24, temperature=kw["temperature"], top_p=kw["top_p"], top_k=kw["top_k"],
                             seed=kw["seed"]).token_ids
        assert out == want, kw
    assert all(out != outs[0] for out in outs[1:]), "a sampling parameter changed nothing"


def test_proposer_field(server, spec, want):
    """A request's own proposer: drafts from the text alone or with the head, the same greedy
    tokens; an unknown proposer is a 400 that names the field."""
    ok = {"model": NAME, "max_tokens": N, "temperature": 0}
    for proposer in ("suffix", "hybrid", "eagle"):
        for p in PROMPTS[:3]:
            r = server.post("/v1/completions", {**ok, "prompt": p, "proposer": proposer})
            assert r.status_code == 200, r.text
            extra = r.json()["eagle3"]
            assert extra["token_ids"] == want[p], (proposer, p)
            if proposer == "eagle":
                assert extra["suffix_draft_tokens"] == 0
    e = _error(server.post("/v1/completions", {**ok, "prompt": "x", "proposer": "ngram"}), 400)
    assert e["param"] == "proposer" and "eagle, suffix, hybrid" in e["message"]
    assert kv_idle(server.engine)
