"""The command that runs one of zerollm's own modules as `python -m` would (`launch.torchrun`,
`launch.deepspeed_launcher`), but finds it in zerollm's folder: -m puts the working directory first on sys.path, where
a user's launch.py was found (and run) in place of zerollm's launch/, and a kernels/ folder in place of zerollm's."""

from __future__ import annotations

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
