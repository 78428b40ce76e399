"""zerollm's kernels/ is imported as the top-level package `kernels`. Hugging Face's `kernels` package (a dependency
of transformers 5.25 and later) has the same name and, installed in site-packages, is found first: zerollm would
then fail later on a missing attribute. This names the clash at import instead."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from llm.command_line import is_zerollm_command

OURS = Path(__file__).resolve().parent.parent / "kernels"


def check_own_kernels() -> None:
    """Unless `import kernels` finds zerollm's kernels/: one line that says what to do, as the command line's error
    (exit 2: `zerollm` and `python -m llm` import this package before their own error handling exists, and gave an
    import traceback), or as an ImportError where zerollm is imported as a library."""
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
