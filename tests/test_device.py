"""The same decoding on every device this machine has: CPU always, CUDA when present.

Every tensor the round builds lives on the target's device (`decoding.runner`); these
tests run generate (chains, trees, sampling) and the engine on each device against that
device's own plain decoding, and each device's greedy tokens against the CPU's for as long as
transformers' float32 logits (the oracle, on the CPU) put the argmax clear of float noise:
float reductions differ across devices, so only near-ties may part them.
"""

from __future__ import annotations

import pytest
import torch

import eagle3
from eagle3.engine import Engine, EngineConfig
from heads import save_context_target, scripted_head

CLEAR = 1e-3  # top-2 logit margin beyond any device's float32 reduction noise at this size


def clear_prefix(ctx: str, prompt: list[int], tokens: list[int]) -> int:
    """How many of `tokens` (greedy after `prompt`) transformers' float32 logits choose with a
    top-2 margin above CLEAR: up to there every device must choose the same tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ctx, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]  # (n, V)
    top = logits.topk(2, -1)
    assert top.indices[:, 0].tolist()[:1] == tokens[:1]  # the oracle's first choice is the CPU's
    clear = (top.values[:, 0] - top.values[:, 1] > CLEAR).tolist() + [False]
    return clear.index(False)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine: the CUDA path is untested here"))]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """A target whose attention changes its output (tests/heads.py)."""
    return save_context_target(str(tmp_path_factory.mktemp("device") / "ctx"))


@pytest.mark.parametrize("device", DEVICES)
def test_generate_and_engine_on_device(ctx, tmp_path, device):
    from eagle3.draft import save_head
    from eagle3.targets import load_target

    prompts = [[3, 17, 9], [40, 2, 7, 11, 5]]
    head = scripted_head(load_target(ctx), prompts, 24, "partial")
    save_head(head, str(tmp_path / "head"), fmt="speculators", include_embedding=True)
    spec = eagle3.load(ctx, str(tmp_path / "head"), device=device)
    assert spec.target_device.type == device
    assert all(t.device.type == device for t in spec.draft.state_dict().values())
    plain = spec.plain()
    cpu = eagle3.load(ctx, "none", device="cpu")
    for p in prompts:
        want = plain.generate(p, 24, stop_token_ids=[]).token_ids
        on_cpu = cpu.generate(p, 24, stop_token_ids=[]).token_ids
        n = clear_prefix(ctx, p, on_cpu)
        assert n >= 1 and want[:n] == on_cpu[:n], (device, n)
        for kw in (dict(num_draft_tokens=3), dict(tree=True), {}):
            assert spec.generate(p, 24, stop_token_ids=[], **kw).token_ids == want, kw
        a = spec.generate(p, 24, stop_token_ids=[], temperature=0.8, seed=5)
        assert a.token_ids == spec.generate(p, 24, stop_token_ids=[], temperature=0.8, seed=5).token_ids
    engine = Engine(spec, EngineConfig(max_batch=2, num_draft_tokens=3)).start(background=False)
    reqs = [engine.submit(p, 24, stop_token_ids=[]) for p in prompts]
    engine.run_until_idle()
    assert [r.token_ids for r in reqs] == [plain.generate(p, 24, stop_token_ids=[]).token_ids
                                           for p in prompts]


def test_device_errors(ctx):
    for bad, msg in (("tpu", "unknown device"), ("cuda:99", "CUDA" if not torch.cuda.is_available()
                                                  else "CUDA device")):
        with pytest.raises(eagle3.Eagle3Error, match=msg):
            eagle3.load(ctx, "none", device=bad)


def test_device_errors_on_the_command_line(ctx, capsys):
    from eagle3.cli import main

    for argv in (["generate", "--target", ctx, "--draft", "none", "--prompt-ids", "1,2",
                  "--device", "tpu"],
                 ["serve", "--target", ctx, "--draft", "none", "--tree", "--num-draft-tokens", "3"],
                 ["export", "--target", ctx, "--out", "/tmp/never-written", "--device", "cuda"]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("eagle3: error:") and "\n" not in err and "Traceback" not in err, err
