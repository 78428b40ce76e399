"""Fault injection: a 2-rank CPU job is killed at seeded random points inside checkpoint saves and metrics writes
(some of them mid-file: the file is left torn) and resumed each time. Every resume starts from a complete
checkpoint, `latest` never names a lost or partial one, and the losses, gradient norms and final weights equal
those of an uninterrupted run bit for bit. Then: a full disk or a lost `latest`; a data-loader worker that is
killed or stuck, with and without a stop request.

The ranks are forked from the tests' forkserver (tests/forked_ranks.py), which imported torch, DeepSpeed and this
module once, so a kill and its resume take seconds. In a rank, the file operations of `llm.train.checkpoint.save`
(every `torch.save`, fsync, atomic write, rename, deletion and collective) and each `MetricsSink.log` are numbered;
the fault rank SIGKILLs itself at the chosen one, and the test kills the other rank as soon as it sees that death,
as a crashed job would end.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from multiprocessing.connection import wait
from pathlib import Path
from types import SimpleNamespace

import h5py
import psutil
import pytest
import torch
import torch.distributed as dist
from forked_ranks import enter_rank, forkserver, run_job
from tokens_swap import reversed_tokens

from conftest import TINY, ZERO_RUN, train_args, zerollm_here
from launch.local import rank_environments
from llm import durable, rundir
from llm.chat_template import ChatTemplateError
from llm.cli import main
from llm.config import build_config
from llm.data.datasets import PretrainWindows
from llm.errors import EXIT_RANK_LOST, UserError
from llm.jsonl import jsonl_lines
from llm.loading import consolidated_weights
from llm.runtime.rank_env import RANK_VARIABLES, free_port
from llm.train import checkpoint, job
from llm.train.loader_watch import WatchedLoader, torch_said
from llm.train.metrics import MetricsSink
from llm.train.run_record import write_run_record

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
    dist.gather_object = points.before(dist.gather_object)
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
        start = latest or rundir.newest_complete_tag(run)  # killed between the first manifest and `latest`: that one
        codes = _launch(context, run, pretrain_data, logs, f"kill{kill}", fault, seed=kill)
        log = (logs / f"kill{kill}.rank0.log").read_text()
        assert codes[rank] == -signal.SIGKILL, (fault, codes, log[-3000:])
        resumed = f"resumed at step {rundir.step_of(start)}" if start else None
        assert (resumed in log) if resumed else ("resumed at step" not in log), (fault, start, log[-3000:])
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


# ---- a full disk, a quota or the file size limit as a run starts; a lost `latest` --------------------------------

@contextmanager
def file_size_limit(size: int):
    """Inside, this process cannot write a file past `size` bytes (`ulimit -f`; Python ignores SIGXFSZ, so such a
    write fails with EFBIG, as one on a full disk fails with ENOSPC)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its content, but the lock a job holds (it names the job's pid)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".train.lock"}


def test_running_out_of_room_as_a_run_starts_is_one_line_and_loses_nothing(tmp_path):
    """`ulimit -f 1` at the start of a resume cut config.yaml to 1024 bytes (written in place), a traceback ended the
    job with exit 76, and every later resume and `zerollm generate` failed on the file. The run files are written
    whole or not at all, not at all when unchanged, and a write that runs out of room is one line naming the run."""
    data, run = tmp_path / "data", tmp_path / "run"
    (data / rundir.TOKENIZER_DIR).mkdir(parents=True)
    (data / rundir.TOKENIZER_DIR / "tokenizer.json").write_text("x" * 4096)
    cfg = build_config("demo", [*TINY, "train.max_steps=8"], {"data.path": str(data)})
    ds_config = {"zero_optimization": {"stage": 1}, "train_batch_size": 8, "wall_clock_breakdown": False}
    job._write_run_files(cfg, run, ds_config)
    write_run_record(run, {"data": {"path": str(data)}, "note": "x" * 300})
    before = _files(run)

    with file_size_limit(0):  # nothing changed: nothing is written (the resume needs no room)
        job._write_run_files(cfg, run, ds_config)
    changed = build_config("demo", [*TINY, "train.max_steps=16"], {"data.path": str(data)})
    for write, name in ((lambda: job._write_run_files(changed, run, ds_config), "config.yaml"),
                        (lambda: job._write_run_files(cfg, run, {**ds_config, "train_batch_size": 16}),
                         "ds_config.json"),
                        (lambda: write_run_record(run, {"data": {"path": str(data)}}), "run_record.jsonl"),
                        (lambda: job._write_run_files(cfg, tmp_path / "new", ds_config), "tokenizer")):
        with file_size_limit(100), pytest.raises(UserError) as refused:
            write()
        assert str(refused.value) == (f"{run if name != 'tokenizer' else tmp_path / 'new'}: a file reached the file "
                                      f"size limit (ulimit -f) while writing {name}; nothing was lost (what was there "
                                      "is as it was): free space and run the command again")
        assert _files(run) == before  # and no temporary file
    assert os.listdir(tmp_path / "new") == []  # no partial tokenizer copy, which blocked every later start
    assert rundir.recorded_config(run)["train"]["max_steps"] == 8


def _fake_checkpoint(run: Path, step: int, complete: bool = True) -> None:
    """A checkpoint folder that is complete as `rundir.incompleteness` reads it (a file and a manifest listing it)."""
    folder = rundir.checkpoint_dir(run) / rundir.tag_for(step)
    folder.mkdir(parents=True)
    (folder / "model_states.pt").write_bytes(b"w" * step)
    if complete:
        (folder / rundir.MANIFEST).write_text(json.dumps({"files": {"model_states.pt": step}}))


def test_a_run_that_lost_its_latest_continues_from_its_newest_complete_checkpoint(tmp_path, capsys):
    """Without checkpoints/latest beside complete checkpoints, a start (with or without --resume auto) began at step 0:
    metrics.jsonl was cut to step 0 and each checkpoint deleted and saved again."""
    for step, complete in ((2, True), (4, True), (6, False)):
        _fake_checkpoint(tmp_path, step, complete)
    assert rundir.usable_tag(tmp_path) == "global_step4"
    assert capsys.readouterr().err == (f"zerollm: note: {rundir.checkpoint_dir(tmp_path)} holds complete checkpoints "
                                       "but no latest; using global_step4, the newest complete one\n")
    assert rundir.holds_checkpoints(tmp_path)
    rundir.check_run_output(tmp_path, resume=True)
    with pytest.raises(UserError) as refused:
        rundir.check_run_output(tmp_path, resume=False)
    assert str(refused.value) == (f"{tmp_path} already holds checkpoints (the newest complete one is global_step4; "
                                  f"{rundir.checkpoint_dir(tmp_path) / 'latest'} is missing); pass --resume auto to "
                                  "continue from global_step4, or choose another --out")
    latest = rundir.checkpoint_dir(tmp_path) / "latest"
    for garbled in (b"", b"\x00\x00\x00"):  # a `latest` a crash of the file system left empty or zeroed
        latest.write_bytes(garbled)
        with pytest.raises(UserError, match="write the tag of a checkpoint folder there \\(global_step4 is the newest "
                                            "complete one\\) or delete it to continue from global_step4$"):
            rundir.usable_tag(tmp_path)
    latest.unlink()
    for step in (2, 4):  # no complete checkpoint: nothing was published, the run starts at step 0
        (rundir.checkpoint_dir(tmp_path) / rundir.tag_for(step) / rundir.MANIFEST).unlink()
    assert rundir.usable_tag(tmp_path) is None and not rundir.holds_checkpoints(tmp_path)
    rundir.check_run_output(tmp_path, resume=False)


def test_a_start_without_resume_leaves_a_run_whose_checkpoints_are_all_incomplete_alone(tmp_path):
    """A run without `latest` whose saved checkpoints were all damaged was trained anew from step 0 over them."""
    for step in (2, 4):
        _fake_checkpoint(tmp_path, step, complete=True)
        (rundir.checkpoint_dir(tmp_path) / rundir.tag_for(step) / "model_states.pt").write_bytes(b"torn!")
    with pytest.raises(UserError) as refused:
        rundir.check_run_output(tmp_path, resume=False)
    assert str(refused.value) == (f"{tmp_path} already holds checkpoints, none of them complete (global_step4: "
                                  "model_states.pt has 5 bytes, 4 were written); choose another --out, or remove "
                                  f"{rundir.checkpoint_dir(tmp_path)} to train this run anew there")


def test_a_run_whose_checkpoints_folder_is_read_only_is_refused_before_training(tmp_path, monkeypatch):
    """It trained until its first save, then ended with a FileNotFoundError traceback: those steps were lost. (As
    root, permissions do not refuse a write: the file system's answer is stood in for.)"""
    _fake_checkpoint(tmp_path, 2)
    (rundir.checkpoint_dir(tmp_path) / "latest").write_text("global_step2")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: real_access(path, mode) and (
        Path(path) != rundir.checkpoint_dir(tmp_path) or not mode & os.W_OK))
    with pytest.raises(UserError) as refused:
        rundir.check_run_output(tmp_path, resume=True)
    assert str(refused.value) == (f"--out {tmp_path}: {rundir.checkpoint_dir(tmp_path)} is not writable; training "
                                  "saves its checkpoints there: make it writable, or choose another --out")


def test_resuming_a_finished_run_that_lost_its_latest_trains_nothing_and_says_so(zero_runs, pretrain_data, tmp_path,
                                                                                  monkeypatch, capsys):
    """The run resumes from its newest complete checkpoint, which is its last step: one line says there is nothing to
    train, and the run directory is left as it was (a run record was added for a session that trained nothing)."""
    run = tmp_path / "run"
    shutil.copytree(zero_runs[2], run)
    (rundir.checkpoint_dir(run) / "latest").unlink()
    before = _files(run)
    args = train_args(pretrain_data, run, *ZERO_RUN, nproc=2, extra=["--zero-stage", 2])
    assert zerollm_here(monkeypatch, *args) == 2
    assert capsys.readouterr().err == (f"zerollm: error: {run} already holds checkpoints (the newest complete one is "
                                       f"global_step4; {rundir.checkpoint_dir(run) / 'latest'} is missing); pass "
                                       "--resume auto to continue from global_step4, or choose another --out\n")
    result = run_job(*args, "--resume", "auto")
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in result.stderr.splitlines() if line.startswith("zerollm: ")]
    assert notes == [f"zerollm: note: {rundir.checkpoint_dir(run)} holds complete checkpoints but no latest; using "
                     "global_step4, the newest complete one",
                     f"zerollm: note: {run}: nothing to train: its checkpoint global_step4 is at step 4 and "
                     "train.max_steps is 4; set a higher train.max_steps to train further"], result.stderr[-3000:]
    assert _files(run) == before


# ---- a data-loader worker killed or stuck; a stop while the rank waits for its data ------------------------------

LOADER_RUN = ["train.precision=fp32", "train.eval_every=0", "train.save_every=0", "train.max_steps=400",
              "train.min_lr_ratio=1"]
"""A job that saves only when it stops, train.max_steps=400 far ahead; its learning rate is constant after warmup, so
a run with fewer steps trains its steps alike."""
WORKER = "data.loader_workers=1"


def _metrics_rows(run: Path) -> list[dict]:
    """The rows a running job has written whole (a row being written may be seen in part)."""
    path = run / rundir.METRICS_FILE
    return [line.value for line in jsonl_lines(path) if line.ended] if path.is_file() else []


@contextmanager
def _job(args, log: Path):
    """`zerollm ARGS` in a session of its own (as SLURM's job step), its output in `log`; everything it started is
    SIGKILLed when it is left (a stopped worker would stay so)."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llm", *map(str, args)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    family = []
    try:
        yield proc, family
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            family += psutil.Process(proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        proc.wait()


def _after_steps(ended: Callable[[], bool], run: Path, steps: int = 2) -> None:
    """Wait until the job has logged `steps` steps; fails if it ends (`ended()`) or 300 s pass first."""
    deadline = time.monotonic() + 300
    while len(_metrics_rows(run)) < steps:
        assert not ended() and time.monotonic() < deadline, "the job ended or took too long"
        time.sleep(0.05)


def _until_stalled(ended: Callable[[], bool], run: Path, worker: psutil.Process) -> None:
    """Wait until the rank of the stopped `worker` waits for its data: no step logged for 2 s, and over that time
    under 0.1 s of the rank's CPU each half second (a step on batches its worker made before it stopped computes;
    under load one took over 2 s)."""
    rank, deadline = worker.parent(), time.monotonic() + 300
    logged, cpu, quiet_since = len(_metrics_rows(run)), sum(rank.cpu_times()[:2]), time.monotonic()
    while time.monotonic() - quiet_since < 2:
        assert not ended() and time.monotonic() < deadline, "the job ended or took too long"
        time.sleep(0.5)
        rows, busy = len(_metrics_rows(run)), sum(rank.cpu_times()[:2])
        if rows != logged or busy - cpu >= 0.1:
            logged, quiet_since = rows, time.monotonic()
        cpu = busy


def _worker(proc, family: list, rank: int | None = None) -> psutil.Process:
    """The data-loader worker of a one-rank job's rank, or of rank `rank` of a `--nproc` job."""
    ranks = [psutil.Process(proc.pid)]
    if rank is not None:
        ranks = [r for r in ranks[0].children() if r.environ().get("RANK") == str(rank)]
    (worker,) = ranks[0].children()
    family.append(worker)
    return worker


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("zerollm: error:")]


def test_torch_s_news_of_a_killed_worker_is_said_as_the_rank_s_own():
    """torch's SIGCHLD handler raises its news wherever the rank is, also where the rank's loader no longer holds the
    worker (its iterator was replaced at an epoch's end): the job then ended with torch's 'DataLoader worker (pid N)
    is killed by signal: Killed.' rather than the line naming SIGKILL and what to do. The loader lives in a process of
    its own, left without shutting the loader down: that waited forever where the worker was killed holding the lock
    of the loader's stop event (the suite hung once)."""
    script = ("import json, os, signal, time, torch\n"
              "batches = iter(torch.utils.data.DataLoader(range(1000), batch_size=1, num_workers=1))\n"
              "next(batches)\n"
              "worker = batches._workers[0].pid\n"
              "os.kill(worker, signal.SIGKILL)\n"
              "try:\n"
              "    for _ in range(600):\n"
              "        time.sleep(0.1)  # torch's handler raises here\n"
              "    news = None\n"
              "except RuntimeError as exc:\n"
              "    news = str(exc)\n"
              "print(json.dumps([worker, news]), flush=True)\n"
              "os._exit(0)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    worker, news = json.loads(result.stdout)
    assert news.startswith(f"DataLoader worker (pid {worker}) is killed by signal: "), result.stderr[-2000:]
    assert torch_said(RuntimeError(news)) == (f"its data-loader worker pid {worker} was killed by SIGKILL (the "
                                              "out-of-memory killer's signal, most often: lower data.loader_workers "
                                              "or free memory)")
    exited = RuntimeError("DataLoader worker (pid 12) exited unexpectedly with exit code 3. Details are lost due to "
                          "multiprocessing. Rerunning with num_workers=0 may give better error trace.")
    assert torch_said(exited) == "its data-loader worker pid 12 exited with code 3"
    assert torch_said(RuntimeError("CUDA error: out of memory")) is None


class _Refused(torch.utils.data.Dataset):
    """A dataset whose every read is refused in the worker, with `error` (a UserError class)."""

    def __init__(self, error: type[UserError]) -> None:
        self.error = error

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        raise self.error("the data changed")


@pytest.mark.parametrize("error", [UserError, ChatTemplateError])
def test_an_error_a_worker_raises_is_said_in_one_line(error):
    """torch raises it again in the rank as 'Caught UserError in DataLoader worker process 0.' followed by the
    worker's traceback: that was the whole message."""
    batches = iter(torch.utils.data.DataLoader(_Refused(error), batch_size=1, num_workers=1))
    with pytest.raises(UserError) as refused:
        WatchedLoader(batches, torch.device("cpu"), "data").next(1, lambda: False, 1, 60)
    assert str(refused.value) == "the data changed"


def test_torch_s_news_raised_during_a_step_ends_the_run_as_a_draw_s_does(tmp_path, capsys):
    """torch raises its news of a dead worker wherever the rank is (its SIGCHLD handler), also inside a step, away
    from the watched draw: `Trainer.fit` ends the run with the same one line, exit 76; other errors pass through."""
    from llm.train.trainer import Trainer

    def trainer(raised: BaseException) -> SimpleNamespace:
        def train(*args):
            raise raised
        stand_in = SimpleNamespace(_train=train, _batches=None, dist=SimpleNamespace(rank=0), run_dir=tmp_path,
                                   preemption=SimpleNamespace(output_lost=lambda error: None))
        stand_in._end_for_data = lambda *args: Trainer._end_for_data(stand_in, *args)
        return stand_in

    logger = SimpleNamespace(bar=SimpleNamespace(close=lambda: None))
    news = RuntimeError("DataLoader worker (pid 12) is killed by signal: Killed. ")
    assert Trainer.fit(trainer(news), logger, None, None) == 76
    assert capsys.readouterr().err == ("zerollm: error: rank 0: its data-loader worker pid 12 was killed by SIGKILL "
                                       "(the out-of-memory killer's signal, most often: lower data.loader_workers or "
                                       "free memory); no checkpoint was saved\n")
    other = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError) as passed:
        Trainer.fit(trainer(other), logger, None, None)
    assert passed.value is other


@pytest.mark.parametrize("fault", ["killed", "stuck"])
def test_a_data_loader_worker_killed_or_stuck_ends_a_one_rank_run_in_one_line(pretrain_data, tmp_path, fault):
    """A worker the out-of-memory killer ended (SIGKILL) was an 80-line traceback, twice chained, and exit 1; a worker
    stuck (here stopped; one whose read of a hung network file system never returns holds the rank alike) held a
    one-rank job, which has no watchdog, forever and without a word. Either is now one line naming the worker, and
    exit 76; a stuck one after 0.9 x train.collective_timeout_s."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    with _job(train_args(pretrain_data, run, *LOADER_RUN, WORKER, "train.collective_timeout_s=10"), log) as \
            (proc, family):
        _after_steps(lambda: proc.poll() is not None, run)
        worker = _worker(proc, family)
        if fault == "killed":
            worker.kill()
        else:
            worker.suspend()
            _until_stalled(lambda: proc.poll() is not None, run, worker)
        code = proc.wait(timeout=60)
    text = log.read_text()
    assert code == 76 and len(_errors(text)) == 1 and "Traceback" not in text, text[-3000:]
    if fault == "killed":
        assert _errors(text) == [f"zerollm: error: rank 0: its data-loader worker pid {worker.pid} was killed by "
                                 "SIGKILL (the out-of-memory killer's signal, most often: lower data.loader_workers or "
                                 "free memory); no checkpoint was saved"]
    else:
        step = _metrics_rows(run)[-1]["step"]
        assert _errors(text)[0].startswith(f"zerollm: error: rank 0: step {step + 1}'s data did not come in ")
        assert _errors(text)[0].endswith(f"s: its data-loader worker(s), pid {worker.pid} (stopped), gave none (stuck "
                                         f"reading {pretrain_data}, e.g. on a hung network file system?); the limit is "
                                         "0.9 x train.collective_timeout_s=10; no checkpoint was saved")


def test_data_prepared_again_into_the_folder_mid_run_ends_it_at_the_next_epoch_in_one_line(pretrain_data, tmp_path):
    """The workers of the next epoch read the new tokens.h5 (a pretraining run trained on the other data, an SFT run
    on the new tokens by the old offsets), and the run ended with exit 0."""
    data, run, log = tmp_path / "data", tmp_path / "run", tmp_path / "run.log"
    shutil.copytree(pretrain_data, data)
    with h5py.File(data / "tokens.h5") as h5:  # steps of 16 windows of 256 tokens
        epoch_steps = (h5["train/tokens"].shape[0] - 1) // 256 // 16
    new = tmp_path / "new.h5"  # made before the run: made during it, it took two epochs of a quiet machine's run
    shutil.copy(data / "tokens.h5", new)
    with h5py.File(new, "r+") as h5:
        reversed_tokens(h5)
    with _job(train_args(data, run, *LOADER_RUN[:3], f"train.max_steps={3 * epoch_steps}", "data.seq_len=256",
                         "train.micro_batch_size=16", WORKER), log) as (proc, _):
        _after_steps(lambda: proc.poll() is not None, run)
        os.replace(new, data / "tokens.h5")
        code = proc.wait(timeout=300)
    text = log.read_text()
    assert code == 2 and "Traceback" not in text, text[-3000:]
    assert _errors(text) == [f"zerollm: error: {data}/tokens.h5 was replaced or changed after this run started reading "
                             f"it (a `zerollm data prepare` into {data}?); a run trains on one version of its data: "
                             "prepare new data into another folder"]
    assert epoch_steps <= _metrics_rows(run)[-1]["step"] < 3 * epoch_steps  # the next epoch's workers refused it


def test_a_stop_while_a_data_loader_worker_is_stuck_saves_the_last_complete_step(pretrain_data, tmp_path):
    """A stuck worker left the rank waiting for the next batch: SIGTERM said "stopping with a checkpoint when this
    step ends" and the job hung until SLURM SIGKILLed it, its work since the last checkpoint lost. The step cannot
    end without its batch, and nothing of it was trained: the last complete step is saved, and resuming from it
    trains as the uninterrupted run does."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    with _job(train_args(pretrain_data, run, *LOADER_RUN, WORKER), log) as (proc, family):
        _after_steps(lambda: proc.poll() is not None, run)
        worker = _worker(proc, family)
        worker.suspend()
        _until_stalled(lambda: proc.poll() is not None, run, worker)
        os.killpg(proc.pid, signal.SIGTERM)  # as SLURM's scancel: the whole job step
        code = proc.wait(timeout=60)
    text = log.read_text()
    step = _metrics_rows(run)[-1]["step"]
    assert code == 75 and "Traceback" not in text, text[-3000:]
    assert (run / "checkpoints" / "latest").read_text() == f"global_step{step}"
    assert f"stopped by signal at step {step} while waiting for step {step + 1}'s data: its data-loader worker(s), " \
           f"pid {worker.pid} (stopped), gave none (stuck reading {pretrain_data}" in text, text[-3000:]
    assert text.count("rerun with --resume auto") == 1, text[-3000:]

    ends = [WORKER, f"train.max_steps={step + 2}"]
    resumed = run_job(*train_args(pretrain_data, run, *LOADER_RUN, *ends, extra=["--resume", "auto"]), name="resumed")
    assert resumed.returncode == 0 and f"resumed at step {step}" in resumed.stdout, resumed.stderr[-3000:]
    straight = run_job(*train_args(pretrain_data, tmp_path / "straight", *LOADER_RUN, *ends), name="straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    keys = ("step", "loss", "grad_norm")
    assert [[r[k] for k in keys] for r in _rows(run)] == [[r[k] for k in keys] for r in _rows(tmp_path / "straight")]


def test_a_stop_while_one_rank_s_data_loader_is_stuck_ends_the_job_saying_so(pretrain_data, tmp_path):
    """Rank 1's worker stuck: rank 0 waits for rank 1 inside the step, so no rank can save. SIGTERM said "stopping
    with a checkpoint" and the job hung until SLURM SIGKILLed it (or the watchdog, after train.collective_timeout_s,
    blamed a rank it took for dead and said to replace its node). Rank 1 now ends the job a few seconds after the
    stop, naming the worker it waited for, and says that nothing was saved."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    args = train_args(pretrain_data, run, *LOADER_RUN, WORKER, "train.collective_timeout_s=60", nproc=2)
    with _job(args, log) as (proc, family):
        _after_steps(lambda: proc.poll() is not None, run)
        worker = _worker(proc, family, rank=1)
        worker.suspend()
        _until_stalled(lambda: proc.poll() is not None, run, worker)
        proc.send_signal(signal.SIGTERM)  # forwarded to both ranks
        code = proc.wait(timeout=45)
    text = log.read_text()
    errors = _errors(text)
    assert code == 76 and errors and "Traceback" not in text, text[-3000:]
    assert errors[0].startswith("zerollm: error: rank 1: asked to stop while waiting ") and \
           errors[0].endswith(f"data: its data-loader worker(s), pid {worker.pid} (stopped), gave none (stuck reading "
                              f"{pretrain_data}, e.g. on a hung network file system?); the other ranks cannot end the "
                              "step without it, so no checkpoint was saved"), errors
    assert not (run / "checkpoints" / "latest").exists()


def stuck_reader_main(argv: list[str], log: Path, trigger: Path, entered: Path) -> None:
    """A one-rank job, `zerollm ARGV` with its output in `log`, whose reads of the train split never return once
    `trigger` exists, as on a hung network file system (`entered` then exists)."""
    enter_rank({k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", *RANK_VARIABLES)}, log, log)
    read = PretrainWindows.__getitem__

    def stuck(self, index):
        if trigger.exists() and self.h5.split == "train":
            entered.touch()
            threading.Event().wait()
        return read(self, index)

    PretrainWindows.__getitem__ = stuck
    main(argv)


def _stopped_while_reading(argv, run: Path, tmp_path: Path, hang_after_steps: bool) -> tuple[int, str]:
    """`zerollm ARGV` (training into `run`) as one forked rank whose reads of the train split hang, after its first
    logged steps or from the start, and which is sent SIGTERM once a read hangs: its exit code and output."""
    log, trigger, entered = tmp_path / "run.log", tmp_path / "hang", tmp_path / "hung"
    log.write_text("")
    if not hang_after_steps:
        trigger.touch()
    rank = forkserver().Process(target=stuck_reader_main, args=(list(map(str, argv)), log, trigger, entered))
    rank.start()
    try:
        if hang_after_steps:
            _after_steps(lambda: rank.exitcode is not None, run)
            trigger.touch()
        while not entered.exists():
            assert rank.exitcode is None, log.read_text()[-3000:]
            time.sleep(0.05)
        os.kill(rank.pid, signal.SIGTERM)
        rank.join(60)
    finally:
        rank.kill()
        rank.join()
    return rank.exitcode, log.read_text()


def test_a_stop_while_the_rank_itself_is_stuck_reading_saves_the_last_complete_step(pretrain_data, tmp_path):
    """data.loader_workers=0 (the CPU's default): the rank reads its batches itself, and a read that never returned
    held it past the stop as a stuck worker did."""
    run = tmp_path / "run"
    code, text = _stopped_while_reading(train_args(pretrain_data, run, *LOADER_RUN, "data.loader_workers=0"), run,
                                        tmp_path, hang_after_steps=True)
    step = _metrics_rows(run)[-1]["step"]
    assert code == 75 and "Traceback" not in text, text[-3000:]
    assert (run / "checkpoints" / "latest").read_text() == f"global_step{step}"
    assert f"stopped by signal at step {step} while waiting for step {step + 1}'s data: its data loader (in the rank " \
           f"itself: data.loader_workers=0) gave none (stuck reading {pretrain_data}" in text, text[-3000:]


def test_a_stop_while_stuck_after_a_resume_keeps_the_checkpoint_it_resumed_from(pretrain_data, tmp_path):
    """A run resumed from its newest complete checkpoint where `latest` was lost, and stopped while its first read
    hangs, saved that step again: the save first deleted the complete folder (`latest` did not name it), so until the
    copy was whole the run had no checkpoint at all, while SLURM's SIGKILL was due."""
    run = tmp_path / "run"
    first = run_job(*train_args(pretrain_data, run, *LOADER_RUN, "data.loader_workers=0", "train.max_steps=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    (run / "checkpoints" / "latest").unlink()
    folder = run / "checkpoints" / "global_step2"
    written = {path: path.stat().st_mtime_ns for path in folder.rglob("*")}
    argv = train_args(pretrain_data, run, *LOADER_RUN, "data.loader_workers=0", "train.max_steps=4",
                      extra=["--resume", "auto"])
    code, text = _stopped_while_reading(argv, run, tmp_path, hang_after_steps=False)  # every read hangs from the start
    assert code == 75 and "resumed at step 2" in text, text[-3000:]
    assert "stopped by signal at step 2 while waiting for step 3's data" in text, text[-3000:]
    assert f"checkpoint global_step2 is in {run}" in text, text[-3000:]
    assert {path: path.stat().st_mtime_ns for path in folder.rglob("*")} == written  # not deleted and written again


def test_a_worker_ended_by_sigbus_is_said_to_need_shared_memory():
    """torch says a worker's SIGBUS may be a full /dev/shm (Docker's 64 MiB default); the one line that replaced its
    message said only the signal."""
    workers = [SimpleNamespace(pid=7, exitcode=-signal.SIGBUS), SimpleNamespace(pid=8, exitcode=None)]
    loader = WatchedLoader(SimpleNamespace(_workers=workers), torch.device("cpu"), "data")
    assert loader.dead_workers() == ("its data-loader worker pid 7 was killed by SIGBUS (most often a full /dev/shm, "
                                     "where workers hand their batches over: raise its size, e.g. docker run "
                                     "--shm-size, or lower data.loader_workers)")


def test_an_error_of_a_rank_s_own_is_not_blamed_on_its_node(pretrain_data, tmp_path):
    """A rank that raised (here torch's AdamW asked for CUDA-graph capture on the CPU, at the first step) ended the
    job telling the user to fix or replace the failed node."""
    config = tmp_path / "capturable.json"
    config.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "capturable": True}}}))
    # a short timeout: the watchdog's heartbeat comes every timeout / 30 s, and telling a rank's own error from a lost
    # peer waits for the peer's next one (10 s at the default)
    result = run_job(*train_args(pretrain_data, tmp_path / "run", "train.max_steps=2", "train.collective_timeout_s=30",
                                 nproc=2, extra=["--deepspeed", config, "--zero-stage", 0]))
    assert result.returncode == EXIT_RANK_LOST, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error: rank ")]
    assert said and all("failed with AssertionError: If capturable=True, params and state_steps must be on " in line
                        and line.endswith("the job is ended on every rank. That rank's traceback, in its output, "
                                          "says where: fix the cause, then start the job again with --resume auto")
                        for line in said), said
    assert "Traceback" in result.stderr and "replace the failed node" not in result.stderr
