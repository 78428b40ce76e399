"""A time budget for training (`train.max_time`): the run stops before a step that would end past the budget,
and the learning-rate schedule follows time, so that it completes inside the budget.

Time counted: the wall time of the training loop (steps, evaluations, samples, checkpoints), summed over every
session of the run. The elapsed seconds are part of each checkpoint's client state, so a resumed run continues
the same budget; the time between a run's last checkpoint and its death, and the time to start again, are not
counted.

Every rank must use the same learning rate and stop after the same step, so rank 0's clock decides: after every
step it publishes what it measured (elapsed time, seconds per step, seconds of an evaluation and of a
checkpoint) in a broadcast; on the CPU the ranks read it at once, on a GPU one step later (copied to pinned memory
behind an event, like the stop vote), so no step waits for the device. All decisions below use published values
only; rank 0 keeps its own estimates apart and updates them from its own measurements alone (on a GPU what it
reads back is a step late), and its checkpoints keep those.

    step_seconds   moving average of a step's wall time, evaluations and checkpoints excluded
    calibration    the first step after warmup (step 1 without warmup) evaluates and saves a checkpoint, whatever
                   train.eval_every and train.save_every say, so that the time both take is measured early; sooner
                   where half the budget would be spent before (a long warmup), and at the first step of a session
                   resumed from a checkpoint that measured no evaluation (a run trained without a budget before);
                   where what it measured leaves no room for another step, the run ends there, its evaluation and
                   checkpoint the final ones; that checkpoint is written before its own time is known, so a run
                   resumed from it (or from any other that knows an evaluation's time but not a checkpoint's) saves
                   again after its first step
    reserve        an evaluation (with its samples) + a checkpoint: the longest of each seen so far
    projection     the end of a later step: the last published elapsed time + step_seconds for each step to come
                   + the evaluations and checkpoints train.eval_every and train.save_every place between them
    stop           after step s when the projected end of step s + 1 falls later than max_time - reserve
    schedule       after warmup, the cosine's progress is the larger of the step progress (train.max_steps) and
                   (projected end of the step - end of warmup) / (projected end of the last step that fits before
                   max_time - reserve, the evaluations and checkpoints due on the way included - end of warmup)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from llm.config import TrainConfig
from llm.runtime.distributed import DistInfo

SMOOTHING = 0.2
"""Weight of the newest step in the moving average of step times."""
CALIBRATE_BY = 0.5
"""Share of the budget by whose end the reserve is measured, however long the warmup: measured at the end of a
warmup that outlasted the budget, it was never kept, and the final evaluation and checkpoint ran past it."""
FEW_STEPS = 3
"""A session of at most this many steps that ended past its budget ran steps decided before any was measured (on a
GPU, where rank 0's numbers are published a step late, one more): `overrun_note`."""


class TimeBudget:
    def __init__(self, t: TrainConfig, info: DistInfo, clock: Callable[[], float] = time.perf_counter) -> None:
        self.max_time = t.max_time_seconds()
        self.warmup_steps, self.eval_every, self.save_every = t.warmup_steps, t.eval_every, t.save_every
        self.info, self.clock = info, clock
        # published (identical on every rank)
        self.elapsed = 0.0
        """Training time at the end of step `known_step`."""
        self.known_step = 0
        self.step_seconds = 0.0
        self.eval_seconds: float | None = None
        self.save_seconds = 0.0
        self.warmup_end: float | None = 0.0 if self.warmup_steps == 0 else None
        # rank 0's own measurements and estimates: what it publishes, never read back from what was published
        self._base = 0.0
        self._session_start = self._iteration_start = 0.0
        self._overhead = 0.0
        self._measured_steps = 0
        self._step_average = 0.0
        self._eval_measured: float | None = None
        """The longest evaluation (with its samples) so far, or None before the first."""
        self._save_measured = 0.0
        """The longest checkpoint so far, 0 before the first."""
        self._steps_done = 0
        """Steps completed when `end_iteration` was last called (or the loop started): the step in progress is
        the next one."""
        self._session_start_step = 0
        self._calibrated = False
        """Whether a step of this session evaluated to measure the reserve (on a GPU the measurement is published a
        step later: the step after it must not calibrate again)."""
        self._measure_save_again = False
        """Resumed from a checkpoint that knew an evaluation's time but not a checkpoint's (the calibration
        checkpoint: written before its own time was measured): the session's first step saves to measure it."""
        self._warmup_ended = self.warmup_end
        """Training time at the end of warmup, None before it."""
        self._progress = 0.0
        """The furthest `progress` given so far (from published values: alike on every rank), kept by checkpoints."""
        self._channel = _Broadcast(info, 6) if self.enabled and info.world_size > 1 else None

    @property
    def enabled(self) -> bool:
        return self.max_time is not None

    # ---- decisions (published values only) -------------------------------------------------------

    @property
    def reserve(self) -> float:
        """Seconds kept for the final evaluation and checkpoint."""
        return (self.eval_seconds or 0.0) + self.save_seconds

    def calibration_due(self, steps_done: int) -> bool:
        """Whether this step saves, and evaluates too while no evaluation was measured (`eval_seconds` is None), to
        measure the reserve (see the module docstring)."""
        if not self.enabled:
            return False
        if self.eval_seconds is None and not self._calibrated and (
                steps_done >= max(1, self.warmup_steps, self._session_start_step + 1) or
                self.projected_end(steps_done + 1) > CALIBRATE_BY * self.max_time):
            self._calibrated = True  # every rank decides alike: published values, and the same steps
            return True
        return self._measure_save_again and steps_done == self._session_start_step + 1

    def spent_by_calibration(self, calibrated: bool, steps_done: int) -> bool:
        """Whether the step that made `steps_done` calibrated (`calibration_due`) and what it measured, published at
        once (`end_iteration` with `wait`), leaves no room for another step: its evaluation and checkpoint were the
        run's final ones (the next step ran, and evaluated and saved again, past the budget)."""
        return calibrated and self.out_of_time(steps_done)

    def projected_end(self, steps_done: int) -> float:
        """Training time when `steps_done` steps will have been completed, with the evaluations and checkpoints due
        after the steps before it."""
        def due(every: int) -> int:  # multiples of `every` among the steps known_step + 1 .. steps_done - 1
            return max(0, (steps_done - 1) // every - self.known_step // every) if every else 0

        planned = due(self.eval_every) * (self.eval_seconds or 0.0) + due(self.save_every) * self.save_seconds
        return self.elapsed + (steps_done - self.known_step) * self.step_seconds + planned

    def last_step(self) -> int | None:
        """The last step that ends inside the budget less the reserve, as projected now (None before a step was
        measured): the evaluations and checkpoints due on the way may end the run well before the budget's end,
        where the schedule must have completed."""
        if self.step_seconds <= 0:
            return None
        limit = self.max_time - self.reserve
        fits, beyond = self.known_step, self.known_step + math.ceil(max(0.0, limit - self.elapsed) /
                                                                    self.step_seconds) + 1
        while beyond - fits > 1:  # projected_end grows with the steps: its last one inside the limit
            middle = (fits + beyond) // 2
            fits, beyond = (middle, beyond) if self.projected_end(middle) <= limit else (fits, middle)
        return fits

    def out_of_time(self, steps_done: int) -> bool:
        """Whether one more step after `steps_done` would end past the budget (less the reserve)."""
        return self.enabled and self.projected_end(steps_done + 1) > self.max_time - self.reserve

    def progress(self, step_index: int) -> float:
        """Share of the post-warmup time spent at the end of optimizer step `step_index` (0-based), in [0, 1]: 1 at
        the end of the `last_step` (with costly evaluations on the way, the budget less the reserve ended a run
        whose last step was at 0.94 of it, above the learning rate's floor)."""
        if not self.enabled or self.warmup_end is None:
            return 0.0
        last = self.last_step()
        horizon = (self.max_time - self.reserve if last is None else self.projected_end(last)) - self.warmup_end
        now = 1.0 if horizon <= 0 else min(1.0, max(0.0, (self.projected_end(step_index + 1) - self.warmup_end) /
                                                    horizon))
        self._progress = max(self._progress, now)  # the last step that fits moves as step times vary: the schedule
        return self._progress  # only goes forward (it rose again after warmup, by up to 4.5 % of the peak rate)

    def warmup_note(self, steps_done: int) -> str | None:
        """When the budget ends the run after `steps_done` steps, before its warmup did, a note saying so: the
        time-driven decay starts after `train.warmup_steps`, so the run neither reached its peak learning rate nor
        decayed from it (published values only: every rank decides alike)."""
        if not self.enabled or steps_done >= self.warmup_steps or not self.out_of_time(steps_done):
            return None
        return (f"note: train.max_time={self.max_time:g} s ended the run after {steps_done} steps, inside its "
                f"warmup of train.warmup_steps={self.warmup_steps}: the learning rate neither reached its peak nor "
                "decayed; lower train.warmup_steps")

    def overrun_note(self) -> str | None:
        """At the run's end, on rank 0 (its own clock: what it says, no rank decides by): a note when training took
        longer than a budget that held only a few steps (the steps before the first one measured are run whatever
        they cost). A run of many steps may end a little past its budget, its last step slower than their average:
        no note."""
        if not self.enabled or self._measured_steps > FEW_STEPS or (used := self._now()) <= self.max_time:
            return None
        took = f"{used:.1f}" if used >= 1 else f"{used:.2g}"  # a budget below a second: 0.0042, not 0.0
        return (f"note: training took {took} s, past train.max_time={self.max_time:g} s: the budget stops the run "
                f"by the time its steps were measured to take ({self._step_average:.2g} s each), and one or two steps "
                "run before any is; give it the time of many steps")

    # ---- measuring (rank 0 decides) -------------------------------------------------------------

    def start(self, step: int) -> None:
        """The loop starts (or resumes) after `step` steps."""
        self.known_step = self._steps_done = self._session_start_step = step
        self._session_start = self._iteration_start = self.clock()

    def _now(self) -> float:
        return self._base + self.clock() - self._session_start

    @contextmanager
    def overhead(self, kind: str | None) -> Iterator[None]:
        """Time what a step does besides training: kept out of the step time, and, for an evaluation ('eval') or a
        checkpoint ('save'), the longest so far kept as reserve (None: neither happens this time)."""
        start = self.clock()
        yield
        seconds = self.clock() - start
        self._overhead += seconds
        if kind == "eval":
            self._eval_measured = max(seconds, self._eval_measured or 0.0)
        elif kind == "save":
            self._save_measured = max(seconds, self._save_measured)

    def end_iteration(self, step: int, wait: bool = False) -> None:
        """After step `step` with its evaluation, logging and checkpoint: measure (rank 0) and publish; with `wait`
        (a calibration step, whose measurements decide whether the run ends there: `spent_by_calibration`), read
        what is published now on a GPU too, waiting for the device once."""
        if not self.enabled:
            return
        now = self.clock()
        step_time = now - self._iteration_start - self._overhead
        self._iteration_start, self._overhead = now, 0.0
        self._steps_done = step
        self._measured_steps += 1
        first = self._measured_steps == 1 and self._step_average == 0
        self._step_average = step_time if first else (1 - SMOOTHING) * self._step_average + SMOOTHING * step_time
        elapsed = self._now()
        if self._warmup_ended is None and step >= self.warmup_steps:
            self._warmup_ended = elapsed
        values = [elapsed, float(step), self._step_average, _or_minus_one(self._eval_measured), self._save_measured,
                  _or_minus_one(self._warmup_ended)]
        published = self._channel.exchange(values, wait) if self._channel else values
        if published is not None:
            self._publish(published)

    def _publish(self, values: list[float]) -> None:
        self.elapsed, known_step, self.step_seconds, eval_seconds, self.save_seconds, warmup_end = values
        self.known_step = int(known_step)
        self.eval_seconds = None if eval_seconds < 0 else eval_seconds
        self.warmup_end = None if warmup_end < 0 else warmup_end

    # ---- checkpoints ----------------------------------------------------------------------------

    def state_dict(self, step: int) -> dict[str, Any] | None:
        """What a checkpoint of step `step` keeps (rank 0 writes it): the elapsed time now and rank 0's own
        estimates (not the published ones, a step late on a GPU). A checkpoint of the last warmup step (the
        calibration's) records the end of warmup as now: `end_iteration` sets it only after the checkpoint, and a
        run resumed from it would otherwise end its warmup a step (and its first step's start-up time) late. (A
        step saved after its `end_iteration`, by a later step that failed, has it set already.)"""
        if not self.enabled:
            return None
        now = self._now()
        warmup_end = self._warmup_ended
        if warmup_end is None and step >= self.warmup_steps:
            warmup_end = now
        return {"elapsed": now, "max_time": self.max_time, "step_seconds": self._step_average,
                "eval_seconds": self._eval_measured, "save_seconds": self._save_measured, "warmup_end": warmup_end,
                "progress": self._progress}

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Continue from the estimates of a checkpoint of step `step`: published at once on every rank (each reads
        the same checkpoint), and rank 0's own, which it goes on updating."""
        if not state or not self.enabled:
            return
        self.known_step = step
        self._base = self.elapsed = state["elapsed"]
        self._step_average = self.step_seconds = state["step_seconds"]
        self._eval_measured = self.eval_seconds = state["eval_seconds"]
        self._save_measured = self.save_seconds = state["save_seconds"] or 0.0
        self._warmup_ended = self.warmup_end = state["warmup_end"]
        # the schedule's progress so far (a checkpoint of an earlier version has none); under another max_time the
        # schedule follows the new budget from here, as another max_steps does (held, a longer budget trained all
        # its extension at the floor)
        self._progress = state.get("progress", 0.0) if state.get("max_time") == self.max_time else 0.0
        self._measure_save_again = self.eval_seconds is not None and not self.save_seconds


def _or_minus_one(seconds: float | None) -> float:
    """A value that may be unknown, as broadcast: -1 for None (see `TimeBudget._publish`)."""
    return -1.0 if seconds is None else seconds


class _Broadcast:
    """Rank 0's values to every rank, on the training device: read at once with gloo; on a GPU returned at the next
    exchange (None the first time), so the host never waits for the step queued before it."""

    def __init__(self, info: DistInfo, size: int) -> None:
        on_gpu = info.device.type == "cuda"
        self._device = torch.zeros(size, dtype=torch.float64, device=info.device)
        self._sent = torch.zeros(size, dtype=torch.float64, pin_memory=on_gpu)
        self._received = torch.zeros(size, dtype=torch.float64, pin_memory=on_gpu)
        self._ready = torch.cuda.Event() if on_gpu else None
        self._pending = False

    def exchange(self, values: list[float], wait: bool = False) -> list[float] | None:
        """`values` broadcast from rank 0; what is published: these (gloo, or `wait`), or on a GPU the previous
        exchange's (None the first time, and after one that waited)."""
        if self._ready is None:
            self._device.copy_(torch.tensor(values, dtype=torch.float64))
            dist.broadcast(self._device, src=0)
            return self._device.tolist()
        previous = None
        if self._pending:
            self._ready.synchronize()
            previous = self._received.tolist()
        self._sent.copy_(torch.tensor(values, dtype=torch.float64))
        self._device.copy_(self._sent, non_blocking=True)
        dist.broadcast(self._device, src=0)
        self._received.copy_(self._device, non_blocking=True)
        self._ready.record()
        self._pending = not wait
        if wait:
            self._ready.synchronize()
            return self._received.tolist()
        return previous
