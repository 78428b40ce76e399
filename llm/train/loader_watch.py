"""A rank's wait for its data loader's next batch, watched: a draw can block where nothing times out (a read of a
hung network file system, in a worker or, with data.loader_workers=0, in the rank; the transfer of a batch a worker
made, which needs that worker to answer), and a worker can die (the out-of-memory killer's SIGKILL). The trainer
(`llm.train.trainer`) turns what this raises into a checkpoint or one line (`Trainer._stop_without_batch`,
`Trainer._end_for_data`)."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import torch

from llm.errors import UserError

POLL_S = 1.0
"""How often a rank waiting for its data loader's next batch looks at the stop flag and at how long it waited."""
STOP_WAIT_S = 5.0
"""How long a rank of several, asked to stop, still waits for a batch of its data loader: the other ranks cannot end
the step, and so cannot save, without it."""
LIMIT = 0.9
"""A batch the data loader owes for this fraction of train.collective_timeout_s ends the job, naming its workers,
before the watchdog ends it at the timeout without knowing what the rank waits for."""


KILLED_HINTS = {signal.SIGKILL: " (the out-of-memory killer's signal, most often: lower data.loader_workers or free "
                                "memory)",
                signal.SIGBUS: " (most often a full /dev/shm, where workers hand their batches over: raise its size, "
                               "e.g. docker run --shm-size, or lower data.loader_workers)"}
"""What a worker's death by each signal most often means."""


class NoBatch(Exception):
    """The data loader gave no batch for step `step` in `waited` seconds, raised before the step trained anything;
    `loader` says what it waits for; `stopped`: a stop was asked for meanwhile."""

    def __init__(self, step: int, waited: float, loader: str, stopped: bool) -> None:
        super().__init__(f"step {step}'s data did not come in {waited:.0f} s: {loader}")
        self.step, self.waited, self.loader, self.stopped = step, waited, loader, stopped


class WorkerDied(Exception):
    """A draw failed because a data-loader worker died; the message says how it ended."""


def worker_failure(exc: BaseException) -> bool:
    """Whether `exc` is the news of a data-loader worker that died (a signal, such as the out-of-memory killer's
    SIGKILL, or an exit): torch's, raised by the rank's next draw or, through its SIGCHLD handler, wherever the rank
    was; or `WorkerDied`."""
    torch_s = isinstance(exc, RuntimeError) and str(exc).startswith("DataLoader worker (pid")
    return torch_s or isinstance(exc, WorkerDied)


def worker_death(pid: int, code: int) -> str:
    """How a data-loader worker ended (`code`: its exit code, or -N for signal N), as one clause with what to do."""
    if code < 0:
        name = signal.Signals(-code).name if -code in SIGNAL_NAMES else f"signal {-code}"  # real-time ones: no name
        return f"its data-loader worker pid {pid} was killed by {name}{KILLED_HINTS.get(-code, '')}"
    return f"its data-loader worker pid {pid} exited with code {code}"


SIGNAL_NAMES = frozenset(signal.Signals)
"""The signals Python has a name for."""
TORCH_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: (.+?)\. ")
TORCH_EXITED = re.compile(r"DataLoader worker \(pid (\d+)\) exited unexpectedly with exit code (-?\d+)\.")
SIGNAL_OF_DESCRIPTION = {signal.strsignal(signum): signum for signum in signal.valid_signals()}
"""torch says a worker's signal by its description (strsignal: "Killed")."""


def torch_said(exc: BaseException) -> str | None:
    """The `worker_death` clause of torch's news of a dead worker (its SIGCHLD handler's, raised wherever the rank
    was: also where no loader of the rank's own still holds that worker, as at an epoch's end); None for other news."""
    text = f"{exc} "
    if (killed := TORCH_KILLED.search(text)) and killed[2] in SIGNAL_OF_DESCRIPTION:
        return worker_death(int(killed[1]), -SIGNAL_OF_DESCRIPTION[killed[2]])
    if exited := TORCH_EXITED.search(text):
        return worker_death(int(exited[1]), int(exited[2]))
    return None


def worker_user_error(error: UserError) -> str | None:
    """The message of a UserError a data-loader worker raised, from what torch raises again in the rank ('Caught
    UserError in DataLoader worker process 0.', the worker's traceback, then the error's own line); None for one the
    rank raised."""
    kind = type(error)
    if not str(error).startswith(f"Caught {kind.__name__} in DataLoader worker process"):
        return None
    return str(error).rstrip().rsplit("\n", 1)[-1].removeprefix(f"{kind.__module__}.{kind.__qualname__}: ")


class WatchedLoader:
    """The batches of a DataLoader iterator `batches`, each drawn by a thread of its own while the rank waits
    POLL_S at a time (`next`). `device`: the rank's (a draw thread on a GPU sets it, as DataLoader's pinning thread
    does); `inputs`: what the loader reads, for messages."""

    def __init__(self, batches: Iterator, device: torch.device, inputs: str) -> None:
        self.batches, self.device, self.inputs = batches, device, inputs

    def next(self, step: int, stop_requested: Callable[[], bool], world_size: int, timeout_s: float) -> Any:
        """The next batch, for step `step`. The wait ends, raising `NoBatch`, when a stop is asked for (one rank: at
        once; several: after STOP_WAIT_S, since the others wait inside the step, where they cannot save without this
        rank) or when no batch came within LIMIT of `timeout_s` (train.collective_timeout_s: one rank has no
        watchdog; of several, the watchdog would end the job at the timeout without knowing why). A draw that failed
        because a worker died raises `WorkerDied`."""
        drawn: dict[str, Any] = {}
        done = threading.Event()

        def draw() -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                drawn["batch"] = next(self.batches)
            except BaseException as exc:  # noqa: BLE001 - raised in the rank's thread, below
                drawn["error"] = exc
            finally:
                done.set()

        threading.Thread(target=draw, name="zerollm-draw", daemon=True).start()
        started, asked = time.monotonic(), None
        while not done.wait(POLL_S):
            now = time.monotonic()
            if stop_requested():
                asked = asked or now
                if world_size == 1 or now - asked >= STOP_WAIT_S:
                    raise NoBatch(step, now - started, self.said(), stopped=True)
            if now - started >= LIMIT * timeout_s:
                raise NoBatch(step, now - started, self.said(), stopped=False)
        if "error" in drawn:
            error = drawn.pop("error")
            # a transfer cut off by its worker's death fails before the rank hears of the death: wait for that news
            if self._workers() and (dead := self.dead_workers(wait_s=POLL_S)):
                raise WorkerDied(dead) from error
            if isinstance(error, UserError) and (said := worker_user_error(error)) is not None:
                raise UserError(said) from None
            raise error
        return drawn.pop("batch")

    def _workers(self) -> list:
        return getattr(self.batches, "_workers", [])

    def said(self) -> str:
        """What a stuck draw's message says of the data loader: its workers, by pid and state."""
        states = []
        for worker in self._workers():
            try:
                states.append(f"{worker.pid} ({psutil.Process(worker.pid).status()})")
            except psutil.Error:
                states.append(f"{worker.pid} (gone)")
        who = f"its data-loader worker(s), pid {', '.join(states)}," if states else \
            "its data loader (in the rank itself: data.loader_workers=0)"
        return f"{who} gave none (stuck reading {self.inputs}, e.g. on a hung network file system?)"

    def dead_workers(self, wait_s: float = 0.0) -> str | None:
        """How the loader's dead workers ended, as one clause with what to do; None while none has (`wait_s`: how long
        to wait for one to). Reading it reaps them, which keeps torch's SIGCHLD handler from raising their news again,
        later, wherever the rank then is (its message depends on which of its checks saw the death first)."""
        deadline = time.monotonic() + wait_s
        while True:
            said = [worker_death(worker.pid, worker.exitcode) for worker in self._workers() if worker.exitcode]
            if said or time.monotonic() >= deadline:
                return "; ".join(said) or None
            time.sleep(0.05)
