"""Which rank of which job this process is and how large the job is, from the variables its launcher set, a free
local port, and the mark of an accelerator zerollm chose: what a process that starts ranks needs, without importing
torch (the ranks do).

torchrun and DeepSpeed's per-node launcher set RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (or
LOCAL_SIZE). mpirun sets its own variables instead (Open MPI's OMPI_COMM_WORLD_*, MVAPICH2's MV2_COMM_WORLD_*,
the PMI_RANK/PMI_SIZE/MPI_LOCALRANKID of MPICH and Intel MPI, PMIX_RANK).
"""

from __future__ import annotations

import errno
import os
import random
import re
import socket
from collections.abc import Mapping

from llm.errors import UserError

CHOSEN_ACCELERATOR = "ZEROLLM_CHOSEN_DS_ACCELERATOR"
"""Set beside DS_ACCELERATOR when zerollm chose it for a process's job (`ensure_accelerator_env`), not the user: a
process that inherits both makes the choice again for its own job."""


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
IANA_EPHEMERAL_LOW = 49152
"""Where the kernel's own port range starts when EPHEMERAL_RANGE_FILE cannot say (macOS; the IANA range)."""
LOWEST_CHOSEN_PORT = 20000
FIRST_UNPRIVILEGED = 1024
MIN_PORTS = 1000
"""The fewest ports drawn from by default."""
PORTS_VARIABLE = "ZEROLLM_PORTS"
"""LOW-HIGH: the ports `free_port` draws from, where jobs on one machine are given ranges of their own."""
TRIES = 64


def ephemeral_low() -> int:
    """The first port of the range the kernel hands out by itself (to connections, to binds of port 0)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return IANA_EPHEMERAL_LOW


def port_range(environ: Mapping[str, str]) -> tuple[int, int]:
    """The ports `free_port` draws from, LOW to HIGH inclusive: PORTS_VARIABLE's, else LOWEST_CHOSEN_PORT up to the
    kernel's own range."""
    given = environ.get(PORTS_VARIABLE)
    if given is None:  # below a kernel range that starts low, from the first unprivileged port
        kernel = ephemeral_low()
        low = LOWEST_CHOSEN_PORT if kernel > LOWEST_CHOSEN_PORT + MIN_PORTS else FIRST_UNPRIVILEGED
        return low, max(kernel - 1, low + MIN_PORTS)
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", given)
    if not match or not FIRST_UNPRIVILEGED <= int(match[1]) <= int(match[2]) <= 65535:
        raise UserError(f"{PORTS_VARIABLE}={given!r}: expected LOW-HIGH, the ports zerollm may choose for a job on "
                        "this machine, with 1024 <= LOW <= HIGH <= 65535 (e.g. 20000-20999)")
    return int(match[1]), int(match[2])


def port_in_use(port: int) -> bool:
    """Whether `port` is taken on this node: a listener could not take it on every interface now, as the
    rendezvous store does. The loopback address is tried as well: BSD kernels (macOS) let a bind to every interface
    share the port of a listener on one address. IPv6's are tried too where the host has IPv6: a listener on ::1
    alone left the IPv4 binds free, and a job whose --master-addr was ::1 hung on it without a word."""
    for family, address in ((socket.AF_INET, ""), (socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::"),
                            (socket.AF_INET6, "::1")):
        try:
            s = socket.socket(family)
        except OSError:  # no IPv6 on this host
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
                if family == socket.AF_INET6:  # IPv6 off or limited on this host: its binds say nothing
                    continue
                raise
    return False


def free_port(environ: Mapping[str, str] = os.environ) -> int:
    """A port free on this node now, for a rendezvous to listen on a moment later, drawn from `port_range`. By
    default that is below the kernel's own range: a port the kernel handed out (bind to port 0) and released was
    soon handed out again, to another process's connection or listener, before the rendezvous could take it."""
    low, high = port_range(environ)
    draw = random.SystemRandom()
    for _ in range(TRIES):
        port = draw.randint(low, high)
        if not port_in_use(port):
            return port
    raise UserError(f"no free port found in {low}-{high} after {TRIES} tries"
                    + (f" ({PORTS_VARIABLE})" if PORTS_VARIABLE in environ else "")
                    + f"; free some, or set {PORTS_VARIABLE}=LOW-HIGH to a range with free ports")


RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE")
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                        "PALS_LOCAL_RANKID")
LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                        "MPI_LOCALNRANKS")


def _first(environ: dict[str, str], names: tuple[str, ...]) -> tuple[str, int] | None:
    """(name, value) of the first of `names` set in `environ`."""
    for name in names:
        if name in environ:
            try:
                return name, int(environ[name])
            except ValueError:
                raise UserError(f"{name}={environ[name]!r} is not a number; the launcher's environment is broken") \
                    from None
    return None


def announced_world_size(environ: dict[str, str]) -> int:
    """The job's size as `rank_environment` reads it, without its checks (it reports what they find): 1 where no
    launcher set a rank, or the size is no number."""
    if not any(name in environ for name in RANK_VARIABLES):
        return 1
    try:
        size = _first(environ, WORLD_SIZE_VARIABLES)
    except UserError:
        return 1
    return size[1] if size else 1


def rank_environment(environ: dict[str, str]) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for this process, from whichever
    launcher started it (see the module docstring), or a group of one on 127.0.0.1 when none did."""
    rank = _first(environ, RANK_VARIABLES)
    if rank is None:
        return dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port(environ)))
    rank_name, rank_value = rank
    world = _first(environ, WORLD_SIZE_VARIABLES)
    if world is None:
        raise UserError(f"this process has rank {rank_value} ({rank_name}) but no world size: none of "
                        f"{', '.join(WORLD_SIZE_VARIABLES)} is set; export WORLD_SIZE to every rank")
    world_size = world[1]
    local = _first(environ, LOCAL_RANK_VARIABLES)
    if local is None and world_size > 1:
        raise UserError(f"rank {rank_value} ({rank_name}) of {world_size} has no local rank: none of "
                        f"{', '.join(LOCAL_RANK_VARIABLES)} is set; export LOCAL_RANK to every rank")
    local_rank = local[1] if local else 0
    local_size = _first(environ, LOCAL_SIZE_VARIABLES)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name)]
    if missing and world_size > 1:
        raise UserError(f"rank {rank_value} of {world_size} was started by a launcher that sets {rank_name} but not "
                        f"{' and '.join(missing)}: give every rank the address and a free port of rank 0's host "
                        "(mpirun -x MASTER_ADDR=HOST -x MASTER_PORT=PORT), or start the job with zerollm launch, "
                        "which does")
    return dict(RANK=str(rank_value), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(local_size[1] if local_size else world_size),
                MASTER_ADDR=environ.get("MASTER_ADDR") or "127.0.0.1",
                MASTER_PORT=environ.get("MASTER_PORT") or str(free_port(environ)))
