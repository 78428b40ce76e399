"""What a rank does before it ends at once (`os._exit`, which skips every `finally`): after a second Ctrl-C or
SIGTERM, or when the watchdog ends a job whose rank died or hung. Each step runs in a thread of its own for at most
`STEP_WAIT_S`, so that one that hangs (wandb's upload on a dead network) cannot keep the process alive."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

STEP_WAIT_S = 10.0

_steps: list[Callable[[int], None]] = []


@contextlib.contextmanager
def before_forced_exit(step: Callable[[int], None]) -> Iterator[None]:
    """Run `step(exit_code)` if the process is ended at once while inside this block (the wandb run's end, which
    records the exit code: it was left without one, its last steps unwritten)."""
    _steps.append(step)
    try:
        yield
    finally:
        _steps.remove(step)


def run_before_forced_exit(exit_code: int) -> None:
    """The registered steps, newest first, each for at most STEP_WAIT_S; what one raises is left unsaid (the process
    is ending with its own message)."""
    for step in reversed(_steps):
        worker = threading.Thread(target=_quietly, args=(step, exit_code), daemon=True)
        worker.start()
        worker.join(STEP_WAIT_S)


def _quietly(step: Callable[[int], None], exit_code: int) -> None:
    with contextlib.suppress(Exception):
        step(exit_code)
