"""Corrupt and truncated files: every loader fails with one `Eagle3Error` line, never a crash.

For each file type eagle3 reads (a Hugging Face target directory's config.json, weights and
tokenizer files; a GGUF file; an EAGLE-3 head in official and speculators format; an exported
ExecuTorch program and its metadata), seeded corruptions -- truncation at chosen and random
offsets, random byte runs, and targeted edits of length / count / shape fields and config
values -- must either load a complete object that then generates (corrupt float weight bytes
legitimately load other weights) or raise `Eagle3Error` with one line naming the file. Any
other exception, or a process crash, fails. A few cases go through the CLI (exit 0 or 2, one
`eagle3: error:` line, no traceback).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType as Q

import eagle3
from conftest import make_hf_model
from eagle3.cli.inspection import inspect_path
from eagle3.draft import save_head
from eagle3.errors import Eagle3Error
from eagle3.targets import load_target
from gguf_files import write_gguf
from heads import random_head

V = 320
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
HINTS = ("re-download", "re-save", "re-convert", "re-export", "export again", "fix", "delete",
         "pass ", "re-quantize", "check ", "convert", "load it", "load with", "set ", "omit", "use ", "merge")
MESSAGES = [{"role": "user", "content": "hi"}]


def _bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world"] * 10,
                            trainer)
    return tok


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    """Good files, built once: a target dir (with tokenizer and chat template), a Q8_0 GGUF
    with a vocabulary, heads in official and speculators format."""
    root = tmp_path_factory.mktemp("pristine")
    hf = make_hf_model("llama", seed=1, vocab_size=V, num_hidden_layers=4)
    target = root / "target"
    hf.save_pretrained(target)
    tok = _bpe()
    tok.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}))
    (target / "chat_template.jinja").write_text(TEMPLATE)
    write_gguf(hf, str(root / "model.gguf"), qtype=Q.Q8_0, tokenizer=tok, chat_template=TEMPLATE)
    write_gguf(hf, str(root / "plain.gguf"), qtype=Q.F32)  # no vocabulary: fast loads
    t = load_target(str(target))
    for fmt in ("official", "speculators"):
        save_head(random_head(t, seed=2, taps=(1, 2, 3)), str(root / f"head_{fmt}"), fmt)
    return {"root": root, "target": target, "gguf": root / "model.gguf",
            "plain_gguf": root / "plain.gguf", "official": root / "head_official",
            "speculators": root / "head_speculators"}


# -- corruption -----------------------------------------------------------------------------

def truncations(size: int, rng: random.Random, n: int, marks: tuple[int, ...] = ()) -> Iterator[
        tuple[str, Callable[[bytes], bytes]]]:
    """Cuts at 0, 1, 7, 8, the `marks` (header end, data start, ...), size-1 and `n` random offsets."""
    cuts = sorted({0, 1, 7, 8, *(m for m in marks if 0 <= m < size), size - 1,
                   *(rng.randrange(size) for _ in range(n))})
    for c in cuts:
        yield f"truncate@{c}", lambda b, c=c: b[:c]


def byte_runs(size: int, rng: random.Random, n: int, lo: int = 0, hi: int | None = None) -> Iterator[
        tuple[str, Callable[[bytes], bytes]]]:
    """`n` corruptions, each 1..4 runs of 1..16 random bytes in [lo, hi)."""
    hi = size if hi is None else min(hi, size)
    for i in range(n):
        runs = []
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(lo, hi)
            runs.append((at, bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))))

        def edit(b: bytes, runs=runs) -> bytes:
            out = bytearray(b)
            for at, data in runs:
                out[at:at + len(data)] = data
            return bytes(out[:len(b)])

        yield f"bytes#{i}@{[r[0] for r in runs]}", edit


def put(at: int, fmt: str, value) -> Callable[[bytes], bytes]:
    """Overwrite the little-endian struct field at `at`."""
    def edit(b: bytes) -> bytes:
        data = struct.pack("<" + fmt, value)
        return b[:at] + data + b[at + len(data):]
    return edit


def json_edits(key_path: tuple[str, ...], values) -> Iterator[tuple[str, Callable[[bytes], bytes]]]:
    """Set (or, for `...`, delete) one JSON key to each of `values`."""
    for v in values:
        def edit(b: bytes, v=v) -> bytes:
            d = json.loads(b)
            node = d
            for k in key_path[:-1]:
                node = node.setdefault(k, {})
            if v is ...:
                node.pop(key_path[-1], None)
            else:
                node[key_path[-1]] = v
            return json.dumps(d).encode()
        yield f"{'.'.join(key_path)}={v!r}"[:80], edit


BAD_SIZES = ("abc", -1, 0, 1.5, None, True, [4], {"a": 1}, 10**9, 10**30, 7, float("inf"), float("nan"))


# -- the check --------------------------------------------------------------------------------

def check_error(e: Eagle3Error, where: Path) -> None:
    msg = str(e)
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    assert str(where) in msg or str(where.parent) in msg or where.name in msg, \
        f"message does not name {where}: {msg}"
    assert any(h in msg for h in HINTS), f"message says nothing to do: {msg}"


def exercise(spec) -> None:
    """A loaded object must be whole: a short generation (and the chat template) runs."""
    out = spec.generate([3, 5, 7], 4)
    assert len(out.token_ids) <= 4
    tok = spec.tokenizer
    if tok is not None:
        tok.decode(tok.encode("hello world"))
        if tok.has_chat_template():
            tok.apply_chat_template(MESSAGES)


def attempt(load: Callable[[], object], where: Path, use: Callable[[object], None] = exercise) -> str:
    """'error' (a proper Eagle3Error) or 'loaded' (and it works); anything else fails the test."""
    try:
        obj = load()
    except Eagle3Error as e:
        check_error(e, where)
        return "error"
    try:
        use(obj)
    except Eagle3Error as e:  # e.g. a garbage chat template: still a one-line user error
        check_error(e, where)
        return "error"
    return "loaded"


def fuzz(src: Path, rel: str, cases, load: Callable[[Path], Callable[[], object]],
         tmp: Path, *, inspect: bool = True, use: Callable[[object], None] = exercise) -> Counter:
    """Apply each case to a fresh copy of `src` (file `rel` inside it, or `src` itself when
    rel is ''), then load it (and `eagle3 inspect` it). Returns outcome counts."""
    counts: Counter = Counter()
    failures: list[str] = []
    original = (src / rel if rel else src).read_bytes()
    for i, (name, edit) in enumerate(cases):
        copy = tmp / f"c{i}{src.suffix}"
        if src.is_dir():
            shutil.copytree(src, copy)
        else:
            copy.write_bytes(b"")
        bad = copy / rel if rel else copy
        bad.write_bytes(edit(original))
        try:
            counts[attempt(load(copy), bad, use)] += 1
            if inspect:
                described = attempt(lambda c=copy: inspect_path(str(c)), bad, lambda info: None)
                counts["inspect-" + described] += 1
        except Exception as e:  # collect them all: one run shows every broken case
            frames = [f for f in traceback.extract_tb(e.__traceback__) if "eagle3" in f.filename]
            at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
            failures.append(f"{rel or src.name} {name}: {type(e).__name__}{at}: {str(e)[:300]}")
        finally:
            shutil.rmtree(copy, ignore_errors=True) if copy.is_dir() else copy.unlink()
    print(rel or src.name, dict(counts))
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)
    return counts


def target_loader(copy: Path) -> Callable[[], object]:
    return lambda: eagle3.load(str(copy), "none")


# -- Hugging Face target directories ----------------------------------------------------------

def _safetensors_marks(data: bytes) -> tuple[int, int]:
    n = struct.unpack("<Q", data[:8])[0]
    return 8 + n // 2, 8 + n


def test_safetensors_weights(pristine, tmp_path):
    src = pristine["target"]
    data = (src / "model.safetensors").read_bytes()
    rng = random.Random(1)
    header_end = _safetensors_marks(data)[1]
    header = json.loads(data[8:header_end])
    name = next(k for k in header if k != "__metadata__")

    def header_edit(fn):
        def edit(b: bytes) -> bytes:
            h = json.loads(b[8:header_end])
            fn(h)
            raw = json.dumps(h).encode().ljust(header_end - 8)
            return struct.pack("<Q", len(raw)) + raw + b[8 + len(raw):] if len(raw) == header_end - 8 \
                else struct.pack("<Q", len(raw)) + raw + b[header_end:]
        return edit

    targeted = [(f"header_len={n}", put(0, "Q", n))
                for n in (0, 1, 2**63 - 1, 2**64 - 1, 2**40, len(data), header_end - 9, header_end + 3)]
    targeted += [
        ("shape", header_edit(lambda h: h[name].update(shape=[10**6, 10**6]))),
        ("shape_small", header_edit(lambda h: h[name].update(shape=[3]))),
        ("dtype", header_edit(lambda h: h[name].update(dtype="I8"))),
        ("dtype_bad", header_edit(lambda h: h[name].update(dtype="Q9"))),
        ("offsets_swapped", header_edit(lambda h: h[name].update(
            data_offsets=h[name]["data_offsets"][::-1]))),
        ("offsets_out", header_edit(lambda h: h[name].update(data_offsets=[0, 2**50]))),
        ("drop_tensor", header_edit(lambda h: h.pop(name))),
    ]
    cases = [*truncations(len(data), rng, 12, _safetensors_marks(data)),
             *byte_runs(len(data), rng, 12, 0, header_end),  # inside the JSON header
             *byte_runs(len(data), rng, 8, header_end), *targeted]  # inside tensor data
    counts = fuzz(src, "model.safetensors", cases, target_loader, tmp_path)
    assert counts["error"] >= len(cases) - 10, counts  # most cuts and header edits are detected
    assert counts["loaded"] >= 1, counts  # bytes in float data load as other weights


def test_config_json(pristine, tmp_path):
    src = pristine["target"]
    data = (src / "config.json").read_bytes()
    rng = random.Random(2)
    cases = [*truncations(len(data), rng, 6), *byte_runs(len(data), rng, 10)]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "head_dim", "max_position_embeddings"):
        cases += json_edits((key,), BAD_SIZES)
    for key, values in (("rope_theta", ("abc", -1, 0, None, [1])),
                        ("rms_norm_eps", ("abc", -1.0, None, [1])),
                        ("rope_scaling", ("abc", 5, [1], {"rope_type": "llama3", "factor": "x"},
                                          {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1,
                                           "high_freq_factor": 1})),
                        ("model_type", (5, None, "gpt9", ["llama"])),
                        ("eos_token_id", ("x", [1, "y"], -5, 10**9, 1.5)),
                        ("bos_token_id", ("x", -5, 10**9)),
                        ("tie_word_embeddings", ("yes", True)), ("architectures", ("x", 5, [5])),
                        ("layer_types", ("x", 5, ["full_attention"], ["x"] * 4)),
                        ("sliding_window", ("x", -1, 0, 10**12, 3.5)),
                        ("hidden_act", (5, "relu", None)), ("attention_bias", ("x", 1))):
        cases += json_edits((key,), values)
    counts = fuzz(src, "config.json", cases, target_loader, tmp_path)
    assert counts["error"] >= len(cases) // 2, counts


@pytest.mark.parametrize("rel", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                 "generation_config.json"])
def test_tokenizer_and_side_files(pristine, tmp_path, rel):
    src = pristine["target"]
    data = (src / rel).read_bytes()
    rng = random.Random(3)
    cases = [*truncations(len(data), rng, 4), *byte_runs(len(data), rng, 6)]
    cases += [("not-utf8", lambda b: b"\xff\xfe" + b[2:]), ("list", lambda b: b"[1, 2]"),
              ("null", lambda b: b"null")]
    if rel == "tokenizer_config.json":
        cases += json_edits(("chat_template",), (5, ["x"], [{"name": "default", "template": 5}],
                                                 "{% if %}", "{{ raise_exception('no') }}", None))
        cases += json_edits(("bos_token",), (5, [1], {"content": 5}))
    if rel == "generation_config.json":
        cases += json_edits(("eos_token_id",), ("x", [1, "y"], -5, 10**9, [], True))
    # only the tokenizer files matter here: `eagle3 inspect` reads none of them
    counts = fuzz(src, rel, cases, target_loader, tmp_path, inspect=False)
    assert sum(counts.values()) == len(cases), counts


# -- GGUF ---------------------------------------------------------------------------------------

def _gguf_fields(path: Path) -> list[tuple[str, Callable[[bytes], bytes]]]:
    """Targeted edits of the length / count / type / dims / offset fields of a GGUF file."""
    r = gguf.GGUFReader(str(path))
    # header: magic, version u32, tensor count u64, kv count u64
    edits = [("version=99", put(4, "I", 99)), ("version=0", put(4, "I", 0))]
    for n in (0, 1, 2**63 - 1, 2**40, len(r.tensors) + 1):
        edits.append((f"tensor_count={n}", put(8, "Q", n)))
    for n in (0, 2**63 - 1, 2**40, len(r.fields)):
        edits.append((f"kv_count={n}", put(16, "Q", n)))
    arch = r.fields["general.architecture"].contents()
    for key in ("general.architecture", f"{arch}.embedding_length", f"{arch}.block_count",
                f"{arch}.attention.head_count", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.chat_template", "tokenizer.ggml.bos_token_id"):
        f = r.fields[key]
        at = f.offset
        key_len = len(key.encode())
        type_at = at + 8 + key_len
        value_at = type_at + 4
        edits.append((f"{key}:key_len=2**62", put(at, "Q", 2**62)))
        edits.append((f"{key}:type=77", put(type_at, "I", 77)))
        kind = f.types[0]
        if kind == gguf.GGUFValueType.STRING:
            for n in (2**62, 2**40, 10**6):
                edits.append((f"{key}:str_len={n}", put(value_at, "Q", n)))
        elif kind == gguf.GGUFValueType.ARRAY:
            edits.append((f"{key}:item_type=77", put(value_at, "I", 77)))
            for n in (2**62, 2**40, 10**6, 0):
                edits.append((f"{key}:array_len={n}", put(value_at + 4, "Q", n)))
            first = int(f.parts[f.data[0]].ctypes.data - f.parts[0].ctypes.data) + at \
                if f.types[-1] == gguf.GGUFValueType.STRING else None
            if first is not None:  # the first string's length: parts are (len, bytes) pairs
                edits.append((f"{key}:item_len=2**62", put(first - 8, "Q", 2**62)))
        else:
            for fmt, v in (("I", 0), ("I", 2**31), ("I", 2**32 - 1)):
                edits.append((f"{key}:value={v}", put(value_at, fmt, v)))
    for t in r.tensors[:3] + r.tensors[-2:]:
        at = t.field.offset
        name_len = len(t.name.encode())
        ndim_at = at + 8 + name_len
        n_dims = len(t.shape)
        dims_at = ndim_at + 4
        type_at = dims_at + 8 * n_dims
        off_at = type_at + 4
        edits += [(f"{t.name}:name_len=2**62", put(at, "Q", 2**62)),
                  (f"{t.name}:n_dims=0", put(ndim_at, "I", 0)),
                  (f"{t.name}:n_dims=9", put(ndim_at, "I", 9)),
                  (f"{t.name}:n_dims=2**31", put(ndim_at, "I", 2**31)),
                  (f"{t.name}:dim0=0", put(dims_at, "Q", 0)),
                  (f"{t.name}:dim0=2**40", put(dims_at, "Q", 2**40)),
                  (f"{t.name}:dim0=2**63", put(dims_at, "Q", 2**63)),
                  (f"{t.name}:dim0+32", put(dims_at, "Q", int(t.shape[0]) + 32)),
                  (f"{t.name}:dim-1=1", put(dims_at + 8 * (n_dims - 1), "Q", 1)),
                  (f"{t.name}:type=99", put(type_at, "I", 99)),
                  (f"{t.name}:type=F16", put(type_at, "I", 1)),
                  (f"{t.name}:type=Q4_K", put(type_at, "I", 12)),
                  (f"{t.name}:offset=2**40", put(off_at, "Q", 2**40)),
                  (f"{t.name}:offset=2**63", put(off_at, "Q", 2**63)),
                  (f"{t.name}:offset=3", put(off_at, "Q", 3))]
    return edits


def _gguf_marks(path: Path) -> tuple[int, ...]:
    r = gguf.GGUFReader(str(path))
    data_start = int(r.data_offset)
    return (24, r.fields["tokenizer.ggml.tokens"].offset, r.tensors[0].field.offset,
            data_start - 1, data_start, data_start + 5)


def gguf_loader(copy: Path) -> Callable[[], object]:
    return lambda: eagle3.load(str(copy), "none")


def test_gguf_file(pristine, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # tokenizers built per file
    src = pristine["gguf"]
    size = src.stat().st_size
    rng = random.Random(4)
    data_start = int(gguf.GGUFReader(str(src)).data_offset)
    cases = [*truncations(size, rng, 10, _gguf_marks(src)),
             *byte_runs(size, rng, 16, 0, data_start),  # metadata and tensor infos
             *byte_runs(size, rng, 6, data_start),  # tensor data (Q8_0 blocks)
             *_gguf_fields(src)]
    counts = fuzz(src, "", cases, gguf_loader, tmp_path)
    assert counts["error"] >= len(cases) // 2, counts
    assert counts["loaded"] >= 1, counts


# -- EAGLE-3 heads ------------------------------------------------------------------------------

def head_loader(pristine) -> Callable[[Path], Callable[[], object]]:
    return lambda copy: (lambda: eagle3.load(str(pristine["target"]), str(copy)))


@pytest.mark.parametrize("fmt", ["official", "speculators"])
def test_head_files(pristine, tmp_path, fmt):
    src = pristine[fmt]
    rng = random.Random(5)
    weights = (src / "model.safetensors").read_bytes()
    header_end = _safetensors_marks(weights)[1]
    cases = [*truncations(len(weights), rng, 6, _safetensors_marks(weights)),
             *byte_runs(len(weights), rng, 6, 0, header_end), *byte_runs(len(weights), rng, 3, header_end),
             ("header_len=2**63", put(0, "Q", 2**63 - 1))]
    counts = fuzz(src, "model.safetensors", cases, head_loader(pristine), tmp_path)
    cfg = (src / "config.json").read_bytes()
    layer = ("transformer_layer_config",) if fmt == "speculators" else ()
    ccases = [*truncations(len(cfg), rng, 4), *byte_runs(len(cfg), rng, 6)]
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "vocab_size", "head_dim", "max_position_embeddings", "num_hidden_layers"):
        ccases += json_edits((*layer, key), BAD_SIZES)
    ccases += json_edits(("draft_vocab_size",), BAD_SIZES)
    ccases += json_edits(("target_hidden_size",), BAD_SIZES)
    ccases += json_edits(("eagle_aux_hidden_state_layer_ids",), ("x", [1, "y"], [1, 2, 99], [-1, 0, 1],
                                                                 [10**12], {"a": 1}))
    ccases += json_edits((*layer, "rope_theta"), ("abc", -1, [1]))
    ccases += json_edits((*layer, "rope_scaling"), ("abc", [1], {"rope_type": "llama3", "factor": "x"}))
    ccases += json_edits((*layer, "rms_norm_eps"), ("abc", -1))
    if fmt == "speculators":
        ccases += json_edits(("transformer_layer_config",), ("x", None, [1]))
    counts += fuzz(src, "config.json", ccases, head_loader(pristine), tmp_path)
    assert counts["error"] >= (len(cases) + len(ccases)) // 2, counts


# -- the CLI ----------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "eagle3", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def check_cli_error(r: subprocess.CompletedProcess, where: Path) -> None:
    """Exit 2, one `eagle3: error:` line naming `where`, no traceback. Lines that torchao and
    torch print while being imported (optional CUDA kernels, pytree notices) are not eagle3's."""
    noise = ("torchao", "_pytree.py")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not any(n in ln for n in noise)]
    assert r.returncode == 2, (r.args, r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("eagle3: error: "), lines
    assert str(where) in lines[0], lines


def _corrupt_copy(src: Path, dst: Path, rel: str, edit: Callable[[bytes], bytes]) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst)
    f = dst / rel if rel else dst
    f.write_bytes(edit((src / rel if rel else src).read_bytes()))
    return dst


@pytest.mark.slow
def test_cli_reports_corrupt_files_in_one_line(pristine, tmp_path):
    p = pristine
    truncated = _corrupt_copy(p["target"], tmp_path / "cut", "model.safetensors", lambda b: b[:100])
    huge = _corrupt_copy(p["plain_gguf"], tmp_path / "huge.gguf", "", put(8, "Q", 2**63 - 1))
    gguf_cut = _corrupt_copy(p["plain_gguf"], tmp_path / "cut.gguf", "", lambda b: b[:len(b) // 2])
    cfg = _corrupt_copy(p["target"], tmp_path / "cfg", "config.json",
                        next(json_edits(("num_hidden_layers",), (10**9,)))[1])
    head = _corrupt_copy(p["speculators"], tmp_path / "head", "config.json",
                         next(json_edits(("transformer_layer_config", "hidden_size"), ("abc",)))[1])
    runs = [(["inspect", str(truncated)], truncated), (["inspect", str(huge)], huge),
            (["generate", "--target", str(gguf_cut), "--prompt-ids", "1,2", "--max-new-tokens", "4"],
             gguf_cut),
            (["generate", "--target", str(cfg), "hi", "--max-new-tokens", "4"], cfg),
            (["generate", "--target", str(p["target"]), "--draft", str(head), "hi",
              "--max-new-tokens", "4"], head)]
    for args, where in runs:
        check_cli_error(_cli(*args), where)


# -- exported ExecuTorch programs ---------------------------------------------------------------

@pytest.fixture(scope="module")
def program(pristine, tmp_path_factory) -> Path:
    """One tiny exported program (2 layers, short cache): lowering is the slow part (~50 s)."""
    from eagle3.export import export_program

    root = tmp_path_factory.mktemp("program")
    tdir = root / "target"
    make_hf_model("llama", seed=3, num_hidden_layers=2).save_pretrained(tdir)
    t = load_target(str(tdir), max_seq_len=32)
    save_head(random_head(t, seed=1, taps=(0, 1, 2)), str(root / "head"), "speculators")
    spec = eagle3.load(str(tdir), str(root / "head"), max_seq_len=32)
    export_program(spec, str(root / "program"), max_seq_len=32, max_draft_tokens=2, log=lambda m: None)
    return root / "program"


def program_loader(copy: Path) -> Callable[[], object]:
    return lambda: eagle3.load("none", backend="executorch", program=str(copy))


@pytest.mark.slow
def test_program_file(program, tmp_path):
    data = (program / "program.pte").read_bytes()
    rng = random.Random(6)
    # the extended header: magic "eh00" at 8, length, program size, segment base, segment size
    head = [(f"{name}={v}", put(at, "Q", v)) for name, at in (("program_size", 16),
                                                              ("segment_base", 24), ("segment_size", 32))
            for v in (0, 2**63 - 1, len(data), len(data) // 2)]
    head += [("magic", lambda b: b[:4] + b"XXXX" + b[8:]), ("eh_magic", lambda b: b[:8] + b"zz00" + b[12:])]
    program_size = struct.unpack("<Q", data[16:24])[0]
    cases = [*truncations(len(data), rng, 8, (24, 40, program_size // 2, program_size)),
             *byte_runs(len(data), rng, 16, 0, program_size),  # the flatbuffer
             *byte_runs(len(data), rng, 6, program_size), *head]  # segments (delegate blobs, weights)
    counts = fuzz(program, "program.pte", cases, program_loader, tmp_path, inspect=False)
    assert counts["error"] >= len(cases) // 2, counts


@pytest.mark.slow
def test_program_metadata(program, tmp_path):
    data = (program / "eagle3_program.json").read_bytes()
    rng = random.Random(7)
    cases = [*truncations(len(data), rng, 4), *byte_runs(len(data), rng, 6)]
    for key in ("max_seq_len", "max_draft_tokens", "vocab_size", "draft_vocab_size", "min_prefill_len"):
        cases += json_edits((key,), ("x", -1, 0, 1.5, None, True, [4], 10**12, ...))
    for key, values in (("taps", ("x", [1, "y"], [], None, 5, [10**12])),
                        ("eos_token_ids", (5, "x", ["a"], None, [-1], [10**12])),
                        ("methods", ("x", [], ["nope"], [5], None)),
                        ("format_version", (2, "1", None)), ("quantize", (5, [1], "int9")),
                        ("d2t", ("x", [1], None))):
        cases += json_edits((key,), values)
    counts = fuzz(program, "eagle3_program.json", cases, program_loader, tmp_path, inspect=False)
    assert counts["error"] >= len(cases) // 2, counts


@pytest.mark.slow
def test_cli_reports_a_corrupt_program_in_one_line(program, pristine, tmp_path):
    bad = _corrupt_copy(program, tmp_path / "prog", "program.pte", lambda b: b[:40] + b"\0" * 64 + b[104:])
    r = _cli("generate", "--target", "none", "--backend", "executorch", "--program", str(bad),
             "--prompt-ids", "1,2", "--max-new-tokens", "4")
    check_cli_error(r, bad)
