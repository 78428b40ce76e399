"""The commands' standard output, guarded (`llm.cli.main`): a write that fails ends the command as a tool ends
there, not in a traceback: quietly with 141 where the reader of a pipe left (`| head`: 128 + SIGPIPE, what a shell
reports for a writer the closed pipe ended), in one line with exit 2 on a full disk (`> /dev/full`)."""

from __future__ import annotations

import os
from typing import Any, TextIO


class OutputLost(Exception):  # noqa: N818 - not an error of the command's: its output's reader or disk
    """A write to standard output failed; `error` says why."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.error = error


class GuardedStdout:
    """`stream` (sys.stdout) whose writes and flushes raise OutputLost where they fail; the rest is the stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as exc:
            raise OutputLost(exc) from None

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as exc:
            raise OutputLost(exc) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def discard(stream: TextIO) -> None:
    """Point `stream`'s file descriptor at /dev/null, so that what is still buffered for it does not fail again at
    exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
