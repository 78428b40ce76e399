"""How the messages of a stopped or failed training job say to continue it: `rerun with --resume auto` from a
training command; a command that runs the job inside itself and has no --resume (`zerollm bench learn`) gives its own
words (`rerun_said_as`), so that its user is not told to pass an option it refuses."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_INSTEAD: ContextVar[str | None] = ContextVar("rerun_instead", default=None)


def rerun_advice(continues: str = "") -> str:
    """'rerun with --resume auto' and `continues` (what the resume does: ' to continue from global_step40'), or the
    words of the command running the job."""
    instead = _INSTEAD.get()
    return f"rerun with --resume auto{continues}" if instead is None else instead


@contextmanager
def rerun_said_as(advice: str) -> Iterator[None]:
    """Inside, a training job's messages say `advice` where they would say to rerun it with --resume auto."""
    token = _INSTEAD.set(advice)
    try:
        yield
    finally:
        _INSTEAD.reset(token)
