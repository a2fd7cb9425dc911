"""The A/B harness: interleaved repetitions, medians, correctness in the same run, a cost model.

Every decoding variant is an *arm*: a function prompt ids -> `Sample`. For each
prompt, the arms run in turn, `repeats` times (A B C A B C ...), after one
untimed warm-up pass over the first prompt. Each repetition `r` gives a total
over all prompts (tokens, seconds, phase seconds); a row reports the median
over repetitions. Every sample's tokens are compared with plain decoding's for
the same prompt and repetition (`outputs_identical`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

import torch

from ..decoding.profile import Profile, profiling
from ..decoding.sampling import SamplingParams
from ..decoding.types import Plan
from ..kernels import cpu_name, isa

PLAIN = "plain"


@dataclass
class Sample:
    """One timed generation: its tokens, wall seconds, and (eagle3's own arms only) stats and profile."""

    token_ids: list[int]
    seconds: float
    stats: dict | None = None
    profile: Profile | None = None


Arm = Callable[[list[int]], Sample]


def generate_arm(spec: Any, max_new_tokens: int, k: int | str | None = None, tree: Any = None,
                 sampling: SamplingParams | None = None, proposer: str | None = None) -> Arm:
    """An arm of eagle3's own: `spec.generate` (chain drafts of K = k, a `tree` shape, or plain
    when `spec` has no head; drafts by `proposer`, None: the default), profiled. Sampled arms
    (`sampling`: temperature > 0, top-p, top-k) seed call n with n."""
    calls = iter(range(1 << 62))
    s = sampling or SamplingParams()

    def run(ids: list[int]) -> Sample:
        with profiling() as prof:
            t0 = time.perf_counter()
            r = spec.generate(ids, max_new_tokens, num_draft_tokens=k, tree=tree,
                              temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              seed=None if s.greedy else next(calls), proposer=proposer)
            seconds = time.perf_counter() - t0
        return Sample(r.token_ids, seconds, r.stats, prof)
    return run


def tree_name(shape: Any) -> str:
    return f"tree {shape.top_k}x{shape.depth}x{shape.total_tokens}"


def sampling_name(s: SamplingParams) -> str:
    """'T=0.7', with ' top-p 0.95' and ' top-k 40' where they are on."""
    return (f"T={s.temperature:g}" + (f" top-p {s.top_p:g}" if s.top_p < 1.0 else "")
            + (f" top-k {s.top_k}" if s.top_k else ""))


def interleave(arms: dict[str, Arm], prompts: list[list[int]], repeats: int,
               warmup: bool = True, progress: bool = False) -> dict[str, list[list[Sample]]]:
    """Run every arm on every prompt `repeats` times, interleaved; returns samples[arm][prompt][rep]."""
    from tqdm import tqdm

    if warmup:
        for arm in arms.values():
            arm(prompts[0])
    samples: dict[str, list[list[Sample]]] = {name: [] for name in arms}
    bar = tqdm(total=len(prompts) * repeats * len(arms), desc="bench", unit="run", disable=not progress)
    for ids in prompts:
        for name in arms:
            samples[name].append([])
        for _ in range(repeats):
            for name, arm in arms.items():
                samples[name][-1].append(arm(ids))
                bar.update(1)
    bar.close()
    return samples


def _per_rep(samples: list[list[Sample]], value: Callable[[Sample], float]) -> list[float]:
    """Totals over prompts, one per repetition."""
    return [sum(value(reps[r]) for reps in samples) for r in range(len(samples[0]))]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Leading tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(samples: list[list[Sample]], plain: list[list[Sample]] | None) -> dict[str, Any]:
    """A row for one arm: median tokens/s, correctness vs `plain` (None for sampled arms, whose
    outputs differ by design), speculation stats, time split."""
    tokens = _per_rep(samples, lambda s: len(s.token_ids))
    seconds = _per_rep(samples, lambda s: s.seconds)
    mismatched = None if plain is None else sum(
        s.token_ids != p.token_ids for reps, preps in zip(samples, plain) for s, p in zip(reps, preps))
    row: dict[str, Any] = {
        "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds)),
        "tokens": int(statistics.median(tokens)), "seconds": statistics.median(seconds),
        "outputs_identical": None if plain is None else mismatched == 0,
        "mismatched_runs": mismatched}
    if mismatched:  # how far a different arithmetic (a peer's) stays on our plain decoding's path
        row["mean_common_prefix"] = statistics.mean(
            common_prefix(s.token_ids, p.token_ids) for reps, preps in zip(samples, plain)
            for s, p in zip(reps, preps))
    if samples[0][0].stats is None:
        return row  # a peer: no stats of ours
    if samples[0][0].stats.get("peer_counts"):  # an engine peer's EAGLE-3 (llama.cpp, vLLM): its counts
        first = [reps[0].stats for reps in samples]
        rounds = sum(s["rounds"] for s in first)
        drafted, accepted = (sum(s[k] for s in first) for k in ("draft_tokens", "accepted_tokens"))
        row.update(rounds=rounds, draft_tokens=drafted, accepted_tokens=accepted,
                   mean_accept_len=(accepted + rounds) / rounds if rounds else 1.0,
                   acceptance_rate=accepted / drafted if drafted else None)
        return row
    # Speculation counts: greedy decoding is deterministic, so one repetition (the first) tells
    # all; sampled runs differ, so they count every repetition.
    first = ([reps[0].stats for reps in samples] if plain is not None else
             [s.stats for reps in samples for s in reps])
    total = lambda key: sum(s[key] for s in first)  # noqa: E731
    rounds, drafted, accepted = total("rounds"), total("draft_tokens"), total("accepted_tokens")
    # Summed position by position; runs differ in length (a deeper round in one prompt only).
    per_pos = [sum(c) for c in zip_longest(*(s["accepted_per_position"] for s in first), fillvalue=0)]
    drafted_pos = [sum(c) for c in zip_longest(*(s.get("drafted_per_position", []) for s in first),
                                               fillvalue=0)]
    row.update(
        rounds=rounds, draft_tokens=drafted, accepted_tokens=accepted,
        target_forwards=total("target_forwards"),
        mean_accept_len=1.0 + accepted / rounds if rounds else 1.0,
        acceptance_rate=accepted / drafted if drafted else None,
        accepted_per_position=per_pos, drafted_per_position=drafted_pos,
        accept_rate_per_position=[a / d if d else None for a, d in zip(per_pos, drafted_pos)],
        accept_len_hist=[sum(c) for c in zip_longest(*(s["accept_len_hist"] for s in first), fillvalue=0)])
    # Tokens per target forward (prefill included): tau counts drafting rounds only, and rows
    # whose drafts come and go (the text's) draft in some rounds only.
    row["tokens_per_target_forward"] = (sum(len(reps[0].token_ids) for reps in samples)
                                        / max(1, sum(reps[0].stats["target_forwards"] for reps in samples)))
    # Per source (`decoding.suffix`): tokens only the text proposed, and the head's own.
    suffix_accepted = sum(s.get("suffix_accepted_tokens", 0) for s in first)
    row.update(suffix_rounds=sum(s.get("suffix_rounds", 0) for s in first),
               suffix_draft_tokens=sum(s.get("suffix_draft_tokens", 0) for s in first),
               suffix_accepted_tokens=suffix_accepted, head_accepted_tokens=accepted - suffix_accepted)
    # Per round (= per target forward after the prefill): medians over repetitions.
    steps = _per_rep(samples, lambda s: s.stats["target_forwards"] - 1)

    def per_round(value: Callable[[Sample], float], scale: float = 1e3) -> float:
        return statistics.median(scale * x / max(n, 1) for x, n in zip(_per_rep(samples, value), steps))

    row.update(
        draft_ms_per_round=per_round(lambda s: s.profile.draft_seconds),
        verify_ms_per_round=per_round(lambda s: s.profile.verify_seconds),
        other_ms_per_round=per_round(lambda s: s.seconds - s.profile.prefill_seconds
                                     - s.profile.draft_seconds - s.profile.verify_seconds),
        host_syncs_per_round=per_round(lambda s: s.profile.host_syncs, scale=1.0),
        # The head's drafting per token it drafted (catch-ups included; the text's nodes cost no
        # draft forward), a median over repetitions.
        draft_ms_per_draft_token=statistics.median(
            1e3 * d / max(n, 1) for d, n in zip(
                _per_rep(samples, lambda s: s.profile.draft_seconds),
                _per_rep(samples, lambda s: s.stats["draft_tokens"] - s.stats.get("suffix_draft_tokens", 0)),
                strict=True)),
        prefill_ms=1e3 * statistics.median(_per_rep(samples, lambda s: s.profile.prefill_seconds))
        / len(samples))
    return row


def cost_model(spec: Any) -> Any:
    """The speculator's cost model (`Eagle3Speculator.calibrate`), measured on its backend as
    configured (compiled steps when enabled). Needs a head."""
    return spec.calibrate()


def run_bench(spec: Any, prompts: list[list[int]], *, ks: list[int], max_new_tokens: int,
              repeats: int, peers: dict[str, Arm] | None = None, auto: bool = False,
              trees: list[Any] = (), temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
              progress: bool = False, backends: dict[str, Any] | None = None,
              proposers: list[str | None] = (None,)) -> dict[str, Any]:
    """Plain decoding vs EAGLE-3 chain for each K and each tree shape (and `peers`),
    interleaved; returns the report.

    `auto` adds a row for num_draft_tokens='auto' (its `chosen_k`: the K it chose last).
    `temperature` > 0 adds sampled rows (plain, chain K=auto, each tree; with `top_p` and
    `top_k` where given) whose speedup is against sampled plain decoding; their outputs differ
    from greedy's by design (`outputs_identical` None), their losslessness is a distribution
    (tests/test_sampling.py).
    `backends` {name: speculator} adds, for each further backend (an exported program),
    its own plain and chain rows (trees and sampling where the backend has them), all
    interleaved in the same run; rows carry `backend`, `speedup` is against the first
    backend's plain decoding and `speedup_vs_backend_plain` against the row's own, each
    row's `outputs_identical` compares it with its own backend's plain decoding (the
    further backends' plain rows say in `matches_first_backend_plain` whether they equal
    the first's), and `cost_models` holds each backend's cost model.

    The report's top-level contract keys describe the fastest fixed-K row of any backend
    (`best_k`, `best_backend`) against the first backend's plain decoding;
    `outputs_identical` there is True only if every row of ours matched plain.

    `proposers` (`decoding.suffix`): the chain and tree rows once per proposer ('eagle',
    'hybrid'; None: the default, unnamed rows), 'suffix' one row of its own (no head, k None);
    each row says its `proposer` and its accepted tokens per source.
    """
    backends = dict(backends or {"eager": spec})
    names = list(backends)
    multi = len(names) > 1
    chosen = [k for k in ks] + (["auto"] if auto else [])
    arms = _BenchArms(multi, max_new_tokens, SamplingParams(temperature, top_p, top_k))
    for b, bspec in backends.items():
        arms.add_backend(b, bspec, chosen, trees, proposers)
    arms.arms.update(peers or {})
    # Calibrated before any timing: the automatic rows need it, and it must not land in a row.
    models = {b: cost_model(bspec) for b, bspec in backends.items() if bspec.draft is not None}
    samples = interleave(arms.arms, prompts, repeats, progress=progress)
    plain = samples[arms.label(names[0], PLAIN)]
    rows = _greedy_rows(arms, samples, names[0])
    base = rows[0]["tokens_per_s"]
    costs = {b: {**m.cost_ratios(), **m.as_dict()} for b, m in models.items()}
    _add_comparisons(rows, models, names[0], multi)
    sampled_rows = _sampled_rows(arms, samples)
    peer_rows = {name: summarize(samples[name], plain) for name in peers or {}}
    for row in peer_rows.values():
        row["speedup"] = row["tokens_per_s"] / base
    report = _headline(rows, names[0])
    report.update({
        "rows": rows, "sampled_rows": sampled_rows, "peers": peer_rows,
        "cost_model": costs.get(names[0]), "cost_models": costs,
        "settings": {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "repeats": repeats,
                     "num_draft_tokens": chosen if spec.draft is not None else [],
                     "backends": names,
                     "trees": [t.as_dict() for t in trees], "temperature": temperature,
                     "top_p": top_p, "top_k": top_k,
                     "prompt_tokens": [len(p) for p in prompts], "torch_threads": torch.get_num_threads(),
                     "kernel_isa": isa(), "cpu": cpu_name()},
    })
    return report


class _BenchArms:
    """The arms of a run, in the order they take turns, and the rows they become: `greedy`
    (backend, arm name, k, tree, proposer) and `sampled` (backend, arm name, k, tree)."""

    def __init__(self, multi: bool, max_new_tokens: int, sampling: SamplingParams) -> None:
        self.multi, self.max_new_tokens, self.sampling = multi, max_new_tokens, sampling
        self.arms: dict[str, Arm] = {}
        self.greedy: list[tuple[str, str, Any, Any, str | None]] = []
        self.sampled: list[tuple[str, str, Any, Any]] = []

    def label(self, backend: str, arm: str) -> str:
        """An arm's name: prefixed by its backend when there are several."""
        return f"{backend} {arm}" if self.multi else arm

    def add_backend(self, b: str, bspec: Any, chosen: list[Any], trees: list[Any],
                    proposers: list[str | None]) -> None:
        """Backend `b`'s arms: plain, then each proposer's chains and trees, then the sampled ones."""
        plain_spec = bspec.plain()  # like for like: the same backend (compiled steps, a program)
        self._greedy(b, PLAIN, generate_arm(plain_spec, self.max_new_tokens), None, None, None)
        exported = getattr(bspec, "program_dir", None) is not None  # greedy chains only
        for pr in proposers if not exported else (None,):
            self._add_proposer(b, bspec, pr, chosen, trees if not exported else (), exported)
        if not self.sampling.greedy and not exported:
            self._add_sampled(b, bspec, plain_spec, trees)

    def _greedy(self, b: str, arm: str, run: Arm, k: Any, tree: Any, proposer: str | None) -> None:
        self.arms[self.label(b, arm)] = run
        self.greedy.append((b, self.label(b, arm), k, tree, proposer))

    def _add_proposer(self, b: str, bspec: Any, pr: str | None, chosen: list[Any], trees: Any,
                      exported: bool) -> None:
        """One proposer's rows: 'suffix' one plain-headed row, the others a chain per K and each tree."""
        n = self.max_new_tokens
        if pr == "suffix":
            self._greedy(b, "suffix", generate_arm(bspec, n, proposer="suffix"), None, None, pr)
            return
        if bspec.draft is None:
            return
        prefix = "" if pr is None else f"{pr} "
        for k in chosen:
            if exported and isinstance(k, int) and k > bspec.max_draft_tokens:
                continue
            self._greedy(b, f"{prefix}K={k}", generate_arm(bspec, n, k, proposer=pr), k, None, pr)
        for t in trees:
            self._greedy(b, prefix + tree_name(t), generate_arm(bspec, n, tree=t, proposer=pr), None, t, pr)

    def _add_sampled(self, b: str, bspec: Any, plain_spec: Any, trees: list[Any]) -> None:
        """Sampled plain decoding, then (with a head) chain K=auto and each tree, at `self.sampling`."""
        how = sampling_name(self.sampling)
        name = self.label(b, f"sampled plain {how}")
        self.sampled.append((b, name, None, None))
        self.arms[name] = generate_arm(plain_spec, self.max_new_tokens, sampling=self.sampling)
        if bspec.draft is None:
            return
        for k, t in [("auto", None)] + [(None, t) for t in trees]:
            name = self.label(b, f"sampled {'K=auto' if t is None else tree_name(t)} {how}")
            self.sampled.append((b, name, k, t))
            self.arms[name] = generate_arm(bspec, self.max_new_tokens, k, t, self.sampling)


def _greedy_rows(arms: _BenchArms, samples: dict[str, list[list[Sample]]], first: str) -> list[dict]:
    """A row per greedy arm, each compared with its own backend's plain decoding."""
    plain = samples[arms.label(first, PLAIN)]
    rows = []
    for b, name, k, t, pr in arms.greedy:
        row = {"arm": "plain" if name.endswith(PLAIN) and k is None and t is None else "eagle3", "k": k}
        if pr is not None:
            row["proposer"] = pr
        if t is not None:
            row["tree"] = t.as_dict()
        if arms.multi:
            row["backend"] = b
        # Lossless means equal to the same backend's plain decoding: a quantized program is
        # another model. Whether a backend's plain decoding equals the first's is reported apart.
        own_plain = samples[arms.label(b, PLAIN)]
        rows.append({**row, **summarize(samples[name], own_plain)})
        if arms.multi and row["arm"] == "plain" and b != first:
            rows[-1]["matches_first_backend_plain"] = summarize(samples[name], plain)["outputs_identical"]
        if k == "auto":
            rows[-1]["chosen_k"] = samples[name][-1][-1].stats["num_draft_tokens"]
    return rows


def _add_comparisons(rows: list[dict], models: dict[str, Any], first: str, multi: bool) -> None:
    """Each row's speedup against the first backend's plain decoding (and its own's), its verify
    and draft costs in plain steps of this run, and the cost model's predicted speedup."""
    base = rows[0]["tokens_per_s"]
    backend_plain = {r.get("backend"): r["tokens_per_s"] for r in rows if r["arm"] == "plain"}
    # A plain step: the target forward of the backend's plain decoding, in this run.
    plain_step = {r.get("backend"): r["verify_ms_per_round"] for r in rows if r["arm"] == "plain"}
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / base
        step = plain_step[row.get("backend")]
        row["verify_over_plain_step"] = row["verify_ms_per_round"] / step if step else None
        row["draft_token_over_plain_step"] = (row["draft_ms_per_draft_token"] / step
                                              if step and row["draft_tokens"] else None)
        if multi:
            row["speedup_vs_backend_plain"] = row["tokens_per_s"] / backend_plain[row["backend"]]
        model = models.get(row.get("backend", first))
        row["predicted_speedup"] = (model.predicted_speedup(row["mean_accept_len"], Plan(row["k"]))
                                    if isinstance(row["k"], int) and model else None)


def _sampled_rows(arms: _BenchArms, samples: dict[str, list[list[Sample]]]) -> list[dict]:
    """A row per sampled arm; speedups against the latest sampled plain decoding (its backend's)."""
    sampled_rows = []
    s = arms.sampling
    for b, name, k, t in arms.sampled:
        first = name == arms.label(b, f"sampled plain {sampling_name(s)}")
        sampled_rows.append({"arm": "plain" if first else "eagle3", "k": k,
                             "tree": t.as_dict() if t is not None else None,
                             "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                             **({"backend": b} if arms.multi else {}),
                             **summarize(samples[name], None)})
        sampled_base = [r for r in sampled_rows if r["arm"] == "plain"][-1]["tokens_per_s"]
        sampled_rows[-1]["speedup"] = sampled_rows[-1]["tokens_per_s"] / sampled_base
        if k == "auto":
            sampled_rows[-1]["chosen_k"] = samples[name][-1][-1].stats["num_draft_tokens"]
    return sampled_rows


def _headline(rows: list[dict], first: str) -> dict[str, Any]:
    """The report's contract keys: the fastest fixed-K row (auto is a row of its own) against
    the first backend's plain decoding; `outputs_identical` over every row."""
    eagle = [r for r in rows if isinstance(r["k"], int)]
    best = max(eagle, key=lambda r: r["tokens_per_s"]) if eagle else None
    return {
        "baseline_tokens_per_s": rows[0]["tokens_per_s"],
        "eagle_tokens_per_s": best["tokens_per_s"] if best else None,
        "speedup": best["speedup"] if best else None,
        "mean_accept_len": best["mean_accept_len"] if best else None,
        "accept_len_hist": best["accept_len_hist"] if best else None,
        "accepted_per_position": best["accepted_per_position"] if best else None,
        "outputs_identical": all(r["outputs_identical"] for r in rows),
        "best_k": best["k"] if best else None,
        "best_backend": best.get("backend", first) if best else None,
    }
