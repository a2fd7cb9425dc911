"""The `eagle3` command, run as a real process (`python -m eagle3` and the console script).

Each process pays the torch import (~2 s), so independent invocations run
concurrently (a few at a time) inside one test. Contract (DESIGN §4): exit 0 on
success; on bad input exit 2 with one line `eagle3: error: ...` on stderr and
never a traceback (argparse usage errors also exit 2, with their usage line).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import make_hf_model

MODULE = [sys.executable, "-m", "eagle3"]
SCRIPT = [os.path.join(os.path.dirname(sys.executable), "eagle3")]
STATS_KEYS = {"rounds", "draft_tokens", "accepted_tokens", "accepted_per_position", "mean_accept_len",
              "accept_len_hist", "target_forwards", "seconds", "tokens_per_s"}
PROMPT = [5, 17, 3, 99, 42, 7]


def _env(home: str) -> dict[str, str]:
    env = dict(os.environ)
    # One thread per process: several run at once, and oversubscribed torch threads crawl.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", XDG_CACHE_HOME=os.path.join(home, "cache"))
    return env


def run(argv: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, env=env)


def run_many(argvs: list[list[str]], env: dict[str, str], workers: int = 4):
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda a: run(a, env), argvs))


def show(p: subprocess.CompletedProcess) -> str:
    return f"argv={p.args}\nrc={p.returncode}\nstdout={p.stdout[-2000:]}\nstderr={p.stderr[-2000:]}"


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int, **kw) -> list[int]:
    """transformers' greedy continuation (its EOS stops it unless eos_token_id=None)."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cli"))


@pytest.fixture(scope="module")
def env(home):
    return _env(home)


@pytest.fixture(scope="module")
def llama(home):
    """(dir, oracle): an 8-layer Llama (default taps (2, 4, 5)), no tokenizer."""
    d = os.path.join(home, "llama")
    model = make_hf_model("llama", num_hidden_layers=8)
    model.save_pretrained(d)
    return d, model


@pytest.fixture(scope="module")
def with_tokenizer(home):
    """A small random Llama with a byte-level tokenizer.json, written by eagle3.targets.default."""
    from eagle3.targets.default import RANDOM_CONFIG, build_random_checkpoint

    d = os.path.join(home, "tok")
    build_random_checkpoint(d, {**RANDOM_CONFIG, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 4, "max_position_embeddings": 256})
    return d


# -- help ----------------------------------------------------------------------
@pytest.mark.slow
def test_help(env):
    top, gen, insp = run_many([SCRIPT + ["--help"], MODULE + ["generate", "--help"],
                               MODULE + ["inspect", "--help"]], env)
    for p in (top, gen, insp):
        assert p.returncode == 0, show(p)
        assert "usage:" in p.stdout and "Traceback" not in p.stderr, show(p)
    for verb in ("generate", "inspect"):
        assert verb in top.stdout
    for opt in ("--prompt-ids", "--target", "--draft", "--backend", "--dtype", "--max-seq-len",
                "--max-new-tokens", "--num-draft-tokens", "--tree", "--chain", "--temperature",
                "--seed", "--stop-ids", "--json"):
        assert opt in gen.stdout, opt
    assert "path" in insp.stdout and "--json" in insp.stdout


# -- generate ------------------------------------------------------------------
@pytest.mark.slow
def test_generate_prompt_ids(llama, env):
    d, model = llama
    base = ["generate", "--target", d, "--draft", "none", "--prompt-ids",
            ",".join(map(str, PROMPT)), "--max-new-tokens", "8"]
    as_json, as_text = run_many([SCRIPT + base + ["--json"], MODULE + base + ["--stop-ids", "999"]],
                                env)
    want = hf_greedy(model, PROMPT, 8)

    assert as_json.returncode == 0, show(as_json)
    assert as_json.stdout.strip().count("\n") == 0, show(as_json)  # one JSON object
    out = json.loads(as_json.stdout)
    assert set(out) == {"token_ids", "text", "stats"}
    assert out["token_ids"] == want
    assert out["text"] == ""  # no tokenizer
    assert set(out["stats"]) >= STATS_KEYS, sorted(out["stats"])
    st = out["stats"]
    assert st["target_forwards"] == len(want)
    assert st["seconds"] > 0 and st["tokens_per_s"] > 0
    assert st["mean_accept_len"] >= 1.0
    assert "Traceback" not in as_json.stderr

    # Without --json: the ids on stdout (no tokenizer), a summary line on stderr. --stop-ids
    # replaces the EOS default: an id never generated runs to --max-new-tokens.
    assert as_text.returncode == 0, show(as_text)
    free = [int(t) for t in as_text.stdout.strip().split(",")]
    assert free == hf_greedy(model, PROMPT, 8, eos_token_id=None)
    assert free[:len(want)] == want
    assert "tok/s" in as_text.stderr


@pytest.mark.slow
def test_generate_text_prompt(with_tokenizer, env):
    from eagle3.targets.tokenizer import load_tokenizer

    d = with_tokenizer
    prompt = "def parse_args(argv):"
    p = run(MODULE + ["generate", prompt, "--target", d, "--draft", "none", "--max-new-tokens", "8",
                      "--json"], env)
    assert p.returncode == 0, show(p)
    out = json.loads(p.stdout)
    tok = load_tokenizer(d)
    ids = tok.encode(prompt)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    assert out["token_ids"] == hf_greedy(oracle, ids, 8)
    assert out["text"] == tok.decode(out["token_ids"]) and out["text"]


# -- inspect -------------------------------------------------------------------
@pytest.mark.slow
def test_inspect(llama, env):
    d = llama[0]
    text, as_json = run_many([SCRIPT + ["inspect", d], MODULE + ["inspect", d, "--json"]], env)
    for p in (text, as_json):
        assert p.returncode == 0, show(p)
    info = json.loads(as_json.stdout)
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["model_type"] == "llama" and info["backend"] == "native"
    assert info["layers"] == 8 and info["hidden_size"] == 64 and info["vocab_size"] == 160
    assert info["heads"] == 4 and info["kv_heads"] == 2 and info["head_dim"] == 16
    assert info["default_taps"] == [2, 4, 5]
    assert info["max_position_embeddings"] == 256 and info["max_seq_len"] == 256
    assert info["weights"] == "model.safetensors" and info["weight_bytes"] > 0
    assert info["tokenizer"] is False
    lines = {line.split()[0]: line.split(None, 1)[1] for line in text.stdout.splitlines() if line.strip()}
    assert lines["architecture"] == "LlamaForCausalLM"
    assert lines["layers"] == "8" and lines["hidden_size"] == "64"
    assert lines["default_taps"] == "[2, 4, 5]" and lines["max_seq_len"] == "256"


def test_inspect_non_native(home, with_tokenizer):
    """In process: a model_type with no native target is described from its own config keys."""
    from eagle3.cli.inspection import inspect_path

    g = os.path.join(home, "gpt2-inspect")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=160, n_embd=64, n_layer=8, n_head=4, n_positions=128)).save_pretrained(g)
    hf = inspect_path(g)
    assert hf["architecture"] == "GPT2LMHeadModel" and hf["backend"].startswith("hf")
    assert hf["layers"] == 8 and hf["hidden_size"] == 64 and hf["vocab_size"] == 160
    assert hf["default_taps"] == [2, 4, 5] and hf["max_seq_len"] == 128
    small = inspect_path(with_tokenizer)  # 4 layers: no default taps, and a tokenizer
    assert small["tokenizer"] is True and small["layers"] == 4
    assert "choose taps explicitly" in small["default_taps"]


# -- bad input -----------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_targets(llama, home):
    """Damaged copies of the Llama checkpoint, one per kind of damage."""
    src = llama[0]
    root = os.path.join(home, "bad")
    os.makedirs(root, exist_ok=True)

    def copy(name: str) -> str:
        d = os.path.join(root, name)
        shutil.copytree(src, d)
        return d

    out = {"missing": os.path.join(root, "does-not-exist")}
    out["no_config"] = copy("no_config")
    os.remove(os.path.join(out["no_config"], "config.json"))
    out["bad_json"] = copy("bad_json")
    with open(os.path.join(out["bad_json"], "config.json"), "w") as f:
        f.write('{"model_type": "llama",')
    out["no_hidden"] = copy("no_hidden")
    cfg = json.load(open(os.path.join(src, "config.json")))
    with open(os.path.join(out["no_hidden"], "config.json"), "w") as f:
        json.dump({k: v for k, v in cfg.items() if k != "hidden_size"}, f)
    out["no_weights"] = copy("no_weights")
    os.remove(os.path.join(out["no_weights"], "model.safetensors"))
    out["truncated"] = copy("truncated")
    path = os.path.join(out["truncated"], "model.safetensors")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    out["wrong_shape"] = copy("wrong_shape")
    path = os.path.join(out["wrong_shape"], "model.safetensors")
    state = load_file(path)
    state["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(32, 64)
    save_file(state, path, metadata={"format": "pt"})
    out["gpt2"] = copy("gpt2")
    with open(os.path.join(out["gpt2"], "config.json"), "w") as f:
        json.dump({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, f)
    out["yarn"] = copy("yarn")
    with open(os.path.join(out["yarn"], "config.json"), "w") as f:
        json.dump({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                              "rope_theta": 10000.0}}, f)
    return out


# Runs `eagle3.cli.main(argv)` for many argv lists in one process (one torch import), the way
# the console script would: stdout/stderr captured per call, SystemExit's code kept, and any
# other exception printed as the traceback the interpreter would show.
DRIVER = r"""
import contextlib, io, json, sys, traceback
from eagle3.cli import main
results = []
for argv in json.load(open(sys.argv[1])):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            rc = 1
    results.append({"argv": argv, "rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def run_batched(argvs: list[list[str]], env: dict[str, str], home: str) -> list[subprocess.CompletedProcess]:
    path = os.path.join(home, f"argvs-{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump(argvs, f)
    p = run([sys.executable, "-c", DRIVER, path], env)
    assert p.returncode == 0, show(p)
    return [subprocess.CompletedProcess(r["argv"], r["rc"], r["stdout"], r["stderr"])
            for r in json.loads(p.stdout)]


def error_problem(p: subprocess.CompletedProcess, words: list[str]) -> str | None:
    """None if p failed the contract way: exit 2, one `eagle3: error:` line naming `words`."""
    err = p.stderr.strip()
    ok = (p.returncode == 2 and "Traceback" not in p.stderr and "\n" not in err
          and err.startswith("eagle3: error:") and all(w.lower() in err.lower() for w in words)
          and p.stdout == "")
    return None if ok else show(p)


def usage_problem(p: subprocess.CompletedProcess, words: list[str]) -> str | None:
    """None if p is argparse's usage error: exit 2, usage line, `error:` naming `words`."""
    err = p.stderr.strip()
    ok = (p.returncode == 2 and "Traceback" not in p.stderr and err.startswith("usage:")
          and "error:" in err.splitlines()[-1] and all(w in err for w in words))
    return None if ok else show(p)


@pytest.mark.slow
def test_bad_input_exits_2(llama, bad_targets, env, home):
    d = llama[0]
    b = bad_targets
    gen = ["generate", "--draft", "none", "--max-new-tokens", "4"]
    ids = ["--prompt-ids", "1,2,3"]
    # (argv, words the one-line error must contain)
    errors = [
        (gen + ["--target", b["missing"]] + ids, ["not a directory"]),
        (gen + ["--target", b["no_config"]] + ids, ["config.json", "missing"]),
        (gen + ["--target", b["bad_json"]] + ids, ["config.json", "not valid JSON"]),
        (gen + ["--target", b["no_hidden"]] + ids, ["hidden_size"]),
        (gen + ["--target", b["no_weights"]] + ids, ["no weights"]),
        (gen + ["--target", b["truncated"]] + ids, ["model.safetensors", "truncated"]),
        (gen + ["--target", b["wrong_shape"]] + ids, ["q_proj", "shape"]),
        (gen + ["--target", b["gpt2"], "--backend", "native"] + ids, ["gpt2", "--backend hf"]),
        (gen + ["--target", b["yarn"], "--backend", "native"] + ids, ["yarn", "backend='hf'"]),
        (gen + ["--target", d, "--dtype", "int8"] + ids, ["dtype", "int8"]),
        (gen + ["--target", d, "--max-seq-len", "1"] + ids, ["max_seq_len"]),
        (gen + ["--target", d, "--max-seq-len", "32", "--prompt-ids", ",".join(["1"] * 40)],
         ["max_seq_len", "32"]),
        (["generate", "--target", d, "--draft", "none", "--max-seq-len", "32", "--max-new-tokens",
          "20", "--prompt-ids", ",".join(["1"] * 20)], ["max_new_tokens", "max_seq_len"]),
        (gen + ["--target", d, "--prompt-ids", "1,2,160"], ["160", "vocabulary"]),
        (gen + ["--target", d, "--prompt-ids=-1,2"], ["-1", "vocabulary"]),
        (gen + ["--target", d, "--prompt-ids", ""], ["empty"]),
        (["generate", "--target", d, "--draft", "none", "--prompt-ids", "1,2", "--max-new-tokens",
          "0"], ["max_new_tokens"]),
        (gen + ["--target", d, "hello"], ["tokenizer", "--prompt-ids"]),
        (gen + ["--target", d, "hello"] + ids, ["either"]),
        (["inspect", b["missing"]], ["not a directory"]),
        (["inspect", b["bad_json"]], ["not valid JSON"]),
        (["inspect", b["no_hidden"]], ["hidden_size"]),
        (["inspect", b["no_weights"]], ["no weights"]),
    ]
    usage = [  # argparse's own errors: exit 2 with a usage line, naming the argument
        (gen + ["--target", d, "--prompt-ids", "1,x"], ["--prompt-ids", "1,x"]),
        (gen + ["--target", d, "--max-new-tokens", "many"] + ids, ["--max-new-tokens"]),
        (gen + ["--target", d, "--backend", "onnx"] + ids, ["--backend", "onnx"]),
        (gen + ["--target", d, "--tree", "--chain"] + ids, ["--chain"]),
        (["frobnicate"], ["frobnicate"]),
        (["inspect"], ["path"]),
    ]
    # All of them in one process; a few again as real processes (exit status, console script).
    real = [
        (SCRIPT + errors[0][0], errors[0][1], error_problem),  # fails while loading
        (MODULE + errors[5][0], errors[5][1], error_problem),  # truncated weights
        (MODULE + errors[13][0], errors[13][1], error_problem),  # fails in generate
        (MODULE + usage[0][0], usage[0][1], usage_problem),
    ]
    with ThreadPoolExecutor(len(real) + 1) as pool:
        batched = pool.submit(run_batched, [a for a, _ in errors + usage] + [[]], env, home)
        procs = list(pool.map(lambda c: run(c[0], env), real))
        batched = batched.result()
    problems = [error_problem(p, w) for p, (_, w) in zip(batched, errors, strict=False)]
    problems += [usage_problem(p, w) for p, (_, w) in zip(batched[len(errors):-1], usage, strict=True)]
    problems += [check(p, w) for p, (_, w, check) in zip(procs, real, strict=True)]
    bare = batched[-1]  # no verb: the help, and exit 2
    if not (bare.returncode == 2 and "generate" in bare.stdout and "Traceback" not in bare.stderr):
        problems.append(show(bare))
    problems = [p for p in problems if p]
    assert not problems, "\n\n".join(problems)
