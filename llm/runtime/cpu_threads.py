"""How many threads a rank that computes on the CPU runs, without importing torch (a launching process uses it).

OMP_NUM_THREADS wins where the user or a launcher set it (DeepSpeed's `--bind_cores_to_rank` when you run
`deepspeed` yourself; bare torchrun sets 1 for jobs of several ranks per node). Otherwise a rank takes the CPUs it
may run on (its affinity mask: taskset, numactl, mpirun's or srun's binding, a container's cpuset; not a `--cpus`
quota, which no mask shows) shared among the ranks of its node that may run on them too: all of them when they share
one mask, none but itself when a launcher bound each rank to CPUs of its own. Counting the machine's CPUs instead
oversubscribes a restricted process.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on (every CPU where the system keeps no affinity mask, as on macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def threads_asked(environ: Mapping[str, str]) -> int | None:
    """OMP_NUM_THREADS as OpenMP reads it (the outermost level of a nested list such as "4,2"); None unless set to a
    positive number."""
    first = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isascii() and first.isdecimal() and int(first) > 0 else None


def cpu_threads_per_rank(ranks_sharing: int, environ: Mapping[str, str]) -> int:
    """Threads for one rank: OMP_NUM_THREADS where set, else its usable CPUs shared among `ranks_sharing` ranks."""
    return threads_asked(environ) or max(1, len(usable_cpus()) // ranks_sharing)


def cpu_claim() -> tuple[str, frozenset[int]]:
    """What one rank tells the others at the start: its host and the CPUs it may run on."""
    return socket.gethostname(), usable_cpus()


def ranks_sharing_cpus(mine: tuple[str, frozenset[int]], everyone: Sequence[tuple[str, frozenset[int]]]) -> int:
    """How many ranks (`everyone`'s `cpu_claim`s, this one's included) run on this rank's host with a CPU this rank
    may use too."""
    host, cpus = mine
    return sum(other_host == host and not cpus.isdisjoint(other_cpus) for other_host, other_cpus in everyone)
