"""Shared fixtures: tiny random Hugging Face checkpoints, built and saved in the tests (seeded).

`VARIANTS` covers every family and config quirk the native targets support.
`make_checkpoint(dir, name)` saves one with `save_pretrained` and returns the
transformers model, which is the oracle.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from eagle3.decoding.sampling import Sampler, SamplingParams

# Tiny models: one thread per test worker avoids oversubscribing the 2 cores (pytest -n 2).
torch.set_num_threads(1)

# "default" means the toy code model (models/toy) in the tests, so that the many tests (and the
# CLI subprocesses they start, which inherit the environment) that need some trained model with
# a head stay fast; tests/test_default.py checks the real default (SmolLM2) explicitly.
_TOY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "toy")
os.environ.setdefault("EAGLE3_DEFAULT_DIR", os.path.join(_TOY, "target"))
os.environ.setdefault("EAGLE3_DEFAULT_HEAD_DIR", os.path.join(_TOY, "head"))

COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama_mha": ("LlamaConfig", {"num_key_value_heads": 4}),
    "llama_mqa_head_dim": ("LlamaConfig", {"num_key_value_heads": 1, "head_dim": 24}),
    # original_max_position_embeddings 64 puts the head_dim-16 frequencies in all three llama3
    # bands (wavelengths 6.3 < 16 kept, 32 in 16..64 smoothed, >= 167 > 64 divided by factor).
    "llama3_rope": ("LlamaConfig", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, "rope_theta": 500000.0}),
    "llama_linear_rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama_bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("MistralConfig", {"sliding_window": 7}),
    "qwen2": ("Qwen2Config", {}),
    # Qwen2 sliding window on layers >= max_window_layers only (mixed full / sliding layers).
    "qwen2_swa": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 7,
                                  "max_window_layers": 3}),
    "qwen3": ("Qwen3Config", {"head_dim": 24, "tie_word_embeddings": True}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 7, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 7,
                                    "query_pre_attn_scalar": 24}),
    # Gemma 3 4B+: linear RoPE scaling on the global layers only, local base on sliding ones.
    "gemma3_linear_rope": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 7,
                                                "query_pre_attn_scalar": 24,
                                                "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
}


@pytest.fixture(autouse=True)
def head_alone_by_default(request, monkeypatch):
    """The suite's head tests count the head's own drafts and acceptance (forced acceptance,
    engine == generate counters, automatic K): in this process the default proposer is the head
    alone. tests/test_suffix.py, which tests 'suffix', 'hybrid' and the real default, opts out
    (`USES_DEFAULT_PROPOSER = True`); CLI subprocesses run the real default."""
    if not getattr(request.module, "USES_DEFAULT_PROPOSER", False):
        from eagle3.decoding import request as requests

        monkeypatch.setattr(requests, "DEFAULT_PROPOSER", "eagle")


def make_hf_model(name: str, seed: int = 0, scale: float = 4.0, **overrides):
    """A seeded random transformers causal LM for variant `name` (weights scaled up)."""
    cls_name, extra = VARIANTS[name]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in n:
                p.mul_(scale)
            elif p.dim() == 1 and "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)  # norms away from identity, so (1+w) vs w matters
            elif p.dim() == 1 and "bias" in n:
                p.add_(torch.randn_like(p) * 0.1)  # biases are zero-initialised: make them matter
    return model


def make_checkpoint(path: str, name: str, seed: int = 0, **save_kw):
    """Save variant `name` to `path` with `save_pretrained`; return the oracle model."""
    model = make_hf_model(name, seed)
    model.save_pretrained(path, **save_kw)
    return model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{variant: (dir, oracle model)} for every variant, built once per session."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name in VARIANTS:
        d = os.path.join(root, name)
        out[name] = (d, make_checkpoint(d, name))
    return out


# A test may skip only for what this machine cannot have; any other skip fails the run (a
# package `make test` installs but that is missing, a kernel that does not build, data not
# found), so a broken setup cannot pass as a green suite of skips.
ALLOWED_SKIPS = ("no CUDA device",                      # tests/test_device.py
                 "vLLM's CPU build is not",              # an optional peer (recipes/vllm/setup.sh)
                 "llama.cpp tools not built",            # an optional peer (make llama.cpp)
                 "the kernels are written for x86-64")   # another CPU architecture


def nucleus_by_sort(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p's kept tokens (..., V) by the rule written out, with a full sort and integer sums:
    each probability (torch's softmax of `scores`) counted in whole 2^-40ths; a token is
    dropped when the tokens no more likely than it (ties included) hold <= (1 - top_p) x 2^40
    of them, except the most likely tokens, which always stay (docs/decoding.md, "Top-k and
    top-p")."""
    flat = scores.reshape(-1, scores.shape[-1])
    keep = torch.zeros(flat.shape, dtype=torch.bool)
    for r, row in enumerate(flat.softmax(-1)):
        mass = (row.double() * 2.0 ** 40).round().long()  # exact: a power-of-two scaling
        values, inverse, counts = torch.unique(mass, sorted=True, return_inverse=True, return_counts=True)
        no_larger = (values * counts).cumsum(0)  # int64: the mass of each value and every smaller one
        kept = no_larger.double() > (1.0 - top_p) * 2.0 ** 40
        kept[-1] = True
        keep[r] = kept[inverse]
    return keep.view(scores.shape)


def clear_of_the_cut(scores: torch.Tensor, top_p: float, margin: float = 1e-6) -> bool:
    """Whether rounding cannot move top-p's cut in `scores` (V,): no tail sum (float64 over the
    ascending probabilities) within `margin` of 1 - top_p, and no tie spanning the cut."""
    p = scores.softmax(-1).double().sort().values
    tail = p.cumsum(0)
    if ((tail - (1.0 - top_p)).abs() < margin).any():
        return False
    dropped = int((tail <= 1.0 - top_p).sum())
    return not (0 < dropped < len(p) and p[dropped - 1] == p[dropped])


def assert_probs_match_transformers(logits: torch.Tensor, temperature: float, top_k: int,
                                    top_p: float) -> int:
    """`Sampler.probs` equals transformers' warpers (temperature, top-k, top-p) followed by a
    softmax, bit for bit, on each row (..., V) whose top-p cut rounding cannot move; returns
    how many rows were compared."""
    V = logits.shape[-1]
    ours = Sampler(SamplingParams(temperature, top_p, top_k)).probs(logits)
    compared = 0
    for row, got in zip(logits.reshape(-1, V), ours.reshape(-1, V), strict=True):
        scores = transformers.TemperatureLogitsWarper(temperature)(None, row[None].clone())
        if top_k:
            scores = transformers.TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0 and not clear_of_the_cut(scores[0], top_p):
            continue
        if top_p < 1.0:
            scores = transformers.TopPLogitsWarper(top_p)(None, scores)
        assert torch.equal(got, scores[0].softmax(-1)), (temperature, top_k, top_p)
        compared += 1
    return compared


def _disallowed_skip(report) -> str | None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return None if any(a in reason for a in ALLOWED_SKIPS) else reason


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if (reason := _disallowed_skip(report)) is not None:
        report.outcome = "failed"
        report.longrepr = (f"skipped for a reason the suite does not allow: {reason} (tests may skip "
                           f"only for what the machine cannot have: {', '.join(ALLOWED_SKIPS)})")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    if (reason := _disallowed_skip(report)) is not None:
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid} skipped for a reason the suite does not allow: {reason}"
