"""The target's tokenizer, read from `tokenizer.json` with the `tokenizers` library.

Chat templates come from `chat_template.jinja` or `tokenizer_config.json`'s
`chat_template` next to it, rendered with jinja2 as transformers does.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import Eagle3Error


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
        self._renderer = None  # (compiled chat template, its special tokens, its file), built once

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def _chat_template(self, where: str) -> tuple[str, dict, str]:
        """(template source, tokenizer_config.json contents, the file the template came from),
        or an Eagle3Error naming `where`."""
        folder = os.path.dirname(self.path)
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
        template, source = cfg.get("chat_template"), cfg_path
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if not template and os.path.isfile(jinja_path):
            try:
                with open(jinja_path, encoding="utf-8") as f:
                    template, source = f.read(), jinja_path
            except (OSError, UnicodeDecodeError) as e:
                raise Eagle3Error(f"cannot read {jinja_path} ({str(e)[:80]}); fix, re-download or "
                                  "delete it") from None
        if not isinstance(template, str) or not template:
            raise Eagle3Error(f"{where}: the tokenizer in {folder} has no chat template (chat_template.jinja "
                              "or tokenizer_config.json's chat_template); give prompts instead of messages")
        return template, cfg, source

    def has_chat_template(self) -> bool:
        """Whether `apply_chat_template` can render messages."""
        if self._renderer is not None:
            return True
        try:
            self._chat_template("chat")
        except Eagle3Error:
            return False
        return True

    def apply_chat_template(self, messages: list[dict], where: str = "messages") -> list[int]:
        """Token ids of `messages` rendered with the chat template and a generation prompt.

        Matches transformers' `apply_chat_template(messages, add_generation_prompt=True,
        tokenize=True)`: the template's text is encoded without extra special tokens.
        """
        template, special, source = self._chat_renderer(where)
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise Eagle3Error(f"{where}: messages must be a list of {{role, content}} objects")
        import jinja2  # present: `_chat_renderer` checked

        try:
            text = template.render(messages=messages, add_generation_prompt=True, **special)
        except jinja2.exceptions.TemplateError as e:
            raise Eagle3Error(f"{where}: the chat template of {source} failed: {str(e)[:200]}; fix "
                              "the template or give prompts instead of messages") from None
        return self._tok.encode(text, add_special_tokens=False).ids

    def _chat_renderer(self, where: str) -> tuple[Any, dict, str]:
        """The chat template compiled once per tokenizer, its special tokens and its file
        (compiled per prompt, it made each prompt several times slower: docs/training.md)."""
        if self._renderer is not None:
            return self._renderer
        template, cfg, source = self._chat_template(where)
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise Eagle3Error(f"{where}: rendering the chat template needs jinja2 "
                              "(pip install jinja2)") from None

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in cfg.items()
                   if k.endswith("_token") and isinstance(v, (str, dict))}
        try:
            compiled = env.from_string(template)
        except jinja2.exceptions.TemplateError as e:
            raise Eagle3Error(f"{where}: the chat template of {source} failed: {str(e)[:200]}; fix "
                              "the template or give prompts instead of messages") from None
        self._renderer = (compiled, special, source)
        return self._renderer


def _read_json(path: str) -> dict:
    """A tokenizer side file (tokenizer_config.json) as a dict, or a one-line error naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise Eagle3Error(f"cannot read {path} ({str(e)[:80]}); fix, re-download or delete it") from None
    if not isinstance(cfg, dict):
        raise Eagle3Error(f"{path} must hold a JSON object, not {type(cfg).__name__}; fix, "
                          "re-download or delete it")
    return cfg


def load_tokenizer(target: str) -> Tokenizer | None:
    """The tokenizer of `target`: a checkpoint directory's `tokenizer.json`, a GGUF file's
    vocabulary (a directory holding one, or a registered model name), 'default'; None when
    there is none."""
    from .gguf import find_gguf, gguf_tokenizer_dir
    from .named import resolve_target

    if target == "default":
        from .default import default_target_dir

        target = default_target_dir()
    target = resolve_target(target)
    gguf_file = find_gguf(target)
    if gguf_file is not None:
        target = gguf_tokenizer_dir(gguf_file)
        if target is None:
            return None
    path = os.path.join(target, "tokenizer.json")
    return Tokenizer(path) if os.path.isfile(path) else None
