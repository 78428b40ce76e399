"""The project's own exception for user mistakes, every exit code a zerollm process ends with (and SIGTERM turned into
an exception where a command must clean up: `SigtermUnwinds`), the reading of a user's text or JSON file that turns its
failures into that exception, and the naming of what in a str UTF-8 cannot hold.

A `UserError` carries one line that names the file, line or key at fault and what to do.
The CLI prints it without a traceback and exits with `EXIT_USER_ERROR`.
"""

from __future__ import annotations

import errno
import json
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llm.wording import printable

EXIT_OK = 0
EXIT_USER_ERROR = 2
"""Bad input (file, config, path, tokenizer), or ranks that disagree at rendezvous; nothing was trained."""
EXIT_PREEMPTED = 75
"""Stopped by SIGTERM/SIGINT (or a lost `zerollm launch`) after saving a checkpoint; rerun with --resume auto."""
EXIT_RANK_LOST = 76
"""A rank died, hung or could not be reached; the job was ended on every rank and the message names the rank."""
EXIT_PIPE_CLOSED = 128 + signal.SIGPIPE
"""The command's output pipe closed (`| head`): 141, as a shell reports a process that SIGPIPE ended."""
EXIT_TERMINATED = 128 + signal.SIGTERM
"""Stopped by SIGTERM outside training (143, as a shell reports a process that SIGTERM ended)."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""How a user, a terminal or a scheduler (`kill`, systemd, docker, SLURM) asks a command to stop."""


class Terminated(SystemExit):
    """SIGTERM, raised where it arrives inside `SigtermUnwinds`."""


class SigtermUnwinds:
    """Context manager: inside, SIGTERM (how `kill`, systemd, docker and SLURM stop a process) raises `Terminated`
    where it arrives, as Ctrl-C raises KeyboardInterrupt, so that what is being written is cleaned up (a staging
    folder, a temporary folder) instead of left behind by a process ended at once. Only in the main thread and where
    SIGTERM has its default action (a trainer's or a server's own handler is kept; a rank is never given one). Python
    drops an exception raised in a finalizer, where the handler may happen to run: the signal is recorded too, that
    exception is not printed, and `check()` (call it before a step that must not follow a stop, such as a rename into
    place) and leaving the block raise it again. A second SIGTERM ends the process at once."""

    def __init__(self) -> None:
        self.signalled = False
        self._unraisablehook = None

    def __enter__(self) -> SigtermUnwinds:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._unraisablehook, sys.unraisablehook = sys.unraisablehook, self._unraisable
            signal.signal(signal.SIGTERM, self._terminate)
        return self

    def __exit__(self, exc_type, *_) -> None:
        if self._unraisablehook is not None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            sys.unraisablehook, self._unraisablehook = self._unraisablehook, None
        if exc_type is None:
            self.check()

    def _terminate(self, signum: int, frame) -> None:
        self.signalled = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated(EXIT_TERMINATED)

    def _unraisable(self, unraisable) -> None:
        if not isinstance(unraisable.exc_value, Terminated):
            self._unraisablehook(unraisable)

    def check(self) -> None:
        """Raise the `Terminated` of a SIGTERM whose exception was dropped in a finalizer."""
        if self.signalled:
            raise Terminated(EXIT_TERMINATED)


class UserError(Exception):
    """A mistake in the user's input (file, config, path, tokenizer), not a bug. `announce` false: already printed
    (one that every rank of a job raises is printed once per node, by `llm.runtime.distributed.raise_together`).
    `end_at_once`: what failed left a library that crashes when its objects are freed (HDF5 after a failed write
    segfaults as Python ends: exit 139 after the message), so the CLI ends the process at once, without finalizers,
    when it has printed the message; everything of the command's own is cleaned up before it is raised."""

    def __init__(self, message: str, announce: bool = True, end_at_once: bool = False) -> None:
        super().__init__(message)
        self.announce, self.end_at_once = announce, end_at_once


class StepInputError(UserError):
    """What a step is made of failed on every rank alike before the step trained anything (a GRPO reward that raised
    or ran out of time): the run is still at its last complete step, which the trainer saves before it ends with the
    message (`Trainer._save_then_fail`). Raised unannounced: the trainer says it, with where that step is."""


def report(message: str) -> None:
    """Print a user error as every zerollm command does: one line on stderr, `zerollm: error: ...`."""
    print(f"zerollm: error: {printable(message)}", file=sys.stderr, flush=True)


USER_FILE_LIMIT = 64 << 20
"""The most `bounded_text` reads of a configuration file (a model's, a tokenizer's, a run's, a recipe, a DeepSpeed
config): far more than any holds; a larger one (an 8 GB sparse config.json) was read whole, a MemoryError traceback
or the process killed without a word."""


def bounded_text(path: Path, limit: int = USER_FILE_LIMIT) -> str:
    """`path.read_text(encoding="utf-8")` (line ends read alike, a byte-order mark that Windows editors write left
    out: DeepSpeed's own reading takes it, json.loads refuses it), but an OSError (EFBIG) for a file of more than
    `limit` bytes, read no further."""
    with path.open("rb") as file:
        raw = file.read(limit + 1)
    if len(raw) > limit:
        raise OSError(errno.EFBIG, f"larger than the {limit:,} bytes zerollm reads of such a file; is it the right "
                                   "file?")
    return raw.decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def read_user_text(path: Path, save_as: str, limit: int = USER_FILE_LIMIT) -> str:
    """The UTF-8 text of a user's file (`bounded_text`), or a one-line UserError naming it: more than `limit` bytes,
    bytes that are not UTF-8 (say where, and to save it as `save_as`) or a file that cannot be read."""
    try:
        return bounded_text(path, limit)
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); save "
                        f"{save_as}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc})") from None


MOST_JSON_LEVELS = 100
"""The deepest nesting of objects and lists taken in a user's JSON file (a config holds a few): the parser takes
some hundreds, but copying such a value (`copy.deepcopy`) recursed past Python's limit."""


def _nested_deeper_than(value: Any, levels: int) -> bool:
    """Whether `value` holds objects or lists more than `levels` deep (walked without recursion)."""
    pending = [(value, 1)]
    while pending:
        value, level = pending.pop()
        if isinstance(value, (dict, list)):
            if level > levels:
                return True
            pending += [(child, level + 1) for child in (value.values() if isinstance(value, dict) else value)]
    return False


def read_user_json_object(path: Path, what: str, loads: Callable[[str], Any] = json.loads) -> dict[str, Any]:
    """The JSON object in a user's UTF-8 file, or a one-line UserError naming the file (and the line and column) at
    fault; `what` is the kind of file, for messages ('DeepSpeed config'). `loads` parses the text: it raises
    json.JSONDecodeError, or a ValueError whose text says what is wrong (e.g. a key given twice)."""
    text = read_user_text(path, f"the {what} as UTF-8 JSON")
    try:
        data = loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg})") from None
    except ValueError as exc:
        raise UserError(f"{path}: invalid JSON ({exc})") from None
    except RecursionError:
        raise UserError(f"{path}: invalid JSON (nested too deeply)") from None
    if _nested_deeper_than(data, MOST_JSON_LEVELS):  # copies and walks of it recurse: a RecursionError traceback
        raise UserError(f"{path}: invalid JSON (nested too deeply: more than {MOST_JSON_LEVELS} levels)")
    if not isinstance(data, dict):
        raise UserError(f"{path}: the {what} must be a JSON object {{...}}, got {json.dumps(data)[:60]}")
    return data


def not_utf8(text: str) -> tuple[int, str] | None:
    """Where `text` first holds what UTF-8 cannot encode (a 0-based index) and what that is: 'byte 0xNN' for a byte
    that was not UTF-8 where Python read bytes with errors='surrogateescape' (a terminal, a command line or the
    environment give those as U+DC80..U+DCFF), else 'lone surrogate U+D800' (as a JSON escape can spell one); None
    for text UTF-8 holds."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        return exc.start, f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
    return None
