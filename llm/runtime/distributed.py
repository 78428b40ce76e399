"""Joining the job's process group: which rank this process is, which device it uses (CUDA, else Apple's MPS for
one rank, else the CPU), which backend, and a group of one when a rank is started directly (no launcher).

torchrun and DeepSpeed's per-node launcher set RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (or
LOCAL_SIZE). mpirun sets its own variables instead (Open MPI's OMPI_COMM_WORLD_*, MVAPICH2's MV2_COMM_WORLD_*,
the PMI_RANK/PMI_SIZE/MPI_LOCALRANKID of MPICH and Intel MPI, PMIX_RANK): `llm.runtime.rank_env` reads them
(without torch, so that a process that only starts ranks does not load it), so ranks started by `zerollm launch
--launcher openmpi|mvapich|mpich|impi` (or by mpirun directly, given MASTER_ADDR and MASTER_PORT) form one job
instead of each training alone.

DeepSpeed's accelerator is chosen before `deepspeed` is imported (`llm.runtime.accelerator`).

A rank uses the GPU of its local rank where it sees enough GPUs for its node's ranks, and its only GPU where it sees
one: under a launcher that gives each rank its rank variables (torchrun, DeepSpeed's launcher, mpirun of Open MPI,
MVAPICH2, MPICH or Intel MPI, PALS: `llm.runtime.rank_env`), with a GPU bound to each rank (a CUDA_VISIBLE_DEVICES
set per rank by a site's wrapper script, GPUs isolated by cgroups), every rank sees one GPU. srun sets no variable
`rank_env` reads (a plain srun task is a job of one): under `srun --gpus-per-task=1` each task needs a wrapper that
exports RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE from SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS and
SLURM_NTASKS_PER_NODE, and MASTER_ADDR and MASTER_PORT (docs/gpu.md). Such a rank's LOCAL_RANK is rewritten to 0,
the index DeepSpeed takes it for; DeepSpeed's features that take LOCAL_RANK for a rank's place on its node are
refused in every job (`llm.train.engine.resolve_ds_config`). Which of those GPUs are one and the same (a one-GPU
node started with `--nproc 2`) only the ranks together know: before NCCL starts, every rank writes its GPU's
identity to the rendezvous store, under keys of this attempt of the job (torchrun keeps one store across its
restarts), a few store operations per rank at any job size, and ranks that share a GPU are refused in one line
instead of NCCL's "Duplicate GPU detected" from every rank, or a hang.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn, TypeVar

import torch
from packaging.version import Version

from llm.errors import UserError, report
from llm.runtime.accelerator import ensure_accelerator_env, local_device_type
from llm.runtime.cpu_threads import cpu_claim, cpu_threads_per_rank, ranks_sharing_cpus
from llm.runtime.rank_env import rank_environment

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """This rank's place in the job. `local_rank` is its place on its node, as its launcher numbered it (the
    environment's LOCAL_RANK names its CUDA GPU once `setup_distributed` has run: 0 where a rank sees one)."""

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
        index = cuda_device_index(local_rank, local_world, torch.cuda.device_count())
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
        backend = "nccl"
        if index != local_rank:  # DeepSpeed takes LOCAL_RANK for the GPU's index (deepspeed.initialize's set_device,
            # zero.Init) and asserts that Open MPI's local rank, where set, is the same: both name the GPU it uses
            for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
                if name == "LOCAL_RANK" or name in os.environ:
                    os.environ[name] = str(index)
    else:
        device = torch.device(kind)
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    gpu = gpu_identity(index) if kind == "cuda" and world > 1 else None  # a failure here is no failure to meet
    try:
        left = timeout
        if rank != 0:  # what is left of the timeout once rank 0's store answers
            left = timedelta(seconds=_wait_for_rendezvous(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                          timeout_s))
        # the group is formed here rather than by deepspeed.init_distributed (which then only wraps it): its store
        # is needed before NCCL starts, and DeepSpeed would bind NCCL to the GPU of LOCAL_RANK and start it at once
        store, _, _ = next(torch.distributed.rendezvous("env://", rank, world, timeout=left))
        store.set_timeout(timeout)
        if gpu is not None:
            refuse_shared_gpus(store, rank, world, gpu, socket.gethostname())
        bind = kind == "cuda" and world > 1 and not Version("2.6.0") < Version(torch.__version__) < Version("2.7.1")
        # as DeepSpeed binds: a bound device starts NCCL now and splits later groups from it; torch 2.6 hangs with one
        # (pytorch#153960)
        torch.distributed.init_process_group(backend, store=torch.distributed.PrefixStore("default_pg", store),
                                             rank=rank, world_size=world, timeout=timeout,
                                             device_id=device if bind else None)
        deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)
        if kind != "cuda":  # the first collective: where ranks that each saw another world size part (rank 0 of a
            # node told 2 nodes, beside one told 3, met its store and timed out here, in a traceback)
            torch.set_num_threads(cpu_threads_per_rank(_ranks_sharing_my_cpus(world), os.environ))
    except (torch.distributed.DistError, RuntimeError, TimeoutError) as exc:
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        reason = str(exc).strip().splitlines()[-1]
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():  # said at once, not a timeout
            raise UserError(f"rank {rank}: port {os.environ['MASTER_PORT']} of {os.environ['MASTER_ADDR']} is taken "
                            "(another job's rendezvous?); start the job with another master port (--master_port P "
                            "for deepspeed, --master-port P for torchrun and zerollm launch), or with zerollm train "
                            "--nproc N, which picks a free one") from None
        raise UserError(f"rank {rank}: the {world} ranks did not all meet at {address} within "
                        f"train.collective_timeout_s={timeout_s:g} s ({reason}); start every node with the same node "
                        "count, ranks per node (--nproc-per-node), master address and port, and check that node 0 is "
                        "reachable from the others") from None
    return DistInfo(rank, local_rank, world, local_world, device)


RENDEZVOUS_RETRY_S = 0.5
"""How often a rank tries rank 0's store while it is not there yet."""


def _wait_for_rendezvous(address: str, port: int, timeout_s: float) -> float:
    """Wait until rank 0's store accepts connections at `address`:`port`, for at most `timeout_s`; the seconds left
    then, or a TimeoutError. torch's client retried with the whole timeout at each try (a rank waited 2 to 3 times
    train.collective_timeout_s for a node 0 that never came) and printed a C++ stack trace at each."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((address, port), timeout=max(0.1, min(5.0, left))).close()
            return max(RENDEZVOUS_RETRY_S, deadline - time.monotonic())
        except OSError as exc:
            if time.monotonic() + RENDEZVOUS_RETRY_S >= deadline:
                raise TimeoutError(f"nothing answered at {address}:{port} ({exc.strerror or exc})") from None
        time.sleep(RENDEZVOUS_RETRY_S)


GPU_PER_RANK = ("a CUDA_VISIBLE_DEVICES set per rank; under srun, --gpus-per-task=1 with a wrapper that exports each "
                "task's RANK and LOCAL_RANK: docs/gpu.md")
"""How a rank gets a GPU of its own, as the refusals of ranks without one say it."""


def cuda_device_index(local_rank: int, local_world: int, gpus: int) -> int:
    """The index of this rank's CUDA GPU among the `gpus` it sees: its local rank where it sees a GPU for each rank
    of its node up to its own, else 0 where it sees one (each rank of the node was given its own, or ranks share it:
    `refuse_shared_gpus` tells which). A UserError where it sees several but too few (printed once per node)."""
    if local_rank < gpus:
        return local_rank
    if gpus == 1:
        return 0
    ranks = max(local_world, local_rank + 1)
    raise UserError(f"this node starts {ranks} ranks but has {gpus} visible CUDA GPU(s), one per rank (local rank "
                    f"{gpus} and up have none): start no more ranks per node than it has GPUs (--nproc {gpus}; under "
                    f"zerollm launch, --nproc-per-node {gpus}), or make more GPUs visible (CUDA_VISIBLE_DEVICES), or "
                    f"bind one to each rank ({GPU_PER_RANK})", announce=local_rank == gpus)


def gpu_identity(index: int) -> str:
    """What names CUDA GPU `index` of this process the same in every process that sees it: its UUID, else the
    host and its PCI address."""
    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid.strip("0-"):  # as nvidia-smi -L shows it
        return f"GPU-{uuid}"
    return (f"{socket.gethostname()} PCI {getattr(props, 'pci_domain_id', 0):04x}:"
            f"{getattr(props, 'pci_bus_id', 0):02x}:{getattr(props, 'pci_device_id', 0):02x}")


def shared_gpu_message(first: tuple[int, str], second: tuple[int, str], gpu: str) -> str:
    """The refusal of two ranks, each (rank, host), that use one GPU."""
    (rank_a, host_a), (rank_b, host_b) = sorted([first, second])
    who = f"ranks {rank_a} and {rank_b} on {host_a}" if host_a == host_b else \
        f"rank {rank_a} on {host_a} and rank {rank_b} on {host_b}"
    return (f"{who} use the same CUDA GPU ({gpu}), and NCCL needs a GPU per rank: start at most as many ranks per "
            f"node as it has GPUs (--nproc, or --nproc-per-node under zerollm launch), or give each rank a GPU of its "
            f"own ({GPU_PER_RANK})")


_NO_SHARED_GPU = "-"


def gpu_check_prefix(environ: Mapping[str, str]) -> str:
    """The store prefix of `refuse_shared_gpus` in this attempt of the job: torchrun's run id and restart count,
    which its workers get in their environment (TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT). Its workers share
    the agent's store, which outlives a restart (--max-restarts): an attempt's keys must not be the last one's."""
    return f"zerollm_gpus/{environ.get('TORCHELASTIC_RUN_ID', '')}/{environ.get('TORCHELASTIC_RESTART_COUNT') or 0}"


def refuse_shared_gpus(store: torch.distributed.Store, rank: int, world: int, gpu: str, host: str) -> None:
    """Every rank of the job calls this (through `store`, the rendezvous store, not NCCL) with its GPU's identity
    (`gpu_identity`): if any two use the same GPU, every rank raises one UserError naming two of them, printed once.
    Four or five store operations per rank, whatever the job's size: a counter per GPU finds a second user, and the
    last rank to arrive tells the verdict to all. The keys are this attempt's (`gpu_check_prefix`)."""
    store = torch.distributed.PrefixStore(gpu_check_prefix(os.environ), store)
    users = store.add(f"gpu/{gpu}", 1)
    if users == 1:
        store.set(f"gpu/{gpu}/first", f"{rank} {host}")
    elif users == 2:  # the first rank to find a GPU shared says so, before any rank can learn the verdict and leave
        first_rank, first_host = store.get(f"gpu/{gpu}/first").decode().split(" ", 1)
        message = shared_gpu_message((int(first_rank), first_host), (rank, host), gpu)
        if store.add("shared", 1) == 1:
            report(message)
            store.set("message", message)
    if store.add("arrived", 1) == world:
        verdict = store.get("message").decode() if store.add("shared", 0) else _NO_SHARED_GPU
        store.set("verdict", verdict)
    else:
        verdict = store.get("verdict").decode()  # waits for the last rank
    if verdict == _NO_SHARED_GPU:
        return
    if store.add("left", 1) == world:
        store.set("all left", "")
    if rank == 0:  # the store's server lives in rank 0 where no torchrun agent holds it: it leaves last
        store.wait(["all left"])
    raise UserError(verdict, announce=False)


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
