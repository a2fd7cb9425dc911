"""Serving engine: concurrent requests, batched speculative rounds, a paged KV pool, metrics.

`Engine(spec, EngineConfig(...)).start()`, then `submit(prompt_ids, max_tokens, ...)`
returns a `Request` to wait on or stream from (`on_event`); see engine.py.
"""

from .engine import Engine, EngineConfig, EngineError
from .request import Request, RequestState

__all__ = ["Engine", "EngineConfig", "EngineError", "Request", "RequestState"]
