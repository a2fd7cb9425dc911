"""`eagle3 chat`: a multi-turn chat in the terminal, streamed through the engine."""

from __future__ import annotations

import argparse

from ..errors import Eagle3Error
from .args import DRAFT_HELP, add_target_args


def cmd_chat(args: argparse.Namespace) -> int:
    import eagle3

    from .chat_session import ChatSession, run_chat

    if args.max_new_tokens < 1:
        raise Eagle3Error("--max-new-tokens must be >= 1")
    spec = eagle3.load(args.target, args.draft, dtype=args.dtype, backend=args.backend,
                       quantize=args.quantize,
                       max_seq_len=args.max_seq_len, device=args.device)
    session = ChatSession(spec, system=args.system, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, seed=args.seed)
    try:
        return run_chat(session)
    finally:
        session.close()


def add_parser(sub: argparse._SubParsersAction) -> None:
    ch = sub.add_parser("chat", help="chat in the terminal (multi-turn, streamed, speculating)",
                        description="An interactive multi-turn chat with the model's chat template; "
                        "tokens stream as they are accepted. /reset forgets the conversation, /exit "
                        "quits, Ctrl-C stops the current answer. A stats line (tokens/s, tau) follows "
                        "each answer. Targets without a chat template are refused (use generate). "
                        "Runs on the engine (batched speculation, as eagle3 serve).")
    add_target_args(ch, engine=True)
    ch.add_argument("--draft", default=None, help=DRAFT_HELP)
    ch.add_argument("--system", default=None, metavar="TEXT", help="a system message opening the chat")
    ch.add_argument("--max-new-tokens", type=int, default=512, help="tokens per answer at most (default 512)")
    ch.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    ch.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    ch.set_defaults(func=cmd_chat)
