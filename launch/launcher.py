"""`zerollm launch`: check a multi-node job, then start the real launcher.

Three ways to start a job, one command for each:

- hostfile mode (`--hostfile FILE`): DeepSpeed's launcher reaches every host itself (pdsh by default,
  or mpirun with `--launcher openmpi|mvapich|mpich|impi`), with `--include/--exclude` under pdsh; what crosses
  to other hosts (training arguments, exported variables) is written so that it arrives unchanged
  (remote_shell.py, environment.py);
- per-node mode (`--nnodes N --node-rank R --master-addr A --master-port P`): you, or a scheduler, start
  one `zerollm launch` on every node; `--backend deepspeed` runs `deepspeed --no_ssh --node_rank R`,
  `--backend torchrun` runs torchrun with c10d rendezvous at A:P;
- SLURM (`--backend slurm`): per-node torchrun with N, R and A taken from the SLURM environment (see
  launch/slurm/zerollm.sbatch, which starts one launcher per node with srun).

Before starting anything: the hostfile is checked, an option the chosen mode would ignore is refused, the program
DeepSpeed's runner reaches the hosts with (pdsh, mpirun) is on PATH, every host pdsh will reach answers over ssh
and, without --master-addr, the first gives its address (reachable.py), the training command has been parsed and
its config built by the CLI (a bad key fails there, not on 100 ranks), the node hosting the rendezvous checks
that the master address is its own and the master port is free, and, where ranks will run on this node, what they
read (the prepared data, GRPO's prompts, a distillation teacher) is checked (`launch`'s `check_inputs`). Once the
ranks meet they compare fingerprints (llm/runtime/fingerprint.py) and watch each other (llm/runtime/watchdog.py).

SIGTERM/SIGINT to `zerollm launch` is forwarded to the training ranks: they agree to stop, save a
checkpoint and the launch exits 75 (`EXIT_PREEMPTED`); `--resume auto` continues, on any number of ranks. A rank
ended by a signal (the OOM killer's SIGKILL) is reported in one line and the launch exits 76 (`EXIT_RANK_LOST`), under
DeepSpeed's launcher (`run_plan`) as under torchrun (launch/torchrun.py); a rank that failed with an exit code of its
own ends the launch with that code, under either.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from launch.deepspeed_launcher import quiet
from launch.environment import env_file_text, parse_env, remote_exports
from launch.hostfile import (
    MAX_SLOTS_PER_HOST,
    active_slots,
    check_address,
    check_filter,
    hostfile_text,
    read_hostfile,
    read_integer,
)
from launch.local import RESUME_ADVICE, STOPPED_AT_ONCE, exit_code, report_rank_ended
from launch.nodelist import nodelist_size, slurm_hosts
from launch.options import LaunchOptions, launcher_problem
from launch.own_module import own_module, zerollm_program, zerollm_script
from launch.reachable import check_reachable, host_address
from launch.remote_shell import check_shell_word, pdsh_argument
from llm import rundir
from llm.command_line import is_zerollm_command
from llm.errors import EXIT_PREEMPTED, EXIT_RANK_LOST, STOP_SIGNALS, UserError, report
from llm.loopback import is_loopback, is_unspecified
from llm.runtime.accelerator import ensure_accelerator_env
from llm.runtime.cpu_threads import cpu_threads_per_rank
from llm.runtime.rank_env import port_in_use
from llm.runtime.supervisor import started_here, supervisor_env
from llm.wording import plural

MAX_PORT = 65535
MAX_NODES = 65536
"""The most nodes one job runs on (--nnodes, SLURM_JOB_NUM_NODES): beyond any cluster, and small enough that a mistyped
number is an error rather than a hostfile of billions of lines or a rendezvous that waits for ever."""
LAUNCHER_PROGRAMS = {"pdsh": ("pdsh",), "openmpi": ("ompi_info", "mpirun"), "mvapich": ("mpiname", "mpirun"),
                     "mpich": ("mpirun",), "impi": ("mpirun",)}
"""What DeepSpeed's runner looks for (its `backend_exists`) and runs, for each --launcher reaching other hosts."""
_INSTALL = {"pdsh": "pdsh (e.g. `apt install pdsh`)", "openmpi": "Open MPI", "mvapich": "MVAPICH2-GDR",
            "mpich": "MPICH", "impi": "Intel MPI"}
_EQUAL_SLOTS = ("mvapich", "mpich", "impi")
"""DeepSpeed's runners for these place the same number of ranks on every host."""


TEMP_DIR = "{dir}"


@dataclass
class Plan:
    """The launcher command this node runs, the training command it starts, its environment additions and the files
    it needs while running."""
    command: list[str]
    """The launcher and its options; a part starting with `{dir}/` names one of `files` in a temporary directory."""
    job: list[str]
    """The training command as the launcher must receive it (quoted for the remote shell where one reads it)."""
    env: dict[str, str] = field(default_factory=dict)
    """Added to the launcher's environment as they are."""
    files: dict[str, str] = field(default_factory=dict)
    """name -> content, written to the temporary directory."""
    file_env: dict[str, str] = field(default_factory=dict)
    """Variables added to the launcher's environment that name one of `files`: variable -> file name."""
    ssh_hosts: list[str] = field(default_factory=list)
    """Hosts the launcher reaches over ssh (pdsh's): each is asked before it starts (`launch.reachable`)."""
    address_of: str | None = None
    """The host whose address, asked over ssh once `ssh_hosts` answer, is the rendezvous (pdsh without
    --master-addr): given to the launcher as its --master_addr (`with_master`)."""
    programs: tuple[str, ...] = ()
    """Programs DeepSpeed's runner needs on this node's PATH to reach the hosts (pdsh, mpirun, ...): each is looked
    for before anything starts (`check_programs`)."""
    stop_wait_s: float = 0.0
    """After a stop was forwarded, how long to wait for the checkpoint the ranks save when the launcher ends without
    it published: DeepSpeed's pdsh runner on several hosts exits 1 s after it has pdsh kill the ranks' launchers,
    while the ranks are still saving (`STOP_WAIT_S`)."""
    ranks_here: bool = True
    """Whether ranks run on this node (a hostfile may list only other hosts): its inputs are then checked here
    before the launcher starts (`launch`)."""
    reaches_hosts: bool = False
    """Whether the launcher starts the ranks on other hosts itself (pdsh, mpirun), which stop their hosts' processes
    on a stop signal; otherwise a stop before any rank runs goes to every process the launcher started
    (`run_plan`)."""
    deepspeed_codes: bool = True
    """Whether the launcher ends as DeepSpeed's per-node launcher does, with the failed rank's return code, a death
    by signal N passed on as 256 - N: DeepSpeed's and launch/torchrun.py (for a signal it does not name itself) do,
    mpirun does not."""

    def with_master(self, address: str) -> Plan:
        at = self.command.index("--no_local_rank")
        return replace(self, command=[*self.command[:at], "--master_addr", address, *self.command[at:]],
                                   address_of=None)

    def argv(self, directory: str) -> list[str]:
        return [directory + part[len(TEMP_DIR):] if part.startswith(TEMP_DIR + "/") else part
                for part in self.command] + self.job

    def environment(self, directory: str) -> dict[str, str]:
        return {**self.env, **{variable: str(Path(directory, name)) for variable, name in self.file_env.items()}}


# ---- checks ------------------------------------------------------------------------------------


def check_numbers(args: LaunchOptions) -> None:
    """The counts and the master port, before anything reads them: the launchers would run one rank for
    --nproc-per-node 0, and a port outside 1..65535 fails only in the ranks."""
    for option, count in (("--nnodes", args.nnodes), ("--nproc-per-node", args.nproc_per_node)):
        if count is not None and count < 1:
            raise UserError(f"{option} must be at least 1, got {count}")
    if args.nnodes is not None and args.nnodes > MAX_NODES:
        raise UserError(f"--nnodes {args.nnodes}: at most {MAX_NODES} nodes run one job")
    if args.nproc_per_node is not None and args.nproc_per_node > MAX_SLOTS_PER_HOST:
        raise UserError(f"--nproc-per-node {args.nproc_per_node}: at most {MAX_SLOTS_PER_HOST} ranks run on one node")
    if not 1 <= args.master_port <= MAX_PORT:
        raise UserError(f"--master-port must be a TCP port, 1..{MAX_PORT}, got {args.master_port}")


def is_local_address(address: str) -> bool:
    """Whether this node can listen on `address`: a host name, an IPv4 or an IPv6 address (an IPv4 socket took
    '::1' for a name that resolves to nothing)."""
    try:
        found = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, protocol, _, where in found:
        try:
            with socket.socket(family, kind, protocol) as s:
                s.bind(where)
            return True
        except OSError:
            continue
    return False


def check_port_free(port: int) -> None:
    """The rendezvous store listens on every interface of the node hosting it; the port must be free there."""
    if port_in_use(port):
        raise UserError(f"master port {port} is already in use on this node (another job?); "
                        "choose a free one with --master-port")


def _slurm_number(environ: dict[str, str], name: str, low: int, high: int, meaning: str) -> int:
    """The SLURM variable `name` as a whole number in low..high, else one line naming it and its value."""
    value = read_integer(environ[name])
    if value is None or not low <= value <= high:
        raise UserError(f"{name} is {environ[name]!r}; expected {meaning}, a whole number in {low}..{high}")
    return value


def slurm_rendezvous(environ: dict[str, str]) -> tuple[int, int, str]:
    """(nodes, this node's rank, first host) of the SLURM job step this process runs in: a step may run on fewer
    nodes than the allocation (`salloc -N4`, then `srun -N2`), and SLURM_NODEID counts the step's nodes, so the
    step's SLURM_STEP_NUM_NODES and SLURM_STEP_NODELIST are read where set, else the job's."""
    count, nodelist = (next((name for name in (f"SLURM_STEP_{what}", f"SLURM_JOB_{what}") if name in environ),
                            f"SLURM_JOB_{what}") for what in ("NUM_NODES", "NODELIST"))
    missing = [k for k in (count, "SLURM_NODEID", nodelist) if k not in environ]
    if missing:
        raise UserError(f"--backend slurm runs inside a SLURM job step (srun); {', '.join(missing)} not set")
    nodes = _slurm_number(environ, count, 1, MAX_NODES, "the number of nodes of the job step")
    node_rank = _slurm_number(environ, "SLURM_NODEID", 0, nodes - 1, f"this node's index among {count}={nodes}")
    try:  # counted before they are listed, here or by scontrol: node[1-20000000] filled the memory
        named = nodelist_size(environ[nodelist])
    except UserError:  # a form only scontrol reads: it lists the hosts
        named = None
    if named in (None, nodes):
        hosts = slurm_hosts(environ[nodelist], environ.get("PATH"))
        named = len(hosts)
    if named != nodes:
        raise UserError(f"{nodelist} {environ[nodelist]!r} names {named:,} host(s) but {count} is {nodes}")
    if nodes > 1 and "SLURM_STEP_ID" not in environ:  # srun sets it; a batch script's own shell, on one node, not
        raise UserError(f"--backend slurm on the {nodes} nodes of {count} runs once on each node: start it with srun "
                        "--ntasks-per-node=1 (as launch/slurm/zerollm.sbatch does); run alone, from the batch "
                        "script, it waited for the other nodes until train.collective_timeout_s")
    tasks = "SLURM_STEP_NUM_TASKS"  # srun's (a batch script's SLURM_NTASKS may count GPUs: its launch runs alone)
    if tasks in environ and environ[tasks].strip() != str(nodes):  # two on a node: one was told its port was taken
        raise UserError(f"{tasks} is {environ[tasks]!r} but the step runs on {nodes} node(s): zerollm launch is one "
                        "task per node, which starts the node's ranks itself; run it with srun --ntasks-per-node=1 "
                        "(as launch/slurm/zerollm.sbatch does)")
    return nodes, node_rank, hosts[0]


def slurm_ranks_per_node(environ: dict[str, str]) -> int:
    """Ranks on this node when --nproc-per-node is not given: SLURM_GPUS_ON_NODE, or 1 where it is not set."""
    if "SLURM_GPUS_ON_NODE" not in environ:
        return 1
    return _slurm_number(environ, "SLURM_GPUS_ON_NODE", 1, MAX_SLOTS_PER_HOST,
                         "the GPUs of this node (or give --nproc-per-node)")


# ---- plans -------------------------------------------------------------------------------------

def rank_program() -> tuple[str, ...]:
    """What DeepSpeed's launchers start on every rank (`zerollm_program`), in their words: `--module llm` for `-m
    llm`."""
    program = zerollm_program()
    return ("--module", "llm") if program[0] == "-m" else tuple(program)


def deepspeed_runner(*options: str, program: tuple[str, ...] | None = None) -> list[str]:
    """DeepSpeed's runner with `options`, starting `program` (`rank_program()` by default) on every rank; the training
    arguments follow. Run through launch/deepspeed_launcher.py, quiet where its output's reader left."""
    return [*quiet("deepspeed.launcher.runner"), *options, "--no_local_rank", *(program or rank_program())]


def console_script() -> str:
    """The `zerollm` script of this installation, which DeepSpeed's MPICH runner needs (it takes no module)."""
    script = zerollm_script(search_path=True)
    if script is None:
        raise UserError("--launcher mpich starts every rank as `python PATH/zerollm ...`, but no zerollm console "
                        f"script (the one pip installs) is beside {sys.executable} or on PATH; install the package "
                        "(pip install -e .)")
    return script


VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def plan_launch(args: LaunchOptions, train_argv: list[str], environ: dict[str, str]) -> Plan:
    """Check the launch options and build the launcher command for this node."""
    check_numbers(args)
    env = parse_env(args.env)
    if args.master_addr is not None:
        check_address(args.master_addr, "--master-addr")
    nproc = args.nproc_per_node
    if args.backend == "slurm":
        given = [option for option, value in (("--hostfile", args.hostfile), ("--nnodes", args.nnodes),
                                               ("--node-rank", args.node_rank), ("--include", args.include),
                                               ("--exclude", args.exclude),
                                               ("--launcher", args.launcher if args.launcher != "pdsh" else None))
                 if value not in (None, "")]
        if given:
            raise UserError(f"--backend slurm takes the nodes from SLURM; drop {'/'.join(given)}")
        nnodes, node_rank, master = slurm_rendezvous(environ)
        nproc = nproc or slurm_ranks_per_node(environ)
        return _plan_torchrun(nnodes, node_rank, args.master_addr or master, args.master_port, nproc,
                              args.rdzv_id or environ.get("SLURM_JOB_ID", "zerollm"), env, environ, train_argv,
                              master_from=None if args.master_addr else "the first host of SLURM's node list")
    if (args.include or args.exclude) and not args.hostfile:
        raise UserError("--include/--exclude select hosts of a --hostfile")
    if args.rdzv_id is not None and args.backend == "deepspeed":
        raise UserError("--rdzv-id names a torchrun rendezvous (--backend torchrun or slurm); DeepSpeed's launcher "
                        "takes none: drop it")
    if args.hostfile and args.node_rank is None:
        if args.backend == "torchrun":
            raise UserError("--hostfile is for --backend deepspeed; torchrun nodes meet at --master-addr: start "
                            "`zerollm launch --backend torchrun --nnodes N --node-rank R --master-addr A` on every "
                            "node")
        if args.nnodes is not None:
            raise UserError(f"--nnodes without --node-rank: a --hostfile job runs on every host of {args.hostfile} "
                            "(choose them with --include/--exclude); per-node mode needs --nnodes, --node-rank and "
                            "--master-addr on every node")
        return _plan_hostfile(args, env, train_argv, environ)
    if args.launcher != "pdsh":
        raise UserError(f"--launcher {args.launcher} is how DeepSpeed's launcher reaches the hosts of a --hostfile "
                        "from one node; " + ("in per-node mode every node starts its own ranks: drop it"
                                             if args.node_rank is not None or args.nnodes else "give a --hostfile"))
    per_node = args.node_rank is not None or args.nnodes
    if per_node and (args.nnodes is None or args.node_rank is None or args.master_addr is None):
        raise UserError("per-node mode needs --nnodes, --node-rank and --master-addr on every node")
    nnodes, node_rank = (args.nnodes, args.node_rank) if per_node else (1, 0)
    master = args.master_addr or "127.0.0.1"
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    visible = visible_devices({**environ, **env}) if args.backend == "deepspeed" else None  # torchrun keeps it
    given = _devices_given(env) if args.backend == "torchrun" else None
    nproc = nproc or (len(visible) if visible else max(1, given) if given is not None else _local_devices())
    if args.backend == "torchrun":
        if args.hostfile:
            raise UserError("--hostfile is for --backend deepspeed; torchrun nodes meet at --master-addr")
        return _plan_torchrun(nnodes, node_rank, master, args.master_port, nproc, args.rdzv_id or "zerollm", env,
                              environ, train_argv)
    _check_rendezvous_host(node_rank, master, args.master_port)
    if args.hostfile:
        if args.include or args.exclude:
            raise UserError("--include/--exclude select the hosts DeepSpeed's launcher reaches from one node; in "
                            f"per-node mode every host of {args.hostfile} runs: list only the nodes to use")
        hosts = read_hostfile(args.hostfile)
        if len(hosts) != nnodes:
            raise UserError(f"{args.hostfile} lists {len(hosts)} hosts but --nnodes is {nnodes}")
        if args.nproc_per_node:  # as in hostfile mode, where DeepSpeed's --num_gpus sets every host's ranks
            hosts = dict.fromkeys(hosts, args.nproc_per_node)
    else:
        hosts = {f"node{i}": nproc for i in range(nnodes)}
    options = ["--hostfile", f"{TEMP_DIR}/hostfile", "--no_ssh", "--node_rank", str(node_rank), "--master_addr",
               master, "--master_port", str(args.master_port)]
    if visible:  # DeepSpeed's launcher gives a node's ranks the GPUs of its slots: these slots, not 0..n-1
        per_host = {host: _first_visible(visible, ranks) for host, ranks in hosts.items()}
        hosts = {host: max(ids) + 1 for host, ids in per_host.items()}
        options += ["--include", "@".join(f"{host}:{','.join(map(str, ids))}" for host, ids in per_host.items())]
    return Plan(deepspeed_runner(*options), train_argv, env, {"hostfile": hostfile_text(hosts)})


def visible_devices(environ: dict[str, str]) -> list[int] | None:
    """The GPU indices CUDA_VISIBLE_DEVICES names in `environ` (this shell's with --env's over it), read as CUDA reads
    it: each entry's leading number, up to the first entry without one (`2,3,` is GPUs 2 and 3: it was taken for no
    GPU, and the ranks got GPUs 0 and 1); None where it names no GPU (unset, -1, SLURM's NoDevFiles). DeepSpeed's
    launcher sets it for every rank from the hostfile's slots (0..n-1 with our own hostfile): the GPUs a user chose
    were replaced by others, perhaps another job's. GPUs it cannot name by a slot (UUIDs, MIG devices), or named
    twice, are refused."""
    text = environ.get(VISIBLE_DEVICES, "").strip()
    ids = []
    for part in text.split(","):
        number = re.match(r"\s*([0-9]+)", part)
        if number is None:
            break
        ids.append(int(number[1]))
    if ids and len(set(ids)) == len(ids):
        return ids
    if ids or re.match(r"(GPU|MIG)-", text):
        raise UserError(f"{VISIBLE_DEVICES}={text}: DeepSpeed's launcher gives the ranks GPUs by index and would "
                        "replace it; give each GPU's index once (as nvidia-smi numbers them), or use --backend "
                        "torchrun, which keeps the variable as it is")
    return None


def _devices_given(env: dict[str, str]) -> int | None:
    """How many GPUs a CUDA_VISIBLE_DEVICES given with --env leaves the ranks, read as CUDA reads it (entries up to
    the first that names no GPU by index or UUID); None where --env does not set it (torch counts this process's
    own). A torchrun node counted all of the node's GPUs: ranks beyond those named found none."""
    if VISIBLE_DEVICES not in env:
        return None
    entries = env[VISIBLE_DEVICES].split(",")
    return next((i for i, entry in enumerate(entries) if not re.match(r"\s*([0-9]|GPU-|MIG-)", entry)), len(entries))


def _first_visible(visible: list[int], ranks: int) -> list[int]:
    if ranks > len(visible):
        raise UserError(f"{ranks} ranks per node, but {VISIBLE_DEVICES}={','.join(map(str, visible))} names "
                        f"{len(visible)} GPUs; lower --nproc-per-node or name more")
    return visible[:ranks]


def _local_devices() -> int:
    import torch  # noqa: PLC0415 - torch only when the GPUs must be counted: a refused launch answers without it

    return max(1, torch.cuda.device_count())


def _check_rendezvous_host(node_rank: int, master: str, port: int, master_from: str | None = None) -> None:
    """On node rank 0, which hosts the rendezvous: `master` (--master-addr, or what `master_from` says it is) must be
    an address of this node, and `port` free. On the others a --master-addr must resolve: a name that does not had
    the node wait train.collective_timeout_s (10 minutes by default) before it said so. (A scheduler's node names,
    `master_from`, are its cluster's own.)"""
    if node_rank != 0:
        try:
            if master_from is None:
                socket.getaddrinfo(master, port)
        except (socket.gaierror, UnicodeError) as exc:
            raise UserError(f"--master-addr {master}: this node cannot resolve it "
                            f"({getattr(exc, 'strerror', None) or exc}); give node 0's IP address, or a name this node "
                            "resolves") from None
        return
    if not is_local_address(master):
        named, option = (f"--master-addr {master}", "") if master_from is None else \
            (f"{master} ({master_from})", " with --master-addr")
        raise UserError(f"{named} is not an address of this node, but node rank 0 hosts the rendezvous; give node "
                        f"0's own address{option}")
    check_port_free(port)


def collective_timeout_s(train_argv: list[str]) -> float:
    """train.collective_timeout_s of the training command (its --recipe and --set overrides, checked by the CLI
    already), as its ranks will read it; the config's default where the command names no recipe (plans built for
    tests)."""
    from llm.config import TrainConfig, build_config  # noqa: PLC0415 - only for torchrun and pdsh plans

    parser = argparse.ArgumentParser(add_help=False)  # abbreviations as the training command's parser takes them
    parser.add_argument("--recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    known, _ = parser.parse_known_args(train_argv[2:])
    if known.recipe is None:
        return TrainConfig().collective_timeout_s
    try:
        return float(build_config(known.recipe, known.overrides).train.collective_timeout_s)
    except UserError:
        return TrainConfig().collective_timeout_s


def _plan_torchrun(nnodes: int, node_rank: int, master: str, port: int, nproc: int, rdzv_id: str,
                   env: dict[str, str], environ: dict[str, str], train_argv: list[str],
                   master_from: str | None = None) -> Plan:
    """torchrun with c10d rendezvous, through launch/torchrun.py (ranks that refuse their job end it with exit 2, as
    under DeepSpeed's launcher). torchrun gives every rank OMP_NUM_THREADS=1 where it is not set; a CPU job's ranks
    share the node's CPUs instead (`llm.runtime.cpu_threads`), unless the variable is set here or in --env. The
    nodes wait for each other train.collective_timeout_s, as ranks under DeepSpeed's launcher do (torchrun's own
    default is 600 s, whatever the config says). `master_from`: what `master` is where --master-addr did not give
    it."""
    _check_rendezvous_host(node_rank, master, port, master_from)
    if "OMP_NUM_THREADS" not in environ:
        env = {"OMP_NUM_THREADS": str(cpu_threads_per_rank(nproc, {})), **env}
    join_timeout = max(1, math.ceil(collective_timeout_s(train_argv)))
    command = [*own_module("launch.torchrun"), "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{port}", "--rdzv-id", rdzv_id,
               "--rdzv-conf", f"is_host={int(node_rank == 0)},join_timeout={join_timeout}", "--max-restarts", "0",
               *zerollm_program()]
    return Plan(command, train_argv, env)


def _check_mpi_selection(args: LaunchOptions, active: dict[str, list[int]]) -> None:
    """What DeepSpeed's MPI runners cannot express, refused here instead of by a traceback on the way."""
    if args.include or args.exclude or args.nproc_per_node:
        raise UserError(f"--launcher {args.launcher} runs every slot of the hostfile (DeepSpeed's MPI runners take no "
                        "--include/--exclude/--nproc-per-node); write a hostfile with the hosts and slots to use")
    counts = {host: len(slots) for host, slots in active.items()}
    if args.launcher in _EQUAL_SLOTS and len(set(counts.values())) > 1:
        raise UserError(f"--launcher {args.launcher} needs the same slots on every host of {args.hostfile}, got "
                        + ", ".join(f"{host} slots={count}" for host, count in counts.items()))


def _selected_slots(args: LaunchOptions) -> tuple[dict[str, int], dict[str, list[int]]]:
    """(hosts of the hostfile, slots the job runs on), after checking the selection options."""
    problem = launcher_problem(args.launcher)
    if problem:
        raise UserError(f"--launcher {args.launcher}: {problem}")
    hosts = read_hostfile(args.hostfile)
    if args.nproc_per_node and (args.include or args.exclude):
        raise UserError("--nproc-per-node cannot be combined with --include/--exclude (DeepSpeed refuses both); "
                        "select slots with --include host:0,1 instead")
    if args.include and args.exclude:
        raise UserError("--include and --exclude cannot be combined (DeepSpeed refuses both); use one of them")
    for spec, option in ((args.include, "--include"), (args.exclude, "--exclude")):
        if spec:
            check_filter(hosts, spec, option, args.hostfile)
    active = active_slots(hosts, args.include, args.exclude, args.nproc_per_node)
    if not active:
        raise UserError(f"--exclude {args.exclude} leaves no slot of {args.hostfile} to run on")
    return hosts, active


def _plan_hostfile(args: LaunchOptions, env: dict[str, str], train_argv: list[str], environ: dict[str, str]) -> Plan:
    """DeepSpeed's runner reaching the hosts of a hostfile; on one local host it starts the ranks itself."""
    hosts, active = _selected_slots(args)
    first = next(iter(active))
    options = ["--hostfile", f"{TEMP_DIR}/hostfile", "--launcher", args.launcher,
               "--master_port", str(args.master_port)]
    options += ["--include", args.include] if args.include else []
    options += ["--exclude", args.exclude] if args.exclude else []
    options += ["--num_gpus", str(args.nproc_per_node)] if args.nproc_per_node else []
    files = {"hostfile": hostfile_text(hosts)}
    here = [host for host in active if is_local_address(host)]  # each asked once: a name may take a DNS lookup
    chosen = visible_devices({**environ, **env})
    if chosen and chosen != list(range(len(chosen))) and not args.include and (VISIBLE_DEVICES in env or here):
        ids = ",".join(map(str, chosen))
        raise UserError(f"{VISIBLE_DEVICES}={ids}, but DeepSpeed's launcher gives each host's ranks the GPUs of its "
                        f"slots in {args.hostfile}, from 0 (it replaces the variable): select them with --include "
                        f"instead, e.g. --include {first}:{ids} (the hostfile giving {first} at least "
                        f"{max(chosen) + 1} slots)")
    first_is_here = first in here
    if first_is_here and args.master_addr is not None and not is_local_address(args.master_addr):
        raise UserError(f"--master-addr {args.master_addr} is not an address of this node, but the first host of "
                        f"{args.hostfile}, {first}, is this node and hosts the rendezvous (rank 0); give its own "
                        "address, or drop --master-addr")
    if len(active) == 1 and first_is_here and args.launcher == "pdsh":  # DeepSpeed starts the ranks here itself
        master = args.master_addr or "127.0.0.1"
        _check_port_if_local(master, args.master_port)
        return Plan(deepspeed_runner(*options, "--no_ssh_check", "--master_addr", master), train_argv, env, files)
    # one host: reach it as several are (a remote one is not run here; an MPI launcher asked for is used, not dropped)
    options += ["--force_multi"] if len(active) == 1 else []
    program, job, master, ssh_hosts = rank_program(), train_argv, args.master_addr, []
    if args.launcher == "pdsh":
        options.append("--no_ssh_check")  # every host is asked first, with pdsh's ssh options (launch.reachable)
        ssh_hosts = list(active)
        check_shell_word(str(Path.cwd()), "the working directory")
        check_shell_word(sys.executable, "the Python interpreter")
        check_shell_word(program[-1], "the zerollm script")
        job = [pdsh_argument(arg) for arg in train_argv]
    else:
        _check_mpi_selection(args, active)
        master = master or first  # MPI places rank 0 on the first host
        env = {**env, "MASTER_ADDR": master, "MASTER_PORT": str(args.master_port)}
        options.append("--no_ssh_check")  # mpirun reaches the hosts its own way
        program = (console_script(),) if args.launcher == "mpich" else program
    if master:  # pdsh without one: asked of the first host at launch
        _check_rendezvous_reachable(master, active, here, "--master-addr" if args.master_addr else
                                    f"the first host of {args.hostfile}, where MPI places rank 0 (the rendezvous),")
        options += ["--master_addr", master]
    _check_port_if_local(master or first, args.master_port)
    home = Path(environ["HOME"]) if environ.get("HOME") else Path.home()  # where DeepSpeed's runner looks
    files["deepspeed_env"] = env_file_text(remote_exports(env, environ, Path.cwd(), home), args.launcher)
    return Plan(deepspeed_runner(*options, program=program), job, files=files, reaches_hosts=True,
                file_env={"DS_ENV_FILE": "deepspeed_env"}, ssh_hosts=ssh_hosts, address_of=None if master else first,
                ranks_here=bool(here),
                programs=LAUNCHER_PROGRAMS[args.launcher], deepspeed_codes=args.launcher == "pdsh",
                stop_wait_s=STOP_WAIT_S if args.launcher == "pdsh" else 0.0)


def _check_rendezvous_reachable(master: str, active: dict[str, int], here: list[str], origin: str) -> None:
    """Refuse a rendezvous address (`origin` says where it came from) that only one machine reaches, for a job
    whose ranks run on several (the `active` hosts, `here` those of this node): those of the others would wait for
    a rendezvous at their own loopback until the collective timeout."""
    others = [host for host in active if host not in here]
    kind = "a loopback address" if is_loopback(master) else \
        "the unspecified address (a host connecting to it reaches itself)" if is_unspecified(master) else None
    if kind and len(others) + bool(here) > 1:
        raise UserError(f"{origin} {master} is {kind}, which the ranks on {others[-1]} cannot reach (they would look "
                        "for the rendezvous on their own host); give an address of the first host that the others "
                        "reach")


def _check_port_if_local(master: str, port: int) -> None:
    if is_local_address(master):
        check_port_free(port)


# ---- running -----------------------------------------------------------------------------------


def _rank_processes(launcher_pid: int) -> list:
    """The training processes under the launcher on this node."""
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ranks = []
    for child in children:
        try:
            if is_zerollm_command(child.cmdline()):
                ranks.append(child)
        except psutil.Error:
            continue
    return ranks


def _preempted_since(run_dir: Path, since: float) -> bool:
    """Whether the ranks published a checkpoint saved on a stop signal after `since`."""
    try:
        tag = rundir.latest_tag(run_dir)
        state_file = rundir.checkpoint_dir(run_dir) / str(tag) / rundir.CLIENT_STATE
        return tag is not None and state_file.stat().st_mtime >= since and \
            rundir.client_state_of(run_dir, tag).get("stopped_by_signal", False)
    except (OSError, UserError, ValueError):
        return False


def _end_with_parent() -> None:
    """Run in the launcher child before exec: SIGTERM it when `zerollm launch` dies, even by SIGKILL (Linux only).
    torchrun then stops its ranks; under DeepSpeed's runner the ranks notice themselves (llm/runtime/supervisor.py)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


SSH_FAILED = 255
"""ssh's exit code for its own failure (a host that cannot be reached, a connection that drops), which pdsh, and so
DeepSpeed's pdsh runner, passes on."""


def deepspeed_signal(code: int) -> int | None:
    """The signal that ended a rank, read from the exit code of DeepSpeed's runner: its per-node launcher exits with
    the rank's return code, -N for signal N, which the process reports as 256 - N (247 for SIGKILL); None for any
    other code (SIGHUP's 255 is also ssh's code for a failed connection)."""
    return 256 - code if 192 < code < SSH_FAILED else None  # not 255: ssh's own failure, passed on by pdsh


POLL_S = 0.25
"""How often a stopped launch looks for the checkpoint of the stop (`_wait_for_preempted`), or for the ranks of this
node to end (`_wait_for_ranks_here`)."""
STOP_WAIT_S = 60.0
"""The longest a stopped launch waits for the checkpoint of the ranks on other hosts (`Plan.stop_wait_s`), or for
ranks of this node that outlived the launcher (`_wait_for_ranks_here`): DeepSpeed's per-node launcher kills a rank
30 s after its SIGTERM, so their checkpoint comes within that or never."""


def _wait_for_preempted(run_dir: Path, since: float, bound_s: float, stopping: list[int]) -> bool:
    """Wait up to `bound_s` for the ranks to publish the checkpoint of a stop (`_preempted_since`); another stop
    signal (appended to `stopping`) ends the wait."""
    print(f"zerollm launch: waiting up to {bound_s:g} s for the ranks of the other hosts to publish the checkpoint "
          f"they save in {run_dir} (stop again to end the wait)", flush=True)
    signals, deadline = len(stopping), time.monotonic() + bound_s
    while not (found := _preempted_since(run_dir, since)) and time.monotonic() < deadline and \
            len(stopping) == signals:
        time.sleep(POLL_S)
    return found


def _ranks_here() -> list[psutil.Process]:
    """The training ranks this launch started on this node that still run, wherever they were re-parented (a zombie
    that nothing reaps, in a container whose first process reaps no orphans, has ended); not their data-loader
    workers, forked with a rank's command line."""
    parents = {}
    for process in started_here():
        with contextlib.suppress(psutil.Error):  # ended meanwhile
            if is_zerollm_command(process.cmdline()):
                parents[process] = process.ppid()
    pids = {process.pid for process in parents}
    return [process for process, parent in parents.items() if parent not in pids]


def _wait_for_ranks_here(run_dir: Path, since: float, stopping: list[int]) -> bool:
    """Where the launcher ended on a stop while ranks it started on this node still run (a stop signal sent to every
    process of the job at once, as `systemctl stop` or SLURM's signalling of a job step do: DeepSpeed's runner dies
    of it, its ranks save), wait up to `STOP_WAIT_S` for them to end (another stop ends the wait), then whether they
    published the checkpoint of the stop."""
    ranks = _ranks_here()
    if not ranks:
        return False
    print(f"zerollm launch: waiting up to {STOP_WAIT_S:g} s for the {len(ranks)} {plural('rank', len(ranks))} on "
          f"this node to save a checkpoint in {run_dir} and end (stop again to end the wait)", flush=True)
    signals, deadline = len(stopping), time.monotonic() + STOP_WAIT_S
    while _ranks_here() and time.monotonic() < deadline and len(stopping) == signals:
        time.sleep(POLL_S)
    return _preempted_since(run_dir, since)


def run_plan(plan: Plan, run_dir: Path) -> int:
    """Start the launcher in its own session, forward SIGTERM/SIGINT to the training ranks, return the exit code:
    EXIT_PREEMPTED when the ranks published a checkpoint saved on a stop signal during this launch (here or on
    another node), whatever code the launcher reports; EXIT_RANK_LOST, in one line, when the launcher reports a rank
    ended by a signal as DeepSpeed's does (256 - N; it does not say which); else the launcher's code, which under
    DeepSpeed's launcher and launch/torchrun.py is the failed rank's own (torchrun alone exits 1)."""
    ensure_accelerator_env()
    stopping: list[int] = []
    with tempfile.TemporaryDirectory(prefix="zerollm-launch-") as tmp:
        for name, content in plan.files.items():
            Path(tmp, name).write_text(content)
        command = plan.argv(tmp)
        env = {**os.environ, **plan.environment(tmp), **supervisor_env()}
        print("zerollm launch: " + shlex.join(command), flush=True)
        started_at = time.time()
        launcher = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_end_with_parent)

        def forward(signum, frame):
            stopping.append(signum)
            if launcher.returncode is not None:  # ended, its pid perhaps reused: waiting
                return
            ranks = _rank_processes(launcher.pid)
            for process in ranks or [launcher]:
                with contextlib.suppress(OSError, psutil.Error):  # already gone
                    process.send_signal(signal.SIGTERM)
            if not ranks and not plan.reaches_hosts:  # and to what it started: DeepSpeed's runner, stopped before it
                with contextlib.suppress(OSError):   # set its handler, left its per-node launcher, which started
                    os.killpg(launcher.pid, signal.SIGTERM)  # the ranks after the launch had ended (its own session)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = launcher.wait()
            preempted = code != 0 and _preempted_since(run_dir, started_at)
            if code != 0 and stopping and not preempted:
                preempted = _wait_for_ranks_here(run_dir, started_at, stopping)
            if code != 0 and stopping and not preempted and plan.stop_wait_s:
                preempted = _wait_for_preempted(run_dir, started_at, plan.stop_wait_s, stopping)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    if preempted:
        return EXIT_PREEMPTED
    if stopping and (code in STOPPED_AT_ONCE or plan.deepspeed_codes and deepspeed_signal(code) in STOP_SIGNALS):
        return 128 + stopping[-1]  # the ranks got the forwarded SIGTERM only (or before their handlers were set, which
        # DeepSpeed's launcher and launch/torchrun.py pass on as 256 - N): said as the stop was sent
    if stopping and plan.stop_wait_s and code == 1:  # DeepSpeed's pdsh runner's own exit on a stop signal
        print(f"zerollm launch: stopped; no checkpoint of the stop appeared in {run_dir} (where the hosts do not "
              "share it, their ranks' checkpoints are not seen here)", flush=True)
        return 128 + stopping[-1]
    if code == SSH_FAILED and plan.ssh_hosts and not stopping:
        report("a host's ssh connection failed or ended (exit 255; the lines above name the host), or a rank there "
               f"was ended by SIGHUP; the job is ended on every rank: {RESUME_ADVICE}")
        return EXIT_RANK_LOST
    signum = deepspeed_signal(code) if plan.deepspeed_codes and not stopping else None
    if signum is not None:  # which rank, DeepSpeed's launcher does not say (torchrun's table above does)
        return report_rank_ended("a rank", signum)
    return exit_code(code)


def check_programs(programs: tuple[str, ...], options: LaunchOptions, path: str | None = None) -> None:
    """Refuse, in one line, a launch whose launcher program is not on `path` (default PATH): DeepSpeed's runner
    fails on it with a traceback (`launcher 'pdsh' not installed`)."""
    missing = [program for program in programs if shutil.which(program, path=path) is None]
    if missing:
        others = ", ".join(name for name in LAUNCHER_PROGRAMS if name != options.launcher)
        raise UserError(f"--launcher {options.launcher} reaches the hosts of {options.hostfile} with "
                        f"{' and '.join(missing)}, and {'it is' if len(missing) == 1 else 'they are'} not on PATH; "
                        f"install {_INSTALL[options.launcher]} on this node, or choose another --launcher ({others}), "
                        "or start `zerollm launch --nnodes N --node-rank R --master-addr A` on every node")


def launch(options: LaunchOptions, train_argv: list[str], run_dir: Path, check_inputs: Callable[[], object]) -> int:
    """Start the checked training command `train_argv` (`train STAGE ...`, writing to `run_dir`) on this node;
    `check_inputs()` first where ranks run on this node (what the ranks read: data, prompts, a teacher), so that a
    mistake there is one line before any launcher starts rather than one per rank after."""
    plan = plan_launch(options, train_argv, dict(os.environ))
    check_programs(plan.programs, options)
    if plan.ssh_hosts:
        check_reachable(plan.ssh_hosts, options.hostfile)
    if plan.address_of:
        plan = plan.with_master(host_address(plan.address_of, options.hostfile))
    if plan.ranks_here:
        check_inputs()
    return run_plan(plan, run_dir)
