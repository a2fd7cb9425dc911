"""The embedded default model.

Until the trained default ships under `models/default/`, a seeded tiny random
Llama checkpoint (with a byte-level tokenizer) is built on first use in the
user cache, so `make run` works on a fresh machine with no downloads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .errors import notice

REPO_MODELS = Path(__file__).resolve().parents[2] / "models" / "default"

RANDOM_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32",
}


def default_target_dir() -> str:
    """The default target checkpoint directory (trained if shipped, else random)."""
    env = os.environ.get("EAGLE3_DEFAULT_DIR")
    shipped = Path(env) if env else REPO_MODELS / "target"
    if (shipped / "config.json").is_file():
        return str(shipped)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "eagle3" / "random-default"
    if not (cache / "model.safetensors").is_file():
        notice(f"no trained default model ships yet; building a seeded tiny random one in {cache}")
        build_random_checkpoint(str(cache))
    return str(cache)


def default_head_dir() -> str | None:
    """The default EAGLE-3 head directory, or None while none ships (plain decoding)."""
    env = os.environ.get("EAGLE3_DEFAULT_HEAD_DIR")
    shipped = Path(env) if env else REPO_MODELS / "head"
    return str(shipped) if (shipped / "config.json").is_file() else None


def build_random_checkpoint(out: str, config: dict | None = None, seed: int = 0) -> None:
    """Write a seeded random Llama checkpoint (+ byte-level tokenizer) to `out`."""
    from safetensors.torch import save_file

    from .targets.config import parse_decoder_config
    from .targets.decoder import NativeTarget

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
