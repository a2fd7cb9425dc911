"""eagle3 bench: interleaving, medians, the same-run correctness check, stats and time-split
accounting, the runner's host-sync counter, the report's keys, bad input, the CLI end to end.

No timing assertions: only structure and accounting. The target's attention changes its
output, and the head is scripted along its greedy runs of PROMPTS (tests/heads.py), so
acceptance is real and known (full).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eagle3
from eagle3.bench import harness, peers
from eagle3.bench.harness import Sample, interleave, run_bench, summarize
from eagle3.bench.report import markdown
from eagle3.cli.bench import main, parse_peers
from eagle3.decoding.profile import profiling
from eagle3.draft import save_head
from eagle3.speculator import Eagle3Speculator
from eagle3.targets import load_target
from heads import save_context_target, scripted_head

TOP_KEYS = {"baseline_tokens_per_s", "eagle_tokens_per_s", "speedup", "mean_accept_len",
            "accept_len_hist", "accepted_per_position", "outputs_identical", "best_k", "rows", "peers",
            "cost_model"}
ROW_KEYS = {"arm", "k", "tokens_per_s", "speedup", "mean_accept_len", "acceptance_rate",
            "accept_rate_per_position", "accepted_per_position", "accept_len_hist", "draft_ms_per_round",
            "verify_ms_per_round", "other_ms_per_round", "host_syncs_per_round", "outputs_identical",
            "draft_ms_per_draft_token", "draft_token_over_plain_step", "verify_over_plain_step"}
PROMPTS = [[5, 17, 3, 99, 42, 7], [11, 60, 23], [150, 4, 88, 31, 9, 77, 120]]
N = 20


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(target dir, head dir, prompts.jsonl): a context target and a full-acceptance head."""
    root = tmp_path_factory.mktemp("bench")
    target, head, prompts = str(root / "target"), str(root / "head"), str(root / "prompts.jsonl")
    save_context_target(target)
    save_head(scripted_head(load_target(target), PROMPTS, 64, "full"), head, "speculators",
              include_embedding=True)
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS)
    return target, head, prompts


@pytest.fixture(scope="module")
def spec(dirs):
    return eagle3.load(dirs[0], dirs[1])


# -- the harness ---------------------------------------------------------------------------------

def test_interleave_runs_the_arms_in_turn_for_each_prompt():
    calls = []
    arm = lambda name: lambda ids: calls.append((name, ids[0])) or Sample(list(ids), 1.0)  # noqa: E731
    samples = interleave({"A": arm("A"), "B": arm("B")}, [[1], [2]], repeats=3)
    warmup = [("A", 1), ("B", 1)]
    assert calls == warmup + [("A", 1), ("B", 1)] * 3 + [("A", 2), ("B", 2)] * 3
    assert [len(reps) for reps in samples["A"]] == [3, 3]  # samples[arm][prompt][rep]
    assert samples["B"][1][2].token_ids == [2]


def test_rows_take_the_median_over_repetitions():
    # Two prompts of 4 tokens, three repetitions: totals per repetition are 8 tokens in
    # 2, 3 and 11 seconds -> tokens/s 4, 2.67, 0.73 -> the median is 8/3.
    secs = [[1.0, 2.0, 10.0], [1.0, 1.0, 1.0]]
    samples = [[Sample([1, 2, 3, 4], s) for s in reps] for reps in secs]
    row = summarize(samples, samples)
    assert row["tokens_per_s"] == pytest.approx(8 / 3)
    assert row["seconds"] == pytest.approx(3.0)
    assert row["tokens"] == 8
    assert row["outputs_identical"] and row["mismatched_runs"] == 0
    assert "mean_common_prefix" not in row
    # A peer whose runs leave our path: how many leading tokens each run shared with ours.
    other = [[Sample([1, 2, 9, 4], s) for s in secs[0]], [Sample([7], s) for s in secs[1]]]
    row = summarize(other, samples)
    assert row["mismatched_runs"] == 6 and row["mean_common_prefix"] == pytest.approx(1.0)  # (2 + 0) / 2


def test_outputs_identical_catches_an_injected_mismatch(spec, monkeypatch):
    real = harness.generate_arm

    def corrupting(s, n, k=None, **kw):  # the K=2 arm corrupts its second timed run (warm-up = call 0)
        run, calls = real(s, n, k, **kw), []

        def arm(ids):
            out = run(ids)
            calls.append(1)
            if k == 2 and len(calls) == 3:
                out.token_ids[-1] = (out.token_ids[-1] + 1) % 160
            return out
        return arm

    monkeypatch.setattr(harness, "generate_arm", corrupting)
    bad_peer, peer_calls = real(spec, N, 1), []

    def peer(ids):
        peer_calls.append(1)
        out = bad_peer(ids)
        return Sample(out.token_ids[:-1] if len(peer_calls) == 4 else out.token_ids, out.seconds)

    report = run_bench(spec, PROMPTS[:2], ks=[1, 2], max_new_tokens=N, repeats=2, peers={"bad": peer})
    rows = {r["k"]: r for r in report["rows"]}
    assert rows[None]["outputs_identical"] and rows[1]["outputs_identical"]
    assert not rows[2]["outputs_identical"] and rows[2]["mismatched_runs"] == 1
    assert report["outputs_identical"] is False  # any row of ours failing fails the whole report
    assert report["peers"]["bad"]["mismatched_runs"] == 1
    assert "NO (1 runs; the first " in markdown(report)


def test_report_accounting_matches_generate_stats(spec, dirs):
    report = run_bench(spec, PROMPTS, ks=[1, 3, 5], max_new_tokens=N, repeats=2)
    assert TOP_KEYS <= set(report) and report["outputs_identical"] is True
    json.dumps(report)  # plain JSON types only
    plain, *rows = report["rows"]
    assert plain["k"] is None and plain["speedup"] == 1.0 and plain["draft_ms_per_round"] == 0.0
    assert plain["verify_over_plain_step"] == 1.0 and plain["draft_token_over_plain_step"] is None
    for row in rows:
        assert row["draft_token_over_plain_step"] == pytest.approx(
            row["draft_ms_per_draft_token"] / plain["verify_ms_per_round"])
        assert row["verify_over_plain_step"] == pytest.approx(
            row["verify_ms_per_round"] / plain["verify_ms_per_round"])
        assert ROW_KEYS <= set(row)
        stats = [spec.generate(p, N, num_draft_tokens=row["k"]).stats for p in PROMPTS]
        hist = [sum(c) for c in zip(*(s["accept_len_hist"] for s in stats))]
        per_pos = [sum(c) for c in zip(*(s["accepted_per_position"] for s in stats))]
        drafted = [sum(c) for c in zip(*(s["drafted_per_position"] for s in stats))]
        rounds = sum(s["rounds"] for s in stats)
        accepted = sum(s["accepted_tokens"] for s in stats)
        assert row["accept_len_hist"] == hist and row["accepted_per_position"] == per_pos
        assert row["rounds"] == rounds == sum(hist)
        assert row["mean_accept_len"] == pytest.approx(1 + accepted / rounds)
        assert row["acceptance_rate"] == 1.0  # the forced head agrees with the target everywhere
        assert row["drafted_per_position"] == drafted and sum(drafted) == row["draft_tokens"]
        assert drafted[0] == rounds and row["accept_rate_per_position"] == [1.0] * row["k"]
        assert row["draft_ms_per_round"] > 0 and row["verify_ms_per_round"] > 0
    best = next(r for r in rows if r["k"] == report["best_k"])
    assert report["eagle_tokens_per_s"] == best["tokens_per_s"]
    assert report["speedup"] == pytest.approx(best["tokens_per_s"] / report["baseline_tokens_per_s"])
    assert report["accept_len_hist"] == best["accept_len_hist"]
    cost = report["cost_model"]
    assert {"2", "4", "6"} <= set(cost["verify_cost_ratio"]) and cost["draft_step_over_target_forward"] > 0
    table = markdown(report)
    assert table.count("| EAGLE-3 K=") == 3 and "| plain (eagle3) |" in table

    no_head = run_bench(eagle3.load(dirs[0], "none"), PROMPTS[:1], ks=[1, 2], max_new_tokens=4, repeats=1)
    assert [r["k"] for r in no_head["rows"]] == [None] and no_head["best_k"] is None
    assert no_head["speedup"] is None and no_head["outputs_identical"] is True
    assert no_head["cost_model"] is None and "Best K" not in markdown(no_head)


def test_host_sync_counter_counts_the_runners_conversions(spec, monkeypatch):
    """Count every tensor -> Python conversion made in the round (round.py, drafting.py, accept.py),
    independently."""
    seen = []
    for name in ("tolist", "item", "__int__", "__bool__", "__index__", "__float__"):
        orig = getattr(torch.Tensor, name)

        def counting(self, *a, _orig=orig, **kw):
            if sys._getframe(1).f_code.co_filename.endswith(("decoding/round.py", "decoding/drafting.py",
                                                                   "decoding/accept.py")):
                seen.append(1)
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counting)

    plain = Eagle3Speculator(spec.target)
    for s, k in ((spec, 3), (spec, 1), (plain, None)):
        seen.clear()
        with profiling() as prof:
            r = s.generate(PROMPTS[0], N, num_draft_tokens=k, stop_token_ids=[])
        forwards = r.stats["target_forwards"]
        assert prof.host_syncs == len(seen) > 0
        if k is None:  # plain: one int(tok) per generated token
            assert prof.host_syncs == len(r.token_ids) == forwards and prof.draft_seconds == 0
        else:  # chain: int(tok) at prefill, one .tolist() per round
            assert prof.host_syncs == 1 + (forwards - 1)
            assert prof.draft_seconds > 0
        assert prof.prefill_seconds > 0 and prof.verify_seconds > 0
    # Off (the default), nothing is recorded and the stats keep their contract keys.
    r = spec.generate(PROMPTS[0], N, num_draft_tokens=3)
    assert set(r.stats) == {"rounds", "draft_tokens", "accepted_tokens", "accepted_per_position",
                            "drafted_per_position", "mean_accept_len", "accept_len_hist",
                            "target_forwards", "seconds", "num_draft_tokens", "suffix_rounds",
                            "suffix_draft_tokens", "suffix_accepted_tokens"}


# -- the command line ------------------------------------------------------------------------------

def err(capsys) -> str:
    e = capsys.readouterr().err.strip()
    assert "Traceback" not in e and e.count("\n") == 0, e
    return e


def test_bad_input_is_one_line_and_exit_2(dirs, tmp_path, capsys, monkeypatch):
    target, head, prompts = dirs
    base = ["bench", "--target", target, "--draft", head, "--max-new-tokens", "8"]
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "broken.jsonl").write_text('{"prompt_ids": [1, 2]}\n{oops\n')
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt_ids": [3] * 300}) + "\n")
    (tmp_path / "vocab.txt").write_text("text needs a tokenizer\n")
    cases = [
        (["--prompts", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--prompts", str(tmp_path / "empty.jsonl")], "holds no prompts"),
        (["--prompts", str(tmp_path / "broken.jsonl")], "broken.jsonl:2 is not valid JSON"),
        (["--prompts", str(tmp_path / "long.jsonl")], "long.jsonl:1: prompt (300 tokens)"),
        (["--prompts", str(tmp_path / "vocab.txt")], "tokenizer"),
        (["--num-draft-tokens", "0,2"], "--num-draft-tokens"),
        (["--num-draft-tokens", "a,b"], "--num-draft-tokens"),
        (["--num-draft-tokens", ""], "--num-draft-tokens"),
        (["--peers", "hf,ollama"], "unknown peer 'ollama'"),
        (["--quantize", "fp32,int3"], "quantize must be one of"),
        (["--peers", "assisted"], "needs --assistant"),
        (["--assistant", str(tmp_path)], "not a checkpoint directory"),
        (["--repeats", "0"], "--repeats"),
        (["--top-p", "0.9"], "add --temperature"),
        (["--temperature", "0.7", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--temperature", "0.7", "--top-k", "-1"], "top_k must be an integer"),
        (["--backend", "eager,executorch"], "needs --program"),
        (["--backend", "eager,native"], "--backend takes"),
        (["--backend", "gpu"], "--backend takes"),
    ]
    for extra, want in cases:
        assert main(base + extra) == 2, extra
        assert want in err(capsys), extra
    monkeypatch.setattr(peers, "available", lambda: False)
    assert main(base + ["--peers", "hf"]) == 2
    assert "need transformers" in err(capsys)
    notes: list[str] = []
    assert parse_peers(None, None, notes) == [] and "skipping the peers" in notes[0]
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0 and "--num-draft-tokens" in capsys.readouterr().out


def test_weight_formats_side_by_side_and_llama_cpp_skipped_with_a_note(dirs, tmp_path, capsys):
    target, head, prompts = dirs
    out = tmp_path / "formats.json"
    notes: list[str] = []
    # engine peers pass parsing; each is skipped with a note at run time when it cannot run
    # (vllm: tests/test_vllm_peer.py)
    assert parse_peers("llama.cpp,vllm", None, notes) == ["llama.cpp", "vllm"] and notes == []
    if peers.available():  # the spelling of the transformers peer
        assert parse_peers("llama.cpp,vllm,transformers", None, notes) == ["llama.cpp", "vllm", "hf"]
    rc = main(["bench", "--target", target, "--draft", head, "--prompts", prompts, "--limit", "2",
               "--max-new-tokens", "8", "--num-draft-tokens", "2", "--tree", "none", "--repeats", "1",
               "--quantize", "fp32,int4", "--peers", "llama.cpp", "--json", str(out)])
    assert rc == 0
    # the target is a checkpoint directory, not a GGUF file (or llama.cpp is not built)
    assert "skipping llama.cpp:" in capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["settings"]["backends"] == ["eager:fp32", "eager:int4"]
    assert report["settings"]["weight_formats"] == {"eager:fp32": "float32", "eager:int4": "int4-g32"}
    assert {r["backend"] for r in report["rows"]} == {"eager:fp32", "eager:int4"}
    assert report["outputs_identical"] is True  # each format against its own plain decoding
    assert report["peers"] == {}


@pytest.mark.slow
def test_cli_end_to_end_with_peers_json_and_plots(dirs, tmp_path):
    target, head, prompts = dirs
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    cmd = [sys.executable, "-m", "eagle3", "bench", "--target", target, "--draft", head,
           "--prompts", prompts, "--max-new-tokens", "16", "--num-draft-tokens", "1,4", "--repeats", "2",
           "--peers", "hf,lookup", "--json", str(out), "--plots", str(plots)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=env)
    assert p.returncode == 0, p.stderr
    assert "| EAGLE-3 K=4 |" in p.stdout and "| transformers prompt lookup |" in p.stdout
    report = json.loads(out.read_text())
    assert TOP_KEYS <= set(report) and report["outputs_identical"] is True
    assert report["best_k"] in (1, 4) and report["mean_accept_len"] > 1.5
    assert set(report["peers"]) == {"hf", "lookup"}
    for peer in report["peers"].values():
        assert peer["outputs_identical"] is True and peer["tokens_per_s"] > 0 and peer["speedup"] > 0
    for name in ("speedup.png", "acceptance.png", "accept_hist.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tree_and_sampled_rows(spec):
    from eagle3.decoding.tree import TreeShape

    shape = TreeShape(2, 4, 8)
    report = run_bench(spec, PROMPTS[:2], ks=[2], max_new_tokens=N, repeats=2, trees=[shape],
                       temperature=1.0, top_p=0.9, top_k=20)
    tree_row = next(r for r in report["rows"] if r.get("tree"))
    assert tree_row["tree"] == shape.as_dict() and tree_row["outputs_identical"]
    # Independently: the same generations' stats, summed.
    stats = [spec.generate(p, N, tree=shape).stats for p in PROMPTS[:2]]
    assert tree_row["accepted_tokens"] == sum(s["accepted_tokens"] for s in stats)
    assert tree_row["draft_tokens"] == sum(s["draft_tokens"] for s in stats)
    names = [(r["arm"], r["k"], r["tree"]) for r in report["sampled_rows"]]
    assert names == [("plain", None, None), ("eagle3", "auto", None), ("eagle3", None, shape.as_dict())]
    for r in report["sampled_rows"]:
        assert r["outputs_identical"] is None and (r["temperature"], r["top_p"], r["top_k"]) == (1.0, 0.9, 20)
    assert report["sampled_rows"][0]["speedup"] == 1.0
    assert report["outputs_identical"]  # greedy rows only
    text = markdown(report)
    assert "EAGLE-3 tree 2x4x8 |" in text and "EAGLE-3 tree 2x4x8, sampled T=1 top-p 0.9 top-k 20 |" in text
    assert "n/a (sampled)" in text


def test_parse_trees():
    from eagle3.cli.bench import parse_trees
    from eagle3.decoding.tree import DEFAULT_TREE, TreeShape
    from eagle3.errors import Eagle3Error

    assert parse_trees("default,4x8x48") == [DEFAULT_TREE, TreeShape(4, 8, 48)]
    assert parse_trees("none") == []
    for bad in ("4x8", "ax2x3", "1x3x4"):
        with pytest.raises(Eagle3Error):
            parse_trees(bad)


# -- the serving benchmark (--concurrency) ----------------------------------------------------------------

def test_concurrency_bench_reports_both_modes_per_concurrency(spec):
    from eagle3.bench.serving import markdown_concurrency, run_concurrency_bench

    prompts = PROMPTS * 2
    report = run_concurrency_bench(spec, prompts, [1, 3], max_new_tokens=12, repeats=2, num_draft_tokens=3)
    assert TOP_KEYS - {"best_k", "rows", "peers", "cost_model"} <= set(report)
    assert [row["concurrency"] for row in report["concurrency"]] == [1, 3]
    for row in report["concurrency"]:
        assert row["plain"]["speculation"] is False and row["eagle"]["speculation"] is True
        assert row["outputs_identical"] is True and row["plain"]["outputs_identical"] is True
        assert row["speedup"] == row["eagle"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
        eagle = row["eagle"]
        # the full-acceptance head: every counted draft accepted; 2 repetitions x 6 prompts x 11 tokens
        # after the prefill token, K=3 rounds emit 4 tokens, the last ones fewer
        assert eagle["mean_accept_len"] > 3 and eagle["accept_len_hist"][0] == 0
        hist = eagle["accept_len_hist"]
        assert sum(eagle["accepted_per_position"]) == sum(i * n for i, n in enumerate(hist))
        assert row["plain"]["mean_accept_len"] is None and row["plain"]["ttft_ms_median"] > 0
    assert max(int(b) for b in report["concurrency"][1]["eagle"]["rounds_by_batch_and_k"]) == 3
    text = markdown_concurrency(report)
    assert "| 3 | on |" in text and "| 1 | off |" in text


@pytest.mark.slow
def test_cli_concurrency_json(dirs, tmp_path, capsys):
    target, head, prompts = dirs
    out = tmp_path / "serve.json"
    assert main(["bench", "--target", target, "--draft", head, "--prompts", prompts, "--max-new-tokens", "10",
                 "--concurrency", "1,2", "--repeats", "1", "--json", str(out), "--plots", str(tmp_path)]) == 0
    report = json.loads(out.read_text())
    png = (tmp_path / "latency_throughput.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000  # drawn, not an empty canvas
    for row in report["concurrency"]:
        for mode in ("plain", "eagle"):
            r = row[mode]
            assert r["e2e_s_p90"] >= r["e2e_s_median"] > 0 and r["requests_per_s"] > 0
    assert report["mode"] == "concurrency" and report["outputs_identical"] is True
    assert report["settings"]["num_draft_tokens"] == "auto"
    assert report["concurrency"][1]["eagle"]["batch_costs_ms"]["verify_ms"].keys() == {"1", "2"}
    for bad, want in ((["--draft", head, "--concurrency", "0,2"], "--concurrency"),
                      (["--draft", head, "--concurrency", "x"], "--concurrency"),
                      (["--draft", head, "--concurrency", "2", "--backend", "hf"], "eager native backend"),
                      (["--draft", "none", "--concurrency", "2"], "needs a draft head")):
        assert main(["bench", "--target", target, "--prompts", prompts] + bad) == 2, bad
        assert want in err(capsys), bad


@pytest.mark.slow
def test_cli_memory_report(dirs, tmp_path):
    """--memory: a fresh process's load time and peak RSS, with the KV cache's bytes as the
    target's shapes give them (k and v, every layer, every position, fp32)."""
    target, head, prompts = dirs
    out = tmp_path / "mem.json"
    assert main(["bench", "--target", target, "--draft", head, "--prompts", prompts, "--max-new-tokens", "8",
                 "--num-draft-tokens", "2", "--tree", "none", "--repeats", "1", "--peers", "none",
                 "--memory", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    row = report["memory"]["eagle3 float32"]  # "auto" on a safetensors checkpoint
    cfg = json.loads((Path(target) / "config.json").read_text())
    hcfg = json.loads((Path(head) / "config.json").read_text())["transformer_layer_config"]

    def per_position(c: dict) -> float:  # k and v of one layer, fp32, MiB
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return 2 * c["num_key_value_heads"] * head_dim * 4 / 2 ** 20

    n = row["max_seq_len"]
    target_kv = cfg["num_hidden_layers"] * per_position(cfg) * n
    # the head's one layer holds the context plus room for a round's drafts (a tree's scratch)
    head_kv = per_position(hcfg)
    assert target_kv + head_kv * n <= row["kv_cache_mb"] <= target_kv + head_kv * (n + 512)
    files = sum(f.stat().st_size for d in (target, head) for f in Path(d).glob("*.safetensors")) / 2 ** 20
    assert 0.5 * files < row["weights_mb"] < 2.5 * files
    assert 0 < row["import_rss_mb"] <= row["peak_rss_mb"] and 0 < row["load_s"] < 60
    assert 0 < row["calibrate_s"] < row["load_s"]  # with a head, load measures the cost model
    need = row["weights_mb"] + row["kv_cache_mb"]
    assert row["peak_over_need"] == pytest.approx(row["peak_rss_mb"] / need)
