"""Learning-rate schedule: linear warmup, then cosine decay to `min_lr_ratio * lr` at `max_steps`, or, with a time
budget (`train.max_time`), at whichever of the step budget and the time budget runs out first
(`llm.train.time_budget`)."""

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
