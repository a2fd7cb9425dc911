"""`eagle3 serve`: the OpenAI-compatible HTTP server over the engine."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from ..errors import Eagle3Error
from .args import (
    DRAFT_HELP,
    add_proposer_arg,
    add_target_args,
    add_tree_args,
    decoding_kwargs,
    num_draft_tokens,
)

API_KEY_ENV = "EAGLE3_API_KEY"


def is_loopback(host: str) -> bool:
    """Whether `host` only listens on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_limits(args: argparse.Namespace) -> ServerLimits:  # noqa: F821
    """The --api-key / --max-* flags as `ServerLimits` (one-line error for a bad value)."""
    from ..serve.protocol import ServerLimits  # the serving extras are imported only to serve

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    limits = ServerLimits(api_key=key, protect_metrics=args.protect_metrics,
                          max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                          max_tokens=args.max_tokens, max_stop_strings=args.max_stop_strings,
                          max_stop_length=args.max_stop_length, max_concurrent=args.max_concurrent,
                          stream_stall_s=args.stream_stall_timeout)
    flags = {"api_key": "--api-key", "stream_stall_s": "--stream-stall-timeout"}
    try:
        limits.check()
    except ValueError as e:
        name = str(e).split(" ")[0]
        raise Eagle3Error(f"{flags.get(name, '--' + name.replace('_', '-'))}: {e}") from None
    if args.protect_metrics and key is None:
        raise Eagle3Error(f"--protect-metrics needs an API key (--api-key or {API_KEY_ENV})")
    return limits


def cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import socket

    try:
        import uvicorn

        from ..serve import build_app
    except ImportError as e:
        raise Eagle3Error(f"eagle3 serve needs the serving extras ({e.name} is missing): "
                          "pip install 'eagle3[serve]'") from None
    import eagle3

    from ..engine import Engine, EngineConfig

    if args.backend not in ("auto", "native"):
        raise Eagle3Error(f"eagle3 serve runs the eager native target; --backend {args.backend} is not "
                          "supported (use --backend auto or native)")
    if args.port < 0:
        raise Eagle3Error("--port must be >= 0")
    limits = server_limits(args)
    name = args.model_name or ("eagle3-default" if args.target == "default"
                               else os.path.basename(os.path.normpath(args.target)))
    spec = eagle3.load(args.target, args.draft, dtype=args.dtype, backend=args.backend,
                       quantize=args.quantize,
                       max_seq_len=args.max_seq_len, device=args.device,
                       calibrate=False)  # the engine measures its own batch costs
    k = None if args.num_draft_tokens in (None, "auto") else args.num_draft_tokens
    tree = decoding_kwargs(args, sampling=False)["tree"]
    if tree is not None and k is not None:
        raise Eagle3Error("--num-draft-tokens fixes a chain; with --tree the cost model picks among "
                          "plain, chains and the tree (drop one)")
    engine = Engine(spec, EngineConfig(max_batch=args.max_batch, max_queue=args.max_queue,
                                       max_kv_tokens=args.max_kv_tokens, speculate=not args.no_speculate,
                                       num_draft_tokens=k, request_timeout_s=args.request_timeout,
                                       tree=tree, proposer=args.proposer))
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise Eagle3Error(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); pick another "
                          "--port or --host") from None
    # uvicorn handles SIGINT/SIGTERM (graceful shutdown), then re-raises them: both end up here as
    # KeyboardInterrupt, so the engine stops and the exit is clean.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        engine.start()
        server = uvicorn.Server(uvicorn.Config(build_app(engine, name, limits=limits),
                                               log_level="warning", timeout_graceful_shutdown=5))
        host, port = sock.getsockname()[:2]
        if limits.api_key is None and not is_loopback(args.host):
            print(f"eagle3: warning: listening on {args.host} without an API key: anyone who can reach "
                  f"port {port} can use it (set --api-key or {API_KEY_ENV})", file=sys.stderr, flush=True)
        print(f"eagle3: serving {name} on http://{host}:{port} (speculation "
              f"{'on' if engine.speculate else 'off'}, API key {'required' if limits.api_key else 'off'})",
              file=sys.stderr, flush=True)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
        sock.close()
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (batched speculation)",
                       description="Serve the model over an OpenAI-compatible HTTP API: POST "
                       "/v1/completions and /v1/chat/completions (streaming or not), GET /v1/models, "
                       "/health and /metrics (Prometheus). Requests are batched by the engine "
                       "(continuous batching over a paged KV pool), each speculating with the head; "
                       "greedy outputs equal plain decoding's. Ctrl-C stops it. Needs pip install "
                       "'eagle3[serve]'. Binds 127.0.0.1 by default; put --api-key on any server "
                       "others can reach.")
    add_target_args(s, engine=True)
    s.add_argument("--draft", default=None, help=DRAFT_HELP)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 listens on every interface)")
    s.add_argument("--port", type=int, default=8000,
                   help="port to listen on (default 8000; 0 picks a free one)")
    s.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model name clients must send (default: eagle3-default for the default "
                        "target, else the target directory's name)")
    s.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait beyond the batch; more are refused with 429 (default 64)")
    s.add_argument("--max-kv-tokens", type=int, default=None, metavar="N",
                   help="KV pool size in tokens, shared by all requests; a request reserves its prompt + "
                        "max_tokens (default: max-batch x the context length)")
    s.add_argument("--no-speculate", action="store_true",
                   help="plain batched decoding even when a head is loaded (a baseline)")
    s.add_argument("--num-draft-tokens", type=num_draft_tokens, default=None, metavar="K|auto",
                   help="draft tokens per round; auto (default) picks K per batch size from a cost "
                        "model measured at start-up and the acceptance seen so far")
    add_tree_args(s, "offer tree drafting too: per batch size the cost model picks plain decoding, "
                      "a chain of K or the tree, by measured costs and acceptance")
    add_proposer_arg(s)
    s.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="abort a request after S seconds (answered 504); default: no limit")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                   help="largest request body accepted; larger ones get 413 (default 1048576)")
    a = s.add_argument_group("access and limits (each refusal is an OpenAI-style error)")
    a.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every /v1/* route (401 otherwise); "
                        f"default: ${API_KEY_ENV} when set, else no key. /health stays open")
    a.add_argument("--protect-metrics", action="store_true",
                   help="require the API key on /metrics too (default: /metrics is open)")
    a.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="longest prompt (after the chat template), in tokens; 400 above (default: the "
                        "context)")
    a.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="largest max_tokens a request may ask for; 400 above; also caps the chat "
                        "default (default: the context)")
    a.add_argument("--max-stop-strings", type=int, default=4, metavar="N",
                   help="most stop strings per request (default 4)")
    a.add_argument("--max-stop-length", type=int, default=256, metavar="N",
                   help="longest stop string, in characters (default 256)")
    a.add_argument("--max-concurrent", type=int, default=None, metavar="N",
                   help="requests in flight at once (decoding, waiting or streaming); 429 above "
                        "(default: --max-batch + --max-queue)")
    a.add_argument("--stream-stall-timeout", type=float, default=30.0, metavar="S",
                   help="a streaming client that reads nothing for S seconds is disconnected and its "
                        "request aborted, freeing its KV (default 30)")
    s.set_defaults(func=cmd_serve)
