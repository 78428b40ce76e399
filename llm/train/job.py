"""Starting a training job on every rank: check the inputs, join the process group, resolve the DeepSpeed
config, agree across ranks, build the model, engines, objective, data and step source, resume, then run the loop
(`llm.train.trainer`). A rank that fails, dies or hangs ends the job on every rank (`llm.runtime.watchdog`).

Pretraining, SFT and DPO read data prepared by `zerollm data prepare`; GRPO reads prompt files and takes its
tokenizer from its --init-from model (`llm.train.rollout.grpo_inputs`); distillation reads pretraining or SFT data
and a --teacher with the data's tokenizer (`llm.train.teacher`).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from kernels.runtime import triton_unavailable
from llm import durable, rundir
from llm.config import RunConfig, settable_key
from llm.data.datasets import DATASETS
from llm.data.formats import expand_inputs
from llm.data.prepare import TOKENS_FILE
from llm.data.prepared import stage_data_attrs
from llm.errors import EXIT_OK, EXIT_PIPE_CLOSED, EXIT_USER_ERROR, UserError
from llm.infer.suggested_sampling import declared_stop_ids, generation_config_text
from llm.loading import (
    FUNCTION_FIELDS,
    SHAPE_FIELDS,
    initial_weights,
    load_tokenizer_copy,
    model_config_of,
    trained_config,
    weights_summary,
)
from llm.model import Transformer
from llm.model.from_weights import model_from_weights
from llm.model.host_memory import check_fits_in_memory
from llm.model.lora import apply_lora, trainable_summary
from llm.runtime.distributed import DistInfo, agreed, refuse_together, setup_distributed
from llm.runtime.fingerprint import check_ranks_agree, fingerprint
from llm.runtime.forced_exit import before_forced_exit
from llm.runtime.shared_run_dir import check_one_run_dir
from llm.runtime.watchdog import Watchdog
from llm.stdout import OutputLost
from llm.tokenizer import Tokenizer
from llm.train import checkpoint
from llm.train.ds_config_file import load_ds_config
from llm.train.ds_scheduler import optimizer_steps_per_step, scheduler_name
from llm.train.ds_scheduler import unfinished_warmup_note as ds_warmup_note
from llm.train.engine import (
    build_engine,
    cpu_has_native_bf16,
    frozen_engine,
    parameter_offload_note,
    resolve_ds_config,
    resolve_precision,
)
from llm.train.metrics import MetricsLogger, MetricsSink, check_wandb, peak_memory_mb
from llm.train.objectives import CausalLMObjective, DistillObjective, DPOObjective, GRPOObjective
from llm.train.rollout import Rollouts, grpo_inputs, tokenizer_dir
from llm.train.run_lock import run_locked
from llm.train.run_record import (
    check_same_data,
    check_same_weights,
    data_summary,
    prompts_summary,
    run_record,
    write_run_record,
)
from llm.train.samples import SampleGenerator
from llm.train.schedule import lr_multiplier, unfinished_warmup_note
from llm.train.steps import DataSteps
from llm.train.teacher import check_teacher, load_teacher
from llm.train.time_budget import TimeBudget
from llm.train.trainer import Trainer, nothing_left, refuse_too_few
from llm.wording import plural


def seed_rank_rngs(seed: int, rank: int) -> None:
    """Seed python, numpy and torch from (run seed, rank)."""
    derived = int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)


def input_tokenizer(cfg: RunConfig) -> Path:
    """The tokenizer the run's input is tokenized with: the prepared data's, or GRPO's --init-from model's."""
    return tokenizer_dir(cfg) if cfg.train.stage == "grpo" else rundir.tokenizer_dir(Path(cfg.data.path))


def input_attrs(cfg: RunConfig) -> dict:
    """vocab_size, tokenizer_hash and pad_id of the run's input: the prepared data's attributes, or (GRPO, which
    reads raw prompt files) its tokenizer's."""
    if cfg.train.stage == "grpo":
        tokenizer = Tokenizer.load(tokenizer_dir(cfg))
        return {"vocab_size": tokenizer.vocab_size, "tokenizer_hash": tokenizer.hash, "pad_id": tokenizer.pad_id,
                "legacy_tokenizer_hash": tokenizer.legacy_hash}
    return stage_data_attrs(cfg.train.stage, cfg.data.path)


def input_files(cfg: RunConfig) -> list[Path]:
    """The files the run's data summary identifies (`data_summary`, `prompts_summary`)."""
    return expand_inputs(cfg.grpo.prompts) if cfg.train.stage == "grpo" else [Path(cfg.data.path) / TOKENS_FILE]


def check_tokenizer(run_dir: Path, cfg: RunConfig, input_hash: str) -> None:
    """Refuse input tokenized with another tokenizer than the one this run directory already keeps, and a kept copy
    that cannot be loaded (an earlier version's copy cut short by a kill or a full disk), naming where it came from."""
    kept = rundir.tokenizer_dir(run_dir)
    if not kept.is_dir():
        return
    kept_tokenizer = load_tokenizer_copy(kept, f"delete it, and the next start copies it again from "
                                               f"{input_tokenizer(cfg)}")
    if not kept_tokenizer.has_hash(input_hash):
        source = f"--init-from {cfg.train.init_from} has" if cfg.train.stage == "grpo" else \
            f"{cfg.data.path} was tokenized with"
        raise UserError(f"{source} another tokenizer (hash {input_hash}) than this run's {kept} (hash "
                        f"{kept_tokenizer.hash}); use {kept}")


def keep_tokenizer(run_dir: Path, source: Path) -> None:
    """Copy the input's tokenizer directory into the run directory, so the run is self-contained: whole or not at
    all (`durable.copy_folder`: a kill or a full disk leaves no partial copy)."""
    kept = rundir.tokenizer_dir(run_dir)
    if source.is_dir() and not kept.is_dir():
        durable.copy_folder(source, kept)


def resharded(run_dir: Path, tag: str, info: DistInfo) -> bool:
    """Whether resuming `tag` needs a universal checkpoint: its optimizer state is partitioned over another number
    of ranks than this job's."""
    saved_world = rundir.client_state_of(run_dir, tag)["world_size"]
    return saved_world != info.world_size and checkpoint.is_partitioned(run_dir, tag)


def convert_resharded(run_dir: Path, tag: str, info: DistInfo) -> None:
    """Rank 0 makes `tag`'s universal checkpoint while the others wait (bounded by train.collective_timeout_s); a
    conversion that fails ends every rank with its one error, said once."""
    def convert() -> None:
        if info.is_main:
            saved_world = rundir.client_state_of(run_dir, tag)["world_size"]
            print(f"{tag} was saved by {saved_world} rank(s), this job has {info.world_size}: converting it to a "
                  "universal checkpoint", flush=True)
            checkpoint.convert_to_universal(run_dir, tag)

    agreed(convert, announce=info.local_rank == 0)


def refuse_data_smaller_than_a_batch(cfg: RunConfig, info: DistInfo, data_attrs: dict) -> None:
    """The trainer's refusal of a train split smaller than one global batch, before the trainer is built (GRPO's
    prompts are counted as its trainer is built)."""
    if cfg.train.stage != "grpo":
        train_set = DATASETS[data_attrs["kind"]](cfg.data.path, "train", cfg.data.seq_len, data_attrs["pad_id"])
        refuse_too_few(DataSteps(cfg, info.device), len(train_set), info)


def has_reference(cfg: RunConfig) -> bool:
    """Whether the stage keeps a frozen reference of its --init-from model: DPO's, and GRPO's KL term's."""
    return cfg.train.stage == "dpo" or (cfg.train.stage == "grpo" and cfg.grpo.kl_coef > 0)


def build_trainer(cfg: RunConfig, run_dir: Path, info: DistInfo, ds_config: dict, data_attrs: dict,
                  sources: dict | None = None) -> Trainer:
    """The model (seeded alike on every rank, or `--init-from` weights), its engine, the stage's data, objective
    and step source, and the per-rank RNG streams (dropout). `sources`: the run record's data section, whose
    `base` and `teacher` (`llm.loading.weights_summary`) name the checkpoints to load: the ones checked and recorded,
    not a newer one their runs saved since."""
    tags = {role: (sources or {}).get(role, {}).get("tag") for role in ("base", "teacher")}
    t, grpo, reference_needed = cfg.train, cfg.train.stage == "grpo", has_reference(cfg)
    teacher = model_config_of(t.teacher, "--teacher") if t.stage == "distill" else None
    remedy = ": make model.dim, model.n_layers or model.vocab_size smaller" + \
        (", distill from a smaller teacher" if teacher else "") + ", or run fewer ranks on a host"

    def fits() -> None:  # hosts differ: every rank refuses, naming the host that cannot where there are several
        try:
            check_fits_in_memory(cfg.model, info.local_world_size * (2 if reference_needed else 1), remedy, teacher)
        except UserError as exc:
            if info.world_size > info.local_world_size:
                raise UserError(f"host {socket.gethostname()}: {exc}") from None
            raise

    agreed(fits, announce=info.local_rank == 0)
    if grpo:
        tokenizer, reward, train_set = grpo_inputs(cfg, info.device)
        val_set = None
    else:
        dataset = DATASETS[data_attrs["kind"]]
        train_set = dataset(cfg.data.path, "train", cfg.data.seq_len, data_attrs["pad_id"])
        val_set = dataset(cfg.data.path, "val", cfg.data.seq_len, data_attrs["pad_id"])
    weights = agreed(lambda: initial_weights(cfg.model, t.init_from, data_attrs["tokenizer_hash"], tags.get("base")),
                     announce=info.local_rank == 0) if t.init_from else None  # said once per node, not by each rank
    if weights is not None:
        model = model_from_weights(cfg.model, weights)  # the loaded tensors themselves: no second copy
    else:
        torch.manual_seed(t.seed)  # identical initial weights on every rank
        model = Transformer(cfg.model)
    if cfg.lora.r:  # frozen base, trainable adapters (the same on every rank)
        apply_lora(model, cfg.lora, t.seed)
    n_params = model.num_parameters()  # before ZeRO-3 partitions the parameters
    seed_rank_rngs(t.seed, info.rank)  # then per-rank streams (dropout, sampling)
    budget = TimeBudget(t, info)
    updates = optimizer_steps_per_step(cfg)  # one step of the run config's schedule
    engine = build_engine(model, cfg, ds_config, lambda step: lr_multiplier(step // updates, t, budget))
    reference = None
    if reference_needed:
        # its own copy: the policy's parameters may still be `weights`' tensors, which training changes in place
        reference = frozen_engine(model_from_weights(cfg.model, {k: v.clone() for k, v in weights.items()}), ds_config)
    steps = DataSteps(cfg, info.device)
    if t.stage == "dpo":
        objective = DPOObjective(reference, t.dpo_beta, t.dpo_loss, t.dpo_sft_weight)
    elif grpo:
        objective = GRPOObjective(cfg.grpo)
        steps = Rollouts(cfg, info, engine, tokenizer, reward, reference)
    elif t.stage == "distill":
        objective = DistillObjective(load_teacher(cfg, ds_config, tags.get("teacher"), info.local_rank == 0),
                                     t.distill_alpha, t.distill_temperature)
    else:
        objective = CausalLMObjective()
    return Trainer(cfg, run_dir, info, engine, objective, steps, train_set, val_set, n_params, budget,
                   _sample_generator(cfg, engine, info, chat=data_attrs.get("kind", t.stage) != "pretrain"))


def _sample_generator(cfg: RunConfig, engine, info: DistInfo, chat: bool) -> SampleGenerator | None:
    """Samples at each evaluation, with the data's tokenizer (data made without one, e.g. by `bench train`, gets
    none); `chat`: the prompts as user turns (post-training on conversations)."""
    source = input_tokenizer(cfg)
    if not cfg.train.sample_prompts or not source.is_dir():
        return None
    tokenizer = Tokenizer.load(source)
    if cfg.train.init_from:  # the end tokens its base declares (Llama 3.1's <|eom_id|>), as generate stops at them
        tokenizer.stop_also(declared_stop_ids(cfg.train.init_from))
    return SampleGenerator(cfg.train.sample_prompts, cfg.train.sample_tokens, tokenizer, engine, info, chat=chat)


def run(cfg: RunConfig, run_dir: Path, ds_config_path: str | None, resume: bool, zero_stage: int | None = None) -> int:
    """Train `cfg` into `run_dir` under DeepSpeed; returns the process exit code."""
    attrs = input_attrs(cfg)
    if cfg.model.vocab_size is None:  # the recipe does not pin one: the tokenizer's
        cfg.model.vocab_size = attrs["vocab_size"]
    if attrs["vocab_size"] > cfg.model.vocab_size:
        if cfg.train.init_from and cfg.train.stage != "grpo":  # the run takes that model's vocab_size
            raise UserError(f"{cfg.data.path}: its tokenizer has {attrs['vocab_size']} tokens, more than the "
                            f"{cfg.model.vocab_size} of --init-from {cfg.train.init_from}'s model; prepare the data "
                            "with that model's tokenizer")
        source = cfg.train.init_from if cfg.train.stage == "grpo" else cfg.data.path
        raise UserError(f"{source}: tokenizer has {attrs['vocab_size']} tokens but model.vocab_size is "
                        f"{cfg.model.vocab_size}; set model.vocab_size >= {attrs['vocab_size']}")
    teacher = check_teacher(cfg, attrs) if cfg.train.stage == "distill" else None
    raw_ds, ds_source = load_ds_config(ds_config_path, cfg.train.stage)
    rundir.check_run_output(run_dir, resume)  # checked by the CLI before any rank starts; again for direct callers
    data = prompts_summary(input_files(cfg), attrs) if cfg.train.stage == "grpo" else \
        data_summary(Path(cfg.data.path), attrs)
    if teacher is not None:
        data["teacher"] = teacher  # recorded with the data: a resume against another teacher is refused
    if cfg.train.init_from and (cfg.lora.r or has_reference(cfg)):  # the frozen base the adapters belong to
        data["base"] = weights_summary(cfg.train.init_from, "--init-from")  # (`load_lora_model`), the reference
    info = setup_distributed(cfg.train.collective_timeout_s)
    announce = info.local_rank == 0  # a refusal every rank finds is printed once per node, not once per rank
    agreed(lambda: check_wandb(cfg.wandb, run_dir) if info.is_main else None, announce)  # rank 0 logs to wandb
    had_checkpoints = resume and rundir.holds_checkpoints(run_dir)  # a resume of them: its settings compared
    ds_config = agreed(lambda: _resolved_ds_config(cfg, run_dir, info, (raw_ds, ds_source), zero_stage,
                                                   had_checkpoints, data, attrs), announce)
    with run_locked(run_dir, info.rank, lambda problem: refuse_together(problem, announce),
                    recheck=lambda: _check_unchanged(run_dir, resume, had_checkpoints)) as tidy_run_dir:
        watchdog = None
        if info.world_size > 1:
            watchdog = Watchdog(info.rank, info.world_size, cfg.train.collective_timeout_s,
                                announce=announce, before_exit=tidy_run_dir)
        try:
            code = _run_job(cfg, run_dir, info, ds_config, attrs, resume, watchdog, data)
        except UserError:
            if watchdog is not None:
                watchdog.stop()
            raise
        except Exception as exc:
            if watchdog is None:
                raise
            if isinstance(exc, OutputLost) and isinstance(exc.error, BrokenPipeError):  # `| head`: every rank ends
                watchdog.end_job(None, code=EXIT_PIPE_CLOSED)                               # as one process does
            lost = watchdog.diagnose()  # a collective that failed because a peer is gone: that is the news
            if lost is None:
                traceback.print_exc()
            failed = f"failed with {type(exc).__name__}: {_first_line(exc)}"
            if lost:
                watchdog.end_job(f"{lost}; this rank then {failed}")
            else:  # an error of its own, not of its node
                watchdog.end_job(failed, advice="That rank's traceback, in its output, says where: fix the cause, "
                                                "then start the job again with --resume auto")
        if watchdog is not None:
            watchdog.stop()
        dist.barrier()  # every rank is done writing; the caller ends the process (see `llm.cli.cmd_train`)
    return code


def _check_unchanged(run_dir: Path, resume: bool, had_checkpoints: bool) -> None:
    """Once this job holds the run's lock: refuse what another job wrote there since this one checked it (it ran to
    its end in between): checkpoints in a new --out (a resume was not checked against them: its data, shape and
    DeepSpeed settings), or anything `rundir.check_run_contents` refuses."""
    rundir.check_run_contents(run_dir, resume)
    if resume and not had_checkpoints and rundir.holds_checkpoints(run_dir):
        raise UserError(f"{run_dir}: another training job saved checkpoints there while this one started; start this "
                        "one again to resume them (it checks them first)")


def _first_line(exc: Exception) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), "")


RESUMED_FIELDS = (*(f"model.{f}" for f in (*SHAPE_FIELDS, *FUNCTION_FIELDS)), "lora.r", "lora.targets", "lora.scale",
                  "train.stage")
"""What a run's checkpoints are shaped by or mean, beside the ZeRO stage: a resume that changes one fails inside
DeepSpeed, or silently trains (and loads the checkpoints as) another function (RoPE, norm epsilon: the keys
--init-from refuses too), or (lora.scale, alpha / r) gives its saved adapters another meaning, or (train.stage)
continues a run's schedule and sampler position under another objective."""
WINDOWED_STAGES = ("pretrain", "sft", "distill")
"""Stages whose samples are windows of data.seq_len tokens (pretraining windows, packed conversations): another
data.seq_len makes the sampler position of a checkpoint mean other samples."""


def _zero_stage(ds_config: Any) -> Any:
    section = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    return section.get("stage", 0) if isinstance(section, dict) else 0


ADAM_TYPES = frozenset({"adam", "adamw"})
"""DeepSpeed's names (in any case) of the optimizers whose state is the same: Adam's moments."""


def _optimizer_state(ds_config: Any) -> str:
    """What a resolved config's optimizer keeps in its state: Adam's moments (Adam or AdamW, whichever, and with
    amsgrad their maxima too), or another optimizer's by its name. A checkpoint's state loads into an optimizer of
    the same state only: another was a traceback (a KeyError, a ZeRO layout that does not match) or trained on
    without the moments (SGD after AdamW)."""
    section = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    kind = str(section.get("type")) if isinstance(section, dict) else "AdamW"
    params = section.get("params") if isinstance(section, dict) else None
    amsgrad = " with amsgrad" if isinstance(params, dict) and params.get("amsgrad") is True else ""
    return ("Adam or AdamW" if kind.lower() in ADAM_TYPES else kind.lower()) + amsgrad


def _recorded_ds_config(run_dir: Path) -> dict:
    """RUN_DIR/ds_config.json, which a resume is checked against; a UserError when it cannot be read (its checks were
    skipped: a resume at another ZeRO stage was an AssertionError traceback in every rank)."""
    path = run_dir / rundir.DS_CONFIG_FILE
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        problem = "it is missing"
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or not UTF-8
        problem = f"it is damaged ({type(exc).__name__})"
    else:
        problem = None if isinstance(recorded, dict) else "it is damaged (not a JSON object)"
    if problem is not None:
        raise UserError(f"{path}: {problem}; it records the DeepSpeed settings the checkpoints were saved with (ZeRO "
                        "stage, optimizer, schedule), which a resume must keep: restore it, or train a new run")
    return recorded


def _schedule(ds_config: Any) -> str:
    name = scheduler_name(ds_config)
    return f"DeepSpeed's {name}" if name else "the run config's schedule"


def _resolved_ds_config(cfg: RunConfig, run_dir: Path, info: DistInfo, ds_file: tuple[dict, str],
                        zero_stage: int | None, resuming: bool, data: dict, attrs: dict) -> dict:
    """The resolved DeepSpeed config (`cfg.train.precision` made concrete), after refusing input of another tokenizer
    than `run_dir` keeps and, `resuming` its checkpoints, a resume of it on other data, teacher, base, precision or
    shape."""
    check_tokenizer(run_dir, cfg, attrs["tokenizer_hash"])
    saved = trained_config(run_dir) if resuming else None
    if saved is not None:
        check_same_stage(run_dir, saved, cfg)
        check_same_data(run_dir, data, input_files(cfg), attrs.get("legacy_tokenizer_hash"))
        for role, option in (("teacher", "--teacher"), ("base", "--init-from")):
            if role in data:
                check_same_weights(run_dir, role, data[role], option)
        cfg.train.precision = resumed_precision(run_dir, saved.train.precision, cfg.train.precision)
    cfg.train.precision = resolve_precision(cfg.train.precision, info.device)
    # named once, recorded: a resume from a shell with other WANDB_* variables sent the same run id to another
    # project; kept by a session with wandb off too (it recorded none, and the next session's went by the variables)
    w, before, logged = cfg.wandb, saved.wandb if saved is not None else None, cfg.wandb.mode != "off"
    w.project = w.project or (before and before.project) or (w.run_project() if logged else None)
    w.name = w.name or (before and before.name) or (w.run_name(run_dir) if logged else None)
    if cfg.model.kernels == "triton" and (reason := triton_unavailable(info.device)) is not None:
        raise UserError(reason if info.device.type == "cuda" else f"model.kernels=triton needs a CUDA GPU (this job "
                        f"runs on {info.device.type}); use auto or torch here")
    raw, source = ds_file
    ds_config = resolve_ds_config(raw, cfg, info.world_size, source, zero_stage)
    if saved is not None:
        check_same_shape(run_dir, saved, cfg, ds_config)
    return ds_config


def check_same_shape(run_dir: Path, saved: RunConfig, cfg: RunConfig, ds_config: dict) -> None:
    """Refuse to resume `run_dir` (trained with `saved`) with a model shape or function, LoRA shape, stage, windowing
    (data.seq_len), ZeRO stage or kind of schedule other than its checkpoints were saved with (DeepSpeed's load fails
    on shapes with a size-mismatch list, an AttributeError or an AssertionError; a schedule of another kind fails
    with a KeyError or restarts from its first step; the others train on silently, into checkpoints that mean
    something else)."""

    def value(config: RunConfig, key: str) -> Any:
        section, _, name = key.partition(".")
        return _compared(key, getattr(getattr(config, section), name))

    def shown(config: RunConfig, key: str) -> Any:
        return _stage(config) if key == "train.stage" else value(config, key)

    differing = [f"{settable_key(key)} {shown(saved, key)} there, {shown(cfg, key)} here" for key in RESUMED_FIELDS
                 if value(saved, key) != value(cfg, key)]
    if cfg.train.stage in WINDOWED_STAGES and saved.data.seq_len != cfg.data.seq_len:
        differing.append(f"data.seq_len {saved.data.seq_len} there, {cfg.data.seq_len} here (its samples are windows "
                         "of that many tokens)")
    recorded = _recorded_ds_config(run_dir)
    if _zero_stage(recorded) != _zero_stage(ds_config):
        differing.append(f"ZeRO stage {_zero_stage(recorded)} there, {_zero_stage(ds_config)} here")
    if scheduler_name(recorded) != scheduler_name(ds_config):
        differing.append(f"{_schedule(recorded)} there, {_schedule(ds_config)} here, as the --deepspeed JSON's "
                         "'scheduler' section sets it")
    if _optimizer_state(recorded) != _optimizer_state(ds_config):
        differing.append(f"optimizer {_optimizer_state(recorded)} there, {_optimizer_state(ds_config)} here, as the "
                         "--deepspeed JSON's 'optimizer' section sets it (its state does not carry over)")
    if differing:
        _refuse_resume(run_dir, differing)


def check_same_stage(run_dir: Path, saved: RunConfig, cfg: RunConfig) -> None:
    """Refuse a resume of `run_dir` (trained with `saved`) by another stage before its data is compared with the
    run's: a GRPO prompt file's digest against an SFT run's tokens.h5 digest was reported as other data,
    mislabelled."""
    if saved.train.stage != cfg.train.stage:
        _refuse_resume(run_dir, [f"train.stage {_stage(saved)} there, {_stage(cfg)} here"])


def _stage(config: RunConfig) -> str:
    return f"distill (--teacher {config.train.teacher})" if config.train.stage == "distill" else config.train.stage


def _refuse_resume(run_dir: Path, differing: list[str]) -> NoReturn:
    raise UserError(f"{run_dir}: its checkpoints cannot resume with these changes ({'; '.join(differing)}); resume "
                    f"with the values there, or start a new run with --init-from {run_dir}")


def resumed_precision(run_dir: Path, saved: str, requested: str) -> str:
    """The precision a resumed run continues in: `saved`, the one its checkpoints were saved in, which `auto` takes
    even where it would choose another on this device; another is refused (DeepSpeed keeps a bf16 run's optimizer
    state in files of other names, so the load would fail half way). A `saved` (config.yaml's) that the newest
    checkpoint's files contradict is refused too: an edit of config.yaml was a traceback in every rank, or named the
    edited precision as the one the run was trained in."""
    tag = rundir.newest_complete_tag(run_dir)
    in_bf16 = None if tag is None else checkpoint.saved_in_bf16(run_dir, tag)
    if in_bf16 is not None and (saved == "bf16") != in_bf16:
        trained = "bf16" if saved != "bf16" else "fp32 (or fp16)"
        raise UserError(f"{rundir.config_file(run_dir)} says train.precision {saved}, but checkpoint {tag} was saved "
                        f"in {trained} (DeepSpeed names a bf16 run's optimizer files apart); put back the precision "
                        "it was trained in there")
    if requested not in ("auto", saved):
        raise UserError(f"{run_dir} was trained in {saved}; train.precision={requested} cannot resume it (DeepSpeed's "
                        f"checkpoints differ by precision): resume with train.precision=auto or {saved}, or start a "
                        f"new run with --init-from {run_dir}")
    return saved


def _nothing_left_at(cfg: RunConfig, run_dir: Path, tag: str, info: DistInfo) -> tuple[int, str] | None:
    """(its step, why) where checkpoint `tag` leaves no step to train (`llm.train.trainer.nothing_left`), read from its
    client state; None while one is left."""
    state = rundir.client_state_of(run_dir, tag)
    budget = TimeBudget(cfg.train, info)
    budget.load_state_dict(state.get("time_budget"), state["step"])
    why = nothing_left(cfg.train.max_steps, budget, state["step"])
    return None if why is None else (state["step"], why)


def _nothing_to_train(run_dir: Path, tag: str, step: int, why: str, info: DistInfo) -> int:
    if info.is_main:
        print(f"zerollm: note: {run_dir}: nothing to train: its checkpoint {tag} is at step {step} and {why}",
              file=sys.stderr, flush=True)
    return EXIT_OK


def _run_job(cfg: RunConfig, run_dir: Path, info: DistInfo, ds_config: dict, attrs: dict, resume: bool,
             watchdog: Watchdog | None, data: dict) -> int:
    if info.world_size > 1:
        check_one_run_dir(run_dir, info.rank, info.local_rank == 0, cfg.train.collective_timeout_s)
        models = {role: data[role]["weights"] for role in ("teacher", "base") if role in data}  # a newer checkpoint
        check_ranks_agree(fingerprint(cfg.to_dict(), ds_config, data["digest"], attrs["tokenizer_hash"], models),
                          announce=info.local_rank == 0)  # saved between two ranks' looks: they would load both
    tag = checkpoint.resume_tag(run_dir, cfg.model, cfg.lora) if resume else None
    universal = tag is not None and resharded(run_dir, tag, info)
    if universal and (finished := _nothing_left_at(cfg, run_dir, tag, info)) is not None:  # said before converting
        return _nothing_to_train(run_dir, tag, *finished, info)  # (minutes, and a copy of the checkpoint's size)
    if universal:  # the data's refusal first: the conversion takes minutes and a copy of the checkpoint's size; then
        refuse_data_smaller_than_a_batch(cfg, info, attrs)  # the trainer, whose model and engine would hold the
        convert_resharded(run_dir, tag, info)  # host's memory beside the conversion's
    engine_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}} \
        if universal else ds_config
    trainer = build_trainer(cfg, run_dir, info, engine_config, attrs, data)
    if tag is not None:
        trainer.resume(tag, universal)
        if universal:
            dist.barrier()
            if info.is_main:
                shutil.rmtree(rundir.universal_dir(run_dir))
    finished = trainer.nothing_left() if tag is not None else None  # every rank finds it, once the resume was checked
    if finished is not None:
        return _nothing_to_train(run_dir, tag, trainer.step, finished, info)
    record = run_record(info, data, resumed_from=tag)  # every rank takes part (hosts and ranks are gathered)
    saved = trained_config(run_dir) if tag is not None and info.is_main else None  # before config.yaml's update
    changes = resumed_changes(saved, cfg) if saved else []
    ds_changes = resumed_ds_changes(_recorded_ds_config(run_dir), ds_config) if saved else []
    batch_note = resumed_batch_note(saved, rundir.client_state_of(run_dir, tag)["world_size"], cfg,
                                    info.world_size) if saved else None
    # written once the run is known to start (a refused resume leaves the directory as it was), by rank 0; a full
    # disk there is one line on every rank
    trained_from = saved.train.init_from if saved else None
    sink = agreed(lambda: _start_files(cfg, run_dir, ds_config, trainer, record, trained_from) if info.is_main
                  else None,
                  announce=info.local_rank == 0)
    if info.is_main:
        _announce(cfg, info, ds_config, trainer, resumed=tag is not None)
        if changes:
            print(f"{cfg.train.stage}: note: resumed with settings other than its {rundir.CONFIG_FILE}'s: "
                  f"{'; '.join(changes)} (a --set of the command that began the run, not given again, takes the "
                  "recipe's value)", flush=True)
        if ds_changes:
            shown = "; ".join(ds_changes[:4]) + (f"; and {len(ds_changes) - 4} more" if len(ds_changes) > 4 else "")
            print(f"{cfg.train.stage}: note: resumed with DeepSpeed settings other than its {rundir.DS_CONFIG_FILE}'s: "
                  f"{shown} (a --deepspeed of the command that began the run, not given again, takes the stage's "
                  "shipped config)", flush=True)
        if batch_note:
            print(f"{cfg.train.stage}: {batch_note}", flush=True)
    logger = MetricsLogger(cfg, info, trainer.n_params, trainer.step, sink)
    checkpointer = checkpoint.Checkpointer(trainer.engine, run_dir, cfg.train.save_every, cfg.train.keep_checkpoints,
                                           trainer.client_state)
    code = 1  # what an exception ends the process with, a UserError 2
    try:
        with before_forced_exit(logger.close):  # a second Ctrl-C or the watchdog: the wandb run ends all the same
            code = trainer.fit(logger, checkpointer, watchdog)
    except UserError:
        code = EXIT_USER_ERROR
        raise
    finally:
        logger.close(code)
    if info.is_main:
        measure = {"cuda": "peak allocated", "mps": "allocated now"}.get(info.device.type, "peak resident set")
        print(f"{cfg.train.stage}: peak memory {peak_memory_mb(info.device):,.0f} MiB on rank 0 ({measure}); "
              f"{trainable_summary(trainer.engine.module, cfg.lora)}", flush=True)
    return code


def _start_files(cfg: RunConfig, run_dir: Path, ds_config: dict, trainer: Trainer, record: dict,
                 trained_from: str | None = None) -> MetricsSink:
    """Rank 0, as the run starts: its run record (first: it makes the folder a zerollm run's, so that a session
    stopped before the other files were written leaves a folder its rerun takes; it was refused as another tool's),
    the run files (config.yaml keeping `trained_from`, the train.init_from its last session recorded: `_as_recorded`),
    then the metrics files cut to its first step (and wandb). A write that runs out of room is a UserError naming
    the run directory, with every file whole."""
    with durable.room_needed(run_dir, rundir.RUN_RECORD_FILE):
        run_dir.mkdir(parents=True, exist_ok=True)
    write_run_record(run_dir, record)
    saved = _as_recorded(cfg, trained_from)
    _write_run_files(saved, run_dir, ds_config, cfg.train.init_from)
    with durable.room_needed(run_dir, rundir.METRICS_FILE):  # wandb's config is config.yaml's
        return MetricsSink(run_dir, saved, trainer.run_id, trainer.step, record)


def _compared(key: str, value: Any) -> Any:
    """A setting's value as a resume compares it: LoRA's targets in any order (adapters are found by module)."""
    return sorted(value) if key == "lora.targets" else value


def resumed_changes(saved: RunConfig, cfg: RunConfig) -> list[str]:
    """'key X there, Y here' for each setting in which this resume differs from `saved`, the config.yaml its run's
    last session wrote: a --set of the first command that the resume did not repeat took the recipe's value without a
    word (a learning rate of 1e-3 went back to 3e-3)."""
    def flat(config: RunConfig) -> dict[str, Any]:
        values = {f"{section}.{key}": _compared(f"{section}.{key}", value)
                  for section, values in config.to_dict().items() for key, value in values.items()}
        if config.lora.r and config.lora.alpha is None:  # alpha left out is 2 * r: `--lora alpha=8` at r=4 changes
            values["lora.alpha"] = 2.0 * config.lora.r   # nothing ("lora.alpha None there, 8.0 here" was noted)
        return values

    there, here = flat(saved), flat(_as_recorded(cfg, saved.train.init_from))
    return [f"{key} {there.get(key)} there, {value} here" for key, value in here.items()
            if there.get(key) != value and key not in KNOWN_BY_CONTENT]


FROM_THE_RUN_CONFIG = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                       "gradient_clipping", "optimizer.params.", "scheduler.params.", "bf16.", "fp16.")
"""DeepSpeed keys (and prefixes) whose values `resolve_ds_config` takes from the run config: a resume changes them
through its run config, whose changes `resumed_changes` names."""


def resumed_ds_changes(recorded: dict, ds_config: dict) -> list[str]:
    """'key X there, Y here' for each DeepSpeed setting in which this resume's resolved config differs from the
    ds_config.json its run recorded, beyond what the run config sets: a resume without the first command's
    --deepspeed took the stage's shipped config (its optimizer offload gone, say) without a word."""
    def flat(node: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(node, dict) or not node:
            return {prefix: node}
        return {key: value for name, child in node.items() for key, value in flat(child, f"{prefix}{name}.").items()}

    def shown(values: dict[str, Any], key: str) -> str:
        return json.dumps(values[key]) if key in values else "absent"

    there, here = ({key.removesuffix("."): value for key, value in flat(config).items()} for config in
                   (recorded, ds_config))
    return [f"{key} {shown(there, key)} there, {shown(here, key)} here"  # values compared as numbers: 2.0 is 2
            for key in sorted(there.keys() | here.keys(), key=lambda key: (key not in there, key))  # the run's first
            if (key in there) != (key in here) or there.get(key) != here.get(key)
            if not key.startswith(FROM_THE_RUN_CONFIG)]


KNOWN_BY_CONTENT = frozenset({"data.path"})
"""Settings a resume compares by what they name, not as written (`check_same_data`: the data's digest): a relative
--data given from another working directory was noted as another setting."""


def resumed_batch_note(saved: RunConfig, saved_world: int, cfg: RunConfig, world: int) -> str | None:
    """A note where a resume on another number of ranks than its checkpoint's (`saved_world`; `saved`: the run config
    it was trained with) takes another number of samples a step (train.micro_batch_size x train.grad_accum x ranks):
    the run went on at another global batch without a word."""
    there = saved.train.micro_batch_size * saved.train.grad_accum * saved_world
    here = cfg.train.micro_batch_size * cfg.train.grad_accum * world
    if saved_world == world or there == here:
        return None
    keeps, left = divmod(there, cfg.train.micro_batch_size * world)
    advice = f"; train.grad_accum={keeps} keeps it" if keeps and not left else ""
    return (f"note: resumed on {world} {plural('rank', world)} where its checkpoint was saved by {saved_world}: a step "
            f"takes {here} samples here, {there} there (train.micro_batch_size x train.grad_accum x ranks){advice}")


def _as_recorded(cfg: RunConfig, trained_from: str | None = None) -> RunConfig:
    """The run config as the run directory records it: the base and the teacher as absolute paths. The base of a
    LoRA run is loaded whenever the run is (its checkpoints hold adapters only), from any directory, and export, run
    from any directory, refuses to replace the base or the teacher (`refuse_replacing_a_source`). A resume that
    loads no base (its checkpoints hold every weight: `llm.loading.base_to_resume_on`) keeps `trained_from`, the one
    the run recorded: it recorded none, and the next export replaced the model an SFT run was trained from."""
    init_from, teacher = (path and str(Path(path).resolve())
                          for path in (cfg.train.init_from or trained_from, cfg.train.teacher))
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=init_from, teacher=teacher))


def _write_run_files(saved: RunConfig, run_dir: Path, ds_config: dict, base: str | None = None) -> None:
    """The run's tokenizer copy, config.yaml (`saved`, `_as_recorded`), ds_config.json and the copy of the
    generation_config.json of `base`, the model this session loads (none where a resume loads none: the copy made
    from the model the run was trained from stays as it was), where it has one, each written whole or not at all,
    and not at all when unchanged (`llm.durable`); a write that runs out of room is a UserError naming the run
    directory."""
    with durable.room_needed(run_dir, rundir.TOKENIZER_DIR):
        keep_tokenizer(run_dir, input_tokenizer(saved))
    # its generation settings, as transformers' Trainer saves them beside the model it tuned (checked before the
    # ranks start: `llm.cli`)
    text = generation_config_text(Path(base) / rundir.GENERATION_CONFIG_FILE) if base else None
    if text is not None:
        with durable.room_needed(run_dir, rundir.GENERATION_CONFIG_FILE):
            durable.update_text(run_dir / rundir.GENERATION_CONFIG_FILE, text)
    with durable.room_needed(run_dir, rundir.CONFIG_FILE):
        saved.save(rundir.config_file(run_dir))
    with durable.room_needed(run_dir, rundir.DS_CONFIG_FILE):
        durable.update_text(run_dir / rundir.DS_CONFIG_FILE, json.dumps(ds_config, indent=2))


def _announce(cfg: RunConfig, info: DistInfo, ds_config: dict, trainer: Trainer, resumed: bool) -> None:
    train_set, stage = trainer.train_set, cfg.train.stage
    if stage == "grpo":
        samples = (f"{len(train_set):,} prompts, {trainer.steps.draw_size} per rank per step with "
                   f"{cfg.grpo.group_size} completions each, rollouts by the {trainer.steps.policy.mode} model")
    else:
        samples = f"{len(train_set):,} train samples" + (
            f" ({100 * train_set.padding_fraction:.1f} % padding)" if hasattr(train_set, "padding_fraction") else "")
    if stage == "distill":
        samples += (f", teacher {cfg.train.teacher} (alpha {cfg.train.distill_alpha:g}, temperature "
                    f"{cfg.train.distill_temperature:g})")
    print(f"{stage}: {trainer.n_params / 1e6:.3f} M parameters, {info.world_size} rank(s), "
          f"ZeRO stage {ds_config.get('zero_optimization', {}).get('stage', 0)}, {cfg.train.precision}, {samples}"
          + (f", learning rate by {_schedule(ds_config)}" if scheduler_name(ds_config) else "")
          + (f", resumed at step {trainer.step}" if resumed else "")
          + (f", time budget {trainer.budget.max_time:g} s ({trainer.budget.elapsed:.1f} s used)"
             if trainer.budget.enabled else ""), flush=True)
    if info.device.type == "cpu" and cfg.train.precision == "bf16" and not cpu_has_native_bf16():
        print(f"{stage}: note: this CPU only emulates bf16 (no AVX-512 or Arm BF16), many times slower than fp32 "
              "(docs/benchmarks.md); train.precision=auto or fp32 trains faster here", flush=True)
    if note := (ds_warmup_note(ds_config, cfg) if scheduler_name(ds_config) else unfinished_warmup_note(cfg.train)):
        print(f"{stage}: {note}", flush=True)
    if note := parameter_offload_note(ds_config):
        print(f"{stage}: {note}", flush=True)
    held = None if trainer.val_set is None else len(trainer.val_set)
    if held is not None and held < info.world_size:  # each rank evaluates whole samples
        ranks = info.world_size
        print(f"{stage}: note: the val split of {cfg.data.path} holds {held} {plural('sample', held)}, too few for "
              f"{'its rank' if ranks == 1 else f'each of its {ranks} ranks'} to evaluate one, so the run is never "
              "evaluated (no val_loss); prepare the data with a larger --val-fraction to evaluate it", flush=True)
    if cfg.train.init_from:
        m = cfg.model
        print(f"{stage}: the model's shape and RoPE are --init-from {cfg.train.init_from}'s: dim {m.dim}, "
              f"{m.n_layers} layers, {m.n_heads} heads ({m.kv_heads} key/value), vocabulary {m.vocab_size}; context "
              f"{m.max_seq_len} positions (its own unless --set model.max_seq_len)", flush=True)
    print(f"{stage}: {trainable_summary(trainer.engine.module, cfg.lora)}", flush=True)
    if stage == "grpo" and train_set.skipped:
        print(train_set.summary(), flush=True)
