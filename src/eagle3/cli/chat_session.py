"""`eagle3 chat`: an interactive multi-turn chat in the terminal, streamed through the engine.

Each turn renders the whole conversation with the model's chat template and submits
it to an `Engine` (one request at a time, speculating with the head); tokens print as
the engine accepts them. `/reset` forgets the conversation, `/exit` (or end of input)
quits, and Ctrl-C stops the current answer (the engine aborts the request and frees
its KV) and returns to the prompt. After each answer a stats line: tokens, tok/s, tau.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from ..errors import Eagle3Error

HELP = "type a message; /reset starts over, /exit quits, Ctrl-C stops an answer"


class ChatSession:
    """The conversation and one engine; `answer(text)` streams one assistant turn to `out`."""

    def __init__(self, spec: Any, *, system: str | None = None, max_new_tokens: int = 512,
                 temperature: float = 0.0, seed: int | None = None, out: TextIO = sys.stdout) -> None:
        from ..engine import Engine, EngineConfig

        tok = spec.tokenizer
        if tok is None or not tok.has_chat_template():
            raise Eagle3Error("this target has no chat template, so it cannot chat; use "
                              "`eagle3 generate PROMPT` for plain completion")
        self.spec, self.tok, self.out = spec, tok, out
        self.system, self.max_new_tokens = system, max_new_tokens
        self.temperature, self.seed = temperature, seed
        self.engine = Engine(spec, EngineConfig(max_batch=1, max_queue=1)).start()
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def close(self) -> None:
        self.engine.stop()

    def prompt_ids(self, text: str) -> list[int]:
        ids = self.tok.apply_chat_template(self.messages + [{"role": "user", "content": text}])
        room = self.spec.max_seq_len - self.max_new_tokens
        if len(ids) > room:
            raise Eagle3Error(f"the conversation ({len(ids)} tokens) no longer fits the context with room "
                              f"for {self.max_new_tokens} new tokens; /reset to start over")
        return ids

    def answer(self, text: str) -> dict:
        """Stream the reply to `text`; returns {tokens, seconds, tokens_per_s, tau, stopped}."""
        ids = self.prompt_ids(text)
        done = threading.Event()
        got: list[int] = []
        shown = [""]

        def on_event(req, new: list[int], finished: bool) -> None:
            got.extend(new)
            text_now = self.tok.decode(got)
            if text_now.startswith(shown[0]):  # print what is new; partial UTF-8 waits for more
                self.out.write(text_now[len(shown[0]):])
                self.out.flush()
                shown[0] = text_now
            if finished:
                done.set()

        t0 = time.perf_counter()
        req = self.engine.submit(ids, self.max_new_tokens, temperature=self.temperature, seed=self.seed,
                                 on_event=on_event)
        stopped = False
        try:
            while not done.wait(0.05):
                pass
        except KeyboardInterrupt:
            stopped = True
            self.engine.abort(req)
            done.wait(30)
        seconds = time.perf_counter() - t0
        reply = self.tok.decode(got)
        if reply.startswith(shown[0]) and reply != shown[0]:  # the tail held back above
            self.out.write(reply[len(shown[0]):])
        self.out.write("\n")
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        hist = req.metrics["accept_len_hist"]
        rounds = sum(hist)
        tau = 1.0 + sum(i * n for i, n in enumerate(hist)) / rounds if rounds else None
        rate = len(got) / seconds if seconds else 0.0
        return {"tokens": len(got), "seconds": seconds, "tokens_per_s": rate, "tau": tau, "stopped": stopped}


def stats_line(s: dict) -> str:
    tau = f", tau {s['tau']:.2f}" if s["tau"] is not None else " (plain decoding)"
    stop = " (stopped)" if s["stopped"] else ""
    return f"[{s['tokens']} tokens in {s['seconds']:.1f}s, {s['tokens_per_s']:.1f} tok/s{tau}]{stop}"


def run_chat(session: ChatSession, inp: TextIO = sys.stdin, err: TextIO = sys.stderr) -> int:
    """The read-answer loop; returns the exit code."""
    print(f"eagle3 chat: {HELP}", file=err)
    interactive = inp.isatty()
    while True:
        try:
            if interactive:
                line = input("> ")
            else:
                err.write("> ")
                err.flush()
                line = inp.readline()
                if not line:
                    break
        except EOFError:
            break
        except KeyboardInterrupt:
            err.write("\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            session.reset()
            print("(conversation reset)", file=err)
            continue
        try:
            print(stats_line(session.answer(text)), file=err, flush=True)
        except Eagle3Error as e:
            print(f"eagle3: {e}", file=err)
    return 0
