"""What `stats` makes of a user mistake (a path, a dataset, a flag): a `StatsError`, which `main` reports as one line
`trl-prefix-sharing stats: error: ...` on stderr with exit status 2, and the helpers that put an error's text on that
line."""

from __future__ import annotations


PROG = "trl-prefix-sharing stats"


class StatsError(Exception):
    """A user mistake (a path, a dataset, a flag): one line on stderr, exit status 2, no traceback."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _cause(error: BaseException) -> str:
    """The innermost explicit cause of `error`, on one line (its type when it has no message)."""
    while error.__cause__ is not None:
        error = error.__cause__
    message = _one_line(error)
    return message.rstrip(".") if message else type(error).__name__
