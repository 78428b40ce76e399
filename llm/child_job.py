"""A zerollm job run as a child process (`bench train`'s training jobs, `zerollm demo`'s stages) that stops when its
parent is stopped, and is waited for: Ctrl-C reaches the job from the terminal as well (its whole process group),
SIGTERM (`kill`, systemd, docker) the parent alone and is passed on. `subprocess.run`, on the KeyboardInterrupt raised
in the parent, killed the job at once (before its checkpoint, its clean-up); on SIGTERM the parent ended and the job
trained on, orphaned."""

from __future__ import annotations

import signal
import subprocess

from llm.errors import STOP_SIGNALS


def run_stopping_together(command: list[str]) -> tuple[int, list[int]]:
    """Run `command` and wait for it: (its exit code, the stop signals this process got meanwhile, in order). A
    Python handler, unlike SIG_IGN, is not inherited: the job takes the signals as ever."""
    stopped: list[int] = []
    job: list[subprocess.Popen] = []

    def stop(signum: int, frame) -> None:
        stopped.append(signum)
        if signum == signal.SIGTERM and job:
            job[0].send_signal(signum)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        job.append(subprocess.Popen(command))
        if signal.SIGTERM in stopped:  # it came as the job started
            job[0].send_signal(signal.SIGTERM)
        code = job[0].wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return code, stopped
