"""Whether a process runs zerollm's command line, read from its interpreter's command line: kept free of imports
beyond the standard library, since `import llm` asks it first (`llm.own_kernels`)."""

from __future__ import annotations

from pathlib import Path

OPTIONS_WITH_A_VALUE = ("-X", "-W", "--check-hash-based-pycs")
"""The interpreter's options whose value is the next word (`python -X dev -m llm`)."""


def is_zerollm_command(argv: list[str]) -> bool:
    """Whether the interpreter command line `argv` (`sys.orig_argv`, a process's `cmdline()`) runs zerollm:
    `python [options] -m llm ...` (a rank of a user's own `deepspeed --module llm`), `python [options] -m llm.cli
    ...` or `python [options] .../zerollm ...` (the console script, as zerollm's launchers start a rank); not one of the
    launchers between a rank and `zerollm launch` (DeepSpeed's runner and per-node launcher, mpirun, DeepSpeed's MPI
    helper), which name zerollm only among their own arguments."""
    rest = argv[1:]
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        rest = rest[2:] if rest[0] in OPTIONS_WITH_A_VALUE else rest[1:]
    return rest[:2] in (["-m", "llm"], ["-m", "llm.cli"]) or (bool(rest) and Path(rest[0]).name == "zerollm")
