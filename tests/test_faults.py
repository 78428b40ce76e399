"""Fault injection: a 2-rank CPU job is killed at seeded random points inside checkpoint saves and metrics writes
(some of them mid-file: the file is left torn) and resumed each time. Every resume starts from a complete
checkpoint, `latest` never names a lost or partial one, and the losses, gradient norms and final weights equal
those of an uninterrupted run bit for bit.

The ranks are forked from the tests' forkserver (tests/forked_ranks.py), which imported torch, DeepSpeed and this
module once, so a kill and its resume take seconds. In a rank, the file operations of `llm.train.checkpoint.save`
(every `torch.save`, fsync, atomic write, rename, deletion and collective) and each `MetricsSink.log` are numbered;
the fault rank SIGKILLs itself at the chosen one, and the test kills the other rank as soon as it sees that death,
as a crashed job would end.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
from multiprocessing.connection import wait
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from forked_ranks import enter_rank, forkserver

from conftest import TINY
from launch.local import rank_environments
from llm import durable, rundir
from llm.cli import main
from llm.loading import consolidated_weights
from llm.runtime.rank_env import free_port
from llm.train import checkpoint
from llm.train.metrics import MetricsSink

REAL_TORCH_SAVE = torch.save
WORLD = 2
KILLS = 20
MAX_STEPS = 2 * KILLS + 4  # a kill comes within 2 steps of the resume, so the run cannot end before the last kill
RUN = ["train.precision=fp32", "train.eval_every=0", "train.save_every=1", "train.keep_checkpoints=2",
       f"train.max_steps={MAX_STEPS}", "train.peak_tflops=1"]


# ---- inside a rank ----------------------------------------------------------------------------------------------

class FaultPoints:
    """Numbers the file operations of checkpoint saves and metrics rows in this rank; at number `kill_at` the rank
    names the operation in `record`, leaves the file it was writing torn (when it writes one) and SIGKILLs itself.
    `record` gets, without a kill, the number of points of each logged or saved step (for the reference run)."""

    def __init__(self, kill_at: int | None, record: Path) -> None:
        self.kill_at, self.record = kill_at, record
        self.count, self.inside, self.per_step = 0, False, []

    def hit(self, name: str, write_torn=None) -> None:
        if not self.inside:
            return
        self.count += 1
        self.per_step[-1] += 1
        if self.count == self.kill_at:
            self.record.write_text(name + (" (torn)" if write_torn else ""))
            if write_torn is not None:
                write_torn()
            os.kill(os.getpid(), signal.SIGKILL)

    def around(self, fn, new_step: bool):
        """`fn` with its file operations numbered; `new_step`: it starts a step's points (the metrics row, or the
        save where a rank logs nothing)."""

        def wrapped(*args, **kwargs):
            if new_step or not self.per_step:
                self.per_step.append(0)
            self.inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside = False
                if self.kill_at is None:
                    self.record.write_text(json.dumps(self.per_step))

        return wrapped

    def before(self, fn, write_torn=None):
        """`fn` preceded by a point (`write_torn(*args)` leaves its file torn when the rank dies there)."""

        def wrapped(*args, **kwargs):
            self.hit(fn.__qualname__, None if write_torn is None else lambda: write_torn(*args, **kwargs))
            return fn(*args, **kwargs)

        return wrapped


def _torn_torch_save(obj, f, *args, **kwargs) -> None:
    data = io.BytesIO()
    REAL_TORCH_SAVE(obj, data)
    torn = data.getvalue()[:random.randrange(len(data.getvalue()))]
    if hasattr(f, "write"):  # checkpoints are saved through file objects (llm.train.checkpoint)
        f.write(torn)
        f.flush()
    else:
        Path(f).write_bytes(torn)


def _torn_text(path: Path, text: str) -> None:
    path.with_name(f".{path.name}.tmp").write_text(text[:random.randrange(max(1, len(text)))])


def _torn_metrics_row(sink, row) -> None:
    line = json.dumps(row) + "\n"
    with sink.path.open("a") as f:
        f.write(line[:random.randrange(1, len(line) - 1)])


def install_fault_points(kill_at: int | None, record: Path, logs_metrics: bool, seed: int) -> None:
    """Number this rank's points (see `FaultPoints`); a step's points start at its metrics row on the rank that logs
    them, else at its save."""
    random.seed(seed)  # the torn lengths (the job seeds the training RNGs itself)
    points = FaultPoints(kill_at, record)
    checkpoint.save = points.around(checkpoint.save, new_step=not logs_metrics)
    MetricsSink.log = points.around(points.before(MetricsSink.log, _torn_metrics_row), new_step=True)
    torch.save = points.before(torch.save, _torn_torch_save)
    durable.write_text = points.before(durable.write_text, _torn_text)
    durable.fsync = points.before(durable.fsync)
    dist.barrier = points.before(dist.barrier)
    dist.all_gather_object = points.before(dist.all_gather_object)
    os.replace = points.before(os.replace)
    shutil.rmtree = points.before(shutil.rmtree)


def rank_main(env: dict[str, str], argv: list[str], log: Path, kill_at: int | None, record: Path, seed: int) -> None:
    """One rank of the job, with `env` (the launcher's, for this rank) as its whole environment and its output in
    `log`."""
    log.write_text("")
    enter_rank(env, log, log)
    install_fault_points(kill_at, record, logs_metrics=env["RANK"] == "0", seed=seed)
    main(argv)


# ---- the test ---------------------------------------------------------------------------------------------------

def _launch(context, run: Path, data: Path, logs: Path, name: str, fault: tuple[int, int] | None = None,
            seed: int = 0) -> dict[int, int]:
    """Both ranks of `zerollm train pretrain ... --resume auto`; `fault` = (rank, point) kills that rank there and
    then the other. Logs and point records go to logs/<name>.*. Returns each rank's exit code (negative: the
    signal that ended it)."""
    argv = ["train", "pretrain", "--recipe", "demo", "--data", str(data), "--out", str(run), "--resume", "auto"]
    argv += [a for o in [*TINY, *RUN] for a in ("--set", o)]
    procs = {}
    for rank, env in enumerate(rank_environments(WORLD, free_port())):
        kill_at = fault[1] if fault and fault[0] == rank else None
        procs[rank] = context.Process(target=rank_main, args=(env, argv, logs / f"{name}.rank{rank}.log",
                                                               kill_at, logs / f"{name}.points{rank}", seed))
        procs[rank].start()
    wait([p.sentinel for p in procs.values()], timeout=300)
    if fault is not None:
        for p in procs.values():
            p.kill()
    for p in procs.values():
        p.join(timeout=300)
    return {rank: p.exitcode for rank, p in procs.items()}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / rundir.METRICS_FILE).read_text().splitlines()]


def _published(run: Path) -> str | None:
    """The tag `latest` names, which must be a complete checkpoint."""
    tag = rundir.latest_tag(run)
    assert tag is None or rundir.incompleteness(run, tag) is None, (tag, rundir.incompleteness(run, tag))
    return tag


@pytest.mark.slow
def test_killed_at_random_points_in_saves_always_resumes_exactly(pretrain_data, tmp_path):
    context, logs = forkserver(), tmp_path / "logs"
    logs.mkdir()
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert _launch(context, reference, pretrain_data, logs, "reference") == {0: 0, 1: 0}
    points = [max(json.loads((logs / f"reference.points{rank}").read_text())) for rank in range(WORLD)]

    rng = random.Random(1234)
    latest, killed_in, resumes = None, [], 0
    for kill in range(KILLS):
        rank = rng.randrange(WORLD)
        fault = (rank, rng.randint(1, 2 * points[rank]))  # in the first or second step after the resume
        codes = _launch(context, run, pretrain_data, logs, f"kill{kill}", fault, seed=kill)
        log = (logs / f"kill{kill}.rank0.log").read_text()
        assert codes[rank] == -signal.SIGKILL, (fault, codes, log[-3000:])
        resumed = f"resumed at step {rundir.step_of(latest)}" if latest else None
        assert (resumed in log) if resumed else ("resumed at step" not in log), (fault, latest, log[-3000:])
        resumes += resumed is not None
        now = _published(run)
        assert latest is None or (now is not None and rundir.step_of(now) >= rundir.step_of(latest)), (latest, now)
        latest = now
        killed_in.append((logs / f"kill{kill}.points{rank}").read_text())
    assert resumes >= KILLS // 2 and rundir.step_of(latest) < MAX_STEPS, (resumes, latest)
    assert len(set(killed_in)) >= 5 and any("torn" in k for k in killed_in), killed_in

    assert _launch(context, run, pretrain_data, logs, "final") == {0: 0, 1: 0}
    assert f"resumed at step {rundir.step_of(latest)}" in (logs / "final.rank0.log").read_text()
    expected, got = _rows(reference), _rows(run)
    assert [r["step"] for r in got] == list(range(1, MAX_STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]  # bit for bit
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in expected]
    weights, reference_weights = consolidated_weights(run), consolidated_weights(reference)
    assert all(torch.equal(weights[k], reference_weights[k]) for k in reference_weights)
    assert _published(run) == rundir.tag_for(MAX_STEPS)
