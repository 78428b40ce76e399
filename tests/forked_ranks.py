"""Training jobs for tests, with their ranks forked from a forkserver that imported torch, DeepSpeed and zerollm once.

A rank started as `python -m llm train ...` spends about 5 s of CPU before its first step (torch 2 s, DeepSpeed
0.7 s, and torch._dynamo 2.2 s, which every torch optimizer imports on its first step), on a 2-core machine that
runs two test files at once. Forked from this module's forkserver, a rank starts in a fraction of a second and runs
exactly what it would run there: `llm.cli.main` with the environment `--nproc N` gives each rank
(`launch.local.rank_environments`), waited for as `--nproc N` waits (`launch.local.wait_for_ranks`). What this
leaves out is the `--nproc` process's own work before the ranks start (the checks of prompts and teachers that are
said once, not once per rank) and the launchers: tests of those run the command itself (`conftest.run_cli`).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from launch.local import rank_environments, strip_option, wait_for_ranks
from llm.runtime.rank_env import RANK_VARIABLES, free_port

PRELOAD = ["torch", "torch._dynamo", "deepspeed", "llm.cli", "llm.train.job",
           "deepspeed.runtime.zero.muon.muon_optimizer", "forked_ranks", "test_faults"]
"""Imported by the forkserver once, so that no rank pays for them (tests/test_faults.py runs ranks of its own)."""
IN_FORKSERVER = "ZEROLLM_TEST_FORKSERVER"
"""Set in the forkserver's environment only (`forkserver`)."""

if os.environ.get(IN_FORKSERVER):  # preloaded by the forkserver: DeepSpeed's op probe, which compiles test programs
    import deepspeed.ops  # and which every rank's `setup_distributed` reads, runs here once instead of in each rank

    _PROBED = deepspeed.ops.__compatible_ops__


def forkserver():
    """The forkserver context, its server started (once per pytest worker) importing PRELOAD. Python before 3.12.8
    and 3.13.1 starts the forkserver without this process's sys.path (CPython gh-117378), so it finds the test
    modules (tests/ is not on the default path) only through PYTHONPATH; without it, the preload of a test module
    fails silently and every rank imports it after the fork. Both variables are set for the server's start only."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    tests = str(Path(__file__).resolve().parent)
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", IN_FORKSERVER)}
    os.environ.update(PYTHONPATH=os.pathsep.join(filter(None, [tests, saved["PYTHONPATH"]])), **{IN_FORKSERVER: "1"})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    return context


def _rank_main(argv: list[str], env: dict[str, str], cwd: Path, out: Path, err: Path) -> None:
    """One rank: `zerollm ARGV` in `cwd` with `env` as its whole environment and its output in `out` and `err`, and
    ARGV in sys.argv, as `python -m llm ARGV` has it."""
    sys.argv = [sys.argv[0], *argv]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    from llm.cli import main  # noqa: PLC0415 - preloaded by the forkserver

    sys.exit(main())


class ForkedRank:
    """A forked rank with the part of `subprocess.Popen` that `wait_for_ranks` uses."""

    def __init__(self, process) -> None:
        self.process = process

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)


def _option(args: list[str], name: str) -> str | None:
    """The value of `name VALUE` or `name=VALUE` in `args`, None without it."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def start_ranks(*args, name: str = "job", cwd: Path | None = None) -> tuple[list[ForkedRank], Path]:
    """Start `zerollm ARGS` (a `train` command) on the ranks its `--nproc` asks for, forked (one rank: as a one-rank
    command runs, with no rank variables), in `cwd` (default: this process's), and return them at once, with the
    folder of their output: OUT.logs beside the command's --out folder, where rank R writes NAME.R.out and .err."""
    args = list(map(str, args))
    nproc, argv = int(_option(args, "--nproc") or 1), strip_option(args, "--nproc")
    if nproc == 1:
        envs = [{k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", *RANK_VARIABLES)}]
    else:
        envs = rank_environments(nproc, free_port())
    cwd = cwd or Path.cwd()
    out = cwd / _option(args, "--out")
    logs = out.with_name(f"{out.name}.logs")
    logs.mkdir(parents=True, exist_ok=True)
    context, ranks = forkserver(), []
    for rank, env in enumerate(envs):
        process = context.Process(target=_rank_main, args=(argv, env, cwd, logs / f"{name}.{rank}.out",
                                                           logs / f"{name}.{rank}.err"))
        process.start()
        ranks.append(ForkedRank(process))
    return ranks, logs


def kill_ranks(ranks: list[ForkedRank]) -> None:
    """SIGKILL every rank still running and reap them all."""
    for rank in ranks:
        if rank.poll() is None:
            rank.send_signal(signal.SIGKILL)
    for rank in ranks:
        rank.process.join()


def run_job(*args, name: str = "job", cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`zerollm ARGS` (a `train` command) with forked ranks (module docstring), waited for; its exit code as
    `--nproc N` gives it, and each stream as the ranks' outputs one after the other (rank 0 first). Every rank is
    killed after `timeout` seconds."""
    ranks, logs = start_ranks(*args, name=name, cwd=cwd)
    deadline = threading.Timer(timeout, kill_ranks, [ranks])
    deadline.start()
    try:
        code = wait_for_ranks(ranks)
    finally:
        deadline.cancel()
        kill_ranks(ranks)
    stdout, stderr = ("".join((logs / f"{name}.{rank}.{kind}").read_text(errors="replace")
                              for rank in range(len(ranks))) for kind in ("out", "err"))
    return subprocess.CompletedProcess(["zerollm", *map(str, args)], code, stdout, stderr)
