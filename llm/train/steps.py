"""What one training step trains on. The trainer draws from the data and hands the draws to a step source, which
returns the step's micro-batches; every stage shares the loop in `llm.train.trainer` and differs only here and in
its objective.

    pretrain, sft, dpo   DataSteps: grad_accum micro-batches drawn from the prepared data, trained once
    grpo                 Rollouts (`llm.train.rollout`): prompts drawn, completions sampled from the current
                         policy and scored, trained `grpo.updates_per_batch` times

A step source has `draw_size` (samples per draw from the data loader), `draws_per_step`, `updates_per_step`,
`collate` (the data loader's collate function), `step_batches(draw, step) -> StepBatches`, `too_few(n, needed)`
(the message when the data holds fewer samples than one step takes) and `inputs` (what it draws from, for messages).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import default_collate

from llm.config import RunConfig
from llm.data.datasets import checked_to
from llm.wording import plural

Batch = dict[str, torch.Tensor]


@dataclass
class StepBatches:
    micro_batches: list[Batch]
    """Trained in order, `updates_per_step` times over."""
    positions: int
    """Token positions one pass over the micro-batches feeds the model (for training throughput)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Step-level scalars of this rank on the device (e.g. GRPO's rewards), averaged over ranks when logged."""
    generated_tokens: int = 0
    """Tokens this rank generated to make the step (GRPO's rollouts)."""
    generation_seconds: float = 0.0
    """Host time this rank spent generating and scoring them."""


class DataSteps:
    """Pretraining, SFT and DPO: a step trains once on grad_accum micro-batches of prepared data."""

    updates_per_step = 1
    collate = staticmethod(default_collate)

    def __init__(self, cfg: RunConfig, device: torch.device) -> None:
        t = cfg.train
        self.inputs, self.vocab_size, self.pairs = cfg.data.path, cfg.model.vocab_size, cfg.train.stage == "dpo"
        self.draw_size, self.draws_per_step, self.device = t.micro_batch_size, t.grad_accum, device
        self.positions = t.micro_batch_size * t.grad_accum * cfg.data.seq_len * (2 if self.pairs else 1)
        """Positions the policy trains on per step on this rank: a DPO pair is two rows, chosen and rejected."""

    def too_few(self, n_samples: int, needed: int) -> str:
        ranks = needed // (self.draw_size * self.draws_per_step)
        what = "preference pairs" if self.pairs else "windows of data.seq_len positions"
        lower = "train.micro_batch_size, train.grad_accum or the ranks" if self.pairs else \
            "train.micro_batch_size, train.grad_accum, the ranks or data.seq_len (shorter windows, more of them)"
        return (f"{self.inputs}: the train split has {n_samples} {what}, fewer than one global batch ({needed}: "
                f"train.micro_batch_size {self.draw_size} x train.grad_accum {self.draws_per_step} x {ranks} "
                f"{plural('rank', ranks)}); add data, or lower {lower}")

    def step_batches(self, draw: Callable[[], Any], step: int) -> StepBatches:
        micro_batches = [checked_to(self.device, draw(), self.vocab_size, self.inputs, "train")
                         for _ in range(self.draws_per_step)]
        return StepBatches(micro_batches, self.positions)
