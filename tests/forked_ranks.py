"""Training jobs for tests, with their ranks forked from a forkserver that imported torch, DeepSpeed and zerollm once.

A rank started as `python -m llm train ...` spends about 5 s of CPU before its first step (torch 2 s, DeepSpeed
0.7 s, and torch._dynamo 2.2 s, which every torch optimizer imports on its first step), on a 2-core machine that
runs two test files at once. Forked from this module's forkserver, a rank starts in a fraction of a second and runs
what it would run there: `llm.cli.main` with the command in sys.argv, unbuffered output, and the environment that
`--nproc N` gives each rank (`launch.local.rank_environments`), waited for as `--nproc N` waits
(`launch.local.wait_for_ranks`). test_train checks that such a job trains bit for bit as the command does.

What differs, so that tests of these things run the command itself (`conftest.run_cli`):
- the `--nproc` process's own work before the ranks start (the checks of prompts and teachers said once, not once
  per rank, and the rank command it builds, which a run records) and the launchers;
- what is fixed when the forkserver starts, once per pytest worker: variables read at import (conftest sets
  DS_ACCELERATOR=cpu first), the modules already imported, the string-hash seed every rank shares, and
  multiprocessing's start method inside a rank (forkserver, not fork, for data-loader workers).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path

import psutil

from launch.local import rank_environments, strip_option, wait_for_ranks
from llm.cli import build_parser
from llm.runtime.rank_env import RANK_VARIABLES, free_port

PRELOAD = ["torch", "llm.cli", "llm.train.job", "torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer",
           "forked_ranks", "test_faults"]
"""Imported by the forkserver once, so that no rank pays for them: llm.train.job chooses DeepSpeed's accelerator
before it imports DeepSpeed, as a rank does (tests/test_faults.py runs ranks of its own)."""
IN_FORKSERVER = "ZEROLLM_TEST_FORKSERVER"
"""Set for the forkserver's start only: its preload of this module runs DeepSpeed's op probe (below)."""
SERVER_ENV = {IN_FORKSERVER: "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "PYTHONUNBUFFERED": "1"}
"""The forkserver's own variables: the second keeps the server from initialising CUDA, which a fork cannot use; the
third makes its standard streams, which every rank inherits, unbuffered (as `python -u` makes a rank's)."""

if os.environ.get(IN_FORKSERVER):  # preloaded by the forkserver: DeepSpeed's op probe, which compiles test programs
    import deepspeed.ops  # and which every rank's `setup_distributed` reads, runs here once instead of in each rank

    _PROBED = deepspeed.ops.__compatible_ops__


def forkserver():
    """The forkserver context, its server started (once per pytest worker) importing PRELOAD. Python before 3.12.8
    and 3.13.1 starts the forkserver without this process's sys.path (CPython gh-117378), so it finds the test
    modules (tests/ is not on the default path) only through PYTHONPATH; without it, the preload of a test module
    fails silently and every rank imports it after the fork. These variables are set for the server's start only."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    tests = str(Path(__file__).resolve().parent)
    server_env = {**SERVER_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    saved = {name: os.environ.get(name) for name in server_env}
    os.environ.update(server_env)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    return context


def enter_rank(env: dict[str, str], out: Path, err: Path) -> None:
    """Make this forked process a rank: `env` its whole environment, its output (unbuffered: `SERVER_ENV`) appended
    to the existing files `out` and `err` (one file may take both)."""
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(file, fd)
        os.close(file)
    os.environ.clear()
    os.environ.update(env)


def _rank_main(argv: list[str], env: dict[str, str], cwd: Path, out: Path, err: Path) -> None:
    """One rank: `zerollm ARGV` in `cwd` (`enter_rank` with `env`, `out` and `err`), ARGV in sys.argv, as
    `python -u -m llm ARGV` has them."""
    enter_rank(env, out, err)
    os.chdir(cwd)
    sys.argv = [sys.argv[0], *argv]
    from llm.cli import main  # noqa: PLC0415 - preloaded by the forkserver

    main()


class ForkedRank:
    """A forked rank with the part of `subprocess.Popen` that `wait_for_ranks` uses (pid, returncode, poll,
    send_signal)."""

    def __init__(self, process) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def send_signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(self.process.pid, signum)


def start_ranks(*args, name: str = "job", cwd: Path | None = None) -> tuple[list[ForkedRank], Path]:
    """Start `zerollm ARGS` (a `train` command) on the ranks its `--nproc` asks for, forked (one rank: as a one-rank
    command runs, with no rank variables), in `cwd` (default: this process's), and return them at once, with the
    folder of their output: OUT.logs beside the command's --out folder, where rank R writes NAME.R.out and .err."""
    args = list(map(str, args))
    parsed = build_parser().parse_args(args)  # --nproc and --out as the command reads them
    if parsed.nproc == 1:  # the command runs its one rank itself
        argv, envs = args, [{k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", *RANK_VARIABLES)}]
    else:
        argv, envs = strip_option(args, "--nproc"), rank_environments(parsed.nproc, free_port())
    cwd = cwd or Path.cwd()
    out = cwd / parsed.out
    logs = out.with_name(f"{out.name}.logs")
    logs.mkdir(exist_ok=True)
    context, ranks = forkserver(), []
    try:
        for rank, env in enumerate(envs):
            streams = [logs / f"{name}.{rank}.{kind}" for kind in ("out", "err")]
            for stream in streams:
                stream.write_text("")  # there, empty, even if the rank fails before it writes
            process = context.Process(target=_rank_main, args=(argv, env, cwd, *streams))
            process.start()
            ranks.append(ForkedRank(process))
    except BaseException:
        kill_ranks(ranks)
        raise
    return ranks, logs


def _kill_running(ranks: list[ForkedRank]) -> None:
    """SIGKILL every rank still running and every process it started. Whether a rank runs is read from its sentinel,
    which any thread may wait on (two threads polling one process can misread its exit code)."""
    family = []
    for rank in ranks:
        if not wait([rank.process.sentinel], 0):
            with contextlib.suppress(psutil.NoSuchProcess):
                process = psutil.Process(rank.process.pid)
                family += [process, *process.children(recursive=True)]
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def kill_ranks(ranks: list[ForkedRank]) -> None:
    """SIGKILL every rank still running and every process it started, and reap the ranks."""
    _kill_running(ranks)
    for rank in ranks:
        rank.process.join()


def _outputs(logs: Path, name: str, nproc: int) -> tuple[str, str]:
    """Each stream of a job: the ranks' outputs one after the other, rank 0 first."""
    return tuple("".join((logs / f"{name}.{rank}.{kind}").read_text(errors="replace") for rank in range(nproc))
                 for kind in ("out", "err"))


def kill_when(condition: Callable[[], bool], *args, name: str = "job", timeout: float = 300) -> None:
    """Start `zerollm ARGS` as `start_ranks` does and SIGKILL it, every rank at once as a job killed outright dies,
    as soon as `condition()` holds. Fails, with each rank's error output, when a rank ends or `timeout` passes
    first."""
    ranks, logs = start_ranks(*args, name=name)
    try:
        deadline = time.monotonic() + timeout
        while not condition():
            codes = [rank.poll() for rank in ranks]
            if condition():  # it came true as a rank ended
                break
            ended = any(code is not None for code in codes)
            if ended or time.monotonic() > deadline:
                tails = "".join(f"\nrank {rank}: ...{(logs / f'{name}.{rank}.err').read_text()[-1500:]}"
                                for rank in range(len(ranks)))
                raise AssertionError(f"{f'exit codes {codes}' if ended else f'{timeout} s'} before the condition "
                                     f"held;{tails}")
            time.sleep(0.005)
    finally:
        kill_ranks(ranks)


def run_job(*args, name: str = "job", cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`zerollm ARGS` (a `train` command) with forked ranks (module docstring), waited for: its exit code as
    `--nproc N` gives it, and each stream as the ranks' outputs one after the other (rank 0 first). After `timeout`
    seconds every rank is killed and subprocess.TimeoutExpired raised, as `conftest.run_cli` raises it."""
    ranks, logs = start_ranks(*args, name=name, cwd=cwd)
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        _kill_running(ranks)

    deadline = threading.Timer(timeout, expire)
    deadline.start()
    try:
        code = wait_for_ranks(ranks)
    finally:
        deadline.cancel()
        kill_ranks(ranks)
    stdout, stderr = _outputs(logs, name, len(ranks))
    command = ["zerollm", *map(str, args)]
    if expired.is_set():
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, code, stdout, stderr)
