"""Training objectives: what one micro-batch contributes to the loss. One trainer serves every stage;
a stage differs only in its dataset and its objective."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroStep:
    loss: torch.Tensor
    """Scalar to backpropagate."""
    loss_tokens: int
    """Target positions that bear loss in this micro-batch."""


def causal_lm(engine, batch: dict[str, torch.Tensor]) -> MicroStep:
    """Next-token cross-entropy over every target (pretraining) or over loss_mask == 1 (when present)."""
    mask = batch.get("loss_mask")
    out = engine(batch["tokens"], batch["targets"], mask)
    loss_tokens = int(mask.sum()) if mask is not None else batch["targets"].numel()
    return MicroStep(out.loss, loss_tokens)


OBJECTIVES = {"pretrain": causal_lm}
