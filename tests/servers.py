"""A real `eagle3 serve` app in a thread on a free loopback port, and waiting helpers (tests)."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time

import openai
import pytest
import requests
import uvicorn

from eagle3.serve import build_app
from eagle3.targets.tokenizer import Tokenizer

NAME = "eagle3-default"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def with_chat_template(spec, folder) -> None:
    """Give `spec` (the toy default, which has none) a copy of its tokenizer with a chat template."""
    plain = spec.tokenizer
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(os.path.dirname(plain.path), f), os.path.join(folder, f))
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    spec.tokenizer = Tokenizer(os.path.join(folder, "tokenizer.json"))
    spec.plain_tokenizer = plain


@pytest.fixture(scope="module", name="spec")
def templated_spec(tmp_path_factory):
    """The fixture `spec` of the server tests: the default model (the toy in the tests), its
    tokenizer given a chat template. A test module takes it with `from servers import spec`."""
    import eagle3

    s = eagle3.load("default")
    with_chat_template(s, tmp_path_factory.mktemp("tok"))
    return s


class Server:
    """uvicorn serving `build_app(engine, ...)` in a daemon thread on a free loopback port."""

    def __init__(self, engine, name: str = NAME, api_key: str = "x", sndbuf: int | None = None,
                 **kw) -> None:
        sock = socket.create_server(("127.0.0.1", 0))
        if sndbuf is not None:  # accepted connections inherit it (small: a stalled reader blocks sends)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine, self.api_key = engine, api_key
        self.server = uvicorn.Server(uvicorn.Config(build_app(engine, name, **kw), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: answers(self.url + "/health"), 30, "the server never answered /health")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0, timeout=120)

    def post(self, path: str, body, headers: dict | None = None, **kw) -> requests.Response:
        """POST with this server's key (`headers` adds to or replaces the defaults)."""
        h = {"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json", **(headers or {})}
        h = {k: v for k, v in h.items() if v is not None}
        if isinstance(body, (dict, list)):
            return requests.post(self.url + path, json=body, timeout=120, headers=h, **kw)
        return requests.post(self.url + path, data=body, timeout=120, headers=h, **kw)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def answers(url: str) -> bool:
    try:
        requests.get(url, timeout=2)
        return True
    except requests.ConnectionError:
        return False


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.02)


def kv_idle(engine) -> bool:
    m = engine.metrics()
    return m["kv_used_tokens"] == 0 and m["num_running"] == 0 and m["num_waiting"] == 0
