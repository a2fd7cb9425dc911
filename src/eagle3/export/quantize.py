"""Quantization of the linear layers before export (torchao), with its cost measured.

Weights: int8 with one scale per output channel, or int4 with one scale per group
of 32 inputs. Activations are quantized to int8 per token at run time (XNNPACK's
dynamically quantized linear, `Int8DynamicActivationIntxWeightConfig`), because
weight-only configs (`IntxWeightOnlyConfig`, fp32 activations) lower to programs
that compute wrong numbers with executorch 1.5.1 + XNNPACK: a 1024x4096 MLP gave
errors of 1e5..1e7 where the eager quantized model's were 0.005..0.1 (the program
was also no smaller). The dynamically quantized programs match their eager models
and are 4x (int8) / 7x (int4) smaller. The embedding table stays float32 (lookups
are cheap; the head shares it). The error is measured, not assumed: the target's
logits over a greedy continuation of a seeded prompt before and after, max and
mean absolute difference and how often the argmax agrees.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import Eagle3Error

GROUP_SIZE = 32
PROBE_PROMPT, PROBE_NEW = 16, 48  # tokens: a seeded random prompt, then a greedy continuation


def _config(mode: str) -> Any:
    try:
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig
        from torchao.quantization.granularity import PerAxis, PerGroup
    except ImportError:
        raise Eagle3Error("quantized export needs torchao (installed with executorch): "
                          "pip install 'eagle3[export]'") from None
    if mode == "int8":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                 weight_granularity=PerGroup(GROUP_SIZE))


@torch.no_grad()
def _probe_logits(target: Any, ids: torch.Tensor) -> torch.Tensor:
    cache = target.new_cache(1, ids.shape[1])
    logits, _ = target.forward_logits_taps(ids, torch.arange(ids.shape[1]), cache, with_taps=False)
    return logits[0]  # (T, V)


def quantize_weights(spec: Any, mode: str) -> dict[str, float]:
    """Quantize `spec`'s target and head linears in place; returns the measured logit error."""
    from torchao.quantization import quantize_

    from ..speculator import Eagle3Speculator

    config = _config(mode)
    target = spec.target
    bad = [n for n, m in [*target.named_modules(), *spec.draft.named_modules()]
           if isinstance(m, torch.nn.Linear) and m.in_features % GROUP_SIZE]
    if mode == "int4" and bad:
        raise Eagle3Error(f"int4 groups of {GROUP_SIZE} need input widths divisible by {GROUP_SIZE} "
                          f"({bad[0]} is not); use --quantize int8")
    gen = torch.Generator().manual_seed(0)
    room = target.config.max_seq_len  # the probe fits the loaded cache and RoPE table
    n_prompt = min(PROBE_PROMPT, max(1, room // 4))
    prompt = torch.randint(0, target.config.vocab_size, (n_prompt,), generator=gen).tolist()
    new = Eagle3Speculator(target).generate(prompt, min(PROBE_NEW, room - n_prompt),
                                            stop_token_ids=[]).token_ids
    ids = torch.tensor([prompt + new])
    before = _probe_logits(target, ids)
    quantize_(target, config)
    quantize_(spec.draft, config, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear))
    after = _probe_logits(target, ids)
    diff = (after - before).abs()
    return {"mode": mode, "probe_tokens": ids.shape[1],
            "max_abs_logit_error": diff.max().item(), "mean_abs_logit_error": diff.mean().item(),
            "logit_scale": before.abs().mean().item(),
            "argmax_agreement": (after.argmax(-1) == before.argmax(-1)).float().mean().item()}
