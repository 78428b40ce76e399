"""The training ranks' side of `zerollm launch`: stop cleanly when the launch process is gone.

`zerollm launch` forwards SIGTERM/SIGINT to the ranks, but if it is killed outright (SIGKILL, an OOM
kill, a lost session) nothing is forwarded, and DeepSpeed's per-node launcher does not notice either.
So every rank started under `zerollm launch` on the same host watches that process; when it is gone,
the rank requests a stop exactly as a SIGTERM would: every rank saves a checkpoint and exits 75.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import psutil

PID_ENV, HOST_ENV, STARTED_ENV, NAME_ENV = ("ZEROLLM_LAUNCH_PID", "ZEROLLM_LAUNCH_HOST", "ZEROLLM_LAUNCH_STARTED",
                                            "ZEROLLM_LAUNCH_NAME")


def started_at(process: psutil.Process) -> float:
    """When `process` started, in clock ticks since the machine booted (/proc/PID/stat): what tells it from a later
    process given its pid. Not psutil's `create_time()`, which adds the boot time /proc/stat gives at the moment, in
    whole seconds: a step or a slew of the wall clock (NTP, settimeofday) moves that, and ranks took their live launch
    for another process and stopped the job. Where there is no /proc (not Linux), `create_time()`."""
    if not Path("/proc/self/stat").is_file():
        return process.create_time()
    try:
        stat = Path(f"/proc/{process.pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(process.pid) from None
    return float(stat[stat.rindex(b")") + 2:].split()[19])  # field 22, starttime; the name before ')' may hold spaces


def supervisor_env(name: str = "zerollm launch") -> dict[str, str]:
    """Environment that identifies this process (the `zerollm launch` of this node, or the command `name` that
    starts `--nproc` local ranks) to the ranks it starts."""
    return {PID_ENV: str(os.getpid()), HOST_ENV: socket.gethostname(), STARTED_ENV: repr(started_at(psutil.Process())),
            NAME_ENV: name}


def started_here() -> list[psutil.Process]:
    """The processes running with this process's `supervisor_env` (the job's processes on this node: ranks, their
    launchers and data-loader workers), wherever they were re-parented: a launcher killed with the whole job leaves
    its ranks to finish saving on their own."""
    mine, found = supervisor_env(), []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):  # ended meanwhile, or another user's
            environment = process.environ()
            if environment.get(PID_ENV) == mine[PID_ENV] and environment.get(STARTED_ENV) == mine[STARTED_ENV] \
                    and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def _alive(pid: int, started: float) -> bool:
    """Whether the process is running: the same one (not a reused pid), and not killed and left unreaped by its
    parent (a zombie, for as long as the parent waits on something else)."""
    try:
        process = psutil.Process(pid)
        return started_at(process) == started and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch_supervisor(on_lost: Callable[[str], None], interval_s: float = 1.0) -> None:
    """When started by `zerollm launch` on this host, call `on_lost(reason)` once, from a daemon thread, when that
    process ends. Does nothing otherwise (or for ranks on other hosts, which have their own launch process)."""
    if PID_ENV not in os.environ or os.environ.get(HOST_ENV) != socket.gethostname():
        return
    pid, started = int(os.environ[PID_ENV]), float(os.environ[STARTED_ENV])
    name = os.environ.get(NAME_ENV, "zerollm launch")  # a rank of a version that did not say
    stopped = threading.Event()

    def watch() -> None:
        while not stopped.wait(interval_s):
            if not _alive(pid, started):
                on_lost(f"{name} (pid {pid}) ended")
                return

    threading.Thread(target=watch, name="zerollm-supervisor", daemon=True).start()
