"""`zerollm launch`: check a multi-node job, then start the real launcher.

Three ways to start a job, one command for each:

- hostfile mode (`--hostfile FILE`): DeepSpeed's launcher reaches every host itself (pdsh by default,
  or openmpi/mvapich/mpich/impi/slurm with `--launcher`), with `--include/--exclude`;
- per-node mode (`--nnodes N --node-rank R --master-addr A --master-port P`): you, or a scheduler, start
  one `zerollm launch` on every node; `--backend deepspeed` runs `deepspeed --no_ssh --node_rank R`,
  `--backend torchrun` runs torchrun with c10d rendezvous at A:P;
- SLURM (`--backend slurm`): per-node torchrun with N, R and A taken from the SLURM environment (see
  launch/slurm/zerollm.sbatch, which starts one launcher per node with srun).

Before starting anything: the hostfile is checked, the training command has been parsed and its config
built by the CLI (a bad key fails there, not on 100 ranks), and the node hosting the rendezvous checks
that the master port is free. Once the ranks meet they compare fingerprints (llm/runtime/fingerprint.py)
and watch each other (llm/runtime/watchdog.py).

SIGTERM/SIGINT to `zerollm launch` is forwarded to the training ranks: they agree to stop, save a
checkpoint and the launch exits 75 (`EXIT_PREEMPTED`); `--resume auto` continues, on any number of ranks.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from launch.hostfile import check_filter, read_hostfile
from launch.options import LaunchOptions
from llm import rundir
from llm.errors import EXIT_PREEMPTED, UserError
from llm.runtime.distributed import ensure_accelerator_env
from llm.runtime.supervisor import supervisor_env

_ENV_ITEM = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class Plan:
    """The launcher command this node runs, its environment additions and files it needs while running."""
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    """name -> content, written to a temporary directory; `{dir}` in the command and env is replaced by it."""


# ---- checks ------------------------------------------------------------------------------------


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        if not _ENV_ITEM.match(item):
            raise UserError(f"--env {item!r}: expected NAME=VALUE")
        name, value = item.split("=", 1)
        env[name] = value
    return env


def is_local_address(address: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def check_port_free(port: int) -> None:
    """The rendezvous store listens on every interface of the node hosting it; the port must be free there."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(f"master port {port} is already in use on this node (another job?); "
                                "choose a free one with --master-port") from None
            raise


def slurm_rendezvous(environ: dict[str, str]) -> tuple[int, int, str]:
    """(nodes, this node's rank, first host) of the SLURM allocation this process runs in."""
    missing = [k for k in ("SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_JOB_NODELIST") if k not in environ]
    if missing:
        raise UserError(f"--backend slurm runs inside a SLURM job step (srun); {', '.join(missing)} not set")
    return int(environ["SLURM_JOB_NUM_NODES"]), int(environ["SLURM_NODEID"]), first_host(environ["SLURM_JOB_NODELIST"])


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    match = re.match(r"^([^,\[]+)(?:\[([^\]\-,]+))?", nodelist.strip())
    if not match:
        raise UserError(f"cannot read the SLURM node list {nodelist!r}")
    return match[1] + (match[2] or "")


# ---- plans -------------------------------------------------------------------------------------


def deepspeed_runner(*options: str) -> list[str]:
    """DeepSpeed's runner with `options`, starting `python -m llm` on every rank; the training arguments follow."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", *options, "--no_local_rank", "--module", "llm"]


def _hostfile_text(nnodes: int, nproc: int) -> str:
    return "".join(f"node{i} slots={nproc}\n" for i in range(nnodes))


def plan_launch(args: LaunchOptions, train_argv: list[str], environ: dict[str, str]) -> Plan:
    """Check the launch options and build the launcher command for this node."""
    env = parse_env(args.env)
    nproc = args.nproc_per_node
    if args.backend == "slurm":
        if args.hostfile or args.nnodes or args.node_rank is not None:
            raise UserError("--backend slurm takes the nodes from SLURM; drop --hostfile/--nnodes/--node-rank")
        nnodes, node_rank, master = slurm_rendezvous(environ)
        return _plan_torchrun(nnodes, node_rank, args.master_addr or master, args.master_port,
                              nproc or int(environ.get("SLURM_GPUS_ON_NODE", 1)),
                              args.rdzv_id or environ.get("SLURM_JOB_ID", "zerollm"), env, train_argv)
    if (args.include or args.exclude) and not args.hostfile:
        raise UserError("--include/--exclude select hosts of a --hostfile")
    if args.hostfile and args.node_rank is None:
        return _plan_hostfile(args, env, nproc, train_argv)
    per_node = args.node_rank is not None or args.nnodes
    if per_node and (args.nnodes is None or args.node_rank is None or args.master_addr is None):
        raise UserError("per-node mode needs --nnodes, --node-rank and --master-addr on every node")
    nnodes, node_rank = (args.nnodes, args.node_rank) if per_node else (1, 0)
    master = args.master_addr or "127.0.0.1"
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    nproc = nproc or _local_devices()
    if args.backend == "torchrun":
        if args.hostfile:
            raise UserError("--hostfile is for --backend deepspeed; torchrun nodes meet at --master-addr")
        return _plan_torchrun(nnodes, node_rank, master, args.master_port, nproc, args.rdzv_id or "zerollm", env,
                              train_argv)
    _check_rendezvous_host(node_rank, master, args.master_port)
    if args.hostfile:
        hosts = read_hostfile(args.hostfile)
        if len(hosts) != nnodes:
            raise UserError(f"{args.hostfile} lists {len(hosts)} hosts but --nnodes is {nnodes}")
        hostfile = str(Path(args.hostfile).resolve())
        files = {}
    else:
        hostfile, files = "{dir}/hostfile", {"hostfile": _hostfile_text(nnodes, nproc)}
    command = deepspeed_runner("--hostfile", hostfile, "--no_ssh", "--node_rank", str(node_rank),
                                "--master_addr", master, "--master_port", str(args.master_port))
    return Plan(command + train_argv, env, files)


def _local_devices() -> int:
    return max(1, torch.cuda.device_count())


def _check_rendezvous_host(node_rank: int, master: str, port: int) -> None:
    if node_rank != 0:
        return
    if not is_local_address(master):
        raise UserError(f"--master-addr {master} is not an address of this node, but node rank 0 hosts the "
                        "rendezvous; give node 0's own address")
    check_port_free(port)


def _plan_torchrun(nnodes: int, node_rank: int, master: str, port: int, nproc: int, rdzv_id: str,
                   env: dict[str, str], train_argv: list[str]) -> Plan:
    _check_rendezvous_host(node_rank, master, port)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{port}", "--rdzv-id", rdzv_id,
               "--rdzv-conf", f"is_host={int(node_rank == 0)}", "--max-restarts", "0", "-m", "llm"]
    return Plan(command + train_argv, env)


def _selected_hosts(hosts: dict[str, int], include: str, exclude: str) -> list[str]:
    """Hosts that keep at least one slot after --include/--exclude (syntax checked by `check_filter`)."""
    if include:
        return [part.partition(":")[0] for part in include.split("@")]
    dropped = {part for part in exclude.split("@") if part and ":" not in part}
    return [host for host in hosts if host not in dropped]


def _plan_hostfile(args: LaunchOptions, env: dict[str, str], nproc: int | None, train_argv: list[str]) -> Plan:
    hosts = read_hostfile(args.hostfile)
    if nproc and (args.include or args.exclude):
        raise UserError("--nproc-per-node cannot be combined with --include/--exclude (DeepSpeed refuses both); "
                        "select slots with --include host:0,1 instead")
    if args.include:
        check_filter(hosts, args.include, "--include", args.hostfile)
    if args.exclude:
        check_filter(hosts, args.exclude, "--exclude", args.hostfile)
    options = ["--hostfile", str(Path(args.hostfile).resolve()), "--launcher", args.launcher,
               "--master_port", str(args.master_port)]
    if args.master_addr:
        options += ["--master_addr", args.master_addr]
    used = _selected_hosts(hosts, args.include, args.exclude)
    if is_local_address(args.master_addr or used[0]):
        check_port_free(args.master_port)
    if used == ["localhost"] or (len(used) == 1 and is_local_address(used[0])):
        options.append("--no_ssh_check")  # one local host: DeepSpeed starts the ranks here, without ssh
        options += [] if args.master_addr else ["--master_addr", "127.0.0.1"]
    options += ["--include", args.include] if args.include else []
    options += ["--exclude", args.exclude] if args.exclude else []
    options += ["--num_gpus", str(nproc)] if nproc else []
    files = {}
    if env:  # DeepSpeed exports these on every host it reaches (its .deepspeed_env mechanism)
        files["deepspeed_env"] = "".join(f"{k}={v}\n" for k, v in env.items())
        env = {**env, "DS_ENV_FILE": "{dir}/deepspeed_env"}
    return Plan(deepspeed_runner(*options) + train_argv, env, files)


# ---- running -----------------------------------------------------------------------------------


def _rank_processes(launcher_pid: int) -> list:
    """The training processes under the launcher on this node (`python -u -m llm ...`)."""
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ranks = []
    for child in children:
        try:
            cmdline = child.cmdline()
        except psutil.Error:
            continue
        if any(cmdline[i:i + 2] == ["-m", "llm"] for i in range(len(cmdline))):
            ranks.append(child)
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


def run_plan(plan: Plan, run_dir: Path) -> int:
    """Start the launcher in its own session, forward SIGTERM/SIGINT to the training ranks, return the exit code:
    EXIT_PREEMPTED when the ranks published a checkpoint saved on a stop signal during this launch (here or on
    another node), whatever code the launcher reports (torchrun reports any non-zero rank as 1)."""
    ensure_accelerator_env()
    with tempfile.TemporaryDirectory(prefix="zerollm-launch-") as tmp:
        for name, content in plan.files.items():
            Path(tmp, name).write_text(content)
        command = [part.replace("{dir}", tmp) for part in plan.command]
        env = {**os.environ, **{k: v.replace("{dir}", tmp) for k, v in plan.env.items()}, **supervisor_env()}
        print("zerollm launch: " + " ".join(command), flush=True)
        started_at = time.time()
        launcher = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_end_with_parent)

        def forward(signum, frame):
            ranks = _rank_processes(launcher.pid)
            for process in ranks or [launcher]:
                try:
                    process.send_signal(signal.SIGTERM)
                except (ProcessLookupError, OSError):
                    pass

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = launcher.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    if code != 0 and _preempted_since(run_dir, started_at):
        return EXIT_PREEMPTED
    return code if code >= 0 else 128 - code


def launch(options: LaunchOptions, train_argv: list[str], run_dir: Path) -> int:
    """Start the checked training command `train_argv` (`train STAGE ...`, writing to `run_dir`) on this node."""
    return run_plan(plan_launch(options, train_argv, dict(os.environ)), run_dir)
