"""A DeepSpeed config's `scheduler` section, as Hugging Face's zero2.json and zero3.json carry it: one of DeepSpeed's
warmup schedules, its "auto" values filled from the run config the way the Hugging Face Trainer fills them from its
arguments, so that DeepSpeed builds that schedule in place of the run config's own (linear warmup, then cosine).

What DeepSpeed would fail on in every rank with a traceback (an unknown parameter, a warmup of 0 steps), or would
silently replace (an unknown `warmup_type` becomes "log"), is a UserError naming the key.
"""

from __future__ import annotations

import json
import math
from typing import Any

from llm.config import RunConfig
from llm.errors import UserError

WARMUP = {"warmup_num_steps": int, "warmup_type": str}
SCHEDULES: dict[str, dict[str, type]] = {
    "WarmupLR": {"warmup_min_lr": float, "warmup_max_lr": float, **WARMUP},
    "WarmupDecayLR": {"warmup_min_lr": float, "warmup_max_lr": float, "total_num_steps": int, **WARMUP},
    "WarmupCosineLR": {"warmup_min_ratio": float, "cos_min_ratio": float, "total_num_steps": int, **WARMUP},
}
"""The schedules taken, with the parameters each takes (DeepSpeed's `deepspeed.runtime.lr_schedules`)."""
WARMUP_TYPES = ("log", "linear")


def optimizer_steps_per_step(cfg: RunConfig) -> int:
    """Optimizer steps in one training step: GRPO's updates per batch of rollouts, 1 otherwise."""
    return cfg.grpo.updates_per_batch if cfg.train.stage == "grpo" else 1


SAME_RATE_EVERYWHERE = ("WarmupLR", "WarmupDecayLR")
"""Schedules that set every parameter group to one rate (warmup_max_lr); WarmupCosineLR scales each group's own."""


def resolve_scheduler(section: Any, cfg: RunConfig, source: str, fill, optimizer_params: dict[str, Any]) -> None:
    """Check the `scheduler` section and fill its "auto" values in place with `fill(params, path, value, run_key)`
    (an explicit value that disagrees is refused there). The run config's values are counted in optimizer steps,
    the unit DeepSpeed's schedules count in. `optimizer_params`: the optimizer section's, whose rates of their own
    (Muon's muon_lr and adam_lr) a one-rate schedule would replace."""
    if not isinstance(section, dict):
        raise UserError(f"{source}: 'scheduler' must be a JSON object {{...}}, got {json.dumps(section)[:60]}")
    name = section.get("type")
    if name not in SCHEDULES:
        raise UserError(f"{source}: 'scheduler.type' is {json.dumps(name)}; the schedules taken are "
                        f"{', '.join(SCHEDULES)}, or leave 'scheduler' out for the run config's (linear warmup, "
                        "cosine to train.min_lr_ratio * train.lr)")
    own_rates = sorted(key for key in optimizer_params if key.endswith("_lr"))
    if name in SAME_RATE_EVERYWHERE and own_rates:
        raise UserError(f"{source}: {name} sets every parameter group to one rate (warmup_max_lr), which replaces the "
                        f"optimizer's {', '.join(own_rates)}; use WarmupCosineLR, which scales each group's own rate")
    if cfg.train.max_time is not None:
        raise UserError(f"{source}: a 'scheduler' section counts steps, and train.max_time ends the run by the clock: "
                        "remove one of them (the run config's own schedule completes inside train.max_time)")
    params = section.setdefault("params", {})
    if not isinstance(params, dict):
        raise UserError(f"{source}: 'scheduler.params' must be a JSON object {{...}}, got {json.dumps(params)[:60]}")
    takes = SCHEDULES[name]
    unknown = [key for key in params if key not in takes]
    if unknown:
        raise UserError(f"{source}: 'scheduler.params.{unknown[0]}' is not a parameter of {name} (it takes "
                        f"{', '.join(takes)}); remove it")
    t, per_step = cfg.train, optimizer_steps_per_step(cfg)
    for key in ("warmup_min_lr", "warmup_min_ratio"):  # no run-config value: the Hugging Face Trainer's 0
        if key in takes and params.get(key, "auto") == "auto":
            params[key] = 0.0
    steps = "" if per_step == 1 else " * grpo.updates_per_batch"
    for key, value, run_key in (("warmup_max_lr", t.lr, "train.lr"),
                                ("cos_min_ratio", t.min_lr_ratio, "train.min_lr_ratio"),
                                ("warmup_num_steps", max(1, t.warmup_steps * per_step),
                                 f"train.warmup_steps{steps} (at least 1)"),
                                ("total_num_steps", t.max_steps * per_step, f"train.max_steps{steps}")):
        if key in takes:
            fill(params, f"scheduler.params.{key}", value, run_key)
    for key, kind in takes.items():
        if key in params:
            params[key] = _checked(params[key], kind, f"{source}: 'scheduler.params.{key}'")


def _checked(value: Any, kind: type, where: str) -> Any:
    """`value` as DeepSpeed's schedule takes it (10.0 steps is 10), or a UserError naming `where`."""
    if kind is str:
        if value not in WARMUP_TYPES:
            raise UserError(f"{where} is {json.dumps(value)[:60]}, not one of {', '.join(WARMUP_TYPES)}")
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        if not (number and value == int(value) and value >= 1):
            raise UserError(f"{where} must be a whole number >= 1, got {json.dumps(value)[:60]}")
        return int(value)
    if not (number and value >= 0):
        raise UserError(f"{where} must be a number >= 0, got {json.dumps(value)[:60]}")
    return value


def unfinished_warmup_note(ds_config: dict[str, Any], cfg: RunConfig) -> str | None:
    """A note when the run ends inside the warmup of the resolved config's schedule, as
    `llm.train.schedule.unfinished_warmup_note` says it of the run config's own: without it, a run of 2 steps under
    Hugging Face's WarmupLR (its warmup filled from a recipe's 50 steps) trained at a learning rate of 0 throughout,
    and said nothing. DeepSpeed's warmups take at least 2 steps (a warmup of 0 or 1 step is raised to 2), and step
    k trains at the rate of the schedule's iteration k - 2 (the first two at the minimum): the log warmup reaches
    its peak at iteration warmup - 1, so at step warmup + 1, the linear one at iteration warmup, step warmup + 2. A
    run of 2 steps with no warmup asked for trained at 0 throughout."""
    params, per_step = ds_config["scheduler"]["params"], optimizer_steps_per_step(cfg)
    asked, total, kind = params["warmup_num_steps"], cfg.train.max_steps * per_step, params.get("warmup_type", "log")
    warmup = max(DEEPSPEED_LEAST_WARMUP, asked)
    peak = warmup + (1 if kind == "log" else 2)
    if total >= peak:
        return None
    steps = "" if per_step == 1 else " x grpo.updates_per_batch"
    raised = f", which DeepSpeed raises to {warmup}" if asked < warmup else ""
    lower = "" if asked <= DEEPSPEED_LEAST_WARMUP else \
        ", or lower train.warmup_steps (and warmup_num_steps, where the config gives it)"
    return (f"note: DeepSpeed's {kind} warmup (scheduler.params.warmup_num_steps={asked}{raised}) reaches its peak "
            f"learning rate at optimizer step {peak}, after the run's {total} (train.max_steps{steps}): the whole run "
            "trains below it, its first two steps at the minimum rate; raise train.max_steps to "
            f"{math.ceil(peak / per_step)}{lower}")


DEEPSPEED_LEAST_WARMUP = 2
"""DeepSpeed's warmup schedules raise `warmup_num_steps` to at least this."""


def scheduler_name(ds_config: Any) -> str | None:
    """The DeepSpeed schedule a resolved config names; None: the run config's own."""
    section = ds_config.get("scheduler") if isinstance(ds_config, dict) else None
    return section.get("type") if isinstance(section, dict) else None
