"""Inputs for the vLLM peer (run with eagle3's .venv): the default target as an HF checkpoint
(dequantized from its GGUF by transformers' own loader), the default head in the
speculators format, and held-out ShareGPT prompts as chat-templated text.

    .venv/bin/python recipes/vllm/prepare.py [N_PROMPTS]     # writes build/vllm/{target,head,prompts.json}
"""

from __future__ import annotations

import json
import os
import sys

import torch

import eagle3
from eagle3.bench.prompts import prompt_set
from eagle3.draft import convert_head
from eagle3.targets.default import default_head_dir, default_target_dir

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "build", "vllm")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = default_target_dir()
    d, f = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    tdir = os.path.join(OUT, "target")
    os.makedirs(tdir, exist_ok=True)
    # save_pretrained refuses a model loaded from GGUF; write the tensors and a plain config
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, os.path.join(tdir, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(tdir, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    spec = eagle3.load("default", "none")
    tok_dir = os.path.dirname(spec.tokenizer.path)
    for name in os.listdir(tok_dir):
        with open(os.path.join(tok_dir, name), "rb") as src, open(os.path.join(tdir, name), "wb") as dst:
            dst.write(src.read())
    hdir = os.path.join(OUT, "head")
    if not os.path.isdir(hdir):
        convert_head(default_head_dir(), hdir, "speculators")
    prompts = [spec.tokenizer.decode(spec.tokenizer.apply_chat_template(rec["messages"]),
                                     skip_special_tokens=False)
               for _, rec in prompt_set("sharegpt-heldout", n)]
    with open(os.path.join(OUT, "prompts.json"), "w") as fh:
        json.dump(prompts, fh)
    print(f"wrote {tdir}, {hdir}, {len(prompts)} prompts")


if __name__ == "__main__":
    main()
