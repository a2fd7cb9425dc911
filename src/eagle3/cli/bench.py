"""`eagle3 bench`: plain decoding vs EAGLE-3 (each K) vs transformers peers, one process, interleaved.

`add_parser(subparsers)` registers the verb; `main(argv)` runs it standalone
(`python -m eagle3.cli.bench bench ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import Eagle3Error

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
verifying and elsewhere; the head's drafting per token it drafted (catch-up included) and
the round's verify, each over plain decoding's step in the same run (draft tok / step,
verify / step); host synchronisations per round; identical outputs.
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
    b.add_argument("--proposer", default=None, metavar="eagle,hybrid,suffix",
                   help="who drafts, one set of rows each (docs/suffix.md): eagle (the head), hybrid "
                        "(head + continuations of earlier matches in the text, one tree), suffix (the "
                        "text alone, one row, no head needed); default: the default proposer's rows "
                        "(hybrid with a head); with --concurrency, one proposer for the engine")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="also measure sampling at this temperature: sampled plain, chain K=auto and "
                        "each tree, speedups against sampled plain (default 0: greedy rows only)")
    b.add_argument("--top-p", type=float, default=1.0,
                   help="with --temperature: keep the most likely tokens holding this much probability "
                        "(default 1: off; chat clients often send 0.9-0.95)")
    b.add_argument("--top-k", type=int, default=0,
                   help="with --temperature: keep the k most likely tokens (default 0: off)")
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


PEER_ALIASES = {"transformers": "hf"}  # another name for transformers' greedy generate


def parse_peers(text: str | None, assistant: str | None, notes: list[str]) -> list[str]:
    """The peers to run; the default skips them (with a note) when transformers is missing."""
    from ..bench import peers
    from ..bench.ab import ENGINE_PEERS

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


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; print the Markdown table; write --json / --plots."""
    notes: list[str] = []
    ks, auto = parse_ks(args.num_draft_tokens)
    trees = parse_trees(args.tree)
    proposers = parse_proposers(args.proposer)
    from ..decoding.sampling import check_sampling

    check_sampling(args.temperature, args.top_p, args.top_k, None)
    if not args.temperature and (args.top_p < 1.0 or args.top_k):
        raise Eagle3Error("--top-p and --top-k shape sampled rows: add --temperature (e.g. 0.7)")
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
    from ..bench.prompts import default_prompt_records, read_prompt_records

    records = (read_prompt_records(args.prompts, args.limit) if args.prompts is not None
               else default_prompt_records(args.target, args.limit))
    if args.concurrency is not None:
        return _cmd_concurrency(args, records, ks, auto, proposers)

    from ..bench.ab import run_ab
    from ..bench.report import markdown

    formats = parse_formats(args.quantize)
    report, spec, prompts = run_ab(args, parse_backends(args), formats, records, ks, auto, trees,
                                   peer_names, notes, proposers)
    print(markdown(report))
    if args.memory:
        from ..bench.memory import markdown_memory, memory_rows

        report["memory"] = memory_rows(args.target, args.draft, spec, formats, prompts[0],
                                       args.max_new_tokens, "llama.cpp" in (args.peers or ""))
        print("\n" + markdown_memory(report["memory"]))
    if args.json:
        _write(args.json, json.dumps(report, indent=2) + "\n")
    if args.plots:
        from ..bench.plots import save_plots

        save_plots(report, args.plots)
    return 0


def parse_proposers(text: str | None) -> list[str | None]:
    """--proposer's list (None: the default proposer's rows)."""
    from ..decoding.proposers import PROPOSERS

    if text is None:
        return [None]
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in PROPOSERS]
    if bad or not names:
        raise Eagle3Error(f"--proposer takes a comma-separated list of {', '.join(PROPOSERS)}, got '{text}'")
    return list(dict.fromkeys(names))


def parse_concurrency(text: str) -> list[int]:
    try:
        cs = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        cs = []
    if not cs or cs[0] < 1 or cs[-1] > 256:
        raise Eagle3Error(f"--concurrency takes comma-separated integers in 1..256 (e.g. 1,4,8), "
                          f"got '{text}'")
    return cs


def _cmd_concurrency(args: argparse.Namespace, records: list, ks: list[int], auto: bool,
                     proposers: list[str | None]) -> int:
    """`eagle3 bench --concurrency ...`: the serving benchmark (bench/serving.py)."""
    import torch

    import eagle3

    from ..bench.prompts import encode_prompts
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
    if len(proposers) > 1:
        raise Eagle3Error("--concurrency runs the engine with one proposer: give --proposer one name")
    report = run_concurrency_bench(spec, prompts, concurrencies, max_new_tokens=args.max_new_tokens,
                                   repeats=args.repeats, num_draft_tokens=k,
                                   tree=trees[0] if trees else None, progress=sys.stderr.isatty(),
                                   proposer=proposers[0])
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
