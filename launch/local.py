"""`--nproc N` on one machine: re-run the same `zerollm` command on N local ranks under the deepspeed launcher."""

from __future__ import annotations

import os
import subprocess

from launch.launcher import deepspeed_runner
from llm.runtime.distributed import RANK_VARIABLES, ensure_accelerator_env, free_port


def under_launcher() -> bool:
    """True inside a process started by a launcher: deepspeed and torchrun set LOCAL_RANK, mpirun its rank
    variables."""
    return "LOCAL_RANK" in os.environ or any(name in os.environ for name in RANK_VARIABLES)


def strip_option(argv: list[str], option: str) -> list[str]:
    """argv without `option VALUE` / `option=VALUE`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def relaunch_local(nproc: int, argv: list[str]) -> int:
    """Start `zerollm <argv>` (without --nproc) on `nproc` local ranks and wait; returns the job's exit code."""
    ensure_accelerator_env()
    command = deepspeed_runner("--num_gpus", str(nproc), "--master_port", str(free_port()))
    return subprocess.run(command + strip_option(argv, "--nproc"), check=False).returncode
