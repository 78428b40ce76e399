"""Stopping together: SIGTERM or SIGINT on any rank (or the loss of the `zerollm launch` that started it)
makes every rank stop after the same step, save a checkpoint and exit with `EXIT_PREEMPTED`.

The ranks agree through a vote: after every step each rank posts its flag in a MAX all-reduce on the
training device. On the CPU (gloo) the result is read at once. On a GPU the result is copied to pinned
host memory behind an event and read after the next step, so reading it waits only for that tiny
collective, never for the step queued after it: there a stop takes effect one step after the request,
on every rank at the same step.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from llm.runtime.distributed import DistInfo
from llm.runtime.supervisor import watch_supervisor


class Preemption:
    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self.requested = False
        on_gpu = info.device.type == "cuda"
        self._flag = torch.zeros(1, dtype=torch.int32, device=info.device)
        self._result = torch.zeros(1, dtype=torch.int32, pin_memory=on_gpu)
        self._ready = torch.cuda.Event() if on_gpu else None
        self._voted = False

    def install(self) -> None:
        """Request a stop on SIGTERM/SIGINT, and when the supervising `zerollm launch` ends."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        watch_supervisor(self._on_supervisor_lost)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    def _on_supervisor_lost(self, reason: str) -> None:
        print(f"rank {self.info.rank}: {reason}; saving a checkpoint and stopping", flush=True)
        self.requested = True

    def agreed(self) -> bool:
        """Called by every rank after every step: True on every rank at the same step once any rank was asked to
        stop (on a GPU, one step after the request)."""
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
