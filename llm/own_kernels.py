"""zerollm's kernels/ is imported as the top-level package `kernels`. Hugging Face's `kernels` package (a dependency
of transformers 5.25 and later) has the same name and, installed in site-packages, is found first: zerollm would
then fail later on a missing attribute. This names the clash at import instead."""

from __future__ import annotations

import importlib.util
from pathlib import Path

OURS = Path(__file__).resolve().parent.parent / "kernels"


def check_own_kernels() -> None:
    """Raise ImportError, in one line that says what to do, unless `import kernels` finds zerollm's kernels/."""
    spec = importlib.util.find_spec("kernels")
    found = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
    if found == OURS:
        return
    raise ImportError(
        f"zerollm: `import kernels` finds {found or 'nothing'}, not zerollm's {OURS}: another package named `kernels` "
        f"(Hugging Face's, which transformers 5.25 and later require) hides it; in this environment run "
        f"`pip uninstall -y kernels && pip install 'transformers<5.25'`, then reinstall zerollm unless it is an "
        f"editable install (pip install -e)")
