"""`eagle3 bench`: plain decoding vs EAGLE-3 (each K) vs transformers peers, one process, interleaved.

`add_parser(subparsers)` registers the verb; `main(argv)` runs it standalone
(`python -m eagle3.cli.bench bench ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import Eagle3Error, notice

BUILTIN_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n",
]
DESCRIPTION = """\
Benchmark in one process: plain decoding (this engine) against EAGLE-3 chain
drafting for each K and tree drafting for each --tree shape, and transformers peers on the same target weights
(greedy generate, prompt lookup, assisted generation with --assistant). For
each prompt the variants run in turn (A B C A B C ...) after one warm-up pass;
each repetition totals all prompts and rows report the median over repetitions.
Every run's tokens are compared with plain greedy decoding in the same run.
--backend eager,executorch --program DIR adds an exported program's rows
(`eagle3 export`) to the same interleaved run.

Columns: tok/s; speedup vs plain; model = the speedup the cost model predicts
from tau; tau (tokens per target forward); accept = accepted / drafted; the
acceptance rate per draft position; the accepted-length histogram (length:rounds);
milliseconds per round (per target forward after the prefill) spent drafting,
verifying and elsewhere; host synchronisations per round; identical outputs.
Below the table: the cost model, cost(K+1)/cost(1) of a target forward and
draft step / target forward. --json OUT writes every number."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `bench` verb on an `eagle3` subparsers object."""
    from .args import add_target_args, int_list

    b = subparsers.add_parser("bench", help="A/B benchmark: plain vs EAGLE-3 per K vs transformers peers",
                              description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(b, backends=True)
    b.add_argument("--draft", default=None,
                   help="EAGLE-3 head directory (default: the default head for --target default)")
    b.add_argument("--taps", type=int_list, default=None, metavar="2,16,29",
                   help="target layers feeding the head (default: the head config's ids)")
    b.add_argument("--prompts", default=None, metavar="SET|FILE",
                   help="sharegpt-heldout (held-out ShareGPT first turns, chat template applied), "
                        "humaneval (HumanEval prompts as code completion), or a .jsonl (one object "
                        "per line: prompt text, prompt_ids or chat messages) or .txt (one prompt per "
                        "line); default: sharegpt-heldout for --target default, else a few built-in "
                        "code prompts")
    b.add_argument("--limit", type=int, default=None, metavar="N",
                   help="use the first N prompts (default: 24 of a named set, all of a file)")
    b.add_argument("--max-new-tokens", type=int, default=64, help="tokens per generation (default 64)")
    b.add_argument("--num-draft-tokens", default="auto,1,2,3,4,5,6,7,8", metavar="auto,1,...,8",
                   help="the K values to measure, 'auto' for the automatic choice (default auto,1..8)")
    b.add_argument("--tree", default="default", metavar="default,4x7x24",
                   help="tree shapes to measure, each 'default' or TOPKxDEPTHxNODES (e.g. 4x8x48), "
                        "or none (default: the default tree); with --concurrency, one shape the "
                        "engine's cost model may pick besides plain and chains")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="also measure sampling at this temperature: sampled plain, chain K=auto and "
                        "each tree, speedups against sampled plain (default 0: greedy rows only)")
    b.add_argument("--compile", action="store_true",
                   help="run our engine's decode/verify/draft steps through torch.compile (compiles "
                        "each step shape once: minutes on a small CPU the first time, cached on disk)")
    b.add_argument("--concurrency", default=None, metavar="1,4,8",
                   help="serving benchmark instead: the engine (eagle3.engine) with speculation off vs "
                        "on at each concurrency (requests decoded together; every prompt queued at "
                        "once), interleaved; reports throughput over all requests, time to first "
                        "token, inter-token latency. K: auto per batch size, or one integer from "
                        "--num-draft-tokens. Chain/tree rows and peers are not run")
    b.add_argument("--repeats", type=int, default=3, help="interleaved repetitions per prompt (default 3)")
    b.add_argument("--peers", default=None, metavar="hf,lookup,assisted,llama.cpp,vllm",
                   help="peers in the same interleaved run: transformers hf (greedy generate; also "
                        "spelled transformers), lookup "
                        "(prompt lookup), assisted (needs --assistant); llama.cpp (plain decoding "
                        "and EAGLE-3 with this head converted by llama.cpp's converter, on the same "
                        "GGUF file; needs `make llama.cpp`); vllm (vLLM's CPU build, plain and "
                        "EAGLE-3 with this head, each engine a worker process of its own environment; "
                        "needs recipes/vllm/setup.sh); or none. Default hf,lookup (+assisted with "
                        "--assistant) when transformers is installed. A peer that cannot run is skipped "
                        "with a note")
    b.add_argument("--vllm-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the vLLM rows' weights and activations (default float32)")
    b.add_argument("--assistant", default=None, metavar="DIR",
                   help="assistant model checkpoint for transformers assisted generation")
    b.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 is steadier on a busy machine)")
    b.add_argument("--memory", action="store_true",
                   help="also report load time (warm) and peak resident memory of one generation, each "
                        "in a fresh process, against the bytes of its weights + KV cache: eagle3 per "
                        "--quantize format, and llama.cpp's llama-completion on the same GGUF with "
                        "--peers llama.cpp (JSON key memory)")
    b.add_argument("--json", default=None, metavar="OUT", help="write the full report as JSON to OUT")
    b.add_argument("--plots", default=None, metavar="DIR",
                   help="write speedup.png, acceptance.png, accept_hist.png to DIR; with --concurrency, "
                        "latency_throughput.png (latency and throughput per offered load); needs matplotlib")
    b.set_defaults(func=cmd_bench)
    return b


def parse_ks(text: str) -> tuple[list[int], bool]:
    """'auto,1,2,4' -> ([1, 2, 4], True): the K values (sorted, unique, each in
    1..MAX_NUM_DRAFT_TOKENS) and whether to add the automatic row."""
    from ..speculator import MAX_NUM_DRAFT_TOKENS

    words = [t.strip() for t in text.split(",") if t.strip()]
    auto = "auto" in words
    try:
        ks = sorted({int(t) for t in words if t != "auto"})
    except ValueError:
        ks = [0]
    if not (ks or auto) or not all(1 <= k <= MAX_NUM_DRAFT_TOKENS for k in ks):
        raise Eagle3Error(f"--num-draft-tokens must be comma-separated integers in 1..{MAX_NUM_DRAFT_TOKENS} "
                          f"and/or 'auto' (e.g. auto,1,2,4,8), got '{text}'")
    return ks, auto


def parse_trees(text: str) -> list:
    """'default,4x8x48' -> [DEFAULT_TREE, TreeShape(4, 8, 48)]; 'none' -> []."""
    from ..decoding.tree import DEFAULT_TREE, parse_tree

    shapes = []
    for word in (t.strip() for t in text.split(",") if t.strip()):
        if word == "none":
            continue
        if word == "default":
            shapes.append(DEFAULT_TREE)
            continue
        try:
            k, d, n = (int(x) for x in word.lower().split("x"))
        except ValueError:
            raise Eagle3Error(f"--tree takes 'default', 'none' or TOPKxDEPTHxNODES shapes such as "
                              f"4x8x48, got '{word}'") from None
        shapes.append(parse_tree({"top_k": k, "depth": d, "total_tokens": n}))
    return list(dict.fromkeys(shapes))


def parse_backends(args: argparse.Namespace) -> list[tuple[str, str]]:
    """--backend as [(row name, load backend)], checked: at most one eager-type backend
    (auto / eager, native or hf) and executorch."""
    words = list(dict.fromkeys(t.strip() for t in args.backend.split(",") if t.strip()))
    bad = [w for w in words if w not in ("auto", "eager", "native", "hf", "executorch")]
    eager = [w for w in words if w != "executorch"]
    if not words or bad or len(eager) > 1:
        raise Eagle3Error(f"--backend takes a comma-separated list of one of auto/eager/native/hf and/or "
                          f"executorch (e.g. eager,executorch), got '{args.backend}'")
    if "executorch" in words and args.program is None:
        raise Eagle3Error("backend executorch needs --program DIR: run `eagle3 export --out DIR` first")
    if "executorch" in words and args.compile and not eager:
        raise Eagle3Error("--compile applies to the eager backend; an exported program is already lowered")
    return [("executorch", "executorch") if w == "executorch" else
            ("eager", "auto" if w == "eager" else w) for w in words]


def parse_formats(text: str | None) -> list[str | None]:
    """--quantize for bench: a comma-separated list of weight formats, each measured as its
    own eager backend in the same interleaved run (None: the default, float32)."""
    from ..kernels import parse_quantize

    words = [w.strip() for w in (text or "").split(",") if w.strip()]
    for w in words:
        parse_quantize(w)  # one-line error for a bad name
    words = [None if w in ("fp32", "float32") else w for w in words]
    return list(dict.fromkeys(words)) or [None]


ENGINE_PEERS = ("llama.cpp", "vllm")  # other engines, run as separate programs
PEER_ALIASES = {"transformers": "hf"}  # the issue's name for transformers' greedy generate


def parse_peers(text: str | None, assistant: str | None, notes: list[str]) -> list[str]:
    """The peers to run; the default skips them (with a note) when transformers is missing."""
    from ..bench import peers

    if text is None:
        names = ["hf", "lookup"] + (["assisted"] if assistant else [])
        if not peers.available():
            notes.append("transformers is not installed: skipping the peers (pip install 'eagle3[hf]')")
            return []
        return names
    names = list(dict.fromkeys(PEER_ALIASES.get(t.strip(), t.strip()) for t in text.split(",") if t.strip()))
    if names in ([], ["none"]):
        return []
    bad = [n for n in names if n not in (*peers.PEERS, *ENGINE_PEERS)]
    if bad:
        raise Eagle3Error(f"unknown peer '{bad[0]}'; use a comma-separated list of "
                          f"{', '.join((*peers.PEERS, *ENGINE_PEERS))}, or none")
    if not [n for n in names if n not in ENGINE_PEERS]:
        return names
    if "assisted" in names and not assistant:
        raise Eagle3Error("peer 'assisted' needs --assistant DIR (a small model sharing the target's "
                          "tokenizer)")
    if not peers.available() and [n for n in names if n in peers.PEERS]:
        raise Eagle3Error(f"peers {','.join(names)} need transformers: pip install 'eagle3[hf]', "
                          "or pass --peers none")
    return names


def read_prompt_records(path: str, limit: int | None = None) -> list[tuple[str, dict]]:
    """(where, record) per prompt of a named set (`bench/prompts.py`) or a .jsonl (prompt /
    prompt_ids / messages) or text file; the first `limit` only when given."""
    from ..bench.prompts import DEFAULT_LIMIT, PROMPT_SETS, prompt_set

    if limit is not None and limit < 1:
        raise Eagle3Error(f"--limit must be >= 1, got {limit}")
    if path in PROMPT_SETS:
        return prompt_set(path, limit or DEFAULT_LIMIT)
    p = Path(path)
    if not p.is_file():
        raise Eagle3Error(f"--prompts {path} does not exist; pass a .jsonl (prompt or prompt_ids per "
                          "line) or a .txt (one prompt per line)")
    lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if p.suffix != ".jsonl":
            records.append((f"{path}:{n}", {"prompt": line}))
            continue
        try:
            records.append((f"{path}:{n}", json.loads(line)))
        except json.JSONDecodeError:
            raise Eagle3Error(f"{path}:{n} is not valid JSON; each line must be an object with "
                              "prompt or prompt_ids") from None
    if not records:
        raise Eagle3Error(f"--prompts {path} holds no prompts; give one per line")
    return records[:limit] if limit else records


def default_prompt_records(target: str, limit: int | None = None) -> list[tuple[str, dict]]:
    from ..default import default_prompts

    if target == "default":
        return read_prompt_records(default_prompts() or "sharegpt-heldout", limit)
    return [(f"built-in prompt {i + 1}", {"prompt": text}) for i, text in enumerate(BUILTIN_PROMPTS)]


def encode_prompts(records: list[tuple[str, dict]], spec, max_new_tokens: int) -> list[list[int]]:
    """Token ids per record, each checked against the target (vocabulary, length)."""
    from ..decoding.request import check_generation
    from ..train.data import prompt_from_record

    cfg = spec.target.config
    prompts = []
    for where, rec in records:
        ids = prompt_from_record(rec, spec.tokenizer, where)
        try:
            prompts.append(check_generation(ids, max_new_tokens, vocab_size=cfg.vocab_size,
                                            max_len=cfg.max_seq_len, eos_token_ids=()).prompt)
        except Eagle3Error as e:
            raise Eagle3Error(f"{where}: {e}") from None
    return prompts


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; print the Markdown table; write --json / --plots."""
    notes: list[str] = []
    ks, auto = parse_ks(args.num_draft_tokens)
    trees = parse_trees(args.tree)
    from ..decoding.sampling import check_sampling

    check_sampling(args.temperature, 1.0, 0, None)
    peer_names = parse_peers(args.peers, args.assistant, notes)
    if args.repeats < 1:
        raise Eagle3Error(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_new_tokens < 1:
        raise Eagle3Error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.threads is not None and args.threads < 1:
        raise Eagle3Error(f"--threads must be >= 1, got {args.threads}")
    if args.assistant is not None and not (Path(args.assistant) / "config.json").is_file():
        raise Eagle3Error(f"--assistant {args.assistant} is not a checkpoint directory (no config.json)")
    if args.plots:
        from ..bench.plots import check_matplotlib

        check_matplotlib()
    records = (read_prompt_records(args.prompts, args.limit) if args.prompts is not None
               else default_prompt_records(args.target, args.limit))
    if args.concurrency is not None:
        return _cmd_concurrency(args, records, ks, auto)

    import torch

    import eagle3

    from ..bench import peers, vllm
    from ..bench.harness import run_bench
    from ..bench.report import markdown
    from ..default import default_target_dir
    from ..targets import HFTarget, resolve_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    backends = {}
    formats = parse_formats(args.quantize)
    for name, backend in parse_backends(args):
        if name == "executorch":
            backends[name] = eagle3.load(args.target, "none" if args.draft == "none" else None,
                                         backend="executorch", program=args.program)
            continue
        for fmt in formats:  # one eager backend per weight format, side by side
            key = name if len(formats) == 1 else f"{name}:{fmt or 'fp32'}"
            backends[key] = eagle3.load(args.target, args.draft, dtype=args.dtype, backend=backend,
                                        max_seq_len=args.max_seq_len, taps=args.taps,
                                        compile=args.compile, device=args.device, quantize=fmt)
    spec = next(iter(backends.values()))
    eager_key = next((k for k in backends if k.startswith("eager")), None)
    if spec.draft is None:
        notes.append("no draft head: measuring plain decoding and the peers only (pass --draft DIR)")
    prompts = encode_prompts(records, spec, args.max_new_tokens)
    arms = {}
    hf_names = [n for n in peer_names if n not in ENGINE_PEERS]  # transformers, in this process
    if hf_names and eager_key is None:
        if args.peers is not None:
            raise Eagle3Error("the transformers peers need the eager backend in --backend; add "
                              "eager or pass --peers none")
        notes.append("no eager backend: skipping the transformers peers")
        hf_names = []
    if "llama.cpp" in peer_names:
        arms.update(llama_cpp_arms(args, spec, ks, notes))
    if hf_names:
        tgt = backends[eager_key].target
        model = (tgt.model if isinstance(tgt, HFTarget) else
                 peers.load_model(default_target_dir() if args.target == "default" else args.target,
                                  resolve_dtype(args.dtype), tgt.embedding_weight.device, "target"))
        assistant = (peers.load_model(args.assistant, resolve_dtype(args.dtype), model.device, "assistant")
                     if "assisted" in hf_names else None)
        arms.update(peers.peer_arms(hf_names, model, args.max_new_tokens, tgt.config.eos_token_ids,
                                    assistant))
    workers = vllm.start_for(args, spec, ks, notes) if "vllm" in peer_names else {}
    for note in notes:
        notice(note)
    try:  # vLLM's engines run in processes of their own: stopped whatever happens
        arms.update({name: vllm.arm(w) for name, w in workers.items()})
        report = run_bench(spec, prompts, ks=ks, max_new_tokens=args.max_new_tokens,
                           repeats=args.repeats, peers=arms, auto=auto, trees=trees,
                           temperature=args.temperature, progress=sys.stderr.isatty(),
                           backends=backends)
    finally:
        vllm.close(workers)
    report["settings"].update(target=args.target, draft=args.draft, backend=args.backend,
                              compiled=args.compile,
                              dtype=str(resolve_dtype(args.dtype)).replace("torch.", ""),
                              device=str(spec.target.embedding_weight.device),
                              program=args.program,
                              weight_formats={k: getattr(b.target, "weight_format", None)
                                              for k, b in backends.items()})
    report["notes"] = notes
    for name, w in workers.items():
        report["peers"][name]["load_seconds"] = w.load_seconds
    print(markdown(report))
    if args.memory:
        report["memory"] = memory_rows(args, spec, formats, prompts[0], "llama.cpp" in (args.peers or ""))
        from ..bench.memory import markdown_memory

        print("\n" + markdown_memory(report["memory"]))
    if args.json:
        _write(args.json, json.dumps(report, indent=2) + "\n")
    if args.plots:
        from ..bench.plots import save_plots

        save_plots(report, args.plots)
    return 0


def memory_rows(args: argparse.Namespace, spec, formats: list, prompt_ids: list[int],
                with_llama_cpp: bool) -> dict:
    """`--memory`: one fresh-process measurement per weight format, and llama.cpp's (bench/memory.py)."""
    import torch

    from ..bench import llamacpp as lc
    from ..bench import memory
    from ..llamacpp import binary
    from ..targets import target_path

    threads = torch.get_num_threads()
    text = spec.tokenizer.decode(prompt_ids, skip_special_tokens=False) if spec.tokenizer else ""
    draft = None if args.draft in (None, "default") else args.draft
    rows = {}
    for fmt in formats:  # named by the format the load resolved ("auto" -> gguf or float32)
        row = memory.eagle3_memory(args.target, draft, fmt, text, args.max_new_tokens, threads,
                                   max_seq_len=spec.max_seq_len)
        rows[f"eagle3 {row['weight_format'] or 'stock'}"] = row
    gguf = target_path(args.target)[1]
    if with_llama_cpp and gguf is not None and lc.missing() is None:
        rows["llama.cpp"] = memory.llamacpp_memory(str(binary("llama-completion")), gguf, text,
                                                   args.max_new_tokens, threads, spec.max_seq_len)
    return rows


def llama_cpp_arms(args: argparse.Namespace, spec, ks: list[int], notes: list[str]) -> dict:
    """llama.cpp plain and EAGLE-3 (our head, converted by llama.cpp's converter) on the same
    GGUF file; none, with a note saying why, when they cannot run."""
    import os
    import tempfile

    import torch

    from ..bench import llamacpp as lc
    from ..llamacpp import head_to_gguf
    from ..targets import target_path

    why = lc.missing()
    if why is None:
        gguf = target_path(args.target)[1]
        if gguf is None:
            why = f"--target {args.target} is not a GGUF file (llama.cpp runs GGUF targets)"
        elif spec.tokenizer is None:
            why = "the target has no tokenizer (llama.cpp takes prompts as text)"
    if why is not None:
        notes.append(f"skipping llama.cpp: {why}")
        return {}
    threads = torch.get_num_threads()
    tok = spec.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    arms = {"llama.cpp plain": lc.completion_arm(gguf, args.max_new_tokens, threads, decode, tok.encode)}
    if spec.draft is not None:
        head = args.draft
        if head is None:
            from ..default import default_head_dir

            head = default_head_dir()
        head_gguf = os.path.join(tempfile.mkdtemp(prefix="eagle3-bench-"), "head.gguf")
        head_to_gguf(head, head_gguf, args.target)
        k = ks[0] if len(ks) == 1 else 3
        arms[f"llama.cpp eagle3 K={k}"] = lc.eagle3_arm(gguf, head_gguf, args.max_new_tokens, k,
                                                        threads, decode, tok.encode)
    return arms


def parse_concurrency(text: str) -> list[int]:
    try:
        cs = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        cs = []
    if not cs or cs[0] < 1 or cs[-1] > 256:
        raise Eagle3Error(f"--concurrency takes comma-separated integers in 1..256 (e.g. 1,4,8), "
                          f"got '{text}'")
    return cs


def _cmd_concurrency(args: argparse.Namespace, records: list, ks: list[int], auto: bool) -> int:
    """`eagle3 bench --concurrency ...`: the serving benchmark (bench/serving.py)."""
    import torch

    import eagle3

    from ..bench.serving import markdown_concurrency, run_concurrency_bench

    concurrencies = parse_concurrency(args.concurrency)
    if args.backend not in ("auto", "eager", "native") or args.compile:
        raise Eagle3Error("--concurrency measures the engine, which runs the eager native backend; drop "
                          "--backend/--program/--compile")
    k = None if auto or len(ks) != 1 else ks[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = eagle3.load(args.target, args.draft, dtype=args.dtype, backend="native",
                       max_seq_len=args.max_seq_len, taps=args.taps, device=args.device,
                       quantize=args.quantize, calibrate=False)  # measured before any timing
    if spec.draft is None:
        raise Eagle3Error("--concurrency compares speculation off vs on: it needs a draft head (--draft DIR)")
    trees = parse_trees(args.tree) if k is None else []  # a fixed K measures chains only
    if len(trees) > 1:
        raise Eagle3Error("--concurrency offers the engine one tree shape: give --tree one shape (or none)")
    prompts = encode_prompts(records, spec, args.max_new_tokens)
    report = run_concurrency_bench(spec, prompts, concurrencies, max_new_tokens=args.max_new_tokens,
                                   repeats=args.repeats, num_draft_tokens=k,
                                   tree=trees[0] if trees else None, progress=sys.stderr.isatty())
    report["settings"].update(target=args.target, draft=args.draft, threads=torch.get_num_threads())
    print(markdown_concurrency(report))
    if args.json:
        _write(args.json, json.dumps(report, indent=2) + "\n")
    if args.plots:
        from ..bench.plots import save_concurrency_plot

        save_concurrency_plot(report, args.plots)
    return 0


def _write(path: str, text: str) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    except OSError as e:
        raise Eagle3Error(f"cannot write {path} ({e.strerror}); pick a writable path") from None


def main(argv: list[str] | None = None) -> int:
    """`eagle3 bench ...` on its own (argv includes the verb), as `eagle3.cli.main` runs it."""
    parser = argparse.ArgumentParser(prog="eagle3")
    add_parser(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Eagle3Error as e:
        print(f"eagle3: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
