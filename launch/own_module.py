"""The commands that run zerollm's own code from any working directory. `python -m` puts the working directory first
on sys.path, where a user's launch.py was found (and run) in place of zerollm's launch/, a kernels/ folder in place of
zerollm's, and an llm.py or llm/ in place of zerollm itself: every rank ran it, and the job exited 0 untrained.
`own_module` runs one of zerollm's modules as `python -m` would, but found in zerollm's folder (`launch.torchrun`,
`launch.deepspeed_launcher`); `zerollm_command` runs the command line as its console script does (a training rank,
a stage of `zerollm demo`), a path DeepSpeed's and torch's launchers can start as they start a script."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The folder holding zerollm's packages: the checkout of an editable install, or site-packages."""


def own_module(module: str, *interpreter_options: str) -> list[str]:
    """`python [OPTIONS] -m MODULE` with zerollm's folder first on sys.path in place of the working directory; the
    module's arguments follow."""
    run = (f"import runpy, sys; sys.path[0] = {str(ROOT)!r}; "
           f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, *interpreter_options, "-c", run]


CONSOLE_SCRIPT_LINE = b"from llm.__main__ import run"
"""What the `zerollm` script pip (or uv) writes for zerollm runs: a `zerollm` that lacks it (a user's shell wrapper
that activates an environment) is no Python the interpreter could run."""


def zerollm_script(search_path: bool = False) -> str | None:
    """The `zerollm` console script of this installation, beside the interpreter (the same path on every host, like
    the interpreter's), or `search_path`, the first on PATH; None where there is none (a checkout run as `python -m
    llm`; one on PATH may be another installation's, whose `llm` that interpreter may import)."""
    beside_python = Path(sys.executable).with_name("zerollm")
    script = str(beside_python) if beside_python.is_file() else shutil.which("zerollm") if search_path else None
    try:
        with open(script or "", "rb") as file:
            return script if CONSOLE_SCRIPT_LINE in file.read(4096) else None
    except OSError:
        return None


def zerollm_program() -> list[str]:
    """What follows the interpreter to run zerollm's command line: its console script (`zerollm_script`), whose
    folder (bin/) is the one put on sys.path, or `-m llm` where there is none."""
    script = zerollm_script()
    return [script] if script else ["-m", "llm"]


def zerollm_command(*interpreter_options: str) -> list[str]:
    """`python [OPTIONS] PATH/zerollm` (`zerollm_program`); its arguments follow."""
    return [sys.executable, *interpreter_options, *zerollm_program()]
