"""Stopping together: SIGTERM or SIGINT on any rank (or the loss of the `zerollm launch` that started it)
makes every rank stop after the same step, save a checkpoint and exit with `EXIT_PREEMPTED`.

The ranks agree through a vote: after every step each rank posts its flag in a MAX all-reduce on the
training device. On the CPU (gloo) the result is read at once. On a GPU the result is copied to pinned
host memory behind an event and read after the next step, so reading it waits only for that tiny
collective, never for the step queued after it: there a stop takes effect one step after the request,
on every rank at the same step.

A second stop request stops a rank at once, without a checkpoint, as SIGKILL would (a step, an evaluation or a
reward that takes minutes, or hangs, need not be waited for; every checkpoint is written atomically, so the last
complete one resumes). One Ctrl-C reaches each rank of `zerollm train --nproc N` twice, from the terminal and
forwarded by the command, so requests less than `FORCE_AFTER_S` apart count as one. Once the stop's checkpoint is
published (`saved`), signals ask nothing more: launchers end the other ranks when the first exits 75.

The signals are read by a thread of their own, through Python's wakeup descriptor, not by a Python signal handler:
that runs only when the main thread runs Python, and a main thread asleep (in a reward that waits on a socket) does
not wake for a signal the kernel handed to another of the rank's threads, nor can one inside a collective. (The
handler records the request too, for when an asyncio loop took the descriptor; each step takes it back.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from llm.errors import STOP_SIGNALS
from llm.runtime.distributed import DistInfo
from llm.runtime.forced_exit import run_before_forced_exit
from llm.runtime.rerun import rerun_advice
from llm.runtime.supervisor import watch_supervisor

FORCE_AFTER_S = 1.0
"""A stop request at least this long after the first stops the rank at once (module docstring)."""
LAST_LINE_WAIT_S = 2.0
"""How long a rank stopped at once waits for its last line to be written."""


def _write_error(text: str) -> None:
    with contextlib.suppress(OSError):  # a closed error stream (its reader was stopped too)
        os.write(2, text.encode())


def _as_before_in_child() -> None:
    """In a process forked from a rank after `install` (a data-loader worker): no wakeup descriptor (the child would
    share the rank's pipe, and a signal to it would be read as one to the rank), SIGINT ignored (a Ctrl-C reaches
    the terminal's whole process group: a worker it ended would crash the rank's next draw, before its checkpoint;
    the rank ends its workers itself) and SIGTERM's default (a data-loader worker ignores it too:
    `data_loader_worker_init`)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def data_loader_worker_init(worker_id: int) -> None:
    """A data-loader worker's `worker_init_fn`: it ignores SIGTERM as well as SIGINT (DataLoader's own handler,
    set after the fork, ends it). A SIGTERM meant for the whole job reaches the workers too (SLURM's scancel signals
    every process of the job step, DeepSpeed's launcher the rank's whole process tree): a worker it ended crashed
    the rank's next draw, before the stop's checkpoint. The rank ends its workers itself, and a worker whose rank
    is gone leaves within DataLoader's status interval (5 s)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def stop_signals_restored() -> Iterator[None]:
    """Inside, a training job may take the stop signals (`Preemption.install`); after, their handlers and the wakeup
    descriptor are as they were, so a command that goes on in the same process (bench learn's evaluation) stops on
    Ctrl-C again: the job's handlers, once its checkpoint was saved, ignored every signal."""
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    try:
        yield
    finally:
        signal.set_wakeup_fd(wakeup)
        for signum, handler in handlers.items():
            if handler is not None:  # None: set from C, not Python's to restore
                signal.signal(signum, handler)


class Preemption:
    _child_hook = False
    """Whether this process resets the stop signals in its forked children (registered once: it cannot be undone)."""
    stopped_by: int | None = None
    """The signal of this process's last stop request: bench learn, whose job runs in its process, ends with 128 + it,
    as any command stopped by that signal (the job's 75 says to resume, and bench learn has no --resume)."""

    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self.requested = False
        self._signalled_at: float | None = None
        self._saved = False
        self.output_lost_now = False
        """Whether standard output was lost (`output_lost`): the stop's last line goes to the error stream."""
        self._wakeup = -1
        on_gpu = info.device.type == "cuda"
        self._flag = torch.zeros(1, dtype=torch.int32, device=info.device)
        self._result = torch.zeros(1, dtype=torch.int32, pin_memory=on_gpu)
        self._ready = torch.cuda.Event() if on_gpu else None
        self._voted = False
        self._rerun = rerun_advice(" to continue from the last complete one")  # here: the signal reader's thread
        # starts with a context of its own

    def install(self) -> None:
        """Request a stop on SIGTERM/SIGINT (read by a daemon thread: module docstring), and when the supervising
        `zerollm launch` ends."""
        read_end, self._wakeup = os.pipe()
        os.set_blocking(self._wakeup, False)  # as set_wakeup_fd requires: a full pipe drops a number, never blocks
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._noted)
        signal.set_wakeup_fd(self._wakeup, warn_on_full_buffer=False)
        if not Preemption._child_hook:
            os.register_at_fork(after_in_child=_as_before_in_child)
            Preemption._child_hook = True
        threading.Thread(target=self._read_signals, args=(read_end,), name="zerollm-stop-signals", daemon=True).start()
        watch_supervisor(self._on_supervisor_lost)

    def _noted(self, signum, frame) -> None:
        """The Python handler of the stop signals, in the main thread when it runs Python: the request, should the
        wakeup descriptor have been taken over meanwhile (an asyncio loop in a reward sets its own, and leaves
        none); the reader thread acts on the signal itself."""
        self.requested = True

    def _read_signals(self, read_end: int) -> None:
        while True:
            numbers = os.read(read_end, 64)  # the signals Python's C handler caught since the last read
            now = time.monotonic()  # one time for all: a slow read must not part one Ctrl-C's two copies
            for signum in numbers:
                if signum in STOP_SIGNALS:
                    self._on_signal(signum, now)

    def _on_signal(self, signum: int, now: float) -> None:
        if self._saved:  # the stop's checkpoint is published: a launcher ending the other ranks asks nothing more
            return
        if self._signalled_at is None:
            self._signalled_at, self.requested, Preemption.stopped_by = now, True, signum
            self._say("stopping with a checkpoint when this step ends; a second Ctrl-C (or SIGTERM) stops at once, "
                      "without one")
        elif now - self._signalled_at >= FORCE_AFTER_S:
            self._say(f"stopped at once by a second signal, without a checkpoint; {self._rerun}",
                      wait_s=LAST_LINE_WAIT_S)
            run_before_forced_exit(128 + signum)
            os._exit(128 + signum)

    def _say(self, line: str, wait_s: float = 0.0) -> None:
        """One line from the first rank on the error stream, written by a thread of its own: a write to a stream
        that does not drain (a paused terminal, a slow pipe) must not hold the signal reader. Waits up to `wait_s`
        for the write (the last line before the process ends, which would take the thread with it)."""
        if self.info.is_main:
            writer = threading.Thread(target=_write_error, args=(f"\nzerollm: {line}\n",), daemon=True)
            writer.start()
            writer.join(wait_s)

    def saved(self) -> None:
        """The checkpoint of a requested stop is published: signals from here on ask nothing more."""
        self._saved = True

    def output_lost(self, error: OSError) -> None:
        """Standard output's write failed (its reader left: `| head`; a full disk): a stop with a checkpoint, as on
        SIGTERM (`llm.stdout.output_loss_handled`); the training went on with its output discarded."""
        if not self.requested:
            reason = "its reader left" if isinstance(error, BrokenPipeError) else error.strerror or str(error)
            self._say(f"standard output cannot be written ({reason}); stopping with a checkpoint when this step ends")
            Preemption.stopped_by = signal.SIGPIPE  # bench learn and bench train, which have no resume, end with 141
        self.requested = self.output_lost_now = True

    def _on_supervisor_lost(self, reason: str) -> None:
        print(f"rank {self.info.rank}: {reason}; saving a checkpoint and stopping", flush=True)
        self.requested = True

    def agreed(self) -> bool:
        """Called by every rank after every step: True on every rank at the same step once any rank was asked to
        stop (on a GPU, one step after the request)."""
        if self._wakeup >= 0:  # ours again, should an asyncio loop (in a reward) have taken it and left none
            signal.set_wakeup_fd(self._wakeup, warn_on_full_buffer=False)
        if self.info.world_size == 1:
            return self.requested
        if self._ready is None:  # gloo: the all-reduce completes before it returns
            self._flag.fill_(int(self.requested))
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
            return bool(self._flag.item())
        stop = False
        if self._voted:
            self._ready.synchronize()
            stop = bool(self._result[0])
        self._flag.fill_(int(self.requested))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        self._result.copy_(self._flag, non_blocking=True)
        self._ready.record()
        self._voted = True
        return stop
