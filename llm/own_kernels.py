"""zerollm's kernels/ is imported as the top-level package `kernels`. Hugging Face's `kernels` package (a dependency
of transformers 5.25 and later) has the same name and, installed in site-packages, is found first: zerollm would
then fail later on a missing attribute. This names the clash at import instead."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from llm.command_line import is_zerollm_command

OURS = Path(__file__).resolve().parent.parent / "kernels"


def _off_the_working_directory() -> None:
    """`python -m llm` puts the working directory first on sys.path: a folder named kernels there (or launch) was
    imported in place of zerollm's own (`import kernels finds nothing`, advising to uninstall Hugging Face's). It is
    taken off, unless zerollm's own packages are there (a checkout, run without installing); a `--reward
    module:function` is looked up there by itself (`llm.train.rewards`)."""
    if sys.path and sys.path[0] in (os.getcwd(), "") and Path(sys.path[0] or ".").resolve() != OURS.parent:
        del sys.path[0]


def check_own_kernels() -> None:
    """Unless `import kernels` finds zerollm's kernels/: one line that says what to do, as the command line's error
    (exit 2: `zerollm` and `python -m llm` import this package before their own error handling exists, and gave an
    import traceback), or as an ImportError where zerollm is imported as a library."""
    if is_zerollm_command(sys.orig_argv):
        _off_the_working_directory()
    spec = importlib.util.find_spec("kernels")
    found = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
    if found == OURS:
        return
    problem = (f"`import kernels` finds {found or 'nothing'}, not zerollm's {OURS}: another package named `kernels` "
               f"(Hugging Face's, which transformers 5.25 and later require) hides it; in this environment run "
               f"`pip uninstall -y kernels && pip install 'transformers<5.25'`, then reinstall zerollm unless it is "
               f"an editable install (pip install -e)")
    if is_zerollm_command(sys.orig_argv):
        print(f"zerollm: error: {problem}", file=sys.stderr)
        sys.exit(2)
    raise ImportError(f"zerollm: {problem}")
