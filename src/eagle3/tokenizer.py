"""The target's tokenizer, read from `tokenizer.json` with the `tokenizers` library."""

from __future__ import annotations

import os

from .errors import Eagle3Error


class Tokenizer:
    """`encode(text) -> list[int]` (with the tokenizer's own special tokens) and `decode(ids) -> str`."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise Eagle3Error(f"cannot read tokenizer {path} ({str(e)[:100]}); re-save the "
                              "tokenizer files or omit them") from None
        self.path = path

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()


def load_tokenizer(checkpoint_dir: str) -> Tokenizer | None:
    """The tokenizer in `checkpoint_dir`, or None when it ships no `tokenizer.json`."""
    path = os.path.join(checkpoint_dir, "tokenizer.json")
    return Tokenizer(path) if os.path.isfile(path) else None
