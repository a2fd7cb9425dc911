"""Real models and data by name: the registry, ShareGPT (cut file, fixed split), HumanEval, prompt sets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagle3.bench.prompts import read_prompt_records
from eagle3.errors import Eagle3Error
from eagle3.targets import named
from eagle3.train import sharegpt

EXE = os.path.join(os.path.dirname(sys.executable), "eagle3")


def _conv(i: int, first: str = "human") -> dict:
    return {"id": f"c{i}", "conversations": [{"from": first, "value": f"question {i}"},
                                              {"from": "gpt", "value": f"answer {i}"}]}


def test_sharegpt_reader_stops_at_the_cut_and_says_so(tmp_path, capsys):
    full = json.dumps([_conv(i) for i in range(5)])
    cut = full[:full.index('"c4"') + 10]  # mid-record, as the packaged file is
    path = tmp_path / "cut.json"
    path.write_text(cut)
    recs = sharegpt.read_sharegpt(str(path))
    assert [r["id"] for r in recs] == ["c0", "c1", "c2", "c3"]
    assert "cut off mid-record" in capsys.readouterr().err
    whole = tmp_path / "whole.json"
    whole.write_text(full)
    assert len(sharegpt.read_sharegpt(str(whole))) == 5
    assert "cut off" not in capsys.readouterr().err
    for bad in ("", "{}", "[{\"id\": "):
        path.write_text(bad)
        with pytest.raises(Eagle3Error):
            sharegpt.read_sharegpt(str(path))


def test_sharegpt_split_is_fixed_by_id_and_disjoint(tmp_path):
    convs = [_conv(i) for i in range(400)] + [_conv(900, first="gpt")]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(convs))
    train = sharegpt.sharegpt_prompts("train", path=str(path), quiet=True)
    held = sharegpt.sharegpt_prompts("heldout", path=str(path), quiet=True)
    ids_t, ids_h = {r["id"] for r in train}, {r["id"] for r in held}
    assert not ids_t & ids_h and len(ids_t) + len(ids_h) == 400  # the gpt-first record is skipped
    assert 0 < len(ids_h) < 30  # ~2%
    # Membership depends on the id alone: another order, the same split.
    path.write_text(json.dumps(convs[::-1]))
    assert {r["id"] for r in sharegpt.sharegpt_prompts("heldout", path=str(path), quiet=True)} == ids_h
    assert held[0]["messages"] == [{"role": "user", "content": f"question {held[0]['id'][1:]}"}]


def test_every_user_turn_is_a_prompt_up_to_the_first_broken_turn(tmp_path):
    turns = lambda *pairs: [{"from": f, "value": v} for f, v in pairs]
    recs = [{"id": "a", "conversations": turns(("human", "q1"), ("gpt", "a1"), ("human", "q2"),
                                                ("chatgpt", "a2"), ("human", "q3"))},
            {"id": "b", "conversations": turns(("human", "q1"), ("gpt", "a1"), ("gpt", "again"),
                                                ("human", "q2"))},  # a repeated role ends it
            {"id": "c", "conversations": turns(("human", "q1"), ("gpt", " "), ("human", "q2"))},
            {"id": "d", "conversations": turns(("system", "s"), ("human", "q1"))},
            {"id": "e", "conversations": []}]
    u, a = (lambda t: {"role": "user", "content": t}), (lambda t: {"role": "assistant", "content": t})
    assert sharegpt.user_turns(recs[0]) == [[u("q1")], [u("q1"), a("a1"), u("q2")],
                                            [u("q1"), a("a1"), u("q2"), a("a2"), u("q3")]]
    assert sharegpt.user_turns(recs[1]) == [[u("q1")]]
    assert sharegpt.user_turns(recs[2]) == [[u("q1")]]
    assert sharegpt.user_turns(recs[3]) == sharegpt.user_turns(recs[4]) == []
    path = tmp_path / "s.json"
    path.write_text(json.dumps(recs + [_conv(i) for i in range(300)]))
    rows = sharegpt.sharegpt_turns("train", path=str(path), quiet=True)
    held = {r["id"] for r in sharegpt.sharegpt_prompts("heldout", path=str(path), quiet=True)}
    assert held and not held & {r["id"] for r in rows}
    # Turn 0 of each conversation is the first-turn prompt `sharegpt_prompts` gives.
    first = {r["id"]: r["messages"] for r in sharegpt.sharegpt_prompts("train", path=str(path), quiet=True)}
    assert {r["id"]: r["messages"] for r in rows if r["turn"] == 0} == first
    assert [r["turn"] for r in rows if r["id"] == "a"] == [0, 1, 2]


def test_packaged_sharegpt_and_humaneval_sets():
    recs = sharegpt.read_sharegpt(quiet=True)
    assert len(recs) == 17671  # the packaged file's complete records before its cut
    held = read_prompt_records("sharegpt-heldout", 10)
    assert len(held) == 10 and all("messages" in r for _, r in held)
    held_ids = {w.split()[1] for w, _ in read_prompt_records("sharegpt-heldout", 10 ** 6)}
    assert all(sharegpt.is_heldout(i) for i in held_ids)
    he = read_prompt_records("humaneval", 200)
    assert len(he) == 164 and "def has_close_elements" in he[0][1]["prompt"]
    assert all("def " in r["prompt"] for _, r in he)
    with pytest.raises(Eagle3Error, match="--limit"):
        read_prompt_records("humaneval", 0)


def test_missing_model_package_names_the_pip_command(monkeypatch):
    fake = named.NamedModel("fake-1m", "no_such_package_eagle3", "pip install no-such-package", "x.gguf",
                            "MIT", "nowhere", False)
    monkeypatch.setitem(named.MODELS, "fake-1m", fake)
    with pytest.raises(Eagle3Error, match="pip install no-such-package"):
        named.resolve_target("fake-1m")
    rows = {r["name"]: r for r in named.describe_models()}
    assert rows["fake-1m"]["installed"] is False and rows["fake-1m"]["path"] is None
    assert named.resolve_target("some/dir") == "some/dir"


def test_models_command_lists_names_sources_licences():
    p = subprocess.run([EXE, "models", "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert set(rows) >= {"smollm2-135m-instruct", "gemma-3-270m"}
    assert rows["smollm2-135m-instruct"]["license"] == "Apache-2.0"
    assert "Gemma" in rows["gemma-3-270m"]["license"]
    for r in rows.values():
        assert r["installed"] == (r["path"] is not None)
    if rows["smollm2-135m-instruct"]["installed"]:
        assert rows["smollm2-135m-instruct"]["path"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
        assert os.path.isfile(rows["smollm2-135m-instruct"]["path"])


@pytest.mark.slow
def test_gemma_is_assembled_once_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = named.model_path("gemma-3-270m")
    assert path.startswith(str(tmp_path)) and os.path.getsize(path) > 100 << 20
    mtime = os.stat(path).st_mtime_ns
    assert named.model_path("gemma-3-270m") == path and os.stat(path).st_mtime_ns == mtime
    assert not [f for f in os.listdir(os.path.dirname(path)) if ".tmp" in f]


@pytest.mark.slow
def test_bench_on_named_prompt_sets(tmp_path):
    """`--prompts humaneval` benchmarks code completion; sharegpt-heldout needs a chat template."""
    out = tmp_path / "b.json"
    base = [EXE, "bench", "--limit", "2", "--max-new-tokens", "4", "--num-draft-tokens", "2",
            "--tree", "none", "--peers", "none", "--repeats", "1", "--threads", "1"]
    p = subprocess.run(base + ["--prompts", "humaneval", "--json", str(out)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    report = json.loads(out.read_text())
    assert report["outputs_identical"] is True and report["settings"]["prompts"] == 2
    p = subprocess.run(base + ["--prompts", "sharegpt-heldout"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 2 and "chat template" in p.stderr and p.stderr.count("\n") == 1, p.stderr
