"""One training job per run directory.

Two jobs writing one run directory (a job submitted again while the first still runs, two terminals, a requeued
SLURM job beside its old allocation) interleave their checkpoints, `latest` and metrics, and a resume then reads
one job's weights with the other's optimizer. So rank 0 of a job holds an exclusive lock on `RUN_DIR/.train.lock`
from its start to its end, and every rank refuses the job when another holds it. It is a POSIX record lock
(`lockf`): the kernel releases it however the process ends, processes it forks (data loader workers) do not
inherit it, so none of them outliving a killed rank keeps a resume out, and NFS shows it to every node. The
process that starts the ranks (`zerollm train --nproc N`, `zerollm launch`) checks first, so the usual case is one
line before any rank starts. A filesystem without locks is trained on unprotected, as before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from llm.errors import UserError
from llm.held_locks import open_lock_file

LOCK_FILE = ".train.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)
"""lockf's errors on a filesystem that has no locks."""


def _held_by(fd: int) -> str:
    holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
    return f"({holder})" if holder else "(another process)"


def _refusal(run_dir: Path, fd: int) -> UserError:
    return UserError(f"{run_dir}: another training job is writing there {_held_by(fd)}; wait for it to end (or stop "
                     "it), or choose another --out")


def _try_lock(fd: int, mode: int = fcntl.LOCK_EX) -> bool:
    """Whether this process now holds the lock of `fd` in `mode` (LOCK_EX, or LOCK_SH: a check, which other checks
    do not exclude): False when another process holds a lock that excludes it, True also where the filesystem has
    no locks."""
    try:
        fcntl.lockf(fd, mode | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return False
        if exc.errno in _UNSUPPORTED:
            return True
        raise
    return True


def _cannot_lock(run_dir: Path, exc: OSError) -> UserError:
    return UserError(f"{run_dir}: cannot lock {LOCK_FILE} there ({exc.strerror or exc}); training keeps it locked "
                     "while a job writes the run, so it needs to write it")


def check_run_unlocked(run_dir: Path) -> None:
    """UserError when a job holds `run_dir`'s lock now, or its lock file cannot be opened for writing; writes
    nothing. It takes a shared lock for a moment, so the checks of one job's launchers and ranks, made at the same
    moment on several nodes, never refuse each other. Call it before `take_run_lock` in a process that takes the
    lock: closing any descriptor of the file releases a process's POSIX locks."""
    try:
        fd = open_lock_file(run_dir / LOCK_FILE, create=False)
    except (FileNotFoundError, NotADirectoryError):  # no run there yet
        return
    except OSError as exc:  # another user's lock file, a folder of that name
        raise _cannot_lock(run_dir, exc) from None
    try:
        if not _try_lock(fd, fcntl.LOCK_SH):
            raise _refusal(run_dir, fd)
    finally:
        os.close(fd)  # releases the lock if this check took it


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` (itself included) that does not exist yet."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            return missing
        missing = folder
    return missing


def take_run_lock(run_dir: Path) -> int:
    """Lock `run_dir` for this process while the returned descriptor is open, creating the folder if need be;
    UserError when another job holds it or it cannot be locked."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = open_lock_file(run_dir / LOCK_FILE)
            if not _try_lock(fd):
                error = _refusal(run_dir, fd)
                os.close(fd)
                raise error
            try:
                same = os.fstat(fd).st_ino == os.stat(run_dir / LOCK_FILE).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else a refused job removed the file (and folder) between our open and lock: lock the new one
                break
            os.close(fd)
            run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cannot_lock(run_dir, exc) from None
    with contextlib.suppress(OSError):  # who holds it, for the message of the next job
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    return fd


def _remove_if_only_the_lock(run_dir: Path, created: Path) -> None:
    """Remove `run_dir` and its new parents up to `created` when they hold nothing but the lock file: a job refused
    before it wrote anything leaves no folder behind."""
    with contextlib.suppress(OSError):
        if os.listdir(run_dir) != [LOCK_FILE]:
            return
        (run_dir / LOCK_FILE).unlink()
        for folder in (run_dir, *run_dir.parents):
            folder.rmdir()
            if folder == created:
                break


@contextlib.contextmanager
def run_locked(run_dir: Path, rank: int, refuse: Callable[[str | None], None],
               recheck: Callable[[], object] = lambda: None) -> Iterator[Callable[[], None]]:
    """Rank 0 holds `run_dir`'s lock inside the block. Every rank enters it, or every rank raises the same UserError
    when another job holds it or `recheck`, run by rank 0 once it holds the lock, raises one (what another job wrote
    there before it ended, in the moment between this job's checks and its lock): `refuse` gets rank 0's refusal,
    None elsewhere, and raises it on every rank (a collective: `llm.runtime.distributed.refuse_together`). The block
    gets what leaving it does on rank 0 (remove the folders this job created when they hold nothing but the lock),
    for a process that ends without leaving it (`os._exit`)."""
    fd, problem, created = None, None, _first_missing(run_dir)
    if rank == 0:
        try:
            fd = take_run_lock(run_dir)
            recheck()
        except UserError as exc:
            problem = str(exc)
        except OSError as exc:  # the recheck's: said by every rank, as a refusal is (rank 0 alone raised it)
            problem = f"{run_dir}: cannot be read ({exc.strerror or exc})"

    def tidy() -> None:
        if fd is not None and created is not None:
            _remove_if_only_the_lock(run_dir, created)

    try:
        refuse(problem)
        yield tidy
    finally:
        if fd is not None:
            tidy()
            os.close(fd)
