"""User-facing errors.

`Eagle3Error` marks a mistake the user can fix (bad path, bad config, bad
argument). Its message is one line naming the problem and the fix; the CLI
prints it and exits with code 2, without a traceback. Anything else is a bug.
"""

from collections.abc import Iterator
from contextlib import contextmanager


class Eagle3Error(ValueError):
    """A problem with the user's input; the message says what and how to fix it."""


class NotNative(Eagle3Error):
    """A checkpoint the native decoder cannot run (its family, RoPE or activation), though the
    transformers adapter can: `load_target(backend='auto')` falls back to it."""


def notice(message: str) -> None:
    """Tell the user something worth knowing (stderr, one line), without failing."""
    import sys

    print(f"eagle3: {message}", file=sys.stderr)


def brief(e: BaseException) -> str:
    """An exception as one short line ("Type: first line of the message"), for a request's error:
    torch's messages run to many lines of internals that no client should see."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


@contextmanager
def wrong_values_as(what: str, fix: str) -> Iterator[None]:
    """Inside: a wrong value in a file we read (a type or arithmetic error while parsing it)
    becomes one `Eagle3Error` line, "what (Type: reason); fix"."""
    try:
        yield
    except Eagle3Error:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, ArithmeticError) as e:
        raise Eagle3Error(f"{what} ({brief(e)}); {fix}") from None
