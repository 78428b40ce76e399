"""DeepSpeed's runner or per-node launcher, `python -m MODULE ARGS`, whose log lines go nowhere, without a word, once
standard output cannot take them (`zerollm launch ... | head`); started as `own_module("launch.deepspeed_launcher")`
with MODULE and ARGS after it.

DeepSpeed's launchers log to standard output: the runner its command, the per-node launcher each rank it starts and,
when a rank ends with an exit code other than 0, the ranks it stops. Once the reader of a pipe has left, each of those
lines printed a '--- Logging error ---' traceback on stderr, where the rest of the CLI ends quietly with 141: the
ranks stop by themselves, with a checkpoint where they train (`llm.stdout.output_loss_handled`), and the launchers
pass their exit code on. The runner starts the per-node launcher of this node through this module too.
"""

from __future__ import annotations

import logging
import runpy
import subprocess
import sys

from launch.own_module import own_module
from llm.stdout import settle

PER_NODE_LAUNCHER = "deepspeed.launcher.launch"


def quiet(module: str, *interpreter_options: str) -> list[str]:
    """The command that runs DeepSpeed's `module` through this one; its arguments follow."""
    return [*own_module(__spec__.name, *interpreter_options), module]


def through_here(command: list[str]) -> list[str]:
    """`command` (the runner's `python -u -m deepspeed.launcher.launch ...` for this node) run through this module;
    any other command as it is."""
    if command[:4] != [sys.executable, "-u", "-m", PER_NODE_LAUNCHER]:
        return command
    return [*quiet(PER_NODE_LAUNCHER, "-u"), *command[4:]]


class _Popen(subprocess.Popen):
    def __init__(self, args, *rest, **options) -> None:
        super().__init__(through_here(args) if isinstance(args, list) else args, *rest, **options)


def main(module: str, argv: list[str]) -> None:
    logging.raiseExceptions = False  # a line a handler cannot write is dropped (logging's `handleError`)
    subprocess.Popen = _Popen
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        settle(sys.stdout)  # what is still buffered for a pipe whose reader left, discarded: no traceback at exit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
