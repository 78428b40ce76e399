"""Rank liveness: a rank that dies or hangs ends the whole job, and the message names it.

Every rank runs a heartbeat thread that increments its counter in the job's rendezvous store (the
TCPStore the launcher set up at MASTER_ADDR:MASTER_PORT) every `interval` seconds. The counters are
a clock that needs no synchronised clocks between nodes:

- when a collective fails (a peer's connection closed) or times out (`train.collective_timeout_s`),
  `diagnose()` reads every counter until all have moved, for at most `stale_after` seconds; ranks whose
  counter did not move are dead or frozen, and are named with the host and pid they registered (a rank of
  the same machine and pid namespace whose process has ended is named at once, without the wait);
- the rank that diagnosed a failure publishes it under an abort key; every other rank's heartbeat
  thread sees the key within one interval, says so, and ends its process, so no rank is left waiting (the
  rank that published it waits until they all said so, as the store may live in its process);
- a step that runs longer than the timeout ends the job from the thread (a backstop for waits that no
  collective timeout covers, such as a peer frozen between collectives).

A failure is therefore reported within the timeout plus the diagnosis (a tenth of the timeout); a
killed process, whose connections close at once, within seconds.

If the store itself is unreachable, the process that hosts it is gone: rank 0 under the deepspeed
launcher, the node-0 agent under torchrun.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import psutil
import torch.distributed as dist

from llm.errors import EXIT_RANK_LOST, report
from llm.runtime.forced_exit import run_before_forced_exit
from llm.stdout import settle, unguarded

_PREFIX = "zerollm/watchdog"


def _counter_key(rank: int) -> str:
    return f"{_PREFIX}/beats/{rank}"


def _identity_key(rank: int) -> str:
    return f"{_PREFIX}/who/{rank}"


def _process_key(rank: int) -> str:
    return f"{_PREFIX}/process/{rank}"


def _this_process() -> str:
    """Where a pid means this process: the boot and the pid namespace of this machine, and the pid ("" where /proc
    does not tell)."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):  # a /proc of another pid namespace: its pids are not ours
            return ""
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.stat('/proc/self/ns/pid').st_ino} {os.getpid()}"
    except OSError:
        return ""


def _ended(process: str, here: str) -> bool:
    """Whether `process` (a rank's `_this_process`) is of this machine and pid namespace, and has ended (or is a
    zombie its launcher has not reaped yet). Elsewhere only its heartbeat can tell."""
    *where, pid = process.split(" ") if process else ["", ""]
    if not here or where != here.split(" ")[:-1]:
        return False
    try:
        return psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # not ours to look at: its heartbeat tells
        return False


_ABORT_KEY = f"{_PREFIX}/abort"
_ABORT_SEEN_KEY = f"{_PREFIX}/abort-seen"
DIAGNOSIS_POLL_S = 0.25
"""How often a diagnosis reads the heartbeat counters while it waits for them to move."""


NODE_ADVICE = "Fix or replace the failed node, then start the job again with --resume auto"
"""What to do when a rank died, hung or could not be reached."""


class Watchdog:
    def __init__(self, rank: int, world_size: int, timeout_s: float, announce: bool,
                 before_exit: Callable[[], None] = lambda: None) -> None:
        """`announce`: whether this rank prints the message when another rank ended the job (one rank per node);
        `before_exit`: what to do before this process ends the job's way (`os._exit`, which skips `finally`)."""
        self.rank, self.world_size, self.announce = rank, world_size, announce
        self.before_exit = before_exit
        self.timeout_s = timeout_s
        self.interval = min(max(timeout_s / 30, 0.5), 10.0)
        self.stale_after = 3 * self.interval
        self.address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self._store = self._connect(timeout_s)
        self._store.set(_identity_key(rank), f"host {socket.gethostname()}, pid {os.getpid()}")
        self._store.set(_process_key(rank), _this_process())
        self._store.add(_counter_key(rank), 1)
        self._busy_since: float | None = None
        self._busy_what = ""
        self._stopped = threading.Event()
        self._ending = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="zerollm-watchdog", daemon=True)
        self._thread.start()

    def _connect(self, timeout_s: float) -> dist.TCPStore:
        host, port = self.address
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    # ---- the main thread's side ----------------------------------------------------------------

    @contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """The main thread does work that should end within the timeout (e.g. "step 12"); past it, the thread
        ends the job. Evaluation and checkpoints run outside, bounded by the collective timeout only."""
        self._busy_what, self._busy_since = what, time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    def stop(self) -> None:
        """Stop beating (before the final barrier: after it, the store's host may exit at any time)."""
        self._stopped.set()
        self._thread.join()

    def diagnose(self) -> str | None:
        """A sentence naming the ranks whose heartbeat stopped, or None when every rank is alive. Ranks of this
        machine whose process has ended are named at once, without waiting for their heartbeat."""
        host, port = self.address
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            store = self._connect(max(5.0, 2 * self.interval))
            here = _this_process()
            process_keys = {r: _process_key(r) for r in others}  # a rank may fail before another registered
            known = (others if store.check(list(process_keys.values())) else
                     [r for r in others if store.check([process_keys[r]])])
            processes = store.multi_get([process_keys[r] for r in known]) if known else []

            def ended() -> list[int]:
                return [r for r, process in zip(known, processes, strict=True) if _ended(process.decode(), here)]

            gone = ended()
            if not gone:
                keys = [_counter_key(r) for r in others]
                before = store.multi_get(keys)
                deadline = time.monotonic() + self.stale_after
                while True:  # until every other rank's counter moved (each beats once an interval), or the deadline
                    time.sleep(min(DIAGNOSIS_POLL_S, self.stale_after))
                    after = store.multi_get(keys)
                    if all(a != b for a, b in zip(after, before, strict=True)) or time.monotonic() >= deadline:
                        break
                gone = ended()  # a rank killed as this began may have been still exiting (its sockets close first)
            if gone:
                who = store.multi_get([_identity_key(r) for r in gone])
                return "; ".join(f"rank {r} ({w.decode()})" for r, w in zip(gone, who, strict=True)) + " ended"
            silent = [r for r, a, b in zip(others, after, before, strict=True) if a == b]
            who = dict(zip(silent, store.multi_get([_identity_key(r) for r in silent]))) if silent else {}
        except Exception:  # noqa: BLE001 - any store failure means the same thing here
            return (f"the job's rendezvous store at {host}:{port} is unreachable: the process hosting it "
                    "(rank 0 under the deepspeed launcher, the node-0 agent under torchrun) or its node stopped")
        if not silent:
            return None
        named = "; ".join(f"rank {r} ({who[r].decode()})" for r in silent)
        return f"{named} stopped responding (no heartbeat for {self.stale_after:.0f} s)"

    def end_job(self, message: str | None, advice: str = NODE_ADVICE, code: int = EXIT_RANK_LOST) -> None:
        """Tell every rank to end, print `message` and `advice` and end this process with `code`, as every rank does
        (None: without a word, as for a closed output pipe). Called from the main thread and the watchdog thread
        alike; the first caller ends the process, a second one waits for that."""
        self._ending.acquire()
        text = f"rank {self.rank}: {message}; the job is ended on every rank. {advice}" if message else ""
        try:
            store = self._connect(5.0)
            store.set(_ABORT_KEY, f"{code}\n{text}")
            store.add(_ABORT_SEEN_KEY, 1)
            # the store may live in this process: it stays until every rank knows (the others look once an interval)
            deadline = time.monotonic() + 1.5 * self.interval
            while store.add(_ABORT_SEEN_KEY, 0) < self.world_size and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store may be what failed; the other ranks' own checks cover it
            pass
        self._exit(text, code)

    # ---- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self._store.add(_counter_key(self.rank), 1)
                self._end_if_told()
            except Exception:  # noqa: BLE001 - the store's host is gone; the main thread's collective fails next
                pass
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.timeout_s:
                reason = self.diagnose() or ("every rank's heartbeat is alive, so a rank is stuck outside "
                                             "communication (a data loader, a file system, its own code), or a step "
                                             "takes longer than that (long GRPO rollouts of a large model: raise "
                                             "train.collective_timeout_s)")
                self.end_job(f"{self._busy_what} did not finish within train.collective_timeout_s="
                             f"{self.timeout_s:g} s: {reason}")

    def _end_if_told(self) -> None:
        """End this process if a rank ended the job, saying this rank knows (each rank says so once: here, or in
        `end_job` where it ends the job itself)."""
        if not self._store.check([_ABORT_KEY]):
            return
        code, _, text = self._store.get(_ABORT_KEY).decode().partition("\n")
        code = int(code) if code.isdigit() else EXIT_RANK_LOST
        if not self._ending.acquire(blocking=False):  # this rank is ending the job itself
            return
        with contextlib.suppress(Exception):
            self._store.add(_ABORT_SEEN_KEY, 1)
        self._exit(text if self.announce else None, code)

    def _exit(self, message: str | None, code: int) -> None:
        try:
            if message:
                report(message)
            settle(unguarded())  # the stream itself: its guard raises OutputLost, which settle does not expect
            self.before_exit()
            run_before_forced_exit(code)
        finally:
            os._exit(code)
