"""`eagle3 generate`: one completion, plain or speculative, optionally timed against plain."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import Eagle3Error
from .args import (
    DRAFT_HELP,
    add_proposer_arg,
    add_target_args,
    add_tree_args,
    decoding_kwargs,
    int_list,
    num_draft_tokens,
)

DEFAULT_PROMPT = "def parse_args(argv):"


def cmd_generate(args: argparse.Namespace) -> int:
    import eagle3

    spec = eagle3.load(args.target, args.draft, dtype=args.dtype, backend=args.backend,
                       quantize=args.quantize,
                       max_seq_len=args.max_seq_len, taps=args.taps, compile=args.compile,
                       program=args.program, device=args.device)
    tok = spec.tokenizer
    if sum(x is not None for x in (args.prompt, args.prompt_ids, args.chat)) > 1:
        raise Eagle3Error("give either a PROMPT, --prompt-ids or --chat, not several")
    if args.system is not None and args.chat is None:
        raise Eagle3Error("--system applies to --chat; add --chat MESSAGE")
    if args.chat is not None:
        if tok is None or not tok.has_chat_template():
            raise Eagle3Error(f"target {args.target} has no chat template, so --chat cannot format a "
                              "message; use `eagle3 generate PROMPT` (plain completion) instead")
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}]
        ids = tok.apply_chat_template(messages, "--chat")
    elif args.prompt_ids is not None:
        ids = args.prompt_ids
    else:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
        if tok is None:
            raise Eagle3Error(f"target {args.target} ships no tokenizer.json, so a text prompt cannot "
                              "be encoded; pass --prompt-ids 1,2,3")
        ids = tok.encode(text)
    result = spec.generate(ids, args.max_new_tokens, **decoding_kwargs(args))
    stats = dict(result.stats)
    n = len(result.token_ids)
    stats["tokens_per_s"] = n / stats["seconds"] if stats["seconds"] > 0 else 0.0
    if args.compare:
        _compare_plain(spec, ids, args, result, stats)
    text = tok.decode(result.token_ids) if tok is not None else ""
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": text, "stats": stats}))
        return 0
    print(text if tok is not None else ",".join(map(str, result.token_ids)))
    if not args.quiet:
        line = (f"eagle3: {n} new tokens in {stats['seconds']:.2f}s ({stats['tokens_per_s']:.1f} tok/s), "
                f"{stats['target_forwards']} target forwards, tau {stats['mean_accept_len']:.2f}")
        if stats.get("tree"):
            line += ", tree {top_k}x{depth}x{total_tokens} (top_k x depth x nodes)".format(**stats["tree"])
        elif stats.get("num_draft_tokens") is not None:
            line += f", K {stats['num_draft_tokens']}" + (" (auto)" if args.num_draft_tokens in
                                                         (None, "auto") else "")
        if stats.get("suffix_rounds"):
            line += (f", {stats['suffix_accepted_tokens']} of {stats['accepted_tokens']} accepted "
                     "tokens from the text (suffix)")
        if args.compare:
            line += (f"; plain decoding {stats['plain_tokens_per_s']:.1f} tok/s -> speedup "
                     f"{stats['speedup']:.2f}x")
            if stats["outputs_identical"] is not None:
                line += f", outputs identical: {stats['outputs_identical']}"

        print(line, file=sys.stderr)
    return 0


def _compare_plain(spec, ids, args, result, stats: dict) -> None:
    """Time plain decoding of the same request in this process (A B A B, medians of five: one
    busy moment of the machine moves a single timing by more than the difference measured)."""
    import statistics

    plain = spec.plain()  # like for like: the same backend
    kw = decoding_kwargs(args)
    plain_kw = {k: v for k, v in kw.items() if k not in ("num_draft_tokens", "tree", "proposer")}
    spec_times, plain_times, same = [], [], True
    for _ in range(5):  # the first timed call above was cold; these are warm
        p = plain.generate(ids, args.max_new_tokens, **plain_kw)
        plain_times.append(p.stats["seconds"])
        r = spec.generate(ids, args.max_new_tokens, **kw)
        spec_times.append(r.stats["seconds"])
        same = same and p.token_ids == result.token_ids == r.token_ids
    n = len(result.token_ids)
    stats["plain_tokens_per_s"] = n / statistics.median(plain_times)
    stats["tokens_per_s"] = n / statistics.median(spec_times)
    stats["speedup"] = stats["tokens_per_s"] / stats["plain_tokens_per_s"]
    # Sampled outputs differ between plain and speculative runs (other random draws); the
    # distribution is what is lossless (tests/test_sampling.py).
    stats["outputs_identical"] = same if args.temperature == 0 else None


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate a completion (plain or speculative)",
                       description="Generate a completion. Greedy output is token-identical to "
                       "plain decoding with the target alone.")
    g.add_argument("prompt", nargs="?", default=None,
                   help=f"prompt text (needs the target's tokenizer; default '{DEFAULT_PROMPT}')")
    g.add_argument("--prompt-ids", type=int_list, default=None, metavar="1,2,3",
                   help="prompt as comma-separated token ids instead of text")
    add_target_args(g)
    g.add_argument("--draft", default=None, help=DRAFT_HELP)
    g.add_argument("--taps", type=int_list, default=None, metavar="2,16,29",
                   help="target layers feeding the head (default: the head config's ids, else "
                        "2,L//2,L-3); tap k = hidden state entering layer k")
    g.add_argument("--chat", default=None, metavar="MESSAGE",
                   help="one chat turn: MESSAGE as the user's, formatted with the model's chat template")
    g.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message first")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--num-draft-tokens", type=num_draft_tokens, default=None, metavar="K|auto",
                   help="draft tokens per round (chain drafting); auto (default) picks K (or plain "
                        "decoding) from the measured cost model and the acceptance seen so far")
    g.add_argument("--compile", action="store_true",
                   help="run the decode/verify/draft steps through torch.compile (faster steps; "
                        "compiling takes a minute or more the first time, then is cached on disk)")
    add_tree_args(g, "dynamic tree drafting (EAGLE-2/3): expand the top-k children of the best "
                      "nodes level by level, verify the best nodes in one target forward")
    add_proposer_arg(g)
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, lossless in distribution")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (default 0: off)")
    g.add_argument("--seed", type=int, default=None,
                   help="random seed for sampling: the same seed and settings give the same output")
    g.add_argument("--stop-ids", type=int_list, default=None, metavar="1,2",
                   help="stop after any of these token ids (default: the target's EOS ids)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object {token_ids, text, stats} instead of text")
    g.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    g.add_argument("--compare", action="store_true",
                   help="also time plain decoding of the same request in this process (interleaved, "
                        "medians) and report the speedup and whether the outputs are identical")
    g.set_defaults(func=cmd_generate)
