"""`python -m launch.torchrun ARGS`: torchrun (`torch.distributed.run`) with ARGS, ending like the ranks when every
rank that failed refused its job.

A rank refuses with one line (`zerollm: error: ...`) and exit code 2 (llm/errors.py). torchrun reports any failed
rank as its ChildFailedError, a traceback and a table of the failures, and exits 1; DeepSpeed's launcher passes the
rank's code on. Here, when the ranks of this node that failed exited 2, this exits 2 as well, and the ranks' lines
are followed only by torchrun's log lines (the ranks it stopped, the exit code), not its traceback; any other failure
is torchrun's own report, unchanged. A rank that torchrun itself ended because another
failed (SIGTERM, then SIGKILL after its timeout: a rank still importing when the first one refused) counts among
its failures too, and is passed over.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from llm.errors import EXIT_USER_ERROR

CLOSING_CODES = (-signal.SIGTERM, -signal.SIGKILL)
"""Exit codes of a rank that torchrun ended after another rank failed."""


def refused(failure: ChildFailedError) -> bool:
    """Whether the failed ranks in `failure` refused their job (exit code 2), apart from ranks torchrun ended."""
    codes = [process.exitcode for process in failure.failures.values()]
    return EXIT_USER_ERROR in codes and all(code in (EXIT_USER_ERROR, *CLOSING_CODES) for code in codes)


def main(argv: list[str]) -> int:
    try:
        torchrun_main(argv)
    except ChildFailedError as failure:
        if not refused(failure):
            raise
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
