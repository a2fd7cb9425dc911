"""The `eagle3` command line. Every verb has `--help`; user mistakes exit 2 with one line."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import Eagle3Error

DEFAULT_PROMPT = "def parse_args(argv):"
DRAFT_HELP = ("EAGLE-3 head directory, or 'none' for plain decoding (default: the default head for "
              "--target default, else none)")


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def _num_draft_tokens(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got '{text}'") from None


def _add_target_args(p: argparse.ArgumentParser, backends: bool = False, engine: bool = False) -> None:
    """--target, --backend, --program, --dtype, --max-seq-len. `backends`: bench's comma-separated
    list; `engine`: the serving engine's eager native backends only (no --program)."""
    p.add_argument("--target", default="default",
                   help="target: a checkpoint directory (Hugging Face layout), a .gguf file (or a "
                        "directory holding one), a model name (eagle3 models: smollm2-135m-instruct, "
                        "gemma-3-270m), or 'default' (SmolLM2-135M-Instruct with the head trained "
                        "here; default)")
    if engine:  # checked in the verb, so that a wrong value is one line, not argparse's usage dump
        p.add_argument("--backend", default="auto", metavar="auto|native",
                       help="the engine runs the eager native PyTorch target: auto (default) or native")
    elif backends:  # bench: a comma-separated list, run side by side
        p.add_argument("--backend", default="auto", metavar="eager,executorch",
                       help="backends to measure side by side, comma-separated: eager (= auto: the "
                            "native PyTorch target when supported), native, hf (the transformers "
                            "adapter), executorch (the exported program --program DIR); speedups "
                            "are against the first one's plain decoding (default auto)")
    else:
        p.add_argument("--backend", default="auto", choices=("auto", "native", "hf", "executorch"),
                       help="native PyTorch target, the transformers adapter, auto (native when "
                            "the architecture is supported), or executorch (an exported program: "
                            "--program DIR)")
    if not engine:
        p.add_argument("--program", default=None, metavar="DIR",
                       help="with --backend executorch: the --out directory of `eagle3 export`")
    p.add_argument("--dtype", default=None, help="compute dtype: float32 (default), bfloat16, float16")
    p.add_argument("--device", default=None,
                   help="where the target and head run: cpu (default), cuda, cuda:N")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache size in tokens (default: min(max_position_embeddings, 4096))")


def _add_tree_args(p: argparse.ArgumentParser, tree_help: str) -> None:
    """--tree / --chain and the tree's shape (--tree-* imply --tree)."""
    from .decoding.tree import DEFAULT_TREE as d

    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--tree", action="store_true", help=tree_help)
    shape.add_argument("--chain", action="store_true", help="chain drafting (default)")
    p.add_argument("--tree-top-k", type=int, default=None, metavar="K",
                   help=f"children per expanded node (default {d.top_k}; implies --tree)")
    p.add_argument("--tree-depth", type=int, default=None, metavar="D",
                   help=f"tree levels = longest acceptable draft (default {d.depth}; implies --tree)")
    p.add_argument("--tree-total-tokens", type=int, default=None, metavar="N",
                   help=f"nodes verified per round (default {d.total_tokens}; implies --tree)")


def cmd_generate(args: argparse.Namespace) -> int:
    import eagle3

    spec = eagle3.load(args.target, args.draft, dtype=args.dtype, backend=args.backend,
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
    result = spec.generate(ids, args.max_new_tokens, **_decoding_kwargs(args))
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
        if args.compare:
            line += (f"; plain decoding {stats['plain_tokens_per_s']:.1f} tok/s -> speedup "
                     f"{stats['speedup']:.2f}x")
            if stats["outputs_identical"] is not None:
                line += f", outputs identical: {stats['outputs_identical']}"

        print(line, file=sys.stderr)
    return 0


def _decoding_kwargs(args: argparse.Namespace, sampling: bool = True) -> dict:
    """generate()'s keyword arguments from the command line (--tree-* imply --tree); without
    `sampling`, only the tree."""
    tree = None
    custom = {key: getattr(args, f"tree_{key}") for key in ("top_k", "depth", "total_tokens")
              if getattr(args, f"tree_{key}") is not None}
    if args.chain and custom:
        raise Eagle3Error("--chain contradicts --tree-top-k/--tree-depth/--tree-total-tokens; "
                          "drop one")
    if args.tree or custom:
        tree = custom or True
    if not sampling:
        return {"tree": tree}
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                num_draft_tokens=args.num_draft_tokens, tree=tree, stop_token_ids=args.stop_ids)


def _compare_plain(spec, ids, args, result, stats: dict) -> None:
    """Time plain decoding of the same request in this process (A B A B, medians)."""
    import statistics

    plain = spec.plain()  # like for like: the same backend
    kw = _decoding_kwargs(args)
    plain_kw = {k: v for k, v in kw.items() if k not in ("num_draft_tokens", "tree")}
    spec_times, plain_times, same = [], [], True
    for _ in range(3):  # the first timed call above was cold; these are warm
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


def cmd_convert(args: argparse.Namespace) -> int:
    from .draft import convert_head

    src_fmt = convert_head(args.src, args.dst, args.to)
    print(f"converted {args.src} ({src_fmt}) -> {args.dst} ({args.to})")
    return 0


def cmd_train_draft(args: argparse.Namespace) -> int:
    from .train.trainer import TrainArgs, train_draft

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = train_draft(TrainArgs(
        target=args.target, data=args.data, out=args.out, draft_vocab=args.draft_vocab,
        ttt_steps=args.ttt_steps, epochs=args.epochs, max_steps=args.max_steps, lr=args.lr,
        batch=args.batch, warmup=args.warmup, grad_clip=args.grad_clip, seed=args.seed,
        resume=args.resume, ckpt_every=args.ckpt_every, prompt_len=args.prompt_len,
        response_len=args.response_len, prompts_per_file=args.prompts_per_file,
        regen_batch=args.regen_batch, temperature=args.temperature, features=args.features,
        taps=tuple(args.taps) if args.taps else None, progress=not args.quiet,
        stop_after=args.stop_after, dtype=args.dtype, max_seq_len=args.max_seq_len,
        max_prompt_len=args.max_prompt_len, autocast=args.autocast))
    if report:
        acc = ", ".join(f"{a:.2f}" for a in report["final_acc_per_step"])
        print(f"eagle3: trained {report['steps']} steps; final loss {report['final_loss']:.3f}; "
              f"top-1 per step [{acc}]; head in {args.out}/head (official) and "
              f"{args.out}/head-speculators")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import os

    import eagle3

    from .export import export_program

    if args.backend not in ("auto", "native"):
        raise Eagle3Error("export lowers the native PyTorch target: use --backend native or auto")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.device not in (None, "cpu"):
        raise Eagle3Error("export lowers for the CPU (XNNPACK); drop --device")
    spec = eagle3.load(args.target, args.draft, dtype=args.dtype, backend="native",
                       max_seq_len=args.max_seq_len, taps=args.taps)
    tdir = os.path.dirname(spec.tokenizer.path) if spec.tokenizer is not None else None
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"eagle3: {msg}", file=sys.stderr))
    export_program(spec, args.out, max_seq_len=args.max_seq_len,
                          max_draft_tokens=args.max_draft_tokens, quantize=args.quantize,
                          source={"target": args.target, "draft": args.draft}, tokenizer_dir=tdir,
                          log=log)
    print(args.out)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os
    import signal
    import socket

    try:
        import uvicorn

        from .serve import build_app
    except ImportError as e:
        raise Eagle3Error(f"eagle3 serve needs the serving extras ({e.name} is missing): "
                          "pip install 'eagle3[serve]'") from None
    import eagle3

    from .engine import Engine, EngineConfig

    if args.backend not in ("auto", "native"):
        raise Eagle3Error(f"eagle3 serve runs the eager native target; --backend {args.backend} is not "
                          "supported (use --backend auto or native)")
    for name in ("port", "max_body_bytes"):
        if getattr(args, name) < (0 if name == "port" else 1):
            raise Eagle3Error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'port' else '>= 1'}")
    name = args.model_name or ("eagle3-default" if args.target == "default"
                               else os.path.basename(os.path.normpath(args.target)))
    spec = eagle3.load(args.target, args.draft, dtype=args.dtype, backend=args.backend,
                       max_seq_len=args.max_seq_len, device=args.device)
    k = None if args.num_draft_tokens in (None, "auto") else args.num_draft_tokens
    tree = _decoding_kwargs(args, sampling=False)["tree"]
    if tree is not None and k is not None:
        raise Eagle3Error("--num-draft-tokens fixes a chain; with --tree the cost model picks among "
                          "plain, chains and the tree (drop one)")
    engine = Engine(spec, EngineConfig(max_batch=args.max_batch, max_queue=args.max_queue,
                                       max_kv_tokens=args.max_kv_tokens, speculate=not args.no_speculate,
                                       num_draft_tokens=k, request_timeout_s=args.request_timeout,
                                       tree=tree))
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
        server = uvicorn.Server(uvicorn.Config(build_app(engine, name, max_body_bytes=args.max_body_bytes),
                                               log_level="warning", timeout_graceful_shutdown=5))
        host, port = sock.getsockname()[:2]
        print(f"eagle3: serving {name} on http://{host}:{port} (speculation "
              f"{'on' if engine.speculate else 'off'})", file=sys.stderr, flush=True)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
        sock.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    import eagle3

    from .chat import ChatSession, run_chat

    if args.max_new_tokens < 1:
        raise Eagle3Error("--max-new-tokens must be >= 1")
    spec = eagle3.load(args.target, args.draft, dtype=args.dtype, backend=args.backend,
                       max_seq_len=args.max_seq_len, device=args.device)
    session = ChatSession(spec, system=args.system, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, seed=args.seed)
    try:
        return run_chat(session)
    finally:
        session.close()


def cmd_models(args: argparse.Namespace) -> int:
    from .targets.named import describe_models

    rows = describe_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        state = "installed" if r["installed"] else f"not installed ({r['install']})"
        print(f"{r['name']:<24} {state}")
        print(f"{'':<24} weights: {r['source']}; licence: {r['license']}; "
              f"chat template: {'yes' if r['chat'] else 'no (base model)'}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import inspect_path

    info = inspect_path(args.path)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for k, v in info.items():
            print(f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3", description="Lossless EAGLE-3 speculative decoding: generate exactly the "
        "tokens the target model would generate alone, faster.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a completion (plain or speculative)",
                       description="Generate a completion. Greedy output is token-identical to "
                       "plain decoding with the target alone.")
    g.add_argument("prompt", nargs="?", default=None,
                   help=f"prompt text (needs the target's tokenizer; default '{DEFAULT_PROMPT}')")
    g.add_argument("--prompt-ids", type=_int_list, default=None, metavar="1,2,3",
                   help="prompt as comma-separated token ids instead of text")
    _add_target_args(g)
    g.add_argument("--draft", default=None, help=DRAFT_HELP)
    g.add_argument("--taps", type=_int_list, default=None, metavar="2,16,29",
                   help="target layers feeding the head (default: the head config's ids, else "
                        "2,L//2,L-3); tap k = hidden state entering layer k")
    g.add_argument("--chat", default=None, metavar="MESSAGE",
                   help="one chat turn: MESSAGE as the user's, formatted with the model's chat template")
    g.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message first")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--num-draft-tokens", type=_num_draft_tokens, default=None, metavar="K|auto",
                   help="draft tokens per round (chain drafting); auto (default) picks K from the "
                        "measured cost model and the acceptance seen so far")
    g.add_argument("--compile", action="store_true",
                   help="run the decode/verify/draft steps through torch.compile (faster steps; "
                        "compiling takes a minute or more the first time, then is cached on disk)")
    _add_tree_args(g, "dynamic tree drafting (EAGLE-2/3): expand the top-k children of the best "
                      "nodes level by level, verify the best nodes in one target forward")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, lossless in distribution")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (default 0: off)")
    g.add_argument("--seed", type=int, default=None,
                   help="random seed for sampling: the same seed and settings give the same output")
    g.add_argument("--stop-ids", type=_int_list, default=None, metavar="1,2",
                   help="stop after any of these token ids (default: the target's EOS ids)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object {token_ids, text, stats} instead of text")
    g.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    g.add_argument("--compare", action="store_true",
                   help="also time plain decoding of the same request in this process (interleaved, "
                        "medians) and report the speedup and whether the outputs are identical")
    g.set_defaults(func=cmd_generate)

    ch = sub.add_parser("chat", help="chat in the terminal (multi-turn, streamed, speculating)",
                        description="An interactive multi-turn chat with the model's chat template; "
                        "tokens stream as they are accepted. /reset forgets the conversation, /exit "
                        "quits, Ctrl-C stops the current answer. A stats line (tokens/s, tau) follows "
                        "each answer. Targets without a chat template are refused (use generate). "
                        "Runs on the engine, which does not yet support sliding-window targets.")
    _add_target_args(ch, engine=True)
    ch.add_argument("--draft", default=None, help=DRAFT_HELP)
    ch.add_argument("--system", default=None, metavar="TEXT", help="a system message opening the chat")
    ch.add_argument("--max-new-tokens", type=int, default=512, help="tokens per answer at most (default 512)")
    ch.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    ch.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    ch.set_defaults(func=cmd_chat)

    m = sub.add_parser("models", help="list the models eagle3 knows by name",
                       description="The registered model names (--target NAME), where their weights "
                       "come from (pip packages that carry GGUF files; nothing is downloaded at run "
                       "time), their licences and whether they are installed here.")
    m.add_argument("--json", action="store_true", help="print JSON")
    m.set_defaults(func=cmd_models)

    i = sub.add_parser("inspect", help="describe a target (directory, .gguf, model name) or a head",
                       description="Describe a target or head. Targets (checkpoint directory, .gguf "
                       "file or model name): architecture, sizes, default taps, maximum length; GGUF "
                       "files also their quantization types and tokenizer. EAGLE-3 heads: format, "
                       "sizes, vocabulary, taps, whether an embedding ships.")
    i.add_argument("path", help="target checkpoint directory, .gguf file, model name, or EAGLE-3 head "
                                "directory")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=cmd_inspect)

    c = sub.add_parser("convert", help="convert an EAGLE-3 head between formats",
                       description="Convert an EAGLE-3 head between the official EAGLE release, "
                       "SGLang and vLLM speculators formats (auto-detected source, tensor-for-tensor "
                       "lossless). Tap ids are copied verbatim.")
    c.add_argument("src", help="source head directory")
    c.add_argument("dst", help="destination directory (created)")
    c.add_argument("--to", required=True, choices=("official", "sglang", "speculators"),
                   help="target format")
    c.set_defaults(func=cmd_convert)

    t = sub.add_parser("train-draft", help="train an EAGLE-3 head for a target (training-time test)",
                       description="Train an EAGLE-3 head: the target regenerates responses to the "
                       "prompts (cached), the draft vocabulary is taken from them, and the head is "
                       "trained with training-time test (unrolled draft steps, loss 0.8^i). Saves "
                       "OUT/head (official), OUT/head-speculators, OUT/report.json and report.png. "
                       "Data-parallel under torchrun --nproc_per_node N -m eagle3 train-draft ...")
    t.add_argument("--target", required=True,
                   help="the frozen target: checkpoint directory, .gguf file or model name "
                        "(eagle3 models)")
    t.add_argument("--data", required=True,
                   help="sharegpt or sharegpt:N (ShareGPT's training split, N conversations, "
                        "chat-templated), a .jsonl with prompt / prompt_ids / messages per line, or a "
                        "text file or directory of text files to cut prompts from")
    t.add_argument("--out", required=True, help="output directory (data cache, checkpoints, head)")
    t.add_argument("--draft-vocab", type=int, default=2048,
                   help="draft vocabulary size: the most frequent response tokens (default 2048)")
    t.add_argument("--ttt-steps", type=int, default=7, help="unrolled draft steps (default 7)")
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--max-steps", type=int, default=None, help="train this many optimizer steps in all")
    t.add_argument("--stop-after", type=int, default=None,
                   help="end this run after this step (checkpointed; --resume continues with the "
                        "same schedule)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch", type=int, default=16, help="sequences per step (global)")
    t.add_argument("--warmup", type=int, default=50, help="linear warmup steps before cosine decay")
    t.add_argument("--grad-clip", type=float, default=0.5)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    t.add_argument("--ckpt-every", type=int, default=100)
    t.add_argument("--prompt-len", type=int, default=64,
                   help="prompt length in tokens when cutting prompts from text files")
    t.add_argument("--prompts-per-file", type=int, default=4)
    t.add_argument("--response-len", type=int, default=96, help="tokens the target generates per prompt")
    t.add_argument("--regen-batch", type=int, default=32, help="prompts per regeneration batch")
    t.add_argument("--temperature", type=float, default=0.0,
                   help="regenerate by sampling at this temperature (default 0: greedy)")
    t.add_argument("--features", choices=("online", "offline"), default="online",
                   help="capture target taps per step (online) or once into memory-mapped files")
    t.add_argument("--taps", type=_int_list, default=None, help="target taps (default 2,L//2,L-3)")
    t.add_argument("--max-prompt-len", type=int, default=384,
                   help="--data sharegpt: skip prompts longer than this many tokens (default 384)")
    t.add_argument("--dtype", default=None,
                   help="the frozen target's dtype for regeneration and features: float32 (default) "
                        "or bfloat16 (faster; the data need not be bit-exact)")
    t.add_argument("--autocast", action="store_true",
                   help="train the head under bf16 autocast (fp32 master weights): several times "
                        "faster on CPUs with AMX / AVX-512 BF16, slower elsewhere")
    t.add_argument("--max-seq-len", type=int, default=None,
                   help="the target's context while training (default: its own, at most 4096)")
    t.add_argument("--threads", type=int, default=None, help="torch threads per process")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train_draft)

    e = sub.add_parser("export", help="export target + head to an ExecuTorch program (XNNPACK)",
                       description="torch.export the speculator's prefill / target_verify / "
                       "draft_decode / decode methods (dynamic lengths, KV caches as buffers shared "
                       "by every method) and lower them to one ExecuTorch program with the XNNPACK "
                       "backend: OUT/program.pte, OUT/eagle3_program.json (bounds, taps, vocabulary, "
                       "d2t) and the target's tokenizer. Run it with `eagle3 generate --backend "
                       "executorch --program OUT`. Needs pip install 'eagle3[export]'. Lowering "
                       "takes one to a few minutes.")
    _add_target_args(e)
    e.add_argument("--draft", default=None,
                   help="EAGLE-3 head directory (default: the default head for --target default)")
    e.add_argument("--taps", type=_int_list, default=None, metavar="2,16,29",
                   help="target layers feeding the head (default: the head config's ids)")
    e.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")
    e.add_argument("--max-draft-tokens", type=int, default=8, metavar="K",
                   help="largest chain the exported target_verify accepts (verify over up to K+1 "
                        "tokens; default 8, the largest automatic K)")
    e.add_argument("--quantize", default="none", choices=("none", "int8", "int4"),
                   help="quantize the linear layers: int8 weights per output channel or int4 "
                        "weights in groups of 32, activations int8 per token at run time "
                        "(XNNPACK's dynamically quantized linear); default none. Prints the "
                        "measured logit error")
    e.add_argument("--threads", type=int, default=None, help="torch threads while exporting")
    e.add_argument("--quiet", action="store_true", help="no progress lines")
    e.set_defaults(func=cmd_export)

    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (batched speculation)",
                       description="Serve the model over an OpenAI-compatible HTTP API: POST "
                       "/v1/completions and /v1/chat/completions (streaming or not), GET /v1/models, "
                       "/health and /metrics (Prometheus). Requests are batched by the engine "
                       "(continuous batching over a paged KV pool), each speculating with the head; "
                       "greedy outputs equal plain decoding's. Ctrl-C stops it. Needs pip install "
                       "'eagle3[serve]'.")
    _add_target_args(s, engine=True)
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
    s.add_argument("--num-draft-tokens", type=_num_draft_tokens, default=None, metavar="K|auto",
                   help="draft tokens per round; auto (default) picks K per batch size from a cost "
                        "model measured at start-up and the acceptance seen so far")
    _add_tree_args(s, "offer tree drafting too: per batch size the cost model picks plain decoding, "
                      "a chain of K or the tree, by measured costs and acceptance")
    s.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="abort a request after S seconds (answered 504); default: no limit")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                   help="largest request body accepted; larger ones get 413 (default 1048576)")
    s.set_defaults(func=cmd_serve)

    from .bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except Eagle3Error as e:
        print(f"eagle3: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eagle3: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
