"""What `zerollm launch` is told: the typed options the CLI hands to the launcher (standard library only, so
the CLI can build its parser without loading the launcher)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

DEFAULT_MASTER_PORT = 29500
MPI_LAUNCHERS = ("openmpi", "mvapich", "mpich", "impi")
"""DeepSpeed runners that start the ranks with mpirun; the ranks take their rank from the MPI environment."""
HOSTFILE_LAUNCHERS = ("pdsh", *MPI_LAUNCHERS)
"""How DeepSpeed's runner reaches the hosts of a hostfile. Its `slurm` runner is left out: it starts
`python -u llm` (it ignores --module) with no rank in the environment; `--backend slurm` is the SLURM way."""
BACKENDS = ("deepspeed", "torchrun", "slurm")
"""Per-node launchers."""


@dataclass
class LaunchOptions:
    """How to start a job on the nodes (the options of `zerollm launch`; see its --help)."""

    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    launcher: str = "pdsh"
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    nproc_per_node: int | None = None
    backend: str = "deepspeed"
    rdzv_id: str | None = None
    env: list[str] = field(default_factory=list)
    """NAME=VALUE items set in every rank's environment."""


def launcher_problem(value: str) -> str | None:
    """Why `value` cannot be a `--launcher`, or None when it can."""
    if value == "slurm":
        return ("DeepSpeed's slurm runner cannot start zerollm's ranks; on SLURM use "
                "`srun zerollm launch --backend slurm` (see launch/slurm/zerollm.sbatch)")
    if value not in HOSTFILE_LAUNCHERS:
        return f"invalid choice: {value!r} (choose from {', '.join(HOSTFILE_LAUNCHERS)})"
    return None


def launcher_name(value: str) -> str:
    """argparse type of `--launcher`."""
    problem = launcher_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value
