"""The file locks this process holds (`flock` on a descriptor), which the workers it forks close as they start.

A forked worker keeps every descriptor, and a lock stays held while any process has it: the orphaned workers of a
`data prepare` or `bench learn` killed with SIGKILL held its output's lock until they noticed, and a rerun at once
was refused as if the dead command still wrote there.
"""

from __future__ import annotations

import contextlib
import os

_HELD: set[int] = set()


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
