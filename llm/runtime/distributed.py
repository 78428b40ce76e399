"""Joining the job's process group: which rank this process is, which device it uses (CUDA, else Apple's MPS for
one rank, else the CPU), which backend, and a group of one when a rank is started directly (no launcher).

torchrun and DeepSpeed's per-node launcher set RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (or
LOCAL_SIZE). mpirun sets its own variables instead (Open MPI's OMPI_COMM_WORLD_*, MVAPICH2's MV2_COMM_WORLD_*,
the PMI_RANK/PMI_SIZE/MPI_LOCALRANKID of MPICH and Intel MPI, PMIX_RANK): `llm.runtime.rank_env` reads them
(without torch, so that a process that only starts ranks does not load it), so ranks started by `zerollm launch
--launcher openmpi|mvapich|mpich|impi` (or by mpirun directly, given MASTER_ADDR and MASTER_PORT) form one job
instead of each training alone.

DeepSpeed's CPU accelerator must be selected before `deepspeed` is first imported, which
`ensure_accelerator_env` does; every module that imports deepspeed calls it first. The choice depends on the job's
size (MPS for one rank only), so a rank makes it again rather than keep the one it inherits from the process that
started it (`zerollm train --nproc N`, `zerollm launch`, DeepSpeed's runner), which chose for a job of one.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn, TypeVar

import torch

from llm.errors import UserError, report
from llm.runtime.cpu_threads import cpu_claim, cpu_threads_per_rank, ranks_sharing_cpus
from llm.runtime.rank_env import CHOSEN_ACCELERATOR, announced_world_size, rank_environment

T = TypeVar("T")


def training_device_type(cuda: bool, mps: bool, world_size: int) -> str:
    """Where a rank trains: a CUDA GPU when there is one; Apple's MPS for a single rank (a Mac has one GPU);
    else the CPU."""
    if cuda:
        return "cuda"
    return "mps" if mps and world_size == 1 else "cpu"


def local_device_type() -> str:
    return training_device_type(torch.cuda.is_available(), torch.backends.mps.is_available(),
                                announced_world_size(dict(os.environ)))


def ensure_accelerator_env() -> None:
    """Select DeepSpeed's accelerator (cpu or mps) for this process's job where there is no CUDA GPU and the user
    chose none, marking it as our choice; must run before deepspeed is imported. A marked choice this process
    inherited is made again, for this job's size."""
    inherited = os.environ.pop(CHOSEN_ACCELERATOR, None)
    if inherited is not None and os.environ.get("DS_ACCELERATOR") == inherited:
        del os.environ["DS_ACCELERATOR"]
    kind = local_device_type()
    if kind != "cuda" and "DS_ACCELERATOR" not in os.environ:
        os.environ["DS_ACCELERATOR"] = os.environ[CHOSEN_ACCELERATOR] = kind


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(timeout_s: float = 600.0) -> DistInfo:
    """Join the process group a launcher prepared, or form a group of one when started directly. Collectives
    (and the wait for every rank to join) fail after `timeout_s` instead of hanging."""
    os.environ.update(rank_environment(dict(os.environ)))
    ensure_accelerator_env()
    # DeepSpeed calls torch.distributed APIs that torch marks deprecated; the warnings are not the user's concern
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    import deepspeed  # noqa: PLC0415 - only after ensure_accelerator_env has chosen the accelerator

    if not torch.cuda.is_available():
        # DeepSpeed's CPU shared-memory all-reduce op is JIT-compiled at init (minutes on a busy machine) and its
        # /dev/shm buffers outlive killed or os._exit-ed jobs; marking it incompatible keeps plain gloo.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    kind = local_device_type()
    if kind == "cuda":
        gpus = torch.cuda.device_count()
        if local_rank >= gpus:  # set_device would end the rank with "CUDA error: invalid device ordinal"
            ranks = max(local_world, local_rank + 1)
            raise UserError(f"this node starts {ranks} ranks but has {gpus} visible CUDA GPU(s), one per rank (local "
                            f"rank {gpus} and up have none): start no more ranks per node than it has GPUs "
                            f"(--nproc {gpus}; under zerollm launch, --nproc-per-node {gpus}), or make more GPUs "
                            "visible (CUDA_VISIBLE_DEVICES)", announce=local_rank == gpus)  # printed once per node
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device(kind)
        backend = "gloo"
    try:
        deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timedelta(seconds=timeout_s))
    except (torch.distributed.DistError, RuntimeError, TimeoutError) as exc:
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        reason = str(exc).strip().splitlines()[-1]
        raise UserError(f"rank {rank}: the {world} ranks did not all meet at {address} within "
                        f"train.collective_timeout_s={timeout_s:g} s ({reason}); start every node with the same node "
                        "count, master address and port, and check that node 0 is reachable from the others") from None
    if kind != "cuda":
        torch.set_num_threads(cpu_threads_per_rank(_ranks_sharing_my_cpus(world), os.environ))
    return DistInfo(rank, local_rank, world, local_world, device)


def _many_ranks() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def raise_together(message: str, announce: bool, kind: type[UserError] = UserError) -> NoReturn:
    """Raise `message` on every rank (a collective: every rank calls it with the same message), printed where
    `announce` is true (one rank per node) before any rank leaves: a rank that ended first had its launcher kill
    the others, and with them a message not yet printed."""
    if announce:
        report(message)
    if _many_ranks():
        torch.distributed.barrier()
    raise kind(message, announce=False)


def refuse_together(problem: str | None, announce: bool) -> None:
    """Every rank raises the first refusal any rank found (`raise_together`; a collective: every rank calls it, with
    its own refusal or None). For checks whose answer may differ between ranks or hosts: a rank that refused alone
    left the others waiting in their next collective."""
    problems = [problem]
    if _many_ranks():
        problems = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(problems, problem)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise_together(first, announce)


def agreed(check: Callable[[], T], announce: bool) -> T:
    """`check()` on every rank (a collective), or its UserError on every rank where any rank's check raised one."""
    try:
        return_value, problem = check(), None
    except UserError as exc:
        return_value, problem = None, str(exc)
    refuse_together(problem, announce)
    return return_value


def _ranks_sharing_my_cpus(world: int) -> int:
    """Every rank asks (a collective): how many ranks of this node may run on a CPU this rank may run on."""
    mine = cpu_claim()
    claims = [mine] * world
    if world > 1:
        torch.distributed.all_gather_object(claims, mine)
    return ranks_sharing_cpus(mine, claims)
