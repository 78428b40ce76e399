"""`python .../launch/deepspeed_launcher.py MODULE ARGS`: DeepSpeed's runner or per-node launcher, `python -m MODULE
ARGS`, whose log lines go nowhere, without a word, once standard output cannot take them (`zerollm launch ... | head`).

DeepSpeed's launchers log to standard output: the runner its command, the per-node launcher each rank it starts and,
when a rank ends with an exit code other than 0, the ranks it stops. Once the reader of a pipe has left, each of those
lines printed a '--- Logging error ---' traceback on stderr, where the rest of the CLI ends quietly with 141: the
ranks stop by themselves, with a checkpoint where they train (`llm.stdout.output_loss_handled`), and the launchers
pass their exit code on. The runner starts the per-node launcher of this node through this file too.

It runs as a file, not as `-m launch.deepspeed_launcher`, and imports zerollm from zerollm's own folder: `-m` put the
working directory first on sys.path, where a user's launch.py was found in place of zerollm's launch/ (and run), and
a kernels/ folder in place of zerollm's kernels/.
"""

from __future__ import annotations

import logging
import runpy
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve()
PER_NODE_LAUNCHER = "deepspeed.launcher.launch"


def through_here(command: list[str]) -> list[str]:
    """`command` (the runner's `python -u -m deepspeed.launcher.launch ...` for this node) run through this file;
    any other command as it is."""
    if command[:4] != [sys.executable, "-u", "-m", PER_NODE_LAUNCHER]:
        return command
    return [*command[:2], str(SCRIPT), *command[3:]]


class _Popen(subprocess.Popen):
    def __init__(self, args, *rest, **options) -> None:
        super().__init__(through_here(args) if isinstance(args, list) else args, *rest, **options)


def main(module: str, argv: list[str]) -> None:
    from llm.stdout import settle  # noqa: PLC0415 - once sys.path names zerollm's folder (below)

    logging.raiseExceptions = False  # a line a handler cannot write is dropped (logging's `handleError`)
    subprocess.Popen = _Popen
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        settle(sys.stdout)  # what is still buffered for a pipe whose reader left, discarded: no traceback at exit


if __name__ == "__main__":
    sys.path[0] = str(SCRIPT.parent.parent)  # the folder of zerollm's packages, in place of launch/ itself
    main(sys.argv[1], sys.argv[2:])
