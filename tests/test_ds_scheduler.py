"""A DeepSpeed config's `scheduler` section, as Hugging Face's zero2.json and zero3.json carry it (it was refused:
"remove 'scheduler'"): DeepSpeed's warmup schedules, their "auto" values filled from the run config."""

import json
import math
import shutil

import pytest
from forked_ranks import run_job

from conftest import train_args
from llm import rundir
from llm.config import build_config
from llm.errors import UserError
from llm.train.ds_config_file import load_ds_config
from llm.train.ds_scheduler import unfinished_warmup_note as ds_warmup_note
from llm.train.engine import resolve_ds_config

AUTO = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
HF_SCHEDULER = {"type": "WarmupLR", "params": AUTO}
"""The scheduler section of Hugging Face's zero2.json and zero3.json."""


def resolved_scheduler(section, *overrides: str, optimizer: dict | None = None) -> dict:
    raw, _ = load_ds_config(None, "pretrain")
    cfg = build_config("demo", ["train.precision=fp32", "train.lr=3e-4", "train.warmup_steps=20",
                                "train.max_steps=500", "train.min_lr_ratio=0.2", *overrides])
    return resolve_ds_config({**raw, "scheduler": section, **({"optimizer": optimizer} if optimizer else {})}, cfg, 1,
                             "x.json")["scheduler"]


MUON = {"type": "Muon", "params": {"lr": "auto", "muon_lr": 0.02, "adam_lr": 2e-3}}


def test_a_one_rate_schedule_is_refused_for_an_optimizer_of_several_rates():
    """WarmupLR set Muon's groups, at muon_lr and adam_lr, both to warmup_max_lr, without a word."""
    with pytest.raises(UserError, match="^x.json: WarmupLR sets every parameter group to one rate .warmup_max_lr., "
                                        "which replaces the optimizer's adam_lr, muon_lr; use WarmupCosineLR"):
        resolved_scheduler(HF_SCHEDULER, optimizer=MUON)
    with pytest.raises(UserError, match="which replaces the optimizer's muon_lr; use WarmupCosineLR"):  # one is enough
        resolved_scheduler(HF_SCHEDULER, optimizer={"type": "Muon", "params": {"lr": "auto", "muon_lr": 0.02}})
    assert resolved_scheduler({"type": "WarmupCosineLR"}, optimizer=MUON)["type"] == "WarmupCosineLR"


@pytest.mark.parametrize("section, params", [
    (HF_SCHEDULER, {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 20}),
    ({"type": "WarmupDecayLR", "params": {**AUTO, "total_num_steps": "auto", "warmup_type": "linear"}},
     {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 20, "total_num_steps": 500,
      "warmup_type": "linear"}),
    ({"type": "WarmupCosineLR"},  # values left out are the run config's too
     {"warmup_min_ratio": 0.0, "cos_min_ratio": 0.2, "warmup_num_steps": 20, "total_num_steps": 500}),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_num_steps": 20.0}},  # 20.0 steps: DeepSpeed
     {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 20}),         # refuses a float
])
def test_hugging_face_scheduler_sections_are_filled_from_the_run_config(section, params):
    filled = resolved_scheduler(section)
    assert filled == {"type": section["type"], "params": params}
    assert type(filled["params"]["warmup_num_steps"]) is int


def test_grpo_schedules_count_every_update_of_a_batch():
    """DeepSpeed's schedule steps once per optimizer step; the run config's, once per batch of rollouts."""
    section = {"type": "WarmupDecayLR", "params": {**AUTO, "total_num_steps": "auto"}}
    params = resolved_scheduler(section, "train.stage=grpo", "train.init_from=x", "grpo.prompts=p.jsonl",
                                "grpo.updates_per_batch=3")["params"]
    assert (params["warmup_num_steps"], params["total_num_steps"]) == (60, 1500)
    assert resolved_scheduler(HF_SCHEDULER, "train.warmup_steps=0")["params"]["warmup_num_steps"] == 1


@pytest.mark.parametrize("section, overrides, message", [
    ({"type": "OneCycle"}, [], "'scheduler.type' is \"OneCycle\"; the schedules taken are WarmupLR, WarmupDecayLR, "
                               "WarmupCosineLR, or leave 'scheduler' out"),
    ([1], [], r"'scheduler' must be a JSON object {...}, got \[1\]"),
    ({"type": "WarmupLR", "params": 3}, [], "'scheduler.params' must be a JSON object {...}, got 3"),
    ({"type": "WarmupLR", "params": {"total_num_steps": 10}}, [],
     "'scheduler.params.total_num_steps' is not a parameter of WarmupLR .it takes warmup_min_lr, warmup_max_lr, "
     "warmup_num_steps, warmup_type.; remove it"),  # a TypeError traceback in every rank
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, ["train.warmup_steps=0"],
     "'scheduler.params.warmup_num_steps' is 0 but train.warmup_steps .at least 1. is 1"),  # DeepSpeed: ValueError
    ({"type": "WarmupLR", "params": {"warmup_type": "linaer"}}, [],
     "'scheduler.params.warmup_type' is \"linaer\", not one of log, linear$"),  # DeepSpeed: "log", with a warning
    ({"type": "WarmupLR", "params": {"warmup_min_lr": -1}}, [],
     "'scheduler.params.warmup_min_lr' must be a number >= 0, got -1$"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1}}, [],
     "'scheduler.params.warmup_max_lr' is 0.1 but train.lr is 0.0003"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 400}}, [],
     "'scheduler.params.total_num_steps' is 400 but train.max_steps is 500"),
    (HF_SCHEDULER, ["train.max_time=10m"], "a 'scheduler' section counts steps, and train.max_time ends the run by "
                                           "the clock: remove one of them"),
])
def test_scheduler_sections_deepspeed_would_fail_on_or_misread_are_one_line(section, overrides, message):
    with pytest.raises(UserError, match=f"^x.json: {message}"):
        resolved_scheduler(section, *overrides)


ONE_RANK = ["train.max_steps=6", "train.warmup_steps=3", "train.save_every=3", "train.keep_checkpoints=0",
            "train.precision=fp32", "train.eval_every=0"]


def test_a_run_that_ends_inside_the_deepspeed_schedules_warmup_says_so():
    """Only the run config's own warmup had the note: 2 steps under Hugging Face's WarmupLR, its warmup filled from
    the recipe's 50 steps, trained at a learning rate of 0 throughout, without a word. DeepSpeed raises a warmup of
    0 or 1 step to 2, and trains step k at its iteration k - 2: no warmup asked for over 2 steps trained at 0 too,
    and a warmup as long as the run ended before its peak, both without the note; so did a linear warmup, whose peak
    is a step later than the log one's."""
    raw, _ = load_ds_config(None, "pretrain")
    notes = []
    for overrides, kind in ((["train.warmup_steps=50", "train.max_steps=2"], "log"),
                            (["train.warmup_steps=20", "train.max_steps=500"], "log"),
                            (["train.warmup_steps=10", "train.max_steps=11"], "log"),  # its peak at the run's last step
                            (["train.warmup_steps=10", "train.max_steps=10"], "log"),
                            (["train.warmup_steps=0", "train.max_steps=2"], "log"),
                            (["train.warmup_steps=0", "train.max_steps=3"], "log"),
                            (["train.warmup_steps=0", "train.max_steps=3"], "linear"),  # rates 0, 0, half the peak
                            (["train.warmup_steps=0", "train.max_steps=4"], "linear"),
                            (["train.warmup_steps=3", "train.max_steps=2", "train.stage=grpo", "train.init_from=x",
                              "grpo.prompts=p.jsonl", "grpo.updates_per_batch=2"], "log")):
        cfg = build_config("demo", overrides)
        scheduler = {"type": "WarmupLR", "params": {**AUTO, "warmup_type": kind}}
        ds = resolve_ds_config({**raw, "scheduler": scheduler}, cfg, 1, "x.json")
        notes.append(ds_warmup_note(ds, cfg))
    lower = ", or lower train.warmup_steps (and warmup_num_steps, where the config gives it)"
    below = "the whole run trains below it, its first two steps at the minimum rate; raise train.max_steps to"
    raised = "(scheduler.params.warmup_num_steps=1, which DeepSpeed raises to 2) reaches its peak learning rate at"
    assert notes == [
        "note: DeepSpeed's log warmup (scheduler.params.warmup_num_steps=50) reaches its peak learning rate at "
        f"optimizer step 51, after the run's 2 (train.max_steps): {below} 51{lower}",
        None,
        None,
        "note: DeepSpeed's log warmup (scheduler.params.warmup_num_steps=10) reaches its peak learning rate at "
        f"optimizer step 11, after the run's 10 (train.max_steps): {below} 11{lower}",
        f"note: DeepSpeed's log warmup {raised} optimizer step 3, after the run's 2 (train.max_steps): {below} 3",
        None,
        f"note: DeepSpeed's linear warmup {raised} optimizer step 4, after the run's 3 (train.max_steps): {below} 4",
        None,
        "note: DeepSpeed's log warmup (scheduler.params.warmup_num_steps=6) reaches its peak learning rate at "
        f"optimizer step 7, after the run's 4 (train.max_steps x grpo.updates_per_batch): {below} 4{lower}"]


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / rundir.METRICS_FILE).read_text().splitlines()]


def _trained(run) -> list[tuple]:
    return [(row["step"], row["loss"], row["lr"], row["grad_norm"]) for row in _rows(run)]


def test_a_run_follows_the_deepspeed_schedule_and_resumes_on_it_exactly(pretrain_data, tmp_path):
    """WarmupDecayLR (log warmup over 3 steps, then linear to 0 at step 6) in place of the run config's cosine,
    continued exactly from a checkpoint; a resume under the other kind of schedule is refused (a LambdaLR restarted
    its count from 0, DeepSpeed's schedule failed with a KeyError)."""
    config = tmp_path / "zero2.json"
    raw, _ = load_ds_config(None, "pretrain")
    config.write_text(json.dumps({**raw, "scheduler": {"type": "WarmupDecayLR",
                                                       "params": {**AUTO, "total_num_steps": "auto"}}}))
    run = tmp_path / "run"
    result = run_job(*train_args(pretrain_data, run, *ONE_RANK, extra=["--deepspeed", config]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "learning rate by DeepSpeed's WarmupDecayLR" in result.stdout
    rows = _rows(run)
    lr = 3e-3  # the TINY run's train.lr
    # step k trains at the rate DeepSpeed's WarmupDecayLR set at its iteration k - 2 (log warmup, then linear
    # decay), step 1 at the one it set when it was built (warmup_min_lr): DeepSpeed's own two steps at 0
    expected = [0.0] + [lr * (math.log(i + 1) / math.log(3) if i < 3 else (6 - i) / (6 - 3)) for i in range(5)]
    assert [row["lr"] for row in rows] == pytest.approx(expected)

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(rundir.checkpoint_dir(resumed) / "global_step6")
    (resumed / rundir.METRICS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows[:3]))
    result = run_job(*train_args(pretrain_data, resumed, *ONE_RANK, extra=["--deepspeed", config, "--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed at step 3" in result.stdout
    assert _trained(resumed) == _trained(run)

    longer = tmp_path / "longer"  # total_num_steps 8 from step 6 on: the first step trained at the old rate
    shutil.copytree(run, longer)
    result = run_job(*train_args(pretrain_data, longer, *ONE_RANK, "train.max_steps=8",
                                 extra=["--deepspeed", config, "--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["lr"] for row in _rows(longer)][6:] == pytest.approx([lr * (8 - i) / (8 - 3) for i in (5, 6)])

    result = run_job(*train_args(pretrain_data, resumed, *ONE_RANK, "train.max_steps=8", extra=["--resume", "auto"]))
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error:")]
    assert result.returncode == 2 and errors == [
        f"zerollm: error: {resumed}: its checkpoints cannot resume with these changes (DeepSpeed's WarmupDecayLR "
        "there, the run config's schedule here, as the --deepspeed JSON's 'scheduler' section sets it); resume with "
        f"the values there, or start a new run with --init-from {resumed}"], result.stderr[-3000:]
