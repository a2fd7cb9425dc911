"""Read a Hugging Face checkpoint's tensors: safetensors (single or sharded) or .bin."""

from __future__ import annotations

import json
import os

import torch

from ..errors import Eagle3Error

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _read_file(path: str) -> dict[str, torch.Tensor]:
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise Eagle3Error(f"weight file {path} is missing: the checkpoint is incomplete; "
                          "re-download or re-save it") from None
    except Exception as e:  # safetensors / pickle errors have no common base class
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise Eagle3Error(f"cannot read {path} ({reason}): the file is truncated or corrupt; "
                          "re-download or re-save the checkpoint") from None


def weight_files(path: str) -> list[str]:
    """The weight files of checkpoint dir `path`, in load order."""
    for name in WEIGHT_FILES:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            continue
        if not name.endswith(".index.json"):
            return [full]
        try:
            with open(full) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise Eagle3Error(f"{full} is not a valid shard index ({e}); re-save the checkpoint") from None
        return [os.path.join(path, shard) for shard in sorted(set(weight_map.values()))]
    raise Eagle3Error(f"no weights in {path}: expected one of {', '.join(WEIGHT_FILES)}")


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of checkpoint dir `path` (shards merged)."""
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        state.update(_read_file(f))
    return state


def load_into(module: torch.nn.Module, state: dict[str, torch.Tensor], where: str, *,
              dtype: torch.dtype, optional: tuple[str, ...] = (),
              ignore_suffixes: tuple[str, ...] = ()) -> list[str]:
    """Copy `state` into `module`'s parameters with shape checks; return unexpected keys.

    Every parameter must be present with the right shape, except names in
    `optional` (e.g. a tied `lm_head.weight`). Errors name the tensor.
    """
    own = dict(module.named_parameters(remove_duplicate=False))
    missing = [n for n in own if n not in state and n not in optional]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise Eagle3Error(f"{where} lacks tensor(s) {', '.join(missing[:3])}{more}: the weights "
                          "do not match config.json (wrong or incomplete checkpoint); re-download or "
                          "re-convert it")
    for name, p in own.items():
        if name not in state:
            continue
        t = state[name]
        if tuple(t.shape) != tuple(p.shape):
            raise Eagle3Error(f"{where}: tensor {name} has shape {tuple(t.shape)} but config.json "
                              f"implies {tuple(p.shape)}; the weights and config disagree (fix "
                              "config.json, or re-download / re-convert the checkpoint)")
    module.load_state_dict({n: state[n].to(dtype) for n in own if n in state},
                           strict=False, assign=True)
    return [k for k in state if k not in own and not k.endswith(ignore_suffixes)]
