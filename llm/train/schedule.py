"""Learning-rate schedule: linear warmup, then cosine decay to `min_lr_ratio * lr` at `max_steps`, or, with a time
budget (`train.max_time`), at whichever of the step budget and the time budget runs out first
(`llm.train.time_budget`). Step s (0-based) of the step budget is at progress (s - warmup) / (max_steps - warmup),
as Hugging Face's and MiniMind's cosine schedules are: its last step runs one step short of the floor. The time
budget's progress is measured at the end of each step: its last step runs at the floor."""

from __future__ import annotations

import math

from llm.config import TrainConfig
from llm.train.time_budget import TimeBudget


def lr_multiplier(step: int, t: TrainConfig, budget: TimeBudget | None = None) -> float:
    """Multiplier of train.lr for optimizer step `step` (0-based)."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    decay_steps = max(1, t.max_steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / decay_steps)
    if budget is not None:
        progress = max(progress, budget.progress(step))
    return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def unfinished_warmup_note(t: TrainConfig) -> str | None:
    """A note when the run ends inside its warmup (`train.warmup_steps` above `train.max_steps`, as a short run of a
    recipe with a long warmup does): its learning rate rises for the whole run, never reaching train.lr nor decaying.
    A time budget only shortens a run; one that ends it inside its warmup says so at the run's end
    (`TimeBudget.warmup_note`)."""
    if t.warmup_steps <= t.max_steps:
        return None
    return (f"note: train.warmup_steps={t.warmup_steps} is above train.max_steps={t.max_steps}: the learning rate "
            f"rises for the whole run, to {t.max_steps / t.warmup_steps:.0%} of train.lr at its last step, and never "
            "decays; lower train.warmup_steps")
