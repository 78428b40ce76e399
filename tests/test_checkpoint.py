"""Checkpoints: the manifest and `latest`, pruning, falling back to the newest complete checkpoint, RNG files and
restricted unpickling, metrics.jsonl after a kill, and resuming on data that no longer fits.

Most tests drive `llm.train.checkpoint` in this process (a process group of one, an engine that writes and reads
one file as DeepSpeed does); the last ones run `zerollm train` on one rank.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from forked_ranks import enter_rank, forkserver, run_job
from test_data_prepare import _file_size_limit

from conftest import FIXTURES, TINY, ZERO_RUN, run_cli, train_args, zerollm_here
from launch.local import rank_environments
from llm import durable, loading, rundir
from llm.config import ModelConfig, build_config
from llm.errors import UserError
from llm.loading import consolidated_weights, load_trained_model
from llm.model import Transformer
from llm.runtime.rank_env import free_port
from llm.runtime.rerun import rerun_said_as
from llm.train import checkpoint
from llm.train.metrics import MetricsSink
from llm.train.schedule import lr_multiplier

MODEL_FILE = rundir.MODEL_STATES
SMALL = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)
CLIENT_STATE = {"step": 0, "run_id": "abc", "world_size": 1, "stopped_by_signal": False, "loss_scale": None,
                "time_budget": None, "sampler": {"epoch": 0, "consumed": 8, "seed": 1, "num_samples": 100}}
"""What `llm.train.trainer` records beside DeepSpeed's state (`rundir.client_state_of` checks each field)."""


class FakeEngine:
    """Saves and loads one model-state file per checkpoint through DeepSpeed's torch checkpoint engine (torch.save)
    and torch.load(weights_only=False), as DeepSpeed's engine does."""

    def __init__(self, value: float = 0.0, size: int = 4) -> None:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        self.state = {"module": {"w": torch.full((size,), value)}}
        self.module = torch.nn.Module()  # no frozen parameters: everything is saved
        self.optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # its settings are restored
        self.checkpoint_engine = TorchCheckpointEngine()
        self.checkpoint_engine.zipfile_serialization = True  # what DeepSpeed's default config gives it

    def save_checkpoint(self, root: str, tag: str, save_latest: bool, exclude_frozen_parameters: bool) -> None:
        Path(root, tag).mkdir(parents=True, exist_ok=True)
        self.checkpoint_engine.save(state_dict=self.state, path=str(Path(root, tag, MODEL_FILE)))  # DeepSpeed's call
        self._copy_recovery_script(root)

    def _copy_recovery_script(self, save_path: str) -> None:
        """Where DeepSpeed's engine copies its zero_to_fp32.py into the checkpoints folder: nothing to copy here."""

    def load_checkpoint(self, root: str, tag: str, **_) -> tuple[str, dict]:
        self.state = torch.load(Path(root, tag, MODEL_FILE), weights_only=False)
        return str(Path(root, tag)), {}


def _state(**changes):
    """What `checkpoint.save` records beside the engine's files: CLIENT_STATE with `changes`, as a callable."""
    return lambda: CLIENT_STATE | changes


def _save(run: Path, *steps: int, keep: int = 0) -> None:
    for step in steps:
        checkpoint.save(FakeEngine(step), run, step, _state(step=step), keep)


def test_a_checkpoints_client_state_is_taken_once_its_files_are_written(one_rank_group, tmp_path):
    """The state (with the time budget's clock) was taken before the model and optimizer files were written: a run
    stopped by a signal and resumed ran past its train.max_time by the stop's checkpoint, uncounted."""
    model_file = rundir.checkpoint_dir(tmp_path) / "global_step2" / MODEL_FILE
    taken = []
    checkpointer = checkpoint.Checkpointer(FakeEngine(2.0), tmp_path, save_every=0, keep=0, client_state=lambda stop:
                                           taken.append(model_file.is_file()) or CLIENT_STATE | {"step": 2})
    checkpointer.after_step(2, last=False, stopped_by_signal=True)
    assert taken == [True] and rundir.usable_tag(tmp_path) == "global_step2"


def _tags(run: Path) -> list[str]:
    return sorted(p.name for p in rundir.checkpoint_dir(run).iterdir() if p.is_dir())


def _partial(run: Path, step: int) -> Path:
    """A folder left by a save that was killed: a torn file, no manifest."""
    folder = rundir.checkpoint_dir(run) / rundir.tag_for(step)
    folder.mkdir(parents=True)
    (folder / MODEL_FILE).write_bytes(b"torn")
    return folder


# ---- item 1: pruning ------------------------------------------------------------------------------------------

def test_pruning_never_deletes_latest_nor_a_partial_folder(one_rank_group, tmp_path):
    """A newer partial folder (left by a crash or a full disk) must not count: the save at step 25 with
    keep_checkpoints=1 used to delete steps 10, 20 and 25 and keep only the partial step 30."""
    _save(tmp_path, 10, 20)
    _partial(tmp_path, 15)
    _partial(tmp_path, 30)
    _save(tmp_path, 25, keep=1)
    assert _tags(tmp_path) == ["global_step15", "global_step25", "global_step30"]
    assert rundir.latest_tag(tmp_path) == "global_step25" and rundir.incompleteness(tmp_path, "global_step25") is None


def test_pruning_keeps_the_newest_complete_checkpoints(one_rank_group, tmp_path):
    _save(tmp_path, 1, 2, 3, keep=2)
    assert _tags(tmp_path) == ["global_step2", "global_step3"]
    _save(tmp_path, 4, keep=0)
    assert _tags(tmp_path) == ["global_step2", "global_step3", "global_step4"]


def test_a_save_replaces_an_unfinished_save_of_the_same_step(one_rank_group, tmp_path):
    _save(tmp_path, 10)
    stale = _partial(tmp_path, 20)
    (stale / "rng_rank7.pt").write_bytes(b"from a job with more ranks")
    _save(tmp_path, 20)
    assert rundir.incompleteness(tmp_path, "global_step20") is None
    assert not (stale / "rng_rank7.pt").exists()


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """In this process, no file written grows past `limit` bytes: a write fails with EFBIG, as on a full disk (no
    root needed to fill a file system). For a child process: test_data_prepare's `_file_size_limit`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def _quota_exceeded_on(name: str, monkeypatch) -> None:
    """Rank 0's durable write of `name` fails as over a disk quota."""
    write = durable.write_text

    def over_quota(path: Path, text: str) -> None:
        if path.name == name:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(path))
        write(path, text)

    monkeypatch.setattr(durable, "write_text", over_quota)


FILE_SIZE_LIMIT = "a file reached the file size limit (ulimit -f)"


@pytest.mark.parametrize("where, reason", [
    ("DeepSpeed's file", FILE_SIZE_LIMIT),  # torch.save said "[enforce fail at inline_container.cc:672] ..."
    (rundir.MANIFEST, "disk quota exceeded"),  # an OSError traceback
    (rundir.LATEST, "disk quota exceeded"),
])
def test_a_save_that_runs_out_of_room_is_one_line_and_keeps_the_previous_checkpoint(one_rank_group, tmp_path,
                                                                                     monkeypatch, capsys, where,
                                                                                     reason):
    _save(tmp_path, 1)
    capsys.readouterr()
    big = FakeEngine(2.0, size=100_000)
    with file_size_limit(100_000 if where == "DeepSpeed's file" else 2**40), pytest.raises(UserError) as error:
        if where != "DeepSpeed's file":
            _quota_exceeded_on(where, monkeypatch)
        checkpoint.save(big, tmp_path, 2, _state(step=2), keep=1)
    message = (f"{rundir.checkpoint_dir(tmp_path)}: {reason} while saving step 2; the previous checkpoint "
               "(global_step1) is intact; free space and rerun with --resume auto")
    assert str(error.value) == message and capsys.readouterr().err == f"zerollm: error: {message}\n"
    assert sorted(p.name for p in rundir.checkpoint_dir(tmp_path).iterdir()) == ["global_step1", rundir.LATEST]
    assert rundir.usable_tag(tmp_path) == "global_step1"


def test_running_out_of_room_after_latest_names_the_new_checkpoint_keeps_it(one_rank_group, tmp_path, monkeypatch,
                                                                           capsys):
    """Out of room after `latest` was replaced (flushing its folder on a quota-bound file system) or while pruning:
    the published checkpoint was removed, `latest` named nothing, and the message called it intact."""
    _save(tmp_path, 1)
    fsync = durable.fsync

    def full_after_latest(path: Path) -> None:
        if path == rundir.checkpoint_dir(tmp_path) and rundir.latest_tag(tmp_path) == "global_step2":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        fsync(path)

    monkeypatch.setattr(durable, "fsync", full_after_latest)
    with pytest.raises(UserError, match=r"no space left on device while saving step 2; its checkpoint "
                                        r"\(global_step2\) was published first; free space"):
        checkpoint.save(FakeEngine(2.0), tmp_path, 2, _state(step=2), keep=1)
    assert rundir.usable_tag(tmp_path) == "global_step2"
    monkeypatch.setattr(durable, "fsync", fsync)
    monkeypatch.setattr(checkpoint, "prune", _raise_enospc)
    capsys.readouterr()
    checkpoint.save(FakeEngine(3.0), tmp_path, 3, _state(step=3), keep=1)
    assert rundir.usable_tag(tmp_path) == "global_step3"
    assert capsys.readouterr().err == (f"zerollm: note: {rundir.checkpoint_dir(tmp_path)}: no space left on device "
                                       "while removing checkpoints older than the 1 newest; they are kept\n")


def _raise_enospc(*args) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_first_save_that_runs_out_of_room_says_none_was_saved_before(one_rank_group, tmp_path):
    with file_size_limit(100_000), pytest.raises(UserError) as error:
        _save(tmp_path, 1)  # the RNG file (about 5 kB) fits; DeepSpeed's (400 kB) does not
        checkpoint.save(FakeEngine(2.0, size=100_000), tmp_path, 2, _state(step=2), keep=0)
    assert str(error.value).endswith("while saving step 2; the previous checkpoint (global_step1) is intact; free "
                                     "space and rerun with --resume auto")
    with file_size_limit(1000), pytest.raises(UserError) as error:
        _save(tmp_path / "new", 1)  # the RNG file, this time
    assert str(error.value) == (f"{rundir.checkpoint_dir(tmp_path / 'new')}: {FILE_SIZE_LIMIT} while saving step 1; "
                                "no checkpoint was saved before; free space and rerun with --resume auto")
    assert os.listdir(rundir.checkpoint_dir(tmp_path / "new")) == []
    with file_size_limit(1000), rerun_said_as("run bench learn again"), pytest.raises(UserError) as error:
        _save(tmp_path / "other", 1)  # inside a command without --resume (bench learn), its own words
    assert str(error.value).endswith("no checkpoint was saved before; free space and run bench learn again")


def test_running_out_of_room_without_latest_names_the_intact_checkpoint(one_rank_group, tmp_path):
    """With `latest` lost, the message read "no checkpoint was saved before" while a resume would continue from the
    newest complete one."""
    _save(tmp_path, 1)
    (rundir.checkpoint_dir(tmp_path) / rundir.LATEST).unlink()
    with file_size_limit(100_000), pytest.raises(UserError) as error:
        checkpoint.save(FakeEngine(2.0, size=100_000), tmp_path, 2, _state(step=2), keep=0)
    assert str(error.value).endswith("while saving step 2; the previous checkpoint (global_step1) is intact; free "
                                     "space and rerun with --resume auto")
    assert rundir.usable_tag(tmp_path) == "global_step1"


def test_two_ranks_out_of_room_end_in_one_line_exit_2(zero_runs, pretrain_data, tmp_path):
    """A full disk while saving was exit 1 after 46 lines (two ranks' tracebacks of torch.save's '[enforce fail at
    inline_container.cc:672] . unexpected pos', which never said why); a rank whose write failed alone left the
    other waiting in the next collective."""
    run = tmp_path / "run"
    shutil.copytree(zero_runs[2], run)  # global_step4; its files are 100 kB to 500 kB
    args = train_args(pretrain_data, run, *ZERO_RUN, "train.max_steps=6", nproc=2,
                      extra=["--zero-stage", 2, "--resume", "auto"])

    result = subprocess.run([sys.executable, "-m", "llm", *map(str, args)], capture_output=True, text=True,
                            preexec_fn=_file_size_limit(64_000), timeout=600, check=False)
    assert (result.returncode, [line for line in result.stderr.splitlines() if "error" in line.lower()]) == (2, [
        f"zerollm: error: {rundir.checkpoint_dir(run)}: {FILE_SIZE_LIMIT} while saving step 6; the previous "
        "checkpoint (global_step4) is intact; free space and rerun with --resume auto"]), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert rundir.checkpoint_tags(run) == ["global_step4"] and rundir.usable_tag(run) == "global_step4"


@pytest.mark.parametrize("stage, name", [(2, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                         (3, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                         (3, "zero_pp_rank_1_mp_rank_00_model_states.pt"), (3, "rng_rank1.pt")])
def test_a_damaged_file_only_one_rank_reads_ends_every_rank_in_one_line(zero_runs, pretrain_data, tmp_path, stage,
                                                                         name):
    """Rank 1 said its partition was damaged and left; rank 0 went on into its next collective (the run record's,
    or ZeRO-3's gather of its persistent parameters inside DeepSpeed's load), whose traceback was the last line."""
    run = tmp_path / "run"
    shutil.copytree(zero_runs[stage], run, symlinks=True)
    damaged = rundir.checkpoint_dir(run) / "global_step4" / name
    damaged.write_bytes(bytes(damaged.stat().st_size))  # zeros of the listed size: complete by its manifest
    result = run_job(*train_args(pretrain_data, run, *ZERO_RUN, "train.max_steps=6", nproc=2,
                                 extra=["--zero-stage", stage, "--resume", "auto"]))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and result.stderr.strip().splitlines()[-1] == (
        f"zerollm: error: {damaged} is damaged: it is not a checkpoint file torch can read (neither a zip archive "
        f"nor a pickle); {rundir.damaged_checkpoint_advice(run, 'global_step4')}")
    assert result.stderr.count("zerollm: error:") == 1


def test_durable_text_that_runs_out_of_room_leaves_the_old_file_and_no_temporary(tmp_path):
    (tmp_path / "latest").write_text("global_step1")
    with file_size_limit(10), pytest.raises(OSError) as error:
        durable.write_text(tmp_path / "latest", "global_step1000000")
    assert os.listdir(tmp_path) == ["latest"] and (tmp_path / "latest").read_text() == "global_step1"
    assert durable.out_of_room(error.value) == FILE_SIZE_LIMIT


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its content (None: a folder)."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("replace", [False, True])
def test_a_failure_inside_a_staged_folder_leaves_the_target_as_it_was_and_no_staging(tmp_path, replace):
    target = tmp_path / "target"
    if replace:
        (target / "sub").mkdir(parents=True)
        (target / "sub" / "a").write_text("old")
    before = _tree(tmp_path)
    with pytest.raises(KeyboardInterrupt), durable.staged_folder(target, replace) as staging:
        staging.mkdir()
        (staging / "a").write_text("new")
        raise KeyboardInterrupt  # killed while filling it
    assert _tree(tmp_path) == before


def test_a_staged_folder_that_cannot_be_renamed_in_leaves_the_target_as_it_was(tmp_path, monkeypatch):
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "a").write_text("new")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "a").write_text("old")
    before = _tree(tmp_path)
    with pytest.raises(OSError):  # a folder is there: copy_folder's target must not exist
        durable.copy_folder(tmp_path / "source", tmp_path / "target")
    assert _tree(tmp_path) == before  # the complete staging folder was left beside it
    rename = os.replace

    def fails_into_target(source, target) -> None:  # the staging folder's rename only
        if Path(source).name == ".target.partial":
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        rename(source, target)

    monkeypatch.setattr(durable.os, "replace", fails_into_target)
    with pytest.raises(OSError), durable.staged_folder(tmp_path / "target", replace=True) as staging:
        staging.mkdir()
    assert _tree(tmp_path) == before  # the earlier folder, moved aside, is back


def test_a_staged_folder_with_replace_swaps_the_whole_old_folder_for_the_new(tmp_path):
    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "a").write_text("old")
    (target / "b").write_text("old")
    for leftover in (".target.partial", ".target.old"):  # of a crash: removed
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "b").write_text("left over")
    with durable.staged_folder(target, replace=True) as staging:
        staging.mkdir()
        (staging / "c").write_text("new")
    assert _tree(tmp_path) == {"target": None, "target/c": b"new"}



def _flushes_and_renames(monkeypatch) -> list[tuple[str, str, str]]:
    """Every os.fsync from now on, as ("fsync", the real path of what it flushed, ""), and every os.replace, as
    ("replace", source, target), in the order they happened: whoever calls them (`durable`'s helpers or not)."""
    events: list[tuple[str, str, str]] = []
    fsync, replace = os.fsync, os.replace

    def watched_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), ""))
        fsync(fd)

    def watched_replace(source, target) -> None:
        replace(source, target)
        events.append(("replace", os.path.abspath(source), os.path.abspath(target)))

    monkeypatch.setattr(os, "fsync", watched_fsync)
    monkeypatch.setattr(os, "replace", watched_replace)
    return events


def _check_flushed_then_renamed(events: list[tuple[str, str, str]], target: Path) -> None:
    """Folder `target` was renamed into place from its staging folder once that folder and every file and subfolder
    in it were flushed, and the folder holding it was flushed after the rename."""
    staging = target.with_name(f".{target.name}.partial")
    renamed = next(i for i, (kind, _, to) in enumerate(events) if kind == "replace" and to == str(target))
    assert events[renamed][1] == str(staging)
    flushed = {path for kind, path, _ in events[:renamed] if kind == "fsync"}
    inside = {str(staging / path.relative_to(target)) for path in target.rglob("*")}
    assert inside and inside - flushed == set()  # every file and subfolder
    assert str(staging) in flushed
    assert ("fsync", str(target.parent), "") in events[renamed + 1:]


def test_a_staged_folder_flushes_every_file_and_subfolder_before_it_is_renamed_in(tmp_path, monkeypatch):
    """Only its files and itself were flushed: after a power loss, a file in a subfolder (copy_folder's tokenizer
    copy, a universal conversion's zero/<parameter>/ files) could be missing from the folder renamed into place."""
    target = tmp_path.resolve() / "target"
    events = _flushes_and_renames(monkeypatch)
    with durable.staged_folder(target) as staging:
        (staging / "sub" / "deeper").mkdir(parents=True)
        for name in ("a", "sub/b", "sub/deeper/c"):
            (staging / name).write_text(name)
    _check_flushed_then_renamed(events, target)


# ---- item 2: completeness and fallback -------------------------------------------------------------------------

def test_the_manifest_lists_every_file_with_its_size(one_rank_group, tmp_path):
    _save(tmp_path, 5)
    folder = rundir.checkpoint_dir(tmp_path) / "global_step5"
    manifest = json.loads((folder / rundir.MANIFEST).read_text())
    assert manifest["step"] == 5 and manifest["world_size"] == 1
    assert manifest["files"] == {p.name: p.stat().st_size for p in folder.iterdir() if p.name != rundir.MANIFEST}
    assert set(manifest["files"]) == {MODEL_FILE, "rng_rank0.pt", rundir.CLIENT_STATE}


# ---- a save on several ranks: each rank flushes the files it wrote, and only rank 0 learns them -----------------

class RankEngine(FakeEngine):
    """FakeEngine on one of two ranks, writing as DeepSpeed's ZeRO engine does: rank 0 the model states, each rank
    its own optimizer partition (of another size on each rank)."""

    def save_checkpoint(self, root: str, tag: str, save_latest: bool, exclude_frozen_parameters: bool) -> None:
        rank = dist.get_rank()
        Path(root, tag).mkdir(parents=True, exist_ok=True)
        if rank == 0:
            self.checkpoint_engine.save(state_dict=self.state, path=str(Path(root, tag, MODEL_FILE)))
        partition = {"state": torch.zeros(10 + 100 * rank)}
        self.checkpoint_engine.save(partition, str(Path(root, tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")))
        self._copy_recovery_script(root)


def _watch_saves(record: Path) -> None:
    """In a rank: for each `checkpoint.save`, one JSON line in `record` with the paths this rank wrote by torch.save
    ("saved"), the paths it flushed by `durable.fsync` ("fsynced"), and what its object collectives brought it, as
    text ("received"; None where a gather brought it nothing)."""
    seen: dict[str, list[str]] = {}
    save, torch_save, fsync = checkpoint.save, torch.save, durable.fsync
    all_gather, gather, broadcast = dist.all_gather_object, dist.gather_object, dist.broadcast_object_list

    def note(key: str, value: str) -> None:
        if seen:
            seen[key].append(value)

    def watched_save(*args, **kwargs):
        seen.update(saved=[], fsynced=[], received=[])
        try:
            return save(*args, **kwargs)
        finally:
            with record.open("a") as f:
                f.write(json.dumps(seen) + "\n")
            seen.clear()

    def watched_torch_save(obj, f, *args, **kwargs):
        note("saved", os.path.abspath(getattr(f, "name", f)))
        return torch_save(obj, f, *args, **kwargs)

    def watched_fsync(path):
        note("fsynced", os.path.abspath(path))
        return fsync(path)

    def watched_all_gather(output, obj, *args, **kwargs):
        all_gather(output, obj, *args, **kwargs)
        note("received", repr(output))

    def watched_gather(obj, output=None, *args, **kwargs):
        gather(obj, output, *args, **kwargs)
        note("received", repr(output))

    def watched_broadcast(objects, *args, **kwargs):
        broadcast(objects, *args, **kwargs)
        note("received", repr(objects))

    checkpoint.save, torch.save, durable.fsync = watched_save, watched_torch_save, watched_fsync
    dist.all_gather_object, dist.gather_object = watched_all_gather, watched_gather
    dist.broadcast_object_list = watched_broadcast


def _rank_of_a_fake_save(rank: int, port: int, run: Path, log: Path, record: Path) -> None:
    """One rank of a 2-rank gloo group saving step 2 of RankEngines (its output in `log`, `_watch_saves` in
    `record`). Rank 0's view of the folder lags, as on a shared file system: its listings lack rank 1's files."""
    log.write_text("")
    enter_rank(dict(os.environ), log, log)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    _watch_saves(record)
    if rank == 0:
        listdir = os.listdir
        os.listdir = lambda path=".": [name for name in listdir(path) if not re.search(r"rank_?1\D", name)]
    checkpoint.save(RankEngine(), run, 2, _state(step=2, world_size=2), keep=0)
    dist.destroy_process_group()


def _rank_of_a_training_job(env: dict[str, str], argv: list[str], log: Path, record: Path) -> None:
    """One rank of `zerollm ARGV` (its launcher's environment `env`, its output in `log`), its saves watched
    (`_watch_saves` in `record`)."""
    log.write_text("")
    enter_rank(env, log, log)
    _watch_saves(record)
    from llm.cli import main  # noqa: PLC0415 - preloaded by the forkserver

    main(argv)


def _watched_ranks(target, args_of_rank: list[tuple], log: Path, timeout: float = 300) -> None:
    """`target(*args)` on forked ranks, one per entry of `args_of_rank`, waited for (each up to `timeout` seconds);
    each must end with exit code 0 (else the failure shows `log`'s files)."""
    ranks = [forkserver().Process(target=target, args=args) for args in args_of_rank]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=timeout)
    for rank in ranks:
        rank.kill()
        rank.join()
    logs = "".join(f"\n{path.name}: ...{path.read_text()[-3000:]}" for path in sorted(log.parent.glob(f"{log.name}*")))
    assert [rank.exitcode for rank in ranks] == [0] * len(ranks), logs


def _check_watched_saves(run: Path, records: list[Path]) -> None:
    """Each save of `run` as its ranks' `records` saw it: each rank flushed exactly the checkpoint files it wrote
    (each once), no rank but rank 0 received another rank's file names, and the manifest lists exactly the folder's
    files with their sizes: every rank's files and the client state."""
    saves = [[json.loads(line) for line in record.read_text().splitlines()] for record in records]
    tags = rundir.checkpoint_tags(run)
    assert tags and [len(seen) for seen in saves] == [len(tags)] * len(records)
    for i, tag in enumerate(tags):
        folder = os.path.abspath(rundir.checkpoint_dir(run) / tag)
        inside = [{key: sorted(Path(p).name for p in seen[i][key] if os.path.dirname(p) == folder)
                   for key in ("saved", "fsynced")} for seen in saves]
        assert [rank["fsynced"] for rank in inside] == [rank["saved"] for rank in inside], tag
        for rank, seen in enumerate(saves[1:], start=1):
            others = [name for other, files in enumerate(inside) if other != rank for name in files["saved"]]
            assert not [name for name in others if any(name in said for said in seen[i]["received"])], (rank, tag)
        files = json.loads(rundir.manifest_file(run, tag).read_text())["files"]
        assert files == {p.name: p.stat().st_size for p in Path(folder).iterdir() if p.name != rundir.MANIFEST}
        assert sorted(files) == sorted([rundir.CLIENT_STATE, *(name for rank in inside for name in rank["saved"])])
        assert rundir.incompleteness(run, tag) is None


def test_each_rank_flushes_only_its_own_files_and_only_rank_0_learns_them(tmp_path):
    """Every rank listed the whole folder and flushed every file it saw (at 512 ranks on Lustre or NFS, 512 fsyncs
    of each file, each a round trip to the metadata server), and all-gathered its listing to every rank (world^2 x
    files names). A rank whose view lags (rank 0 here) still cannot leave another rank's file out of the manifest."""
    run, port = tmp_path / "run", free_port()
    records = [tmp_path / f"saves.{rank}" for rank in range(2)]
    _watched_ranks(_rank_of_a_fake_save, [(rank, port, run, tmp_path / f"log.{rank}", records[rank])
                                          for rank in range(2)], tmp_path / "log")
    _check_watched_saves(run, records)
    assert rundir.latest_tag(run) == "global_step2"
    assert sorted(json.loads(rundir.manifest_file(run, "global_step2").read_text())["files"]) == sorted([
        MODEL_FILE, "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "rng_rank0.pt", "rng_rank1.pt", rundir.CLIENT_STATE])


class EngineWritingAside(FakeEngine):
    """A DeepSpeed that writes one file of its checkpoint otherwise than through its checkpoint engine."""

    def save_checkpoint(self, root: str, tag: str, save_latest: bool, exclude_frozen_parameters: bool) -> None:
        super().save_checkpoint(root, tag, save_latest, exclude_frozen_parameters)
        Path(root, tag, "written_aside.json").write_text("{}")


def test_a_file_no_rank_wrote_through_the_checkpoint_engine_is_still_listed(one_rank_group, tmp_path, monkeypatch):
    """The ranks list the files they wrote through DeepSpeed's checkpoint engine; one written otherwise would have
    made every checkpoint incomplete (a file not in its manifest), so rank 0 flushes and lists it."""
    flushed = []
    fsync = durable.fsync
    monkeypatch.setattr(durable, "fsync", lambda path: (flushed.append(Path(path).name), fsync(path)))
    checkpoint.save(EngineWritingAside(), tmp_path, 3, _state(step=3), keep=0)
    assert rundir.incompleteness(tmp_path, "global_step3") is None
    assert "written_aside.json" in json.loads(rundir.manifest_file(tmp_path, "global_step3").read_text())["files"]
    assert flushed.count("written_aside.json") == 1


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "fp32"), (2, "bf16"), (3, "bf16")])
def test_deepspeed_saves_on_two_ranks_flush_each_rank_s_own_files(pretrain_data, tmp_path, stage, precision):
    """As above, with DeepSpeed's engine under each ZeRO stage (bf16 adds its bf16_zero_pp_rank_<R> files): the
    files each rank flushes are those it wrote (seen through torch.save, not through the save's own record of them),
    rank 0 flushes no file it did not write, and the manifest lists every rank's."""
    run = tmp_path / "run"
    argv = ["train", "pretrain", "--recipe", "demo", "--data", str(pretrain_data), "--out", str(run),
            "--zero-stage", str(stage)]
    argv += [a for o in [*TINY, "train.max_steps=2", "train.save_every=1", "train.eval_every=0",
                         f"train.precision={precision}"] for a in ("--set", o)]
    records = [tmp_path / f"saves.{rank}" for rank in range(2)]
    _watched_ranks(_rank_of_a_training_job, [(env, argv, tmp_path / f"log.{rank}", records[rank])
                                             for rank, env in enumerate(rank_environments(2, free_port()))],
                   tmp_path / "log")
    _check_watched_saves(run, records)


# ---- ZeRO-Infinity's NVMe optimizer offload: DeepSpeed copies the swap files into the checkpoint itself ------------

class SwappingOptimizer:
    """What a checkpoint's save and load ask of an optimizer under NVMe offload: the folder of its swapper, and to
    read its state back from there once DeepSpeed's load copied the checkpoint's swap files to it (counted)."""

    swap_optimizer = True

    def __init__(self, swap: Path) -> None:
        self.optimizer_swapper = SimpleNamespace(swap_folder=str(swap))
        self.param_groups: list[dict] = []
        self.swapped_back = 0

    def reset_swap_buffers(self) -> None:
        self.swapped_back += 1


class NvmeOffloadEngine(FakeEngine):
    """A stand-in engine under NVMe optimizer offload, saved by DeepSpeed's own `save_checkpoint`: the model states
    through its checkpoint engine (rank 0), then its copy (shutil.copytree, outside the checkpoint engine) of the
    optimizer swapper's folder on the NVMe drive, `swap` (a swap file of each size in `sizes`, and a gradient's,
    which DeepSpeed leaves out), into <tag>/offloaded_tensors/rank<NN>. Loaded by DeepSpeed's own `load_checkpoint`:
    the model states, then its copy of <tag>/offloaded_tensors/rank<NN> back to `swap`, from which the optimizer
    reads its state back (ZeRO's optimizer files are not read under NVMe offload)."""

    def __init__(self, swap: Path, sizes: list[int]) -> None:
        super().__init__()
        swap.mkdir(parents=True, exist_ok=True)
        for i, size in enumerate(sizes):
            (swap / f"{i}.tensor.swp").write_bytes(bytes([i + 1]) * size)
        (swap / "0_gradient_0_8.tensor.swp").write_bytes(bytes(8))
        self.optimizer = SwappingOptimizer(swap)
        self.global_rank = self.local_rank = dist.get_rank()
        self.has_moe_layers = self.save_zero_checkpoint = False

    def save_checkpoint(self, root: str, tag: str, save_latest: bool, exclude_frozen_parameters: bool) -> None:
        from deepspeed.runtime.engine import DeepSpeedEngine

        DeepSpeedEngine.save_checkpoint(self, root, tag=tag, save_latest=save_latest,
                                        exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, root: str, tag: str, **kwargs) -> tuple[str, dict]:
        from deepspeed.runtime.engine import DeepSpeedEngine

        return DeepSpeedEngine.load_checkpoint(self, root, tag=tag, **kwargs)

    def _load_checkpoint(self, load_dir: str, tag: str, **_) -> tuple[str, dict]:
        return FakeEngine.load_checkpoint(self, load_dir, tag)

    def _load_zero_checkpoint(self, *args, **kwargs) -> bool:
        raise AssertionError("ZeRO's optimizer files are not read under NVMe offload")

    def zero_optimization(self) -> bool:
        return True

    def load_universal_checkpoint(self) -> bool:
        return False

    # what DeepSpeed's save_checkpoint asks of its engine besides, answered as an engine with NVMe offload answers
    def zero_nvme_offload_optimizer(self) -> bool:
        return self.optimizer.swap_optimizer

    def use_node_local_storage(self) -> bool:
        return False

    def _optimizer_has_ckpt_event_prologue(self) -> bool:
        return False

    def _optimizer_has_ckpt_event_epilogue(self) -> bool:
        return False

    def _checkpoint_tag_validation(self, tag: str) -> None:
        pass

    def _create_checkpoint_file(self, save_dir: str, tag: str, zero_checkpoint: bool) -> bool:
        Path(save_dir, tag).mkdir(parents=True, exist_ok=True)
        return True

    def _save_checkpoint(self, save_dir: str, tag: str, client_state, exclude_frozen_parameters: bool) -> None:
        if self.global_rank == 0:
            self.checkpoint_engine.save(self.state, str(Path(save_dir, tag, MODEL_FILE)))


def _deepspeed_collectives() -> object:
    """DeepSpeed's collectives over this process's group (its save's barriers), as deepspeed.init_distributed makes
    them once torch's group exists, without the shared-memory op (as `setup_distributed` builds them on a CPU; its
    compile takes a minute of a core). In this process the `deepspeed_without_shared_memory` fixture undoes that."""
    import deepspeed
    from deepspeed.comm.torch import TorchBackend

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return TorchBackend("gloo", timedelta(minutes=5), None)


@pytest.fixture
def deepspeed_collectives(one_rank_group, deepspeed_without_shared_memory, monkeypatch) -> None:
    from deepspeed.comm import comm

    monkeypatch.setattr(comm, "cdb", _deepspeed_collectives())


def _files_below(folder: Path) -> dict[str, int]:
    """Every file in `folder` and its subfolders, by its path there, with its size."""
    return {path.relative_to(folder).as_posix(): path.stat().st_size for path in folder.rglob("*") if path.is_file()}


COPIES = ["offloaded_tensors/rank00/0.tensor.swp", "offloaded_tensors/rank00/1.tensor.swp"]
"""A one-rank NvmeOffloadEngine's copies of its swap files, by their paths in the checkpoint folder."""


def test_nvme_offload_copies_are_flushed_and_listed_by_their_path(deepspeed_collectives, tmp_path, monkeypatch):
    """DeepSpeed's copy of the optimizer's swap files into the checkpoint was flushed by no rank and listed in no
    manifest (rank 0's listing skipped folders): a checkpoint whose optimizer state was torn or missing counted as
    complete. A manifest that lists no file in a subfolder (an NVMe checkpoint saved before) still counts."""
    run, flushed = tmp_path / "run", []
    fsync = durable.fsync
    monkeypatch.setattr(durable, "fsync", lambda path: (flushed.append(os.path.abspath(path)), fsync(path)))
    checkpoint.save(NvmeOffloadEngine(tmp_path / "nvme", [300, 5000]), run, 3, _state(step=3), keep=0)
    folder = rundir.checkpoint_dir(run) / "global_step3"
    manifest = json.loads((folder / rundir.MANIFEST).read_text())
    assert manifest["files"] == {name: size for name, size in _files_below(folder).items()
                                 if name != rundir.MANIFEST}
    assert sorted(manifest["files"]) == sorted([MODEL_FILE, "rng_rank0.pt", rundir.CLIENT_STATE, *COPIES])
    assert [manifest["files"][name] for name in COPIES] == [300, 5000]
    assert [flushed.count(str(folder / name)) for name in COPIES] == [1, 1]
    assert {str(folder / "offloaded_tensors" / "rank00"), str(folder / "offloaded_tensors")} <= set(flushed)
    assert rundir.incompleteness(run, "global_step3") is None
    manifest["files"] = {name: size for name, size in manifest["files"].items() if name not in COPIES}
    (folder / rundir.MANIFEST).write_text(json.dumps(manifest))
    assert rundir.incompleteness(run, "global_step3") is None


@pytest.mark.parametrize("damage, reason", [
    (lambda f: (f / COPIES[1]).write_bytes(bytes(100)), f"{COPIES[1]} has 100 bytes, 5000 were written"),
    (lambda f: (f / COPIES[0]).unlink(), f"{COPIES[0]} is missing"),
    (lambda f: shutil.rmtree(f / "offloaded_tensors"), f"{COPIES[0]} is missing"),
    (lambda f: (f / "offloaded_tensors/rank01").mkdir() or (f / "offloaded_tensors/rank01/0.tensor.swp").touch(),
     f"offloaded_tensors/rank01/0.tensor.swp not in its {rundir.MANIFEST}"),
])
def test_a_torn_nvme_offload_copy_makes_its_checkpoint_incomplete(deepspeed_collectives, tmp_path, capsys, damage,
                                                                  reason):
    run = tmp_path / "run"
    for step in (10, 20):
        checkpoint.save(NvmeOffloadEngine(tmp_path / "nvme", [300, 5000]), run, step, _state(step=step),
                        keep=0)
    damage(rundir.checkpoint_dir(run) / "global_step20")
    assert rundir.incompleteness(run, "global_step20") == reason
    assert rundir.usable_tag(run) == "global_step10"
    assert f"global_step20: {reason}; using global_step10" in capsys.readouterr().err


def _rank_of_an_nvme_save(rank: int, port: int, run: Path, log: Path, record: Path, out_of_room: bool) -> None:
    """One rank of a 2-rank gloo group saving steps 1 and 2 of NvmeOffloadEngines (its output in `log`,
    `_watch_saves` in `record`, what its save of step 2 raised in LOG.said). With `out_of_room`, rank 1's copy of a
    swap file at step 2 runs past the file size limit."""
    log.write_text("")
    enter_rank(dict(os.environ), log, log)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from deepspeed.comm import comm

    comm.cdb = _deepspeed_collectives()
    _watch_saves(record)
    swap = run.parent / f"nvme{rank}"
    checkpoint.save(NvmeOffloadEngine(swap, [300 + 1000 * rank, 70]), run, 1,
                    _state(step=1, world_size=2), keep=0)
    full = out_of_room and rank == 1
    engine = NvmeOffloadEngine(swap, [200_000 if full else 300, 70])
    try:
        with file_size_limit(100_000 if full else 2**40):
            checkpoint.save(engine, run, 2, _state(step=2, world_size=2), keep=0)
    except UserError as exc:
        Path(f"{log}.said").write_text(str(exc))
    dist.destroy_process_group()


def _nvme_saves_on_two_ranks(tmp_path: Path, out_of_room: bool) -> tuple[Path, list[Path], list[Path]]:
    """`_rank_of_an_nvme_save` on two forked ranks: the run, the ranks' records and their logs."""
    run, port = tmp_path / "run", free_port()
    records, logs = [tmp_path / f"saves.{rank}" for rank in range(2)], [tmp_path / f"log.{rank}" for rank in range(2)]
    _watched_ranks(_rank_of_an_nvme_save, [(rank, port, run, logs[rank], records[rank], out_of_room)
                                           for rank in range(2)], tmp_path / "log", timeout=120)
    return run, records, logs


def test_each_rank_flushes_its_own_nvme_offload_copies_and_the_manifest_lists_all(tmp_path):
    run, records, _ = _nvme_saves_on_two_ranks(tmp_path, out_of_room=False)
    for i, tag in enumerate(["global_step1", "global_step2"]):
        folder = rundir.checkpoint_dir(run) / tag
        copies = [[f"offloaded_tensors/rank0{rank}/{n}.tensor.swp" for n in range(2)] for rank in range(2)]
        saves = [[json.loads(line) for line in record.read_text().splitlines()][i] for record in records]
        for rank, seen in enumerate(saves):
            flushed = sorted(os.path.relpath(path, folder) for path in seen["fsynced"]
                             if Path(path).is_relative_to(folder / "offloaded_tensors"))
            assert flushed == sorted([*copies[rank], f"offloaded_tensors/rank0{rank}", "offloaded_tensors"]), tag
        assert not [name for name in copies[0] if any(name in said for said in saves[1]["received"])], tag
        files = json.loads(rundir.manifest_file(run, tag).read_text())["files"]
        assert files == {name: size for name, size in _files_below(folder).items()
                         if name != rundir.MANIFEST}
        assert [files[name] for name in copies[0] + copies[1]] == [300, 70, 1300 if i == 0 else 300, 70]
        assert rundir.incompleteness(run, tag) is None


def test_an_nvme_offload_copy_out_of_room_on_one_rank_ends_every_rank_in_one_line(tmp_path):
    """Rank 1's copy ran out of room inside DeepSpeed's save, which it left with a shutil.Error, while rank 0 waited
    in DeepSpeed's closing barrier."""
    run, _, logs = _nvme_saves_on_two_ranks(tmp_path, out_of_room=True)
    message = (f"{rundir.checkpoint_dir(run)}: {FILE_SIZE_LIMIT} while saving step 2; the previous checkpoint "
               "(global_step1) is intact; free space and rerun with --resume auto")
    assert [Path(f"{log}.said").read_text() for log in logs] == [message, message]
    said = [[line for line in log.read_text().splitlines() if "error" in line.lower()] for log in logs]
    assert said == [[f"zerollm: error: {message}"], []]
    assert rundir.checkpoint_tags(run) == ["global_step1"] and rundir.usable_tag(run) == "global_step1"



def _copy_back_out_of_room(swap: Path, run: Path) -> str:
    """What DeepSpeed's load copying the swap files of `run`'s checkpoint global_step1 back to `swap` (a full
    drive) is said as."""
    return (f"{swap}: {FILE_SIZE_LIMIT} while copying the optimizer's swap files back from "
            f"{rundir.checkpoint_dir(run) / 'global_step1' / 'offloaded_tensors'}; the checkpoint is intact: free "
            "space there and rerun with --resume auto")


def test_loading_copies_the_nvme_offload_files_back_and_a_full_drive_is_one_line(deepspeed_collectives, tmp_path):
    """DeepSpeed's copy back to the drive ran out of room with a shutil.Error of texts (its copytree went on with
    every other file), and the optimizer then read its state back from the partial copy."""
    run = tmp_path / "run"
    checkpoint.save(NvmeOffloadEngine(tmp_path / "nvme", [300, 5000]), run, 1, _state(step=1), keep=0)
    engine = NvmeOffloadEngine(tmp_path / "loaded", [1, 1])
    assert checkpoint.load(engine, run, "global_step1")["step"] == 1
    assert [(tmp_path / "loaded" / f"{i}.tensor.swp").read_bytes() for i in range(2)] == [b"\1" * 300, b"\2" * 5000]
    assert engine.optimizer.swapped_back == 1
    assert "reset_swap_buffers" not in vars(engine.optimizer)  # the class's method again

    engine = NvmeOffloadEngine(tmp_path / "full", [1, 1])
    with file_size_limit(1000), pytest.raises(UserError) as error:
        checkpoint.load(engine, run, "global_step1")
    assert str(error.value) == _copy_back_out_of_room(tmp_path / "full", run)
    assert engine.optimizer.swapped_back == 0  # nothing read back from a partial copy
    assert rundir.usable_tag(run) == "global_step1"


def _rank_of_an_nvme_load(rank: int, port: int, run: Path, log: Path) -> None:
    """One rank of a 2-rank gloo group saving step 1 of NvmeOffloadEngines, then loading it into fresh ones (its
    output in `log`, what its load raised in LOG.said): rank 1's copy of a swap file back to the drive runs past the
    file size limit."""
    log.write_text("")
    enter_rank(dict(os.environ), log, log)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from deepspeed.comm import comm

    comm.cdb = _deepspeed_collectives()
    checkpoint.save(NvmeOffloadEngine(run.parent / f"nvme{rank}", [300 if rank == 0 else 200_000, 70]), run, 1,
                    _state(step=1, world_size=2), keep=0)
    try:
        with file_size_limit(100_000 if rank == 1 else 2**40):
            checkpoint.load(NvmeOffloadEngine(run.parent / f"loaded{rank}", [1, 1]), run, "global_step1")
    except UserError as exc:
        Path(f"{log}.said").write_text(str(exc))
    dist.destroy_process_group()


def test_an_nvme_offload_copy_back_out_of_room_on_one_rank_ends_every_rank_in_one_line(tmp_path):
    """Rank 1's copy back to its drive raised a shutil.Error out of DeepSpeed's load, on rank 1 alone, while rank 0
    waited for it in the load's agreement."""
    run, port = tmp_path / "run", free_port()
    logs = [tmp_path / f"log.{rank}" for rank in range(2)]
    _watched_ranks(_rank_of_an_nvme_load, [(rank, port, run, logs[rank]) for rank in range(2)], tmp_path / "log",
                   timeout=120)
    message = _copy_back_out_of_room(tmp_path / "loaded1", run)
    assert [Path(f"{log}.said").read_text() for log in logs] == [message, message]
    said = [[line for line in log.read_text().splitlines() if "error" in line.lower()] for log in logs]
    assert said == [[f"zerollm: error: {message}"], []]

@pytest.mark.parametrize("damage, reason", [
    (lambda f: (f / MODEL_FILE).write_bytes((f / MODEL_FILE).read_bytes()[:100]), f"{MODEL_FILE} has 100 bytes"),
    (lambda f: (f / "rng_rank0.pt").unlink(), "rng_rank0.pt is missing"),
    (lambda f: (f / rundir.MANIFEST).unlink(), "no manifest.json"),
    (lambda f: (f / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"x"), "not in its manifest.json"),
    (lambda f: shutil.rmtree(f), "does not exist"),
])
def test_an_incomplete_newest_checkpoint_is_passed_over_with_a_note(one_rank_group, tmp_path, capsys, damage, reason):
    _save(tmp_path, 10, 20)
    damage(rundir.checkpoint_dir(tmp_path) / "global_step20")
    assert rundir.usable_tag(tmp_path) == "global_step10"
    note = capsys.readouterr().err
    assert "global_step20" in note and reason in note and "using global_step10" in note
    engine = FakeEngine()
    assert checkpoint.load(engine, tmp_path, "global_step10")["step"] == 10
    assert torch.equal(engine.state["module"]["w"], torch.full((4,), 10.0))
    assert torch.equal(consolidated_weights(tmp_path)["w"], torch.full((4,), 10.0))


def test_files_loading_does_not_read_leave_a_checkpoint_complete(one_rank_group, tmp_path, capsys):
    """A .DS_Store, an NFS .nfs file or a note in the newest checkpoint made it incomplete: a resume went back to the
    one before (and deleted this one to save it again), and where it was the only one, the run was to be trained
    again."""
    _save(tmp_path, 10, 20)
    folder = rundir.checkpoint_dir(tmp_path) / "global_step20"
    for name in (".DS_Store", ".nfs000000000123", "notes.txt", ".snapshot/hourly.0"):
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text("x")
    assert rundir.incompleteness(tmp_path, "global_step20") is None
    assert rundir.usable_tag(tmp_path) == "global_step20" and capsys.readouterr().err == ""
    (folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"x")  # DeepSpeed would read it as a rank's
    assert rundir.incompleteness(tmp_path, "global_step20") == \
        "zero_pp_rank_1_mp_rank_00_optim_states.pt not in its manifest.json"


def test_no_complete_checkpoint_is_one_clear_error(one_rank_group, tmp_path):
    _save(tmp_path, 10)
    (rundir.checkpoint_dir(tmp_path) / "global_step10" / "rng_rank0.pt").unlink()
    with pytest.raises(UserError, match="holds no complete checkpoint .*rng_rank0.pt is missing.*, so nothing can be "
                                        "loaded from this run; train it again into a new run directory"):
        rundir.usable_tag(tmp_path)
    assert rundir.usable_tag(tmp_path / "elsewhere") is None


def test_a_run_saved_before_manifests_is_told_how_to_carry_it_over(one_rank_group, tmp_path):
    """A run trained by the zerollm of before manifests (its first day; its RNG files pickled numpy's state, which
    this version does not unpickle) was refused as holding only unfinished saves, to be trained again."""
    for step in (10, 20):  # as this version saves them
        checkpoint.save(FakeEngine(step), tmp_path, step, _state(step=step, tokens_seen=64 * step), 0)
    root = rundir.checkpoint_dir(tmp_path)
    (root / "global_step20" / rundir.MANIFEST).unlink()
    assert rundir.usable_tag(tmp_path) == "global_step10"  # a run of this version: its unfinished save passed over
    (root / "global_step10" / rundir.MANIFEST).unlink()
    with pytest.raises(UserError, match="holds no complete checkpoint"):  # its manifests lost: not an old run
        rundir.usable_tag(tmp_path)
    old_state = {key: value for key, value in CLIENT_STATE.items() if key != "time_budget"} | {"step": 20}
    (root / "global_step20" / rundir.CLIENT_STATE).write_text(json.dumps(old_state))  # as the first day's were
    with pytest.raises(UserError) as refused:
        rundir.usable_tag(tmp_path)
    assert str(refused.value) == (
        f"{root / 'global_step20'}: saved by a zerollm from before checkpoints had a manifest.json, whose checkpoints "
        f"this version cannot load; export the run with that version (`zerollm export --run {tmp_path} --out DIR`) "
        "and give this one the export (--init-from DIR, --model DIR)")

def test_a_newer_complete_checkpoint_latest_does_not_name_is_not_used(one_rank_group, tmp_path):
    """Killed after the manifest but before `latest` moved: `latest` still decides (and the folder is redone)."""
    _save(tmp_path, 10, 20)
    (rundir.checkpoint_dir(tmp_path) / rundir.LATEST).write_text("global_step10")
    assert rundir.usable_tag(tmp_path) == "global_step10"


# ---- item 13: RNG files and restricted unpickling ---------------------------------------------------------------

def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_rng_files_load_with_weights_only_and_restore_every_stream(one_rank_group, tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws()
    _save(tmp_path, 1)
    expected = _draws()
    _draws()
    state = torch.load(rundir.rng_file(tmp_path, "global_step1", 0), weights_only=True)
    checkpoint.set_rng_state(state)
    assert _draws() == expected


class Payload:
    """A pickle that creates a folder when it is unpickled (what any code in a pickle could do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def _plant(run: Path, tag: str, name: str, content) -> None:
    """Write a checkpoint file and keep the manifest consistent (as anyone who can write the folder can)."""
    folder = rundir.checkpoint_dir(run) / tag
    torch.save(content, folder / name)
    manifest = json.loads((folder / rundir.MANIFEST).read_text())
    manifest["files"][name] = (folder / name).stat().st_size
    (folder / rundir.MANIFEST).write_text(json.dumps(manifest))


def _payload(marker: Path) -> dict:
    return {"module": {"w": Payload(marker)}, "python": Payload(marker), "optimizer_state_dict": Payload(marker)}


@pytest.mark.parametrize("name", [MODEL_FILE, "rng_rank0.pt"])
def test_resuming_never_runs_a_pickle_found_in_a_checkpoint(one_rank_group, tmp_path, name):
    _save(tmp_path, 1)
    _plant(tmp_path, "global_step1", name, _payload(tmp_path / "pwned"))
    with pytest.raises(UserError, match=rf"global_step1/{name} holds more than tensors .*GLOBAL posix.mkdir"):
        checkpoint.load(FakeEngine(), tmp_path, "global_step1")
    assert not (tmp_path / "pwned").exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


@pytest.mark.parametrize("name", [MODEL_FILE, "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_loading_weights_never_runs_a_pickle_found_in_a_checkpoint(one_rank_group, tmp_path, name):
    """generate, chat, serve, export and --init-from read weights through `consolidated_weights`, plain or
    ZeRO-partitioned (DeepSpeed's zero_to_fp32, which asks torch.load for weights_only=False)."""
    _save(tmp_path, 1)
    if name != MODEL_FILE:  # DeepSpeed's model-state file, which zero_to_fp32 reads before the optimizer's
        _plant(tmp_path, "global_step1", MODEL_FILE, {"module": {}, "buffer_names": [], "shared_params": {},
                                                      "param_shapes": [{"w": torch.Size([4])}]})
    _plant(tmp_path, "global_step1", name, _payload(tmp_path / "pwned"))
    with pytest.raises(UserError, match=rf"global_step1/{name} holds more than tensors .*GLOBAL posix.mkdir"):
        consolidated_weights(tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_a_bf16_run_without_zero_gives_its_fp32_master_weights(pretrain_data, tmp_path):
    """Without ZeRO, export, --init-from, generate and eval read the module's weights, rounded to bf16, where the
    same run under ZeRO-1 to 3 gave the fp32 master copies its optimizer keeps."""
    run = tmp_path / "run"
    result = run_job(*train_args(pretrain_data, run, "train.max_steps=2", "train.precision=bf16",
                                 extra=["--zero-stage", 0]))
    assert result.returncode == 0, result.stderr[-3000:]
    saved = run / "checkpoints" / "global_step2"
    with checkpoint.restricted_unpickling(saved):
        state = torch.load(saved / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    decayed, others = state["optimizer"]["fp32_groups"]  # the master copies, in the optimizer's two groups
    module = state["module"]
    assert module["tok_embeddings.weight"].dtype == torch.bfloat16
    weights = consolidated_weights(run)
    assert set(weights) == set(module)
    assert torch.equal(weights["tok_embeddings.weight"], decayed[0])  # the first matrix
    assert torch.equal(weights["layers.0.attention_norm.weight"], others[0])  # the first vector
    assert torch.equal(weights["layers.1.feed_forward.w3.weight"], decayed[-1])  # the last matrix (output is tied)
    assert torch.equal(weights["output.weight"], decayed[0])
    assert not torch.equal(decayed[0], decayed[0].bfloat16().float())
    model, _ = load_trained_model(run)
    assert torch.equal(model.tok_embeddings.weight, decayed[0])


def test_fp32_masters_in_one_flat_tensor_per_group_are_read_and_copies_that_do_not_line_up_are_not():
    """DeepSpeed's fused fp16 optimizer (FusedAdam on a GPU, bf16 too) keeps one flat fp32 tensor per parameter
    group; copies of other sizes than the module's parameters are not taken for them; DeepSpeed drops an empty
    group (a LoRA run's adapters are all matrices)."""
    masters = {"emb": torch.randn(6, 4), "norm": torch.randn(4), "w": torch.randn(3, 4)}
    module = {name: t.bfloat16() for name, t in masters.items()}
    module["out"] = module["emb"]  # tied: one parameter under two names
    flat = [torch.cat([masters["emb"].flatten(), masters["w"].flatten()]), masters["norm"]]
    weights = loading._unpartitioned_weights({"module": module, "optimizer": {"fp32_groups_flat": flat}})
    assert all(torch.equal(weights[name], masters[name]) for name in masters)
    assert torch.equal(weights["out"], masters["emb"])
    short = [flat[0][:-1], flat[1]]
    rounded = loading._unpartitioned_weights({"module": module, "optimizer": {"fp32_groups_flat": short}})
    assert all(torch.equal(rounded[name], module[name].float()) for name in module)
    adapters = {"a": torch.randn(2, 4), "b": torch.randn(4, 2)}  # a LoRA run's: matrices only, one group left
    state = {"module": {name: t.bfloat16() for name, t in adapters.items()},
             "optimizer": {"fp32_groups": [list(adapters.values())]}}
    assert all(torch.equal(loading._unpartitioned_weights(state)[name], adapters[name]) for name in adapters)


def _run_of(tmp_path: Path, trained_tied: bool, config_tied: bool) -> tuple[Path, Transformer]:
    """A run directory whose checkpoint holds a model trained with tie_embeddings `trained_tied` (both of its
    matrices, as DeepSpeed saves a tied model's) and whose config.yaml says `config_tied`; the model trained."""
    cfg = build_config("demo", [*TINY, f"model.tie_embeddings={str(config_tied).lower()}"])
    torch.manual_seed(0)
    trained = Transformer(dataclasses.replace(cfg.model, tie_embeddings=trained_tied)).eval()
    engine = FakeEngine()
    engine.state = {"module": trained.state_dict()}
    run = tmp_path / "run"
    checkpoint.save(engine, run, 1, _state(step=1), keep=0)
    cfg.save(rundir.config_file(run))
    return run, trained


@pytest.mark.parametrize("trained_tied, why", [
    (False, "model.tie_embeddings is true, but the checkpoint was trained untied"),
    (True, "model.tie_embeddings is false, but the checkpoint was trained tied"),
], ids=["tied-config-untied-checkpoint", "untied-config-tied-checkpoint"])
def test_a_config_tied_otherwise_than_its_checkpoint_is_one_line(one_rank_group, tmp_path, monkeypatch, capsys,
                                                                 trained_tied, why):
    """Tied over untied: both matrices were loaded into the one tied parameter, the output matrix last, and export
    succeeded with logits 1.4 away from the trained model's. Untied over tied: the model's two matrices were one
    tensor, and export ended in safetensors' traceback ("Some tensors share memory")."""
    run, _ = _run_of(tmp_path, trained_tied=trained_tied, config_tied=not trained_tied)
    assert zerollm_here(monkeypatch, "export", "--run", run, "--out", tmp_path / "export") == 2
    assert capsys.readouterr().err == f"zerollm: error: {run}: checkpoint does not match config.yaml ({why})\n"
    assert not (tmp_path / "export").exists()


def test_a_tied_checkpoint_with_both_matrices_loads_under_a_tied_config(one_rank_group, tmp_path):
    run, trained = _run_of(tmp_path, trained_tied=True, config_tied=True)
    tokens = torch.arange(20).reshape(1, 20)
    with torch.no_grad():
        assert torch.equal(load_trained_model(run)[0](tokens).logits, trained(tokens).logits)


@pytest.mark.parametrize("pruned", ["when chosen", "after latest is read", "while its files are listed",
                                    "while DeepSpeed is imported", "while torch maps a file"])
def test_a_checkpoint_pruned_before_it_is_read_gives_way_to_the_newest(one_rank_group, tmp_path, monkeypatch, pruned):
    """export, generate and eval beside a training saving often (keep_checkpoints 2): the newest checkpoint was
    chosen, then pruned while DeepSpeed was imported, and opening it was a FileNotFoundError traceback; pruned
    between reading `latest` and listing the checkpoints, the run was said to hold no complete checkpoint ("train
    it again"); pruned as its files were listed, a FileNotFoundError traceback; as torch mapped a file, its
    RuntimeError."""
    _save(tmp_path, 1, 2)
    saves = iter([3, 4])  # a training saves (pruning the one before) each time a checkpoint is about to be read

    def training_saves_and_prunes() -> None:
        if (step := next(saves, None)) is not None:
            _save(tmp_path, step, keep=1)

    if pruned == "when chosen":
        choose = rundir.usable_tag
        monkeypatch.setattr(rundir, "usable_tag", lambda run: (choose(run), training_saves_and_prunes())[0])
    elif pruned == "after latest is read":
        read_latest = rundir.latest_tag
        monkeypatch.setattr(rundir, "latest_tag", lambda run: (read_latest(run), training_saves_and_prunes())[0])
    elif pruned == "while its files are listed":
        listed = rundir.checkpoint_files
        monkeypatch.setattr(rundir, "checkpoint_files", lambda folder: (listed(folder), training_saves_and_prunes())[0])
    elif pruned == "while torch maps a file":
        restricted = loading.restricted_unpickling

        def pruned_as_mapped(source):
            training_saves_and_prunes()
            if not source.is_dir():
                raise RuntimeError(f"unable to open file <{source}/model.pt> in read-only mode: No such file or "
                                   "directory (2)")
            return restricted(source)

        monkeypatch.setattr(loading, "restricted_unpickling", pruned_as_mapped)
    else:
        restricted = loading.restricted_unpickling
        monkeypatch.setattr(loading, "restricted_unpickling", lambda source: (training_saves_and_prunes(),
                                                                             restricted(source))[1])
    read = consolidated_weights(tmp_path)["w"]  # global_step2 pruned, and global_step3 too where it was chosen
    assert torch.equal(read, torch.full((4,), 4.0)) if pruned in ("when chosen", "while DeepSpeed is imported") else \
        read.unique().tolist() in ([3.0], [4.0])  # (here the save patched in runs from the save too, once more)
    if pruned in ("after latest is read", "while its files are listed"):
        return  # (their save runs at each look at the run, not once a read, so the race below is not staged)
    saves = iter(range(5, 100))  # now as fast as it is read
    with pytest.raises(UserError) as error:
        consolidated_weights(tmp_path)
    assert str(error.value) == (f"{tmp_path}: a training is saving checkpoints faster than they can be read (the "
                                f"newest one was pruned before it was read, {loading.READ_ATTEMPTS} times); retry, or "
                                "raise train.keep_checkpoints")


def test_a_latest_naming_a_pruned_checkpoint_names_the_newest_complete_one(one_rank_group, tmp_path):
    """`latest` written back to an older tag (DeepSpeed's way to pick a checkpoint) that was pruned: the run was
    said to hold no complete checkpoint, and to be trained again, while newer complete ones were there."""
    _save(tmp_path, 2, 3)
    (rundir.checkpoint_dir(tmp_path) / rundir.LATEST).write_text("global_step1")
    with pytest.raises(UserError) as error:
        rundir.usable_tag(tmp_path)
    root = rundir.checkpoint_dir(tmp_path)
    assert str(error.value) == (f"{root / rundir.LATEST} names global_step1, but no checkpoint up to it is complete "
                                f"({root / 'global_step1'}: the folder does not exist); write the tag of a checkpoint "
                                "folder there (global_step3 is the newest complete one) or delete it to continue from "
                                "global_step3")


def test_the_universal_conversion_never_runs_a_pickle_found_in_a_checkpoint(tmp_path):
    """Resuming on another number of ranks converts with DeepSpeed's ds_to_universal, in a subprocess."""
    folder = rundir.checkpoint_dir(tmp_path) / "global_step1"
    folder.mkdir(parents=True)
    for name in (MODEL_FILE, "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        torch.save({**_payload(tmp_path / "pwned"), "param_shapes": Payload(tmp_path / "pwned")}, folder / name)
    with pytest.raises(UserError, match="Weights only load failed"):
        checkpoint.convert_to_universal(tmp_path, "global_step1")
    assert not (tmp_path / "pwned").exists()


def test_an_fp16_dynamic_loss_scaler_in_a_zero_optimizer_file_loads_with_its_scale(tmp_path):
    """fp16 with dynamic loss scaling under ZeRO 1-3 pickles a DynamicLossScaler into every *optim_states.pt: only
    LossScaler was allowed, so such a run could never be resumed, exported nor loaded."""
    checkpoint.deepspeed_state_classes()  # chooses the accelerator before deepspeed is imported
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler  # noqa: PLC0415

    scaler = CreateLossScaler(torch.half, 0, True, {"init_scale": 2**16, "scale_window": 1000, "min_scale": 1,
                                                    "delayed_shift": 2, "consecutive_hysteresis": False,
                                                    "raise_error_at_min_scale": True})
    scaler.cur_scale = 1024.0
    folder = rundir.checkpoint_dir(tmp_path) / "global_step1"
    folder.mkdir(parents=True)
    partition = folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    # what ZeRO's optimizer state_dict holds (stage_1_and_2.py / stage3.py: "loss_scaler", "dynamic_loss_scale")
    torch.save({"optimizer_state_dict": {"loss_scaler": scaler, "dynamic_loss_scale": True}}, partition)
    with checkpoint.restricted_unpickling(folder):
        loaded = torch.load(partition, weights_only=False)["optimizer_state_dict"]["loss_scaler"]
    assert type(loaded) is type(scaler) and loaded.dynamic and loaded.cur_scale == 1024.0
    assert loaded.dtype == torch.half and loaded.scale_window == 1000


def _converted_weights(run: Path, tag: str) -> dict[str, torch.Tensor]:
    folder = rundir.universal_dir(run) / tag / "zero"
    with checkpoint.restricted_unpickling(folder):
        return {p.parent.name: torch.load(p, weights_only=True)["param"] for p in folder.glob("*/fp32.pt")}


def test_a_universal_conversion_is_used_only_whole_and_for_the_checkpoint_it_was_made_from(zero_runs, tmp_path):
    """A conversion left by a refused resume was used for a checkpoint of the same step saved later (the run resumed
    the old weights, silently: the manifest and client state may be the same byte for byte), and one that a job was
    killed while removing failed in DeepSpeed's load with a traceback (`ValueError: exp_avg not found`)."""
    run, tag = tmp_path / "run", "global_step4"
    shutil.copytree(zero_runs[2], run, symlinks=True)
    checkpoint.convert_to_universal(run, tag)
    converted = next((rundir.universal_dir(run) / tag / "zero").glob("*/fp32.pt"))
    made, before = converted.stat().st_mtime_ns, _converted_weights(run, tag)
    checkpoint.convert_to_universal(run, tag)  # whole, and of this checkpoint: used as it is
    assert converted.stat().st_mtime_ns == made

    # the step is saved again (other weights, files of the same sizes): rank 0's partition moved by 1
    partition = rundir.checkpoint_dir(run) / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with checkpoint.restricted_unpickling(partition.parent):
        state = torch.load(partition, weights_only=True)
    state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].data += 1
    with open(partition, "wb") as f:  # as the save writes it (`_writes_held_at_first_failure`)
        torch.save(state, f)
    assert rundir.incompleteness(run, tag) is None  # the manifest is as it was
    checkpoint.convert_to_universal(run, tag)
    after = _converted_weights(run, tag)
    moved = [name for name in before if not torch.equal(before[name], after[name])]
    assert moved and all(((d == 0) | ((d - 1).abs() < 1e-5)).all() for d in (after[n] - before[n] for n in moved))

    # a job killed while removing the conversion after its load
    (rundir.universal_dir(run) / tag / "zero" / moved[0] / "exp_avg.pt").unlink()
    checkpoint.convert_to_universal(run, tag)
    assert (rundir.universal_dir(run) / tag / "zero" / moved[0] / "exp_avg.pt").is_file()
    assert all(torch.equal(after[name], weights) for name, weights in _converted_weights(run, tag).items())



def test_a_universal_conversion_is_flushed_whole_before_it_is_renamed_into_place(zero_runs, tmp_path, monkeypatch):
    """The conversion was renamed into place with only its record flushed: after a power loss, a later resume could
    trust a conversion whose parameter files were torn or empty (their sizes are in the record, flushed)."""
    run, tag = tmp_path.resolve() / "run", "global_step4"
    shutil.copytree(zero_runs[2], run, symlinks=True)
    events = _flushes_and_renames(monkeypatch)
    checkpoint.convert_to_universal(run, tag)
    target = rundir.universal_dir(run) / tag
    assert [path for path in target.rglob("*") if path.is_file() and path.parent.parent.name == "zero"]
    _check_flushed_then_renamed(events, target)
    renamed = next(i for i, (kind, _, to) in enumerate(events) if kind == "replace" and to == str(target))
    assert ("fsync", str(rundir.checkpoint_dir(run)), "") in events[:renamed]  # universal/ itself, made new


# ---- damaged files: `latest`, client state, RNG files, manifest sizes, unreadable checkpoint files ----------------

def _latest(run: Path) -> Path:
    return rundir.checkpoint_dir(run) / rundir.LATEST


def _replace_latest_by_a_folder(latest: Path) -> None:
    latest.unlink()
    latest.mkdir()


@pytest.mark.parametrize("damage, problem", [
    (lambda latest: latest.write_bytes(b"global_step10\xff"), "is damaged (not UTF-8 text)"),
    (_replace_latest_by_a_folder, "is not a file"),
    # read whole and said whole in the line: a damaged `latest` of gigabytes exhausted the memory
    (lambda latest: latest.write_bytes(b"global_step10" + b"0" * 10_000_000),
     "is damaged (longer than a checkpoint tag)"),
])
def test_a_latest_that_is_not_a_text_file_is_one_clear_error(one_rank_group, tmp_path, damage, problem):
    """Used to be a UnicodeDecodeError (generate, export, resume), or for a folder a resume from step 0 that died
    saving its first checkpoint with IsADirectoryError."""
    _save(tmp_path, 10)
    damage(_latest(tmp_path))
    expected = rf"{_latest(tmp_path)} {re.escape(problem)}.*write the tag of a checkpoint folder there .*or delete it"
    for read in (rundir.latest_tag, rundir.usable_tag, consolidated_weights,
                 lambda run: rundir.check_run_output(run, resume=True)):
        with pytest.raises(UserError, match=expected):
            read(tmp_path)


def test_a_latest_of_a_step_past_64_bits_is_one_clear_error(one_rank_group, tmp_path):
    """int() of its digits was a ValueError traceback (past 4300 digits) or a step no counter holds."""
    _save(tmp_path, 10)
    _latest(tmp_path).write_text("global_step" + "9" * 40)
    with pytest.raises(UserError, match=f"names 'global_step{'9' * 40}', which is not a checkpoint tag; write the "
                                        "tag of a checkpoint folder there \\(global_step10 is the newest complete"):
        rundir.usable_tag(tmp_path)


def test_a_manifest_nested_too_deep_makes_its_checkpoint_incomplete(one_rank_group, tmp_path):
    _save(tmp_path, 10, 20)
    (rundir.checkpoint_dir(tmp_path) / "global_step20" / rundir.MANIFEST).write_bytes(b"[" * 200_000)
    assert rundir.incompleteness(tmp_path, "global_step20") == "unreadable manifest.json (RecursionError)"
    assert rundir.usable_tag(tmp_path) == "global_step10"


def test_resuming_with_a_damaged_latest_is_refused_before_training(pretrain_data, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _latest(run).parent.mkdir(parents=True)
    _latest(run).write_bytes(b"global_step2\xff")
    assert zerollm_here(monkeypatch, *train_args(pretrain_data, run, *ONE_RANK, extra=["--resume", "auto"])) == 2
    assert capsys.readouterr().err.strip() == (f"zerollm: error: {_latest(run)} is damaged (not UTF-8 text); write "
                                               "the tag of a checkpoint folder there (e.g. global_step0) or delete it "
                                               "to start over")


def _rewrite(path: Path, content: bytes) -> None:
    """Replace a checkpoint file and keep its manifest consistent (a manifest checks sizes, not contents)."""
    path.write_bytes(content)
    manifest = json.loads((path.parent / rundir.MANIFEST).read_text())
    manifest["files"][path.name] = len(content)
    (path.parent / rundir.MANIFEST).write_text(json.dumps(manifest))


def _client_state(**changes) -> bytes:
    state = CLIENT_STATE | {"step": 20} | changes
    return json.dumps({key: value for key, value in state.items() if value != "drop"}).encode()


@pytest.mark.parametrize("content, problem", [
    (b"\0" * 180, "not JSON: Expecting value"),  # power loss: the size is right, the blocks are zeros
    (b'{"step": 20,', "not JSON"),
    (b"\xff{}", "not UTF-8 text"),
    (b"[1]", "a JSON object was expected, found list"),
    (b"[" * 200_000 + b"]" * 200_000, "JSON nested too deep"),  # was a RecursionError traceback
    (_client_state(world_size="1"), "world_size is '1', not a number of ranks"),
    (_client_state(world_size=0), "world_size is 0, not a number of ranks"),
    (_client_state(world_size=2), "world_size is 2, but its manifest.json records the files of 1 rank"),  # was a
    # DeepSpeed traceback (ZeRORuntimeException), the resume taken for one on another number of ranks
    (_client_state(step="x"), "step is 'x', not a step number"),
    (_client_state(step=99), "step is 99, not the folder's 20"),
    (_client_state(sampler="drop"), "sampler is None, not an object"),
    (_client_state(sampler={"epoch": 0, "consumed": -5, "seed": 1, "num_samples": 100}), "sampler.consumed is -5"),
    (_client_state(run_id=7), "run_id is 7, not a string"),
    (_client_state(time_budget={"elapsed": "1"}), "time_budget.elapsed is '1'"),
    (_client_state(loss_scale=float("inf")), "loss_scale is inf, not a number"),  # JSON's Infinity: was resumed
    (_client_state(tokens_seen=-1), "tokens_seen is -1, not a count"),
])
def test_a_damaged_client_state_is_one_clear_error(one_rank_group, tmp_path, content, problem):
    """Used to be a JSONDecodeError, TypeError or KeyError traceback on resume, or a resume at a wrong step."""
    _save(tmp_path, 10, 20)
    client_file = rundir.checkpoint_dir(tmp_path) / "global_step20" / rundir.CLIENT_STATE
    _rewrite(client_file, content)
    assert rundir.usable_tag(tmp_path) == "global_step20"  # complete: sizes match its manifest
    # rank 0 finds it while it picks the checkpoint, so that it is said once (every rank printed it)
    for read in (lambda: checkpoint.resume_tag(tmp_path, SMALL), lambda: checkpoint.load(FakeEngine(), tmp_path,
                                                                                          "global_step20")):
        with pytest.raises(UserError) as raised:
            read()
        message = str(raised.value)
        assert message.startswith(f"{client_file} is damaged ({problem}") and message.endswith(
            f"), so checkpoint global_step20 cannot be used; remove {client_file.parent} to continue from "
            "global_step10, the newest complete checkpoint before it")
    shutil.rmtree(client_file.parent)  # as the message says
    assert rundir.usable_tag(tmp_path) == "global_step10"
    assert checkpoint.load(FakeEngine(), tmp_path, "global_step10")["step"] == 10


def _wider_model() -> tuple[ModelConfig, dict[str, torch.Size]]:
    """A model twice SMALL's width (another model's checkpoint to it), and its parameters' shapes by name."""
    wider = ModelConfig(**{**SMALL.__dict__, "dim": 64, "n_heads": 4})
    with torch.device("meta"):
        return wider, {name: param.shape for name, param in Transformer(wider).named_parameters()}


@pytest.mark.parametrize("zero", [False, True])
def test_another_models_checkpoint_is_one_clear_error_before_anything_loads(one_rank_group, tmp_path, zero):
    """A checkpoint folder of another model's run copied into this one: DeepSpeed's load ended every rank with a
    traceback (a state-dict size mismatch; on another number of ranks, the universal loader's assertion after a
    conversion). The shapes come from the module's tensors, or from DeepSpeed's param_shapes under ZeRO (whose
    module holds none); a parameter the model does not name (a LoRA adapter) is not compared."""
    wider, shapes = _wider_model()
    engine = FakeEngine()
    engine.state = {"module": {"lora_a": torch.zeros(3)}, "param_shapes": [shapes]} if zero else \
        {"module": {name: torch.zeros(shape) for name, shape in shapes.items()}}
    checkpoint.save(engine, tmp_path, 10, _state(step=10), keep=0)
    assert checkpoint.resume_tag(tmp_path, wider) == "global_step10"
    with pytest.raises(UserError) as raised:
        checkpoint.resume_tag(tmp_path, SMALL)
    assert str(raised.value) == (f"{tmp_path}: checkpoint global_step10 does not match config.yaml (size mismatch "
                                 "for tok_embeddings.weight: [64, 64] in the checkpoint, [64, 32] in the config): put "
                                 "config.yaml back as the run was trained; if the checkpoint is another run's, no "
                                 "earlier checkpoint is complete: train the run again into a new run directory")


def test_a_config_yaml_every_checkpoint_differs_from_is_named_as_what_changed(one_rank_group, tmp_path):
    """config.yaml's model.dim edited: the refusal advised removing the newest checkpoint to continue from the one
    before it, which held the same shape and was refused the same way."""
    _, shapes = _wider_model()
    engine = FakeEngine()
    engine.state = {"module": {name: torch.zeros(shape) for name, shape in shapes.items()}}
    for step in (10, 20):
        checkpoint.save(engine, tmp_path, step, _state(step=step), keep=0)
    with pytest.raises(UserError) as raised:
        checkpoint.resume_tag(tmp_path, SMALL)
    assert str(raised.value) == (f"{tmp_path}: checkpoint global_step20 does not match config.yaml (size mismatch "
                                 "for tok_embeddings.weight: [64, 64] in the checkpoint, [64, 32] in the config): put "
                                 "config.yaml back as the run was trained (global_step10 differs from it too, so "
                                 "config.yaml is what changed)")


@pytest.mark.parametrize("zero", [False, True])
def test_a_checkpoint_trained_tied_or_untied_against_the_other_in_config_yaml_is_one_clear_error(one_rank_group,
                                                                                                tmp_path, zero):
    """config.yaml's model.tie_embeddings edited after training: DeepSpeed's load ended in a traceback (its parameter
    layout); docs/checkpoints.md promises one line. Tied, the module's state holds the embedding's storage under a
    second name, and DeepSpeed's param_shapes leave the output layer out."""
    untied = ModelConfig(**{**SMALL.__dict__, "tie_embeddings": False})
    tied = ModelConfig(**{**SMALL.__dict__, "tie_embeddings": True})
    with torch.device("meta"):
        shapes = {name: param.shape for name, param in Transformer(tied).named_parameters()}
    module = {name: torch.zeros(shape) for name, shape in shapes.items()}
    module["output.weight"] = module["tok_embeddings.weight"]  # as the tied model's state_dict() holds it
    engine = FakeEngine()
    engine.state = {"module": {}, "param_shapes": [shapes]} if zero else {"module": module}
    checkpoint.save(engine, tmp_path, 10, _state(step=10), keep=0)
    assert checkpoint.resume_tag(tmp_path, tied) == "global_step10"
    with pytest.raises(UserError, match=re.escape(
            "checkpoint global_step10 does not match config.yaml (model.tie_embeddings is false, but the checkpoint "
            "was trained tied): put config.yaml back as the run was trained")):
        checkpoint.resume_tag(tmp_path, untied)


@pytest.mark.parametrize("zeroed", ["all", "start"])
def test_a_model_states_file_torch_cannot_map_is_left_for_the_load_to_name(one_rank_group, tmp_path, zeroed):
    """Zeros of the listed size (a power loss): the shape check's mmap load raised a RuntimeError traceback, where
    the load says in one line that the file is damaged. Zeros at its start alone passed `zipfile.is_zipfile`, which
    reads the end, and torch's mapped load raised a traceback about `_use_new_zipfile_serialization`."""
    engine = FakeEngine()
    engine.state = {"module": {"tok_embeddings.weight": torch.zeros(64, 32)}}
    checkpoint.save(engine, tmp_path, 10, _state(step=10), keep=0)
    states = rundir.checkpoint_dir(tmp_path) / "global_step10" / MODEL_FILE
    content = states.read_bytes()
    states.write_bytes(bytes(len(content)) if zeroed == "all" else bytes(200) + content[200:])
    assert checkpoint.resume_tag(tmp_path, SMALL) == "global_step10"
    with pytest.raises(UserError, match="is damaged: it is not a checkpoint file torch can read"):
        checkpoint.load(FakeEngine(), tmp_path, "global_step10")


def test_a_damaged_client_state_without_an_earlier_checkpoint_says_to_train_again(one_rank_group, tmp_path):
    _save(tmp_path, 10)
    _rewrite(rundir.checkpoint_dir(tmp_path) / "global_step10" / rundir.CLIENT_STATE, b"{}")
    with pytest.raises(UserError, match=r"client_state.json is damaged \(step is None, .*no earlier checkpoint is "
                                        "complete: train the run again into a new run directory"):
        rundir.client_state_of(tmp_path, "global_step10")


@pytest.mark.parametrize("content, problem", [
    ({"python": [1, 2]}, r"rng_rank0.pt is damaged \(not the random state of a rank: ValueError"),
    ([1, 2, 3], r"rng_rank0.pt is damaged \(not the random state of a rank: TypeError"),
    (b"garbage" * 100, r"rng_rank0.pt is damaged: it is not a checkpoint file torch can read \(Unsupported operand"),
])
def test_a_damaged_rng_file_is_one_clear_error(one_rank_group, tmp_path, content, problem):
    """Used to be `ValueError: not enough values to unpack` (and 'holds more than tensors' for garbage)."""
    _save(tmp_path, 10, 20)
    folder = rundir.checkpoint_dir(tmp_path) / "global_step20"
    if isinstance(content, bytes):
        _rewrite(folder / "rng_rank0.pt", content)
    else:
        _plant(tmp_path, "global_step20", "rng_rank0.pt", content)
    with pytest.raises(UserError, match=rf"{folder}/{problem}.*; remove {folder} to continue from global_step10"):
        checkpoint.load(FakeEngine(), tmp_path, "global_step20")


def test_manifest_sizes_that_are_not_numbers_make_a_damaged_manifest(one_rank_group, tmp_path, capsys):
    """Used to read 'client_state.json has 218 bytes, 218 were written'."""
    _save(tmp_path, 10, 20)
    manifest = rundir.manifest_file(tmp_path, "global_step20")
    listed = json.loads(manifest.read_text())
    listed["files"] = {name: str(size) for name, size in listed["files"].items()}
    manifest.write_text(json.dumps(listed))
    assert rundir.incompleteness(tmp_path, "global_step20") == (
        f"damaged {rundir.MANIFEST} (it lists {rundir.CLIENT_STATE} with size "
        f"'{listed['files'][rundir.CLIENT_STATE]}', not a number of bytes)")
    assert rundir.usable_tag(tmp_path) == "global_step10"
    assert "damaged manifest.json" in capsys.readouterr().err


@pytest.mark.parametrize("content, detail", [
    (b"garbage" * 100, "Unsupported operand 103"),  # not a pickle, not a zip
    (b"", "it ends early"),
    ("torn", "PytorchStreamReader failed reading zip archive: failed finding central directory"),
    (bytes(4096), "neither a zip archive nor a pickle"),  # zeros, as a crash after allocation leaves (a traceback)
    (bytes(range(101, 256)) * 8, None),  # bytes the unpickler fails on in its own ways (was a traceback)
])
def test_an_unreadable_model_file_is_named_as_damaged(one_rank_group, tmp_path, content, detail):
    """Used to be 'global_step20: a file holds more than tensors and plain values' with torch's advice to load with
    weights_only=False (or an EOFError traceback for an empty file)."""
    _save(tmp_path, 10, 20)
    model = rundir.checkpoint_dir(tmp_path) / "global_step20" / MODEL_FILE
    _rewrite(model, model.read_bytes()[:200] if content == "torn" else content)
    advice = f"); remove {model.parent} to continue from global_step10, the newest complete checkpoint before it"
    for read in (lambda: checkpoint.load(FakeEngine(), tmp_path, "global_step20"),
                 lambda: consolidated_weights(tmp_path)):
        with pytest.raises(UserError) as raised:
            read()
        message = str(raised.value)
        assert message.startswith(f"{model} is damaged: it is not a checkpoint file torch can read (") and \
            message.endswith(advice) and "\n" not in message and "weights_only" not in message
        assert detail is None or f"({detail}{advice}" in message
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


def test_damaged_bytes_loaded_from_memory_name_the_checkpoint(one_rank_group, tmp_path):
    """A torch.load of a buffer (no file name) inside a checkpoint being read was reported as '? is damaged'."""
    folder = rundir.checkpoint_dir(tmp_path) / "global_step20"
    folder.mkdir(parents=True)
    message = rf"^{re.escape(str(folder))} is damaged: it is not a checkpoint file torch can read \(it ends early\); "
    with pytest.raises(UserError, match=message + "no earlier checkpoint is complete"), \
            checkpoint.restricted_unpickling(folder):
        torch.load(io.BytesIO(b""))


# ---- item 3: metrics.jsonl ---------------------------------------------------------------------------------------

def test_a_torn_last_metrics_line_is_dropped_and_named(tmp_path, capsys):
    rows = [json.dumps({"step": step, "loss": 1.0 / step}) for step in (1, 2, 3)]
    (tmp_path / rundir.METRICS_FILE).write_text("\n".join(rows) + '\n{"step": 4, "lo')
    cfg = build_config("demo")
    cfg.wandb.mode = "off"
    MetricsSink(tmp_path, cfg, "run", start_step=2).log({"step": 3, "loss": 0.5})
    assert (tmp_path / rundir.METRICS_FILE).read_text().splitlines() == [*rows[:2], '{"step": 3, "loss": 0.5}']
    assert f"{tmp_path / rundir.METRICS_FILE}:4: dropped a line that is not a row of a step" in capsys.readouterr().err


def test_a_resume_reads_the_metrics_a_line_at_a_time_and_cuts_them_in_place(tmp_path, capsys):
    """Every resume read metrics.jsonl and samples.jsonl whole into a list and rewrote them: for a long run's
    million rows, 10 s and 870 MB on rank 0 (its reported peak memory among them), even with nothing to drop."""
    import tracemalloc

    path = tmp_path / rundir.METRICS_FILE
    row = {"loss": 1.0, "lr": 3e-4, "grad_norm": 0.5, "tokens_per_s": 12345.6, "note": "x" * 150}
    path.write_text("".join(json.dumps({"step": step, **row}) + "\n" for step in range(1, 20_001)))
    size, inode = path.stat().st_size, path.stat().st_ino
    cfg = build_config("demo")
    cfg.wandb.mode = "off"
    tracemalloc.start()
    MetricsSink(tmp_path, cfg, "run", start_step=19_990)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert size > 4_000_000 and peak < size / 10, (size, peak)
    lines = path.read_text().splitlines()
    assert len(lines) == 19_990 and json.loads(lines[-1])["step"] == 19_990 and path.stat().st_ino == inode
    MetricsSink(tmp_path, cfg, "run", start_step=19_990)  # nothing to drop: left as it is
    assert path.read_text().splitlines() == lines and path.stat().st_ino == inode
    with path.open("a") as f:  # a row kept after one dropped (a file edited by hand): rewritten without it
        f.write('{"step": 19995}\n{"step": 5}\n{"step": 6')
    MetricsSink(tmp_path, cfg, "run", start_step=19_990)
    assert path.read_text().splitlines() == [*lines, '{"step": 5}']
    assert capsys.readouterr().err == (f"zerollm: note: {path}:19993: dropped a line that is not a row of a step "
                                       "(torn by a killed run)\n")
    path.write_text('{"step": 1}\n{"step": 2}')  # a kill between a row and its newline
    MetricsSink(tmp_path, cfg, "run", start_step=2).log({"step": 3, "loss": 0.5})
    assert path.read_text().splitlines() == ['{"step": 1}', '{"step": 2}', '{"step": 3, "loss": 0.5}']

# ---- through `zerollm train` (one rank) -------------------------------------------------------------------------

ONE_RANK = ["train.max_steps=4", "train.save_every=2", "train.keep_checkpoints=0", "train.precision=fp32",
            "train.eval_every=0"]


@pytest.fixture(scope="module")
def one_rank_run(pretrain_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("one_rank") / "run"
    result = run_job(*train_args(pretrain_data, run, *ONE_RANK))
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_export_tag_writes_the_checkpoint_it_names(one_rank_run, tmp_path, cli_here):
    """export took the newest checkpoint only: an earlier one (the best validation loss) could not be exported."""
    from llm.export import read_weights

    result = cli_here("export", "--run", one_rank_run, "--out", tmp_path / "step2", "--tag", "global_step2")
    assert result.returncode == 0, result.stderr
    assert " of global_step2 to " in result.stdout
    exported = read_weights(tmp_path / "step2")["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(exported, consolidated_weights(one_rank_run, "global_step2")["layers.0.attention.wq.weight"])
    assert not torch.equal(exported, consolidated_weights(one_rank_run, "global_step4")["layers.0.attention.wq.weight"])
    missing = cli_here("export", "--run", one_rank_run, "--out", tmp_path / "none", "--tag", "global_step3")
    assert (missing.returncode, missing.stderr) == (2, f"zerollm: error: --tag global_step3: {one_rank_run} holds no "
                                                       "such checkpoint (it holds global_step2, global_step4)\n")
    assert not (tmp_path / "none").exists()
    nowhere = run_cli("export", "--run", tmp_path / "nope", "--out", tmp_path / "none", "--tag", "global_step2")
    assert (nowhere.returncode, nowhere.stderr) == (2, f"zerollm: error: {tmp_path / 'nope'}: no such directory\n")
    # (the command itself, in a fresh interpreter: nothing else on its error output)


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / rundir.METRICS_FILE).read_text().splitlines()]


def test_resume_passes_over_a_torn_checkpoint_and_continues_exactly(one_rank_run, pretrain_data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(one_rank_run, run)
    torn = rundir.checkpoint_dir(run) / "global_step4" / MODEL_FILE
    torn.write_bytes(torn.read_bytes()[:1000])
    lines = (run / rundir.METRICS_FILE).read_text().splitlines()
    (run / rundir.METRICS_FILE).write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])  # killed mid-row
    result = run_job(*train_args(pretrain_data, run, *ONE_RANK, extra=["--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "global_step4: mp_rank_00_model_states.pt has 1000 bytes" in result.stderr
    assert "resumed at step 2" in result.stdout
    assert _losses(run) == _losses(one_rank_run)
    assert rundir.incompleteness(run, "global_step4") is None


def test_a_resume_with_another_learning_rate_and_weight_decay_trains_at_them(one_rank_run, pretrain_data, tmp_path):
    """The schedule's saved state brought the old train.lr back: the run trained on at it while config.yaml
    recorded the new one (and a diverged run, resumed at a lower rate as advised, diverged again). The optimizer's
    saved state likewise brought back the old weight decay (and betas, eps)."""
    run = tmp_path / "run"
    shutil.copytree(one_rank_run, run)
    torn = rundir.checkpoint_dir(run) / "global_step4" / MODEL_FILE
    torn.write_bytes(torn.read_bytes()[:1000])  # resumed at step 2
    result = run_job(*train_args(pretrain_data, run, *ONE_RANK, "train.lr=3e-5", "train.weight_decay=0.5",
                                 extra=["--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = build_config((run / "config.yaml").as_posix())
    rates = [json.loads(line)["lr"] for line in (run / rundir.METRICS_FILE).read_text().splitlines()]
    assert cfg.train.lr == 3e-5 and rates[2:] == pytest.approx([3e-5 * lr_multiplier(s, cfg.train) for s in (2, 3)])
    optimizer = next((rundir.checkpoint_dir(run) / "global_step4").glob("*optim_states.pt"))
    groups = torch.load(optimizer, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    assert [group["weight_decay"] for group in groups] == [0.5, 0.0]


def test_a_conversion_that_fails_ends_every_rank_in_one_line(one_rank_run, pretrain_data, tmp_path):
    """Rank 0 converts a checkpoint resumed on another number of ranks while the others wait: its failure was its
    error with 2,000 characters of the converter's traceback, then rank 1's traceback from the barrier."""
    run = tmp_path / "run"
    shutil.copytree(one_rank_run, run)
    damaged = next((rundir.checkpoint_dir(run) / "global_step4").glob("*optim_states.pt"))
    damaged.write_bytes(bytes(damaged.stat().st_size))  # complete by its manifest
    result = run_job(*train_args(pretrain_data, run, *ONE_RANK, "train.max_steps=6", nproc=2,
                                 extra=["--resume", "auto"]))
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error:")]
    assert "Traceback" not in result.stderr and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"zerollm: error: {damaged.parent}: conversion to a universal checkpoint failed (")
    assert errors[0].endswith("); resume it on the number of ranks that saved it, or remove it to resume from the "
                              "checkpoint before it")


@pytest.mark.parametrize("said, free", [
    ("RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598", 0),  # torch.save's
    ("OSError: [Errno 28] No space left on device", 10**12),
])
def test_a_conversion_that_ran_out_of_room_says_so_and_keeps_the_checkpoint(one_rank_group, tmp_path, monkeypatch,
                                                                           said, free):
    """It was blamed on the checkpoint ("conversion to a universal checkpoint failed (...unexpected pos...); ...
    remove it"): following the advice deleted an intact checkpoint."""
    _save(tmp_path, 10)
    monkeypatch.setattr(checkpoint.subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(
        command, 1, "", f"Traceback (most recent call last):\n{said}\n"))
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, free))
    universal = rundir.universal_dir(tmp_path)
    with pytest.raises(UserError) as refused:
        checkpoint.convert_to_universal(tmp_path, "global_step10")
    assert str(refused.value) == (f"{universal}: no space left on device while converting "
                                  f"{rundir.checkpoint_dir(tmp_path) / 'global_step10'} to a universal checkpoint (to "
                                  "resume it on another number of ranks); the checkpoint is intact: free space and "
                                  "rerun")
    assert rundir.incompleteness(tmp_path, "global_step10") is None and list(universal.iterdir()) == []


def test_a_resume_with_more_steps_follows_the_longer_schedule_from_its_first_step(one_rank_run, pretrain_data,
                                                                                    tmp_path):
    """docs/checkpoints.md: train.max_steps may change on a resume and takes effect from there. The first resumed
    step trained at the rate the old schedule had computed for it (its floor, min_lr_ratio * lr, here)."""
    run = tmp_path / "run"
    shutil.copytree(one_rank_run, run)  # complete at step 4
    result = run_job(*train_args(pretrain_data, run, *ONE_RANK, "train.max_steps=6", extra=["--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = build_config((run / "config.yaml").as_posix())
    rates = [json.loads(line)["lr"] for line in (run / rundir.METRICS_FILE).read_text().splitlines()]
    assert cfg.train.max_steps == 6 and len(rates) == 6
    assert rates[4:] == pytest.approx([cfg.train.lr * lr_multiplier(s, cfg.train) for s in (4, 5)])


@pytest.mark.parametrize("earlier_version", [False, True])
def test_tokens_seen_count_each_part_of_a_resumed_run_at_its_own_batch(one_rank_run, pretrain_data, tmp_path,
                                                                       earlier_version):
    """`zerollm plot` drew tokens as step x the global batch recorded last: a run resumed at another batch (other
    ranks, micro-batch or accumulation) was drawn as if every step had trained at the new one. A checkpoint of an
    earlier version, which keeps no count, counts its steps at the batch its run directory records."""
    from llm.plot import read_run

    run = tmp_path / "run"
    shutil.copytree(one_rank_run, run)  # complete at step 4, 4 windows of 32 positions a step
    if earlier_version:  # its count and its rows' gone (a key of the same length: the manifest records the size)
        state = rundir.checkpoint_dir(run) / "global_step4" / rundir.CLIENT_STATE
        state.write_text(state.read_text().replace('"tokens_seen"', '"old_version"'))
        rows = [{k: v for k, v in json.loads(line).items() if k != "tokens"}
                for line in (run / rundir.METRICS_FILE).read_text().splitlines()]
        (run / rundir.METRICS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run_job(*train_args(pretrain_data, run, *ONE_RANK, "train.max_steps=6", "train.micro_batch_size=8",
                                 extra=["--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-3000:]
    expected = [128, 256, 384, 512, 512 + 256, 512 + 512]
    assert [json.loads(line).get("tokens") for line in (run / rundir.METRICS_FILE).read_text().splitlines()] == \
        [None] * 4 * earlier_version + expected[4 * earlier_version:]
    drawn = read_run(run).points("loss", "tokens")[0]  # an earlier version's rows: at the batch recorded now
    assert drawn == (expected if not earlier_version else [256, 512, 768, 1024, *expected[4:]])
    assert json.loads((rundir.checkpoint_dir(run) / "global_step6" / rundir.CLIENT_STATE).read_text())[
        "tokens_seen"] == 1024


def test_resuming_on_other_data_is_one_clear_error(one_rank_run, tokenizer_dir, tmp_path):
    data = tmp_path / "other_data"
    result = run_cli("data", "prepare", "--input", FIXTURES / "pretrain" / "en_notes.jsonl", "--tokenizer",
                     tokenizer_dir, "--out", data, "--val-fraction", 0.05, "--workers", 1)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    shutil.copytree(one_rank_run, run)
    args = train_args(data, run, *ONE_RANK, "train.max_steps=6", extra=["--resume", "auto"])
    result = run_job(*args)  # the run record names the data it trained on: refused before anything starts
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error:")]
    assert result.returncode == 2 and len(errors) == 1 and "not the data" in errors[0], result.stderr[-3000:]
    (run / rundir.RUN_RECORD_FILE).unlink()  # a run without a record: the sampler's state does not fit the data
    result = run_job(*args)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error:")]
    assert len(errors) == 1 and "global_step4 does not fit the data" in errors[0] and "--init-from" in errors[0]
    assert "Traceback" not in result.stderr
