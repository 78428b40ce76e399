"""The file locks this process holds (`flock` on a descriptor), which the workers it forks close as they start.

A forked worker keeps every descriptor, and a lock stays held while any process has it: the orphaned workers of a
`data prepare` or `bench learn` killed with SIGKILL held its output's lock until they noticed, and a rerun at once
was refused as if the dead command still wrote there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from llm.errors import UserError

_HELD: set[int] = set()


def open_lock_file(path: Path, create: bool = True) -> int:
    """A descriptor of lock file `path` for reading and writing (made where new, unless not `create`): never through
    a symbolic link, nor of anything but a regular file. A link planted in a folder handed over, or in a shared /tmp,
    made zerollm empty the file it named and write its pid there. OSError otherwise, its strerror saying why."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0), 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path.name} is a symbolic link, not a lock file; remove it") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path.name} is not a regular file, so not a lock file; remove it")
    return fd


def hold(fd: int) -> None:
    """Note that descriptor `fd` holds a lock of this process."""
    _HELD.add(fd)


def release(fd: int) -> None:
    """Close `fd`, a descriptor `hold` noted: its lock is released."""
    _HELD.discard(fd)
    os.close(fd)


def close_in_worker() -> None:
    """In a forked worker: close its copies of the descriptors holding its parent's locks."""
    for fd in _HELD:
        with contextlib.suppress(OSError):  # closed since (a worker's own code is not ours)
            os.close(fd)
    _HELD.clear()


def _flocked(fd: int, mode: int = fcntl.LOCK_EX) -> bool:
    """Whether this process now holds `fd`'s lock in `mode` (LOCK_EX, or LOCK_SH: a look), taken without waiting:
    False where another process holds one that excludes it; True also where the file system has no locks (not
    held)."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN)
    return True


@contextlib.contextmanager
def held_folder(folder: Path, marker: str, command: str) -> Iterator[None]:
    """Inside, `folder`'s `marker` file (the folder and the marker made where new) is locked by this process: a
    second `command` into the same --out, started while the first worked between its trainings (whose run folders
    alone were locked), deleted the first's files without a word. A file system without locks is not held."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = open_lock_file(folder / marker)
    except OSError as exc:
        raise UserError(f"--out {folder}: cannot write there ({exc.strerror or exc})") from None
    if not _flocked(fd):
        os.close(fd)
        raise UserError(f"--out {folder}: another {command} is writing there; wait for it to end, or choose another "
                        "--out")
    hold(fd)
    try:
        yield
    finally:
        release(fd)


def _lock_beside(target: Path) -> Path:
    return target.with_name(f".{target.name}.lock")


def _written_now(target: Path) -> UserError:
    return UserError(f"{target}: another zerollm command is writing it now; wait for it to end, or choose another "
                     "--out")


def refuse_if_held_beside(target: Path) -> None:
    """The refusal `held_beside` would give, where another process holds `target`'s lock now: checked before long work
    that ends in writing it (a second tokenizer train into one folder was refused after its whole training)."""
    try:
        fd = open_lock_file(_lock_beside(target), create=False)
    except OSError:  # none (no writer), or one that cannot be used: said when it is taken
        return
    held = not _flocked(fd, fcntl.LOCK_SH)
    os.close(fd)
    if held:
        raise _written_now(target)


@contextlib.contextmanager
def held_beside(target: Path) -> Iterator[None]:
    """Inside, folder `target` (written whole beside it: `llm.durable.staged_folder`) is locked by this process
    through `.NAME.lock` beside it, removed on leaving: two exports (or tokenizer trains) into one folder at once
    deleted each other's copies, ended in tracebacks, and once left one's weights beside the other's config. A file
    system without locks is not held."""
    lock = _lock_beside(target)
    while True:
        try:
            fd = open_lock_file(lock)
        except OSError as exc:  # a read-only folder: as the folder itself could not be created
            raise UserError(f"--out {target}: cannot create it ({exc.strerror or exc})") from None
        if not _flocked(fd):
            os.close(fd)
            raise _written_now(target)
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else its holder removed it between our open and lock: lock the new one
            break
        os.close(fd)
    hold(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
        release(fd)
