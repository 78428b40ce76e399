"""The output directory of `data prepare`: one writer at a time, replaced as a whole.

OUT holds `tokens.h5`, `report.json`, `tokenizer/` and the lock file `.prepare.lock`, nothing else. A run

1. refuses an OUT that holds anything else (a run directory, a tokenizer of your own, any file of yours), so
   nothing of yours is ever deleted; OUT may be new, empty, or an earlier output of `data prepare`;
2. takes an exclusive lock on `OUT/.prepare.lock` (released by the kernel when the process ends, however it
   ends), so a second run into the same OUT is refused with a message naming the first one's pid;
3. writes everything into a staging directory beside OUT with a unique name (`.OUT.partial-<pid>-<random>`);
4. commits by renaming: the old OUT moves aside and the staging directory becomes OUT, so OUT holds either the
   whole old output or the whole new one, never new tokens beside an old tokenizer. The lock file is
   hard-linked into the new output first, so the lock stays held across the swap.

A run stopped by Ctrl-C (SIGINT) or SIGTERM removes its staging directory (and OUT, if it created it) before it
exits: while the block runs, SIGINT raises KeyboardInterrupt and SIGTERM `SystemExit(143)` (128 + 15, as a shell
reports it). Python drops an exception raised in a finalizer, where a signal handler may happen to run; so the
signal is recorded too, the lost exception is not printed, and `check_stopped` (called as the run goes, and by
`commit`) raises it again: a stopped run never replaces OUT. Leftovers of killed runs (SIGKILL, a crash: staging
and set-aside directories) are removed by the next run that holds the lock; but where a run was killed between the
two renames of its commit, OUT is missing and its earlier output is whole in `.OUT.old-<pid>-<random>`: the next run
puts that back as OUT first, so that it is replaced only when the new output is whole.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from llm import durable, held_locks
from llm.durable import STAGED_SUFFIX, set_aside_copies
from llm.errors import UserError
from llm.wording import printable

LOCK_FILE = ".prepare.lock"


def _cannot_write(out: Path, exc: OSError) -> UserError:
    return UserError(f"--out {out}: cannot write there ({exc.strerror or exc}); data prepare needs to write in it and "
                     "beside it (in its parent directory)")


def cannot_write_output(out: str | Path, exc: OSError) -> UserError:
    """A failed write into the output (a full disk, a quota): its reason without the library's details (h5py gives
    errno 28 with a paragraph of its own). HDF5 crashes when it frees a file whose write failed, so the process
    ends at once after the message (`UserError.end_at_once`)."""
    return UserError(f"--out {out}: cannot write the output ({os.strerror(exc.errno) if exc.errno else exc}); "
                     "nothing was kept", end_at_once=True)


def refuse_foreign_contents(out: Path, given: str | Path, command: str, names: set[str], marker: str,
                            ignored: set[str] = frozenset(),
                            not_ours: Callable[[Path], str | None] | None = None) -> None:
    """Refuse an existing directory `out` unless it is empty or an earlier output of `command`: it holds only
    `names` (besides `ignored`) and among them `marker`, which only `command` writes, or, where the names are not
    `command`'s alone (model.safetensors, tokens.h5), which `not_ours(out)` finds `command` wrote (it names what
    `command` did not write, or None). So a command that replaces or overwrites its output never touches a folder of
    the user's (a run, a tokenizer of their own, any file)."""
    entries = sorted(set(os.listdir(out)) - ignored)
    foreign = [name for name in entries if name not in names]
    unmarked = bool(entries) and marker not in entries  # e.g. a tokenizer/ of your own
    if unmarked:
        foreign = entries
    elif entries and not foreign and not_ours is not None and (found := not_ours(out)):
        foreign = [found]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        whose = f" but no {marker}, which {command} writes into its every output, so they may be yours" if unmarked \
            else f", which {command} did not write"
        raise UserError(f"--out {given} holds {shown}{whose}; it replaces its output there, so give it a new or "
                        "empty directory (or one it wrote before)")


def staging_leftovers(entries: Iterable[str], outputs: Iterable[str]) -> set[str]:
    """Those of a folder's `entries` that a killed `tokenizer train` or `data prepare` into one of its `outputs` left
    beside it, a staging or set-aside folder (`OutputDir`: the next one into that output removes it), by the exact
    form of their names: `.OUT.partial-PID-XXXXXXXX` and `.OUT.old-PID-XXXXXXXX` (eight hexadecimal digits, or the
    eight characters of `tempfile.mkdtemp` an earlier tokenizer train used), and `.OUT.partial` and `.OUT.old`
    (`llm.durable.staged_folder`, which tokenizer train uses), and the `.OUT.lock` it holds while it writes: any name
    starting so matched, and a user's own `.data.old-backup` beside --out data was deleted."""
    staged = "|".join(re.escape(name) for name in outputs)
    return {e for e in entries if re.fullmatch(rf"\.(?:{staged})\.(?:{STAGED_SUFFIX}|lock)", e)}


def refuse_current_directory(out: Path, given: Path, command: str, example: str) -> None:
    """Refuse an --out (resolved: `out`) that is the current directory or holds it: `command` replaces its output
    whole, and the shell would be left in a deleted folder."""
    cwd = Path.cwd().resolve()
    if cwd == out or out in cwd.parents:
        raise UserError(f"--out {given} is the current directory or holds it; {command} replaces the whole output "
                        f"directory, so give it a directory of its own, e.g. --out {example}")


def refuse_mount_point(out: Path, given: Path, command: str) -> None:
    """Refuse an --out (resolved: `out`) that is a mount point: `command` stages its output beside it and renames it
    into place, which a mount point cannot take ('Device or resource busy', 'Invalid cross-device link')."""
    if os.path.ismount(out):
        raise UserError(f"--out {given} is a mount point, which {command} cannot replace (it writes its output beside "
                        f"it and renames it into place); give a folder inside it, e.g. --out {given / 'out'}")


class OutputDir:
    """Context manager: `with OutputDir(out, names, not_ours) as output: ...write into output.staging...;
    output.commit()`.

    `names` are the entries a data prepare output holds (besides the lock file); an earlier output is recognised
    by the first of them (tokens.h5) and by `not_ours(out)`, which looks inside. Leaving the block without `commit()`
    (an error, Ctrl-C, SIGTERM) removes the staging directory and leaves OUT as it was (and removes OUT if this run
    created it).
    """

    def __init__(self, out: str | Path, names: tuple[str, ...], not_ours: Callable[[Path], str | None]) -> None:
        self.given, self.not_ours = Path(out), not_ours
        self.out = self.given.resolve()  # a symlink to a directory: replace the directory, keep the link
        self.names, self.marker = set(names) | {LOCK_FILE}, names[0]
        self.prefix = f".{self.out.name}."
        self.staging = self.out.with_name(f"{self.prefix}partial-{os.getpid()}-{secrets.token_hex(4)}")
        self._lock_fd: int | None = None
        self._created = self._committed = False
        self._handlers: dict[int, Any] = {}
        """SIGINT's and SIGTERM's handlers before this block, restored when it ends (none replaced off the main
        thread, where Python runs no signal handler)."""
        self._signalled: int | None = None
        self._unraisablehook = sys.unraisablehook

    def __enter__(self):
        refuse_current_directory(self.out, self.given, "data prepare", "data/")
        refuse_mount_point(self.out, self.given, "data prepare")
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"--out {self.given} is a file; give a directory")
        if threading.current_thread() is threading.main_thread():
            self._handlers = {signum: signal.signal(signum, self._stop) for signum in (signal.SIGINT, signal.SIGTERM)}
            sys.unraisablehook = self._unraisable
        try:
            self._put_back_set_aside()
            self._created = not self.out.exists()
            if not self._created:
                self._check_contents()  # before writing anything there
            self.out.mkdir(parents=True, exist_ok=True)
            self._lock()
            self._remove_leftovers()
            self.staging.mkdir()
        except OSError as exc:
            self.__exit__()
            raise _cannot_write(self.given, exc) from None
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        if self._created and not self._committed and self._lock_fd is not None:  # leave no empty OUT behind
            with contextlib.suppress(OSError):
                (self.out / LOCK_FILE).unlink()
                self.out.rmdir()
        self._unlock()
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._handlers = {}
        sys.unraisablehook = self._unraisablehook

    def _stop(self, signum: int, frame) -> None:
        self._signalled = signum
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def _unraisable(self, unraisable) -> None:
        if self._signalled is None or not isinstance(unraisable.exc_value, (KeyboardInterrupt, SystemExit)):
            self._unraisablehook(unraisable)

    def check_stopped(self) -> None:
        """Raise the KeyboardInterrupt or SystemExit of a signal whose exception was lost in a finalizer."""
        if self._signalled is not None:
            self._stop(self._signalled, None)

    def _lock(self) -> None:
        while True:
            fd = held_locks.open_lock_file(self.out / LOCK_FILE)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise UserError(f"--out {self.given}: another `zerollm data prepare` (pid {holder}) is writing "
                                "there; wait for it to finish or choose another --out") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.out / LOCK_FILE).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else the holder committed between our open and flock: lock the new file
                break
            os.close(fd)
        self._lock_fd = fd  # before the writes: one that fails (a full disk) leaves no OUT this run created
        held_locks.hold(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            held_locks.release(self._lock_fd)
            self._lock_fd = None

    def _check_contents(self) -> None:
        refuse_foreign_contents(self.out, self.given, "data prepare", self.names, self.marker, ignored={LOCK_FILE},
                                not_ours=self.not_ours)

    def _put_back_set_aside(self) -> None:
        """Where OUT is missing and a run killed between `commit`'s two renames left the earlier output aside, whole
        (it holds the marker), rename the newest such copy back to OUT: the leftovers' removal deleted it before this
        run had written anything, and a rerun that then failed had lost both outputs."""
        if self.out.exists() or self.out.is_symlink():
            return
        with contextlib.suppress(OSError):
            whole = [path for path in set_aside_copies(self.out) if (path / self.marker).is_file()]
            if whole:
                aside = max(whole, key=lambda path: path.stat().st_mtime_ns)
                os.rename(aside, self.out)
                print(f"zerollm: note: --out {printable(str(self.given))} was missing, its earlier output set aside "
                      f"by a data prepare stopped as it replaced it: put back from {printable(aside.name)}, to be "
                      "replaced when this run's output is whole", file=sys.stderr, flush=True)

    def _remove_leftovers(self) -> None:
        for name in staging_leftovers(os.listdir(self.out.parent), [self.out.name]):
            durable.remove_leftover(self.out.parent / name, self.out)

    def commit(self) -> None:
        """Make the staging directory OUT: the old output moves aside and is removed."""
        self.check_stopped()
        old = self.out.with_name(f"{self.prefix}old-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.link(self.out / LOCK_FILE, self.staging / LOCK_FILE)
            os.rename(self.out, old)
        except OSError as exc:
            raise _cannot_write(self.given, exc) from None
        try:
            os.rename(self.staging, self.out)
        except OSError as exc:
            with contextlib.suppress(OSError):  # fails only if another run created OUT meanwhile; it replaces it
                os.rename(old, self.out)
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise UserError(f"--out {self.given}: another `zerollm data prepare` started writing there while this "
                                "one finished; nothing of this run was kept") from None
            raise _cannot_write(self.given, exc) from None
        self._committed = True
        durable.remove_set_aside(old, self.out)
