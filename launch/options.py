"""What `zerollm launch` is told: the typed options the CLI hands to the launcher (standard library only, so
the CLI can build its parser without loading the launcher)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MASTER_PORT = 29500
SSH_LAUNCHERS = ("pdsh", "openmpi", "mvapich", "mpich", "impi", "slurm")
"""How DeepSpeed's runner reaches the hosts of a hostfile."""
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
