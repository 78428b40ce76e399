"""Every rank of a job writes into one run directory: rank 0 writes the manifests, `latest` and metrics, each rank
its own checkpoint files. Nodes given different `--out`s (a typo, a relative path from another working directory),
or one on storage local to each node, trained to the end with exit 0 into checkpoints that were all incomplete
(each node's files in its own folder) and could never be resumed. So at the start rank 0 writes a file of a new
name into the run directory, and every rank looks for it there: a rank on rank 0's host sees it at once; one on
another host waits up to `SEEN_WAIT_S` (at most half the collective timeout) for a network file system's caches (a
name looked up before it existed may be remembered as missing for up to a minute)."""

from __future__ import annotations

import contextlib
import secrets
import socket
import time
from pathlib import Path

import torch.distributed as dist

from llm.runtime.distributed import raise_together

SEEN_WAIT_S = 70.0
POLL_S = 0.5
PREFIX = ".zerollm-seen-"


def check_one_run_dir(run_dir: Path, rank: int, announce: bool, collective_timeout_s: float) -> None:
    """A collective: every rank raises one UserError naming the ranks that do not see the file rank 0 wrote into
    `run_dir` (module docstring), or none does. Rank 0 removes the file. A rank on another host waits at most half of
    `collective_timeout_s` (rank 0 waits for it in a collective)."""
    host = socket.gethostname()
    sent: list[str | None] = [None, None]
    if rank == 0:
        name = PREFIX + secrets.token_hex(8)
        with contextlib.suppress(OSError):  # a full disk: said where the run's own files are written
            (run_dir / name).write_text(host)
            sent = [name, host]
    try:
        dist.broadcast_object_list(sent, src=0)
        name, first_host = sent
        if name is None:
            return
        wait_s = 0.0 if host == first_host else min(SEEN_WAIT_S, collective_timeout_s / 2)
        views: list[tuple[bool, str, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(views, (_seen(run_dir / name, wait_s), host, str(run_dir.resolve())))
    finally:
        if rank == 0 and sent[0] is not None:
            with contextlib.suppress(OSError):
                (run_dir / sent[0]).unlink()
    blind = [(i, view) for i, view in enumerate(views) if not view[0]]
    if blind:
        _, first_host, first_dir = views[0]
        said = "; ".join(f"rank {i} on {other_host} (--out {other_dir})" for i, (_, other_host, other_dir) in blind)
        raise_together(f"the ranks do not share one run directory: {said} cannot see the file rank 0 on {first_host} "
                       f"wrote into {first_dir}; give every node the same --out, on a file system they all see (each "
                       "node's checkpoint files would land in a folder of its own, and no checkpoint could be "
                       "resumed); nothing was trained", announce)


def _seen(path: Path, wait_s: float) -> bool:
    """Whether `path` is a file here, within `wait_s`; a folder this rank cannot read (EACCES, a stale NFS handle)
    does not let it see it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if path.is_file():
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
