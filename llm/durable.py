"""Writing files so that a crash (SIGKILL, power loss, a full disk) leaves either the old or the new content,
never a torn file: write under a temporary name, fsync, rename over the target, fsync the folder. And naming a write
that failed for want of room (`out_of_room`)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

OUT_OF_ROOM = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EFBIG: "a file reached the file size limit (ulimit -f)"}
"""The errors of a write that ran out of room, as said in messages."""


def out_of_room(exc: BaseException) -> str | None:
    """Why `exc` is a write that ran out of room (a full disk, a quota, the file size limit), from the OSError it is
    or was raised from or while handling, or the error's text in its message (torch.save's 'write(): fd 20 failed
    with File too large', safetensors' 'No space left on device (os error 28)'); None for any other failure. torch.save
    given a path loses the reason ('[enforce fail at inline_container.cc:672] . unexpected pos'): give it a file."""
    seen: BaseException | None = exc
    while seen is not None:
        for number, said in OUT_OF_ROOM.items():
            if getattr(seen, "errno", None) == number or os.strerror(number) in str(seen):
                return said
        seen = seen.__cause__ or seen.__context__
    return None


def fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, text: str) -> None:
    """Replace `path` by `text` atomically and durably; a failed write (a full disk) leaves `path` as it was and no
    temporary file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync(path.parent)


def current_umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask
