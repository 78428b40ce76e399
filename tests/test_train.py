"""Training under DeepSpeed on the CPU: ZeRO stages on 2 ranks, exact resume, preemption, metrics, wandb."""

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import h5py
import numpy as np
import psutil
import pytest
import torch
from forked_ranks import kill_when, run_job
from wandb_files import wandb_records

from conftest import FIXTURES, METRIC_KEYS, ZERO_RUN, run_cli, zerollm_here
from conftest import train_args as _args
from llm import rundir
from llm.command_line import is_zerollm_command
from llm.config import build_config
from llm.loading import consolidated_weights
from llm.runtime.rank_env import free_port
from llm.train.engine import cpu_has_native_bf16
from llm.train.steps import DataSteps


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_rank_training_under_each_zero_stage(zero_runs, stage):
    run = zero_runs[stage]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(set(r) >= METRIC_KEYS for r in rows)
    assert all(math.isfinite(r["loss"]) and r["tokens_per_sec"] > 0 for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert rows[-1]["loss"] < rows[0]["loss"]
    ds = json.loads((run / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == stage and ds["train_batch_size"] == 8
    assert (run / "config.yaml").is_file()
    assert (run / "checkpoints" / "latest").read_text() == "global_step4"
    rng_files = sorted(p.name for p in (run / "checkpoints" / "global_step4").glob("rng_rank*.pt"))
    assert rng_files == ["rng_rank0.pt", "rng_rank1.pt"]


def test_forked_ranks_past_their_deadline_raise_timeout_expired(pretrain_data, tmp_path):
    """As `run_cli` raises it (the ranks killed at the deadline had no pid for the wait to name them by)."""
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        run_job(*_args(pretrain_data, tmp_path / "run", "train.max_steps=100000", nproc=2), timeout=2)
    assert expired.value.timeout == 2 and expired.value.cmd[:3] == ["zerollm", "train", "pretrain"]


def test_forked_ranks_train_exactly_as_the_command_does(zero_runs, pretrain_data, tmp_path):
    """Most tests' jobs fork their ranks (tests/forked_ranks.py); the same job as `zerollm train --nproc 2` starts it
    (a fresh interpreter per rank) logs the same numbers and saves the same weights, bit for bit."""
    result = run_cli(*_args(pretrain_data, tmp_path, *ZERO_RUN, nproc=2, extra=["--zero-stage", 2]))
    assert result.returncode == 0, result.stderr[-3000:]
    keys = ("step", "loss", "lr", "grad_norm", "val_loss")
    assert [[r.get(k) for k in keys] for r in _metrics(tmp_path)] == [[r.get(k) for k in keys]
                                                                      for r in _metrics(zero_runs[2])]
    forked, started = consolidated_weights(zero_runs[2]), consolidated_weights(tmp_path)
    assert forked.keys() == started.keys() and all(torch.equal(forked[k], started[k]) for k in forked)


def test_zero_stages_agree_numerically(zero_runs):
    """Same seed, data and global batch: ZeRO partitioning must not change the math (fp32)."""
    losses = {stage: [r["loss"] for r in _metrics(run)] for stage, run in zero_runs.items()}
    for stage in (1, 2, 3):
        assert losses[stage] == pytest.approx(losses[0], rel=1e-4), stage
    # ZeRO-0 in fp32 logged no gradient norm (null at every step): DeepSpeed keeps none there
    norms = {stage: [r["grad_norm"] for r in _metrics(run)] for stage, run in zero_runs.items()}
    assert all(isinstance(norm, float) and norm > 0 for norm in norms[0]), norms[0]
    for stage in (1, 2, 3):
        assert norms[stage] == pytest.approx(norms[0], rel=1e-3), stage
    weights = {stage: consolidated_weights(run) for stage, run in zero_runs.items()}
    for stage in (1, 2, 3):
        for name, tensor in weights[0].items():
            assert torch.allclose(weights[stage][name], tensor, atol=1e-5), (stage, name)


ACCUMULATED = ["train.max_steps=4", "train.eval_every=2", "train.precision=fp32", "train.micro_batch_size=2",
               "train.grad_accum=2", "train.eval_batches=4", "train.save_every=2", "train.keep_checkpoints=0"]


@pytest.fixture(scope="module")
def accumulated_runs(pretrain_data, tmp_path_factory):
    """`accumulated_runs(stage)`: the job of `zero_runs[stage]` (2 ranks, 4 steps, global batch 8, evaluated at
    steps 2 and 4) as 2 ranks x micro 2 x accum 2 with twice the eval batches (the same validation windows),
    saving at steps 2 and 4 and logging to offline wandb; trained when a test first asks for it. Tests only read it
    (test_two_ranks_to_one_resume_converts_to_universal_and_continues resumes a copy)."""
    runs = {}

    def run(stage: int):
        if stage not in runs:
            out = tmp_path_factory.mktemp(f"accumulated{stage}")
            result = run_job(*_args(pretrain_data, out, *ACCUMULATED, nproc=2,
                                    extra=["--zero-stage", stage, "--wandb", "offline"]))
            assert result.returncode == 0, result.stderr[-3000:]
            runs[stage] = out
        return runs[stage]

    return run


def test_gradient_accumulation_matches_a_larger_micro_batch(zero_runs, accumulated_runs):
    """2 ranks x micro 2 x accum 2 sees the same 8 windows per step as 2 ranks x micro 4
    (and, with twice the eval batches, the same validation windows)."""
    accumulated, reference = _metrics(accumulated_runs(2)), _metrics(zero_runs[2])
    assert [r["loss"] for r in accumulated] == pytest.approx([r["loss"] for r in reference], rel=1e-4)
    # ZeRO-0 in fp32, whose norm zerollm takes itself: of the gradients accumulated over the step's micro-steps
    assert [r["grad_norm"] for r in _metrics(accumulated_runs(0))] == pytest.approx(
        [r["grad_norm"] for r in _metrics(zero_runs[0])], rel=1e-4)
    assert [r["val_loss"] for r in accumulated if "val_loss" in r] == pytest.approx(
        [r["val_loss"] for r in reference if "val_loss" in r], rel=1e-4)


def test_bf16_on_two_ranks(pretrain_data, tmp_path):
    result = run_job(*_args(pretrain_data, tmp_path, "train.max_steps=3", "train.eval_every=0",
                            "train.precision=bf16", nproc=2, extra=["--zero-stage", 2]))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path)
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)
    assert json.loads((tmp_path / "ds_config.json").read_text())["bf16"]["enabled"] is True
    assert ("this CPU only emulates bf16" in result.stdout) == (not cpu_has_native_bf16())  # said once if so
    assert result.stdout.count("emulates bf16") <= 1
    assert "warmup" not in result.stdout  # warmup_steps 2, max_steps 3


def test_a_run_that_ends_inside_its_warmup_says_so(pretrain_data, tmp_path):
    """`--set train.max_steps=50` on a recipe of warmup_steps 100 trained at a rising learning rate that never reached
    train.lr nor decayed, without a word."""
    result = run_job(*_args(pretrain_data, tmp_path / "run", "train.max_steps=1", "train.warmup_steps=4",
                            "train.eval_every=0", "train.max_time=1h"))  # a time budget only shortens a run
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("pretrain: note: train.warmup_steps=4 is above train.max_steps=1: the learning rate rises for the whole "
            "run, to 25% of train.lr at its last step, and never decays; lower train.warmup_steps\n") in result.stdout
    assert [row["lr"] for row in _metrics(tmp_path / "run")] == pytest.approx([0.25 * 3e-3])  # TINY's train.lr


def _start(args, log):
    return subprocess.Popen([sys.executable, "-m", "llm", *map(str, args)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_for(predicate, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"process ended with {proc.returncode} before the condition held")
        time.sleep(0.005)
    raise AssertionError("timed out")


SLOW_STEPS = ["data.seq_len=128", "train.micro_batch_size=16", "train.precision=fp32", "train.eval_every=0",
              "train.save_every=3", "train.max_steps=8"]


def test_sigkill_then_resume_is_bit_exact(pretrain_data, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    result = run_job(*_args(pretrain_data, straight, *SLOW_STEPS, nproc=2))
    assert result.returncode == 0, result.stderr[-3000:]

    latest = killed / "checkpoints" / "latest"
    # step 3's checkpoint, or step 6's where the poll missed the moment on a loaded machine
    saved = ("global_step3", "global_step6")
    kill_when(lambda: latest.is_file() and latest.read_text() in saved, *_args(pretrain_data, killed, *SLOW_STEPS,
                                                                               nproc=2))
    assert latest.read_text() in saved
    result = run_job(*_args(pretrain_data, killed, *SLOW_STEPS, nproc=2, extra=["--resume", "auto"]), name="resumed")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed at step 6" in result.stdout or "resumed at step 3" in result.stdout

    a, b = _metrics(straight), _metrics(killed)
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit for bit
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    wa, wb = consolidated_weights(straight), consolidated_weights(killed)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sigterm_saves_exits_75_and_resume_continues(pretrain_data, tmp_path):
    """The SIGTERM goes to the job's whole process group, as SLURM's scancel sends it: it reached the data-loader
    workers too, which died, and the rank's next draw crashed before the stop's checkpoint."""
    args = _args(pretrain_data, tmp_path, *SLOW_STEPS[:-2], "train.save_every=0", "train.max_steps=400",
                 "data.loader_workers=2")
    with open(tmp_path / "run.log", "w") as log:
        proc = _start(args, log)
        _wait_for(lambda: (tmp_path / "metrics.jsonl").is_file() and len(_metrics(tmp_path)) >= 2, proc)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 75, (tmp_path / "run.log").read_text()[-3000:]
    step = int((tmp_path / "checkpoints" / "latest").read_text().removeprefix("global_step"))
    assert step >= 2 and (tmp_path / "run.log").read_text().count("rerun with --resume auto") == 1
    result = run_job(*_args(pretrain_data, tmp_path, *SLOW_STEPS[:-2], "train.save_every=0",
                            f"train.max_steps={step + 2}", extra=["--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed at step {step}" in result.stdout
    assert [r["step"] for r in _metrics(tmp_path)] == list(range(1, step + 3))


def test_sigterm_to_a_two_rank_job_reaches_every_rank_and_leaves_nothing_running(pretrain_data, tmp_path):
    """`--nproc 2` starts its two ranks itself (no launcher processes between), forwards SIGTERM to them (they save
    and the job exits 75) and leaves no process behind."""
    args = _args(pretrain_data, tmp_path, *SLOW_STEPS[:-2], "train.save_every=0", "train.max_steps=400", nproc=2)
    with open(tmp_path / "run.log", "w") as log:
        proc = _start(args, log)
        try:
            _wait_for(lambda: (tmp_path / "metrics.jsonl").is_file() and len(_metrics(tmp_path)) >= 2, proc)
            children = psutil.Process(proc.pid).children(recursive=True)
            assert len(children) == 2 and all(is_zerollm_command(child.cmdline()) for child in children), \
                [child.cmdline() for child in children]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 75, (tmp_path / "run.log").read_text()[-3000:]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert psutil.wait_procs(children, timeout=10)[1] == []
    step = int((tmp_path / "checkpoints" / "latest").read_text().removeprefix("global_step"))
    saved = tmp_path / "checkpoints" / f"global_step{step}"
    assert step >= 2 and all(list(saved.glob(f"*zero_pp_rank_{rank}_*")) for rank in (0, 1))  # both ranks saved


def test_rerun_into_a_used_run_dir_without_resume_is_refused(zero_runs, pretrain_data):
    result = run_cli(*_args(pretrain_data, zero_runs[2], "train.max_steps=4"))
    assert result.returncode == 2 and "--resume auto" in result.stderr and "Traceback" not in result.stderr


def test_a_resumed_run_that_diverges_names_the_checkpoint_it_resumed_from(zero_runs, pretrain_data, tmp_path):
    """Resumed without `checkpoints/latest` (lost; the newest complete checkpoint is taken), a run that diverged said
    "no checkpoint was saved before"."""
    run = tmp_path / "run"
    shutil.copytree(zero_runs[2], run)
    (run / "checkpoints" / "latest").unlink()
    result = run_job(*_args(pretrain_data, run, *ZERO_RUN[1:], "train.max_steps=8", "train.lr=1e30", nproc=2,
                            extra=["--zero-stage", 2, "--resume", "auto"]))
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].endswith("stopped without saving; the newest checkpoint, global_step4, is from before: rerun "
                              "with --resume auto with a lower train.lr (--set train.lr=...), or change what made "
                              "the run diverge"), errors


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_to_one_resume_converts_to_universal_and_continues(zero_runs, accumulated_runs, pretrain_data,
                                                                     tmp_path, stage):
    """A 2-rank ZeRO run (micro 2 x accum 2) stopped after step 2 resumes on 1 rank (micro 4 x accum 2 keeps the
    global batch): DeepSpeed's universal checkpoint is made automatically, and steps 3-4 see the same samples with
    the same optimizer state as the uninterrupted 2-rank run, in the same wandb run.

    Under ZeRO-3, DeepSpeed's universal load gave both param groups one shared Adam step (advanced twice a step) and
    the first group's weight decay (the norms decayed): step 4's loss was off by ~9e-5 and the resumed run saved
    Adam steps of 6 at step 4, and weight decay 0.01 for every group."""
    common = ["train.max_steps=4", "train.eval_every=2", "train.precision=fp32"]
    run = tmp_path / "run"
    shutil.copytree(accumulated_runs(stage), run, symlinks=True)
    straight_state = json.loads((run / "checkpoints" / "global_step4" / "client_state.json").read_text())
    # the job "died" after step 2: only that checkpoint and those metrics remain
    (run / "checkpoints" / "latest").write_text("global_step2")
    shutil.rmtree(run / "checkpoints" / "global_step4")
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in
                                               (run / "metrics.jsonl").read_text().splitlines()[:2]))

    result = run_job(*_args(pretrain_data, run, *common, "train.grad_accum=2", nproc=1,
                            extra=["--zero-stage", stage, "--wandb", "offline", "--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "saved by 2 rank(s), this job has 1: converting it to a universal checkpoint" in result.stdout
    assert "resumed at step 2" in result.stdout and "a step takes" not in result.stdout  # the global batch is kept
    rows, reference = _metrics(run), _metrics(zero_runs[stage])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # one rank sums what two ranks reduced, in another order: losses agree to ~1e-5, gradient norms (a square root
    # of sums of squares, after ZeRO-3's repartitioned flattening) to ~2e-4 on the committed corpus
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=1e-4)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-3)
    # the same 2 steps from the same state as the uninterrupted run of the copied checkpoint: equal to rounding
    straight = _metrics(accumulated_runs(stage))
    assert [r["loss"] for r in rows[2:]] == pytest.approx([r["loss"] for r in straight[2:]], rel=0, abs=2e-6)
    resumed_adam = _adam_state(run / "checkpoints" / "global_step4", stage)
    assert resumed_adam == _adam_state(accumulated_runs(stage) / "checkpoints" / "global_step4", stage)
    assert resumed_adam[0] == [4, 4] and [group["weight_decay"] for group in resumed_adam[1]] == [0.01, 0.0]
    resumed_state = json.loads((run / "checkpoints" / "global_step4" / "client_state.json").read_text())
    assert resumed_state["sampler"] == straight_state["sampler"] and resumed_state["world_size"] == 1
    assert not (run / "checkpoints" / "universal").exists()
    run_ids = {p.name.rsplit("-", 1)[1] for p in (run / "wandb").glob("offline-run-*")}
    assert len(run_ids) == 1 and resumed_state["run_id"] in run_ids


def test_a_finished_run_resumed_on_another_number_of_ranks_trains_nothing_before_converting(zero_runs, pretrain_data,
                                                                                              tmp_path):
    """It made a universal copy of its checkpoint (minutes, and the checkpoint's size on disk) before it found that
    no step was left to train."""
    run = tmp_path / "run"
    shutil.copytree(zero_runs[2], run, symlinks=True)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    result = run_job(*_args(pretrain_data, run, *ZERO_RUN, nproc=1, extra=["--zero-stage", 2, "--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "converting it to a universal checkpoint" not in result.stdout
    assert (f"zerollm: note: {run}: nothing to train: its checkpoint global_step4 is at step 4 and train.max_steps is "
            "4; set a higher train.max_steps to train further") in result.stderr
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


def _adam_state(folder, stage):
    """Rank 0's Adam steps (one per param group, or ZeRO-3 sub-group) and its param groups' settings but the learning
    rate, in checkpoint `folder` of a ZeRO `stage` run."""
    from llm.train.checkpoint import restricted_unpickling

    with restricted_unpickling(folder):
        saved = torch.load(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=True)
    saved = saved["optimizer_state_dict"]
    adam = saved["optimizer_state_dict" if stage == 3 else "base_optimizer_state"]
    return ([int(state["step"]) for _, state in sorted(adam["state"].items())],
            [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in adam["param_groups"]])


def test_metrics_jsonl_and_offline_wandb_hold_the_same_numbers(accumulated_runs):
    run = accumulated_runs(2)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "val_loss" in rows[-1]
    history = _wandb_history(run)
    assert [h["_step"] for h in history] == [1, 2, 3, 4]
    for row, logged in zip(rows, history):
        for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "val_loss"):
            if key in row:
                assert logged[key] == pytest.approx(row[key], rel=1e-12), key


def _wandb_history(run_dir):
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in wandb_records(files[0]) if record.WhichOneof("record_type") == "history"]


def test_data_from_another_tokenizer_is_refused(zero_runs, tmp_path):
    tok, data = tmp_path / "tok", tmp_path / "data"
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"another corpus, document {i}" for i in range(400)))
    assert run_cli("tokenizer", "train", "--input", corpus, "--vocab-size", 300, "--out", tok).returncode == 0
    assert run_cli("data", "prepare", "--input", corpus, "--tokenizer", tok, "--out", data).returncode == 0
    result = run_cli(*_args(data, zero_runs[2], "train.max_steps=6", extra=["--resume", "auto"]))
    assert result.returncode == 2 and "another tokenizer" in result.stderr


@pytest.mark.parametrize("change, extra, differing", [
    ("model.dim=128", [], "model.dim 64 there, 128 here"),  # was a list of DeepSpeed's size mismatches, exit 1
    ("train.max_steps=6", ["--zero-stage", 0], "ZeRO stage 2 there, 0 here"),  # was an AttributeError
    ("train.max_steps=6", ["--zero-stage", 3], "ZeRO stage 2 there, 3 here"),  # was an AssertionError
])
def test_a_resume_with_another_shape_or_zero_stage_is_refused(zero_runs, pretrain_data, tmp_path, change, extra,
                                                               differing):
    run = tmp_path / "run"
    shutil.copytree(zero_runs[2], run, symlinks=True)
    before = sorted(p.name for p in run.rglob("*"))
    result = run_job(*_args(pretrain_data, run, "train.max_steps=6", "train.precision=fp32", change,
                            extra=["--resume", "auto", *extra]))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"zerollm: error: {run}: its checkpoints cannot resume with these changes ({differing}" in result.stderr
    assert f"); resume with the values there, or start a new run with --init-from {run}\n" in result.stderr
    assert "Traceback" not in result.stderr and sorted(p.name for p in run.rglob("*")) == before


@pytest.mark.parametrize("given", ["--init-from", "--set", "recipe"])
def test_a_missing_init_from_is_named_as_the_user_gave_it(tmp_path, pretrain_data, monkeypatch, capsys, given):
    """Given by --set or the recipe, it was named --init-from, an option the user never typed."""
    missing = tmp_path / "nowhere"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"train:\n  init_from: {missing}\n")
    command = {"--init-from": ["--recipe", "demo", "--init-from", missing],
               "--set": ["--recipe", "demo", "--set", f"train.init_from={missing}"], "recipe": ["--recipe", recipe]}
    assert zerollm_here(monkeypatch, "train", "pretrain", "--data", pretrain_data, "--out", tmp_path / "run",
                        *command[given]) == 2
    name = "--init-from" if given == "--init-from" else "train.init_from"
    assert capsys.readouterr().err == f"zerollm: error: {name} {missing}: no such directory\n"


def test_missing_data_and_wrong_kind_are_clear_errors(tmp_path, pretrain_data):
    result = run_job(*_args(tmp_path / "nowhere", tmp_path / "run", "train.max_steps=1"))
    assert result.returncode == 2 and f"{tmp_path / 'nowhere'}: no such directory" in result.stderr
    result = run_job(*_args(pretrain_data, tmp_path / "run", "model.vocab_size=100", "train.max_steps=1"))
    assert result.returncode == 2 and "model.vocab_size" in result.stderr


def test_data_smaller_than_one_global_batch_is_one_line_naming_what_makes_the_batch(pretrain_data, tmp_path):
    """It advised lowering data.seq_len to a DPO run (which cannot add pairs) and never named train.grad_accum or the
    ranks, the rest of the global batch."""
    with h5py.File(pretrain_data / "tokens.h5") as h5:
        windows = (h5["train/tokens"].shape[0] - 1) // 32
    result = run_job(*_args(pretrain_data, tmp_path / "run", f"train.micro_batch_size={windows // 2 + 1}",
                            "train.grad_accum=2", "train.max_steps=1"))
    assert (result.returncode, result.stderr.splitlines()[-1]) == (2, (
        f"zerollm: error: {pretrain_data}: the train split has {windows} windows of data.seq_len positions, fewer "
        f"than one global batch ({windows + 2 - windows % 2}: train.micro_batch_size {windows // 2 + 1} x "
        "train.grad_accum 2 x 1 rank); add data, or lower train.micro_batch_size, train.grad_accum, the ranks or "
        "data.seq_len (shorter windows, more of them)"))
    cfg = build_config("demo", ["train.stage=dpo", "train.micro_batch_size=4"], {"data.path": "pairs",
                                                                             "train.init_from": "base"})
    assert DataSteps(cfg, torch.device("cpu")).too_few(5, 8) == (
        "pairs: the train split has 5 preference pairs, fewer than one global batch (8: train.micro_batch_size 4 x "
        "train.grad_accum 1 x 2 ranks); add data, or lower train.micro_batch_size, train.grad_accum or the ranks")


def test_a_resume_that_changes_settings_says_which(pretrain_data, tmp_path):
    """A --set of the first command that the resume did not give again took the recipe's value without a word: a
    learning rate of 1e-3 went back to the recipe's 3e-3. So did its --deepspeed JSON, the stage's shipped one taking
    its place (an optimizer offload, a bucket size gone), and ds_config.json recorded the swap."""
    run, ds_json = tmp_path / "run", tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000000}}))
    result = run_job(*_args(pretrain_data, run, "train.max_steps=1", "train.lr=1e-3", extra=["--deepspeed", ds_json]))
    assert result.returncode == 0, result.stderr[-2000:]
    result = run_job(*_args(pretrain_data, run, "train.max_steps=2", extra=["--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("pretrain: note: resumed with settings other than its config.yaml's: train.max_steps 1 there, 2 here; "
            "train.lr 0.001 there, 0.003 here (a --set of the command that began the run, not given again, takes the "
            "recipe's value)") in result.stdout.splitlines()
    assert ("pretrain: note: resumed with DeepSpeed settings other than its ds_config.json's: "
            "zero_optimization.reduce_bucket_size 1000000 there, 50000000 here; steps_per_print absent there, "
            "1000000000 here; wall_clock_breakdown absent there, false here; zero_optimization.allgather_bucket_size "
            "absent there, 50000000 here; and 2 more (a --deepspeed of the command that began the run, not given "
            "again, takes the stage's shipped config)") in result.stdout.splitlines()
    result = run_job(*_args(pretrain_data, run, "train.max_steps=2", extra=["--resume", "auto"]))
    assert result.returncode == 0 and "note: resumed with" not in result.stdout + result.stderr  # nothing to train


def test_a_resumes_deepspeed_settings_are_compared_as_values():
    """A ds_config.json that recorded the stage as 2.0 was noted as changed from 2."""
    from llm.train.job import resumed_ds_changes

    recorded = {"zero_optimization": {"stage": 2.0, "offload_optimizer": {"device": "cpu"}}, "train_batch_size": 4}
    assert resumed_ds_changes(recorded, {"zero_optimization": {"stage": 2}, "train_batch_size": 8}) == [
        'zero_optimization.offload_optimizer.device "cpu" there, absent here']


def test_a_resume_without_init_from_keeps_the_model_the_run_was_trained_from(pretrain_data, tmp_path, monkeypatch,
                                                                             capfd):
    """A resume that loads no base (its checkpoints hold every weight) recorded train.init_from null in config.yaml,
    and the next export replaced the model the run was trained from, which export refuses to. Keeping it, the resume
    read that model's generation_config.json again: edited since, the run's copy was replaced, or the resume
    refused."""
    base, exported, run = tmp_path / "base", tmp_path / "exported", tmp_path / "run"
    assert run_job(*_args(pretrain_data, base, "train.max_steps=1")).returncode == 0
    assert zerollm_here(monkeypatch, "export", "--run", base, "--out", exported) == 0
    (exported / "generation_config.json").write_text('{"temperature": 0.7}')
    result = run_job(*_args(pretrain_data, run, "train.max_steps=1", extra=["--init-from", exported]))
    assert result.returncode == 0, result.stderr[-2000:]
    (exported / "generation_config.json").write_text('{"temperature": "hot"}')  # the resume loads no base: its
    result = run_job(*_args(pretrain_data, run, "train.max_steps=2", extra=["--resume", "auto"]))  # copy stays
    assert result.returncode == 0 and "train.init_from" not in result.stdout, result.stdout + result.stderr[-2000:]
    assert (run / "generation_config.json").read_text() == '{"temperature": 0.7}'
    capfd.readouterr()
    assert zerollm_here(monkeypatch, "export", "--run", run, "--out", exported) == 2
    assert capfd.readouterr().err.endswith(f"zerollm: error: --out {exported} is the run's train.init_from, a model it "
                                           "was trained from, which export would replace; choose another --out\n")


def test_a_resume_names_no_change_for_the_same_lora_targets_in_another_order_or_the_default_alpha(tmp_path):
    """The targets are adapters found by module, in any order (as the resume's shape check compares them)."""
    from llm.loading import trained_config
    from llm.train.job import resumed_changes

    paths = {"train.init_from": str(tmp_path / "base")}  # as config.yaml records it: absolute
    saved = build_config("demo", ["train.stage=sft", "model.vocab_size=512", "lora.r=4", "lora.targets=[wq, wv]"],
                         paths=paths)
    saved.save(tmp_path / "config.yaml")
    again = build_config("demo", ["train.stage=sft", "model.vocab_size=512", "lora.r=4", "lora.targets=[wv, wq]"],
                         paths=paths)
    assert resumed_changes(trained_config(tmp_path), again) == []
    again.lora.targets = ["wq", "wk"]
    assert resumed_changes(trained_config(tmp_path), again) == ["lora.targets ['wq', 'wv'] there, ['wk', 'wq'] here"]
    saved.data.path = "data"
    saved.save(tmp_path / "config.yaml")
    again.lora.targets, again.data.path = ["wq", "wv"], str(tmp_path / "elsewhere" / "data")
    assert resumed_changes(trained_config(tmp_path), again) == []  # the data is compared by its digest (a relative
    # --data from another working directory was noted as another setting)
    again.lora.alpha = 8.0  # alpha left out is 2 * r: the same scale
    assert resumed_changes(trained_config(tmp_path), again) == []
    again.lora.alpha = 16.0
    assert resumed_changes(trained_config(tmp_path), again) == ["lora.alpha 8.0 there, 16.0 here"]


def test_a_resume_on_another_number_of_ranks_that_changes_the_global_batch_says_so():
    """2 ranks to 1 at the same micro-batch and accumulation halved the samples a step without a word."""
    from llm.train.job import resumed_batch_note

    saved = build_config("demo", ["train.micro_batch_size=4", "train.grad_accum=2"])
    assert resumed_batch_note(saved, 2, saved, 1) == (
        "note: resumed on 1 rank where its checkpoint was saved by 2: a step takes 8 samples here, 16 there "
        "(train.micro_batch_size x train.grad_accum x ranks); train.grad_accum=4 keeps it")
    assert resumed_batch_note(saved, 2, saved, 3).endswith("a step takes 24 samples here, 16 there "
                                                           "(train.micro_batch_size x train.grad_accum x ranks)")
    kept = build_config("demo", ["train.micro_batch_size=4", "train.grad_accum=4"])
    assert resumed_batch_note(saved, 2, kept, 1) is None and resumed_batch_note(saved, 2, saved, 2) is None


def test_a_resume_on_other_ranks_refuses_a_batch_larger_than_the_data_before_converting(zero_runs, pretrain_data,
                                                                                        tmp_path):
    """The conversion to a universal checkpoint (minutes, and a copy of the checkpoint's size, left behind) came
    first, the refusal only after it."""
    run = tmp_path / "run"
    shutil.copytree(zero_runs[2], run, symlinks=True)
    result = run_job(*_args(pretrain_data, run, *ZERO_RUN, "train.max_steps=6", "train.grad_accum=100000", nproc=1,
                            extra=["--zero-stage", 2, "--resume", "auto"]))
    assert result.returncode == 2 and "fewer than one global batch" in result.stderr, result.stderr[-2000:]
    assert "converting" not in result.stdout and not rundir.universal_dir(run).exists()


def test_a_val_split_too_small_to_evaluate_is_said(tokenizer_dir, tmp_path):
    """Data prepared with --val-fraction 0 trained with no val_loss at any step, the end's included, without a word."""
    data = tmp_path / "data"
    prepared = run_cli("data", "prepare", "--input", FIXTURES / "pretrain" / "en_stories.txt", "--tokenizer",
                       tokenizer_dir, "--out", data, "--val-fraction", 0, "--workers", 1)
    assert prepared.returncode == 0, prepared.stderr
    result = run_job(*_args(data, tmp_path / "run", "train.max_steps=1", "train.eval_every=1"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (f"pretrain: note: the val split of {data} holds 0 samples, too few for its rank to evaluate one, so the "
            "run is never evaluated (no val_loss); prepare the data with a larger --val-fraction to evaluate it") \
        in result.stdout.splitlines()


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_token_id_beyond_the_vocabulary_is_one_line_naming_the_file(pretrain_data, tmp_path, split):
    """A tokens.h5 changed after `data prepare` (its digest is of what it recorded): an IndexError traceback at the
    embedding on the CPU, a device-side assert on a GPU."""
    import h5py

    data = tmp_path / "data"
    shutil.copytree(pretrain_data, data)
    with h5py.File(data / "tokens.h5", "r+") as h5:
        h5[f"{split}/tokens"][:] = 600
    result = run_job(*_args(data, tmp_path / "run", "train.max_steps=2", "train.eval_every=1"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (
        f"zerollm: error: {data}/tokens.h5: the {split} split holds token id 600, beyond the model's vocabulary of "
        "512 (ids 0-511); the file was changed after `zerollm data prepare` wrote it: prepare the data again")


def _drop(h5, name):
    del h5[name]


def _signed(h5, name):
    tokens = h5[name][:].astype(np.int32)
    tokens[0] = -1
    del h5[name]
    h5[name] = tokens


@pytest.mark.parametrize("damage, name, problem", [
    (_drop, "val", "the val split has no tokens array"),
    (_drop, "train/doc_offsets", "the train split has no doc_offsets array"),
    (_signed, "train/tokens", "train/tokens holds int32 values, not the unsigned integers data prepare writes"),
])
def test_a_tokens_file_missing_an_array_or_with_signed_ids_is_one_line(pretrain_data, tmp_path, damage, name,
                                                                       problem):
    """A split removed was a KeyError traceback; token id -1 (an edit in a signed type) an IndexError one, past the
    check of the highest id."""
    import h5py

    data = tmp_path / "data"
    shutil.copytree(pretrain_data, data)
    with h5py.File(data / "tokens.h5", "r+") as h5:
        damage(h5, name)
    result = run_job(*_args(data, tmp_path / "run", "train.max_steps=1"))
    assert (result.returncode, result.stderr) == (2, f"zerollm: error: {data}/tokens.h5: {problem}; the file was "
                                                     "changed after `zerollm data prepare` wrote it: prepare the "
                                                     "data again\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("stage, data, message", [
    ("pretrain", "empty", "{empty}: no tokens.h5; create it with `zerollm data prepare --kind pretrain`"),
    ("sft", "empty", "{empty}: no tokens.h5; create it with `zerollm data prepare --kind sft`"),
    ("sft", "pretrain", "{data}/tokens.h5: holds 'pretrain' data, this stage needs 'sft'"),
])
def test_wrong_data_is_refused_before_any_rank_starts(pretrain_data, tmp_path, monkeypatch, capsys, stage, data,
                                                       message):
    """A --data folder without tokens.h5 (or of another kind) was refused by the ranks, after torch and DeepSpeed
    had loaded: 5 s for one line."""
    import launch.local  # noqa: PLC0415 - patched below

    monkeypatch.setattr(launch.local, "relaunch_local", lambda *a: pytest.fail("ranks were started"))
    (tmp_path / "empty").mkdir()
    args = _args(pretrain_data if data == "pretrain" else tmp_path / "empty", tmp_path / "run", nproc=2)
    args[1] = stage
    assert zerollm_here(monkeypatch, *args) == 2
    expected = message.format(empty=tmp_path / "empty", data=pretrain_data)
    assert capsys.readouterr().err.startswith(f"zerollm: error: {expected}")
    assert not (tmp_path / "run").exists()


def test_a_missing_data_folder_is_refused_before_torch_loads(tmp_path):
    script = ("import sys\nfrom llm.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as end:\n"
              "    print(end.code, 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script, *map(str, _args(tmp_path / "none", tmp_path / "run"))],
                            capture_output=True, text=True, timeout=120, check=False)
    assert "no such directory" in result.stderr and result.stdout == "2 False\n", result.stdout + result.stderr


SMALL_HOST = """
import os, sys
from llm.model import host_memory
if os.environ["RANK"] == "1":
    host_memory.usable_memory = lambda: 1 << 10  # this "host" has 1 KiB
from llm.cli import main
main(sys.argv[1:])
"""


def test_a_host_too_small_for_the_model_stops_every_host_with_its_reason(pretrain_data, tmp_path):
    """Two nodes of one rank each, the second with too little memory for the model: it refused alone, and the first
    waited in its next collective for the collective timeout (still waiting after 300 s), to name the second lost."""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", SMALL_HOST, *map(str, _args(pretrain_data, tmp_path / "run"))],
                              env={**env, "RANK": str(rank)}, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [2, 2], errors
    for error in errors:  # each node's first rank prints it
        assert f"zerollm: error: host {socket.gethostname()}: the model has " in error, error
        assert "GiB of memory: make model.dim, model.n_layers or model.vocab_size smaller" in error
        assert "Traceback" not in error


# ---- what --out may be ------------------------------------------------------------------------------------------

def _folder(root, files: dict[str, str]):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("files, message", [
    ({"config.yaml": "# my own recipe\n", "metrics.jsonl": '{"my": "notes"}\n', "train.log": ""},
     "holds config.yaml, metrics.jsonl but is not a zerollm run; training would overwrite them"),
    ({"tokens.h5": "", "report.json": "{}", "tokenizer/tokenizer.json": "{}"},
     "is a prepared data folder (it holds tokens.h5); give the run a directory of its own"),
    ({"tokenizer.json": "{}", "tokenizer_config.json": "{}"},  # a run was mixed into a tokenizer's folder
     "is a tokenizer or export folder (it holds tokenizer.json); give the run a directory of its own"),
    ({"run_record.jsonl": "{}\n", "checkpoints": "a file"}, "checkpoints is a file where training keeps a folder"),
    ({"run_record.jsonl": "{}\n", "metrics.jsonl/notes.txt": "mine"},  # a traceback after the first step
     "metrics.jsonl is a folder where training writes a file; move it away"),
    ({"config.yaml": "user: mine\n", "checkpoints/last.ckpt": "ck"},  # another tool's run: its config.yaml was lost
     "holds checkpoints, config.yaml but is not a zerollm run; training would overwrite them"),
])
def test_an_out_folder_that_is_not_a_run_is_refused_untouched(pretrain_data, tmp_path, monkeypatch, capsys, files,
                                                               message):
    """Before, training overwrote a user's config.yaml and metrics.jsonl, or filled a prepared data folder with
    checkpoints (--resume auto), exit 0; a file named checkpoints was a traceback."""
    out = _folder(tmp_path / "out", files)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert zerollm_here(monkeypatch, *_args(pretrain_data, out, nproc=2), "--resume", "auto") == 2  # no job here
    assert message in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_run_whose_files_are_symbolic_links_is_refused_and_the_files_they_name_kept(pretrain_data, tmp_path,
                                                                                       monkeypatch, capsys):
    """A run folder handed over with run_record.jsonl (or metrics.jsonl, ...) linked to a file elsewhere: training
    appended its rows to that file."""
    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")
    out = _folder(tmp_path / "out", {"run_record.jsonl": "{}\n"})
    (out / "metrics.jsonl").symlink_to(victim)
    assert zerollm_here(monkeypatch, *_args(pretrain_data, out, nproc=2), "--resume", "auto") == 2
    assert capsys.readouterr().err == (f"zerollm: error: --out {out}: metrics.jsonl is a symbolic link, where training "
                                       "writes (and appends to) a file of its own; replace it by a copy of the file "
                                       "it names\n")
    assert victim.read_text() == "precious\n"


KILLED_AFTER_THE_RUN_FILES = """
import os, signal, sys
from llm import cli
from llm.train import job
write = job._write_run_files
def killed(*args):
    write(*args)
    os.kill(os.getpid(), signal.SIGKILL)
job._write_run_files = killed
cli.main(sys.argv[1:])
"""
"""`zerollm ARGS`, killed as its run starts, once its tokenizer copy, config.yaml and ds_config.json are written."""


def test_a_run_killed_as_it_starts_is_taken_by_its_rerun(pretrain_data, tmp_path):
    """A start stopped (SIGKILL, Ctrl-C, a full disk) after the run files and before the run record left a folder
    that the same command, or --resume auto, refused as another tool's: 'holds config.yaml, ds_config.json,
    tokenizer but is not a zerollm run'."""
    args = [str(a) for a in _args(pretrain_data, tmp_path / "run", "train.max_steps=2")]
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_THE_RUN_FILES, *args], capture_output=True,
                            text=True, timeout=300, check=False)
    assert killed.returncode == -signal.SIGKILL and (tmp_path / "run" / "config.yaml").is_file(), killed.stderr[-2000:]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "global_step2"


def test_an_out_that_is_or_lies_below_a_file_is_one_line(pretrain_data, tmp_path, monkeypatch, capsys):
    (tmp_path / "notes.txt").write_text("kept")
    for out in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "run"):
        assert zerollm_here(monkeypatch, *_args(pretrain_data, out, nproc=2)) == 2
        assert capsys.readouterr().err == f"zerollm: error: --out {out}: {tmp_path / 'notes.txt'} is a file; give a " \
                                          "directory\n"
    assert (tmp_path / "notes.txt").read_text() == "kept"


def test_a_model_no_host_could_hold_is_refused_before_it_is_allocated(pretrain_data, tmp_path):
    """A vocabulary of 10**11 rows was torch's allocator traceback (or, for sizes that nearly fit, the OOM killer
    after minutes of swapping): each rank builds the whole fp32 model before DeepSpeed partitions it."""
    result = run_cli(*_args(pretrain_data, tmp_path / "run", "model.vocab_size=100000000000", nproc=2))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = next(line for line in result.stderr.splitlines() if line.startswith("zerollm: error: "))
    assert line.startswith("zerollm: error: the model has 6,400,000,") and "; this host builds 2 copies of it" in line
    assert line.endswith("make model.dim, model.n_layers or model.vocab_size smaller, or run fewer ranks on a host")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS bounds allocations on Linux only")
def test_a_step_that_runs_out_of_memory_is_one_line_naming_what_to_lower(tmp_path):
    """torch's allocator error was a traceback in every rank (a GPU's 'CUDA out of memory' alike); here the host
    refuses the allocation beyond an address-space limit, as a container's `ulimit -v` does."""
    import resource

    # start-up fits in 3 GiB at one thread (each thread reserves address space of its own: 32 did not fit in 4 GiB);
    # each GiB more is pages of the batch touched before the refusal
    limit = 4 * 1024**3
    sets = ["model.dim=32", "model.n_layers=1", "data.seq_len=128000", "model.max_seq_len=128000",  # few long rows:
            "train.micro_batch_size=100"]  # a batch of 100,000 rows of 128 took minutes to draw
    result = subprocess.run([sys.executable, "-m", "llm", "bench", "train", "--recipe", "demo",
                             *(a for o in sets for a in ("--set", o)), "--steps", "1", "--warmup", "0"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=600,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},  # on the CPU
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.search(r"^zerollm: error: rank 0 ran out of memory in step 1 \(the host refused \d+ bytes\); lower "
                     r"train.micro_batch_size \(100; a higher train.grad_accum keeps the samples a step\) or "
                     r"data.seq_len \(128000\)$", result.stderr, re.MULTILINE), result.stderr[-3000:]


def test_a_damaged_run_record_is_one_line(tmp_path):
    from llm.errors import UserError
    from llm.train.run_record import last_record

    (tmp_path / "run_record.jsonl").write_text('{"data": {}}\nnot json\n')
    with pytest.raises(UserError, match=r"run_record.jsonl:2: not a run record \(the file is damaged\)"):
        last_record(tmp_path)


def test_a_run_with_checkpoints_is_refused_without_resume_before_any_launcher_starts(pretrain_data, tmp_path):
    """Under `zerollm launch --backend torchrun` the rank's refusal came back as torchrun's ChildFailedError
    traceback and exit 1; the launching process now refuses it first, as `zerollm train` does."""
    from llm.cli import checked_training_command
    from llm.errors import UserError

    run = _folder(tmp_path / "run", {"run_record.jsonl": "{}\n", "checkpoints/latest": "global_step2"})
    job = ["--", *map(str, _args(pretrain_data, run))]
    del job[job.index("--nproc"):job.index("--nproc") + 2]  # the launcher starts the ranks
    with pytest.raises(UserError, match="already holds checkpoints; pass --resume auto to continue it"):
        checked_training_command(job)
    assert checked_training_command([*job, "--resume", "auto"])[1] == run


def test_a_zero0_run_of_two_ranks_resumes_on_one_without_a_universal_conversion(zero_runs, pretrain_data, tmp_path):
    """Without ZeRO the optimizer state is whole: no test resumed such a run on another number of ranks, and one that
    converted it to a universal checkpoint (which needs partitioned states) ended in DeepSpeed's error."""
    run = tmp_path / "run"
    shutil.copytree(zero_runs[0], run, symlinks=True)  # 2 ranks, fp32, no ZeRO
    overrides = [o for o in ZERO_RUN if not o.startswith("train.max_steps")]
    result = run_job(*_args(pretrain_data, run, *overrides, "train.max_steps=5", "train.grad_accum=2", nproc=1,
                            extra=["--zero-stage", 0, "--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed at step 4" in result.stdout and "universal" not in result.stdout
    assert not (run / "checkpoints" / "universal").exists()
