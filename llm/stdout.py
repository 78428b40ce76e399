"""The commands' standard output, guarded (`llm.cli.main`): a write that fails ends the command as a tool ends
there, not in a traceback: quietly with 141 where the reader of a pipe left (`| head`: 128 + SIGPIPE, what a shell
reports for a writer the closed pipe ended), in one line with exit 2 on a full disk (`> /dev/full`)."""

from __future__ import annotations

import codecs
import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO


def _shown_anyhow(error: UnicodeError) -> tuple[bytes, int]:
    """The codec error handler SHOWN_ANYHOW: characters standard output's encoding lacks (Chinese in a latin-1 or
    an ASCII locale) as \\uXXXX escapes, where strict encoding raised once the work was done (a training at its first
    sample, losing it); surrogates that stand for the bytes of a path that is not UTF-8 as those bytes, as ls
    writes them."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    text = error.object[error.start:error.end]
    shown = b"".join(bytes([ord(c) - 0xDC00]) if "\udc80" <= c <= "\udcff" else
                     c.encode("ascii", "backslashreplace") for c in text)
    return shown, error.end


SHOWN_ANYHOW = "zerollm.shown_anyhow"
codecs.register_error(SHOWN_ANYHOW, _shown_anyhow)


class OutputLost(Exception):  # noqa: N818 - not an error of the command's: its output's reader or disk
    """A write to standard output failed; `error` says why."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.error = error


_ON_LOST: list[Callable[[OSError], None]] = []
"""What a failed write to standard output calls instead of raising OutputLost (`output_loss_handled`)."""


@contextlib.contextmanager
def output_loss_handled(handler: Callable[[OSError], None]) -> Iterator[None]:
    """Inside, a write to standard output that fails calls `handler` with its error, and what is written from then
    on is discarded, instead of raising OutputLost: a training's ranks stop with a checkpoint (`| head` ended a
    training at once, its steps since the newest checkpoint lost)."""
    _ON_LOST.append(handler)
    try:
        yield
    finally:
        _ON_LOST.remove(handler)


class GuardedStdout:
    """`stream` (sys.stdout) whose write, writelines and flush raise OutputLost where they fail; the rest is the
    stream's (`unguarded` gives the stream itself)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        written = self._guarded(self.stream.write, text)
        return len(text) if written is None else written

    def writelines(self, lines: Iterable[str]) -> None:
        self._guarded(self.stream.writelines, lines)

    def flush(self) -> None:
        self._guarded(self.stream.flush)

    def _guarded(self, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as exc:
            if not _ON_LOST:
                raise OutputLost(exc) from None
            discard(self.stream)  # what is buffered, and written from now on, goes nowhere
            _ON_LOST[-1](exc)
            return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def unguarded() -> TextIO:
    """sys.stdout without the guard: for decoration whose failure must not end the command (a progress bar, which
    turns itself off where its terminal is gone)."""
    return sys.stdout.stream if isinstance(sys.stdout, GuardedStdout) else sys.stdout


def on_terminal() -> bool:
    """Whether sys.stdout is a terminal (not where descriptor 1 was closed at start, `>&-`: sys.stdout is None)."""
    return sys.stdout is not None and sys.stdout.isatty()


def settle(stream: TextIO | None) -> None:
    """Flush `stream` (the real sys.stdout, at the end of a command that failed otherwise); where that fails, discard
    what is buffered rather than fail again at exit: the command's own exit code stands."""
    if stream is None:
        return
    try:
        stream.flush()
    except OSError:
        discard(stream)


def discard(stream: TextIO) -> None:
    """Point `stream`'s file descriptor at /dev/null, so that what is still buffered for it does not fail again at
    exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
