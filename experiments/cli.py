"""Error handling shared by every entry point.

A user error (a bad config value, a missing file, a checkpoint that does not match) is reported as one
line `error: <message>` on stderr with exit status 2, and no traceback: the traceback would only bury the
message. Anything else is a bug and keeps its traceback. Put the decorator *inside* `@hydra.main`, so Hydra
does not catch the exception first:

    @hydra.main(version_base="1.3", config_path="../conf", config_name="train_base")
    @exit_on_user_error
    def main(cfg: DictConfig) -> None: ...
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

__all__ = ["USER_ERRORS", "exit_on_user_error", "one_line"]

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)
EXIT_USER_ERROR = 2

F = TypeVar("F", bound=Callable)


def one_line(error: BaseException) -> str:
    """The exception's message with all whitespace (newlines included) collapsed to single spaces."""
    text = " ".join(str(error).split())
    return text or type(error).__name__


def exit_on_user_error(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            print(f"error: {one_line(e)}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)

    return wrapper  # type: ignore[return-value]
