"""Writing files so that a crash (SIGKILL, power loss, a full disk) leaves either the old or the new content,
never a torn file: write under a temporary name, fsync, rename over the target, fsync the folder; a folder is made
the same way (`staged_folder`, `copy_folder`). And naming a write that failed for want of room (`out_of_room`,
`room_needed`)."""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llm.errors import UserError
from llm.held_locks import held_beside

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


@contextmanager
def room_needed(folder: Path, writing: str, again: str = "run the command again",
                kept: str = "nothing was lost (what was there is as it was)") -> Iterator[None]:
    """Inside, a write that runs out of room (`out_of_room`) is one UserError naming `folder` and what was being
    written (`writing`), what is kept (`kept`) and how to go on once there is room (`again`), for writes that leave
    what was there as it was (`write_text`, `append_text`, `copy_folder`)."""
    try:
        yield
    except OSError as exc:
        reason = out_of_room(exc)
        if reason is None:
            raise
        raise UserError(f"{folder}: {reason} while writing {writing}; {kept}: free space and {again}") from None


def write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` by `data` atomically and durably; a failed write (a full disk) leaves `path` as it was and no
    temporary file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync(path.parent)


def write_text(path: Path, text: str) -> None:
    """`write_bytes` of `text` in UTF-8."""
    write_bytes(path, text.encode("utf-8"))


def append_text(path: Path, text: str) -> None:
    """Append `text` (UTF-8) to `path` whole or not at all: a write that fails (a full disk) cuts the file back to
    where it ended before, so no torn line is left, and is raised."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        left = memoryview(text.encode("utf-8"))
        try:
            while left:
                left = left[os.write(fd, left):]
        except BaseException:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def update_text(path: Path, text: str) -> bool:
    """`write_text`, unless `path` already holds `text` (then nothing is written: a start that changes nothing needs
    no room); whether it wrote."""
    try:
        if path.read_bytes() == text.encode("utf-8"):
            return False
    except OSError:  # missing or unreadable: written
        pass
    write_text(path, text)
    return True


def remove(path: Path) -> None:
    """Delete `path`: a folder with what it holds, a file, or a link (never what it names)."""
    if path.is_symlink() or path.exists() and not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def remove_leftover(path: Path, of: Path) -> None:
    """Delete `path`, a copy of folder `of` that an earlier run left beside it (a partial or a set-aside one), before
    anything is written; where it cannot be deleted (a read-only copy), a UserError naming it: it was left, and the
    next rename onto its name failed with a traceback."""
    try:
        remove(path)
    except (FileNotFoundError, NotADirectoryError):  # none, or no folder to hold one (--out below a file)
        pass
    except OSError as exc:
        raise UserError(f"{path}, a copy of {of} an earlier run left beside it, cannot be deleted "
                        f"({exc.strerror or exc}); delete it (or make it writable) and run again") from None


def remove_set_aside(old: Path, target: Path) -> None:
    """Delete `old`, the earlier copy of folder `target` that its replacement set aside; where it cannot be deleted
    (a read-only copy), a note naming it: `target` is whole, but a copy of the earlier one was left without a word."""
    try:
        shutil.rmtree(old)
    except FileNotFoundError:
        pass
    except OSError as exc:
        print(f"zerollm: note: {target} is written, but its earlier copy, set aside as {old}, cannot be deleted "
              f"({exc.strerror or exc}); delete it yourself", file=sys.stderr, flush=True)


def check_staged_name(target: Path) -> None:
    """UserError where the names `staged_folder` gives beside folder `target` (`.NAME.partial`, `.NAME.old`) are
    longer than its file system takes (255 bytes): a name of 247 to 255 bytes was a traceback (File name too long),
    after a tokenizer's whole training."""
    existing = next(path for path in target.parents if path.exists() or path == path.parent)
    try:
        most = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        most = 255
    if len(f".{target.name}.partial".encode(errors="surrogateescape")) > most:
        raise UserError(f"--out {target}: its name is too long to be written whole: the copy written first beside it, "
                        f".{target.name}.partial, would be longer than the {most} bytes a name may have; choose a "
                        "shorter name")


@contextmanager
def staged_folder(target: Path, replace: bool = False) -> Iterator[Path]:
    """Make folder `target` whole or not at all: inside, fill the hidden `.NAME.partial` beside it that this yields
    (not yet created; a leftover is removed first); on leaving, its files, its subfolders and it are flushed, it is
    renamed into place and the folder holding it is flushed. `target` must not exist, unless `replace`: then an
    earlier one is renamed aside to `.NAME.old` and deleted after (a crash between the two renames leaves both
    complete folders, the old one as `.NAME.old`). A failure inside or while flushing (a full disk) leaves `target`
    as it was and no partial folder. Leftovers of an earlier run that cannot be deleted are refused before anything
    is written (`remove_leftover`); so is a second writer of `target` while one is at work (`held_beside`)."""
    check_staged_name(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where a parent folder should be
        raise UserError(f"--out {target}: cannot create it ({os.strerror(errno.ENOTDIR)})") from None
    except OSError as exc:
        raise UserError(f"--out {target}: cannot create it ({exc.strerror or exc})") from None
    with held_beside(target):  # one writer at a time: the names beside it are shared
        partial, old = target.with_name(f".{target.name}.partial"), target.with_name(f".{target.name}.old")
        for staging in (partial, old):  # a file of that name: a traceback as it was renamed over, or a wrong path
            if staging.is_symlink() or staging.exists() and not staging.is_dir():
                raise UserError(f"{staging} is in the way: replacing {target} whole takes that name beside it (for "
                                "the new copy as it is written, or the earlier one set aside); move it away")
            if staging == partial or target.exists():  # else `.NAME.old` is the one copy a crash left: kept till done
                remove_leftover(staging, target)
        try:
            yield partial
            for path in sorted(partial.rglob("*"), reverse=True):  # a subfolder after the files and folders in it
                if not path.is_symlink() and (path.is_file() or path.is_dir()):
                    fsync(path)
            fsync(partial)
            if replace and target.exists():
                os.replace(target, old)
            os.replace(partial, target)
        except BaseException:
            if replace and old.exists() and not target.exists():  # the new one could not be renamed in
                os.replace(old, target)
            shutil.rmtree(partial, ignore_errors=True)
            raise
        fsync(target.parent)
        if replace:
            remove_set_aside(old, target)


STAGED_SUFFIX = r"(?:partial|old)(?:-[0-9]+-[a-z0-9_]{8})?"
"""What follows `.NAME.` in the staging and set-aside folders beside a folder NAME that is replaced whole:
`staged_folder`'s `.NAME.partial` and `.NAME.old`, data prepare's with its process id and 8 random characters."""


def set_aside_copies(path: Path) -> list[Path]:
    """The earlier copies of folder `path` that a replacement stopped between its two renames left whole beside it
    (`.NAME.old`, `.NAME.old-PID-XXXXXXXX`: `staged_folder`'s, data prepare's), sorted by name."""
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    return [path.parent / name for name in sorted(names) if name.startswith(f".{path.name}.old")
            and re.fullmatch(rf"\.{re.escape(path.name)}\.{STAGED_SUFFIX}", name)]


def no_such_folder(path: Path) -> str:
    """'PATH: no such directory', saying where a replacement of it that was stopped between its two renames left its
    earlier copy, whole (`set_aside_copies`): the loaders said only that it was missing."""
    aside = set_aside_copies(path)
    if not aside:
        return f"{path}: no such directory"
    return (f"{path}: no such directory (a command replacing it was stopped: its earlier copy is whole in "
            f"{aside[0]}; rename that back to {path.name})")


def copy_folder(source: Path, target: Path) -> None:
    """Copy folder `source` to `target` (which must not exist) whole or not at all (`staged_folder`): a failed copy
    (a full disk) leaves no `target` and no partial folder."""
    with staged_folder(target) as partial:
        shutil.copytree(source, partial)


def current_umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask
