"""Training objectives: what one micro-batch contributes to the loss. One trainer serves every stage;
a stage differs only in its dataset and its objective.

    pretrain, sft   CausalLMObjective: next-token cross-entropy over targets whose loss mask is 1 (all in
                    pretraining); packed SFT samples carry segment ids so they neither see each other nor share
                    positions
    dpo             DPOObjective: preference loss against a frozen reference model, log-probabilities
                    summed over reply tokens only
    grpo            GRPOObjective: clipped policy-ratio loss on group-normalised advantages, with a KL term to
                    a frozen reference, over completion tokens only (the rollouts are `llm.train.rollout`)
    distill         DistillObjective: cross-entropy mixed with the KL from a frozen teacher's softened token
                    distribution to the student's, over the targets whose loss mask is 1 (pretraining or SFT data)

Everything an objective returns stays on the training device (no host sync per micro-batch). An objective whose
loss is a mean over the 1s of a batch mask names that mask `token_mask` (None otherwise): the trainer then weighs
each micro-batch by its share of those tokens in the whole step (`Trainer._token_weights`). `metric_mask` names
the mask its metrics are means over in the same way (None: means over samples), so that a step's logged metric is
the mean over every such token of the step, however the tokens fell into micro-batches. An MoE policy's
load-balancing loss is a term of the micro-batch as a whole, not of its tokens: every objective returns it apart
(`MicroStep.aux`), outside that weight and outside a validation loss, computed over the batch's real tokens only
(segment ids > 0 in packed SFT rows, `real_tokens` in DPO's and GRPO's right-padded rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llm.config import GRPOConfig
from llm.model.token_losses import Distillation
from llm.train.engine import gathered


@dataclass
class MicroStep:
    loss: torch.Tensor
    """Scalar to backpropagate."""
    loss_tokens: torch.Tensor
    """Scalar: target positions that bear loss in this micro-batch."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Stage-specific scalars averaged into the logged row (e.g. DPO rewards)."""
    aux: torch.Tensor | None = None
    """Scalar backpropagated beside `loss` and unweighted by its tokens: an MoE policy's load-balancing loss
    (already scaled by model.moe_aux_loss_coef); None for a dense model."""


def loss_bearing_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Scalar: the targets whose loss mask is 1 (SFT), or every target of a batch without one (pretraining)."""
    mask, targets = batch.get("loss_mask"), batch["targets"]
    return mask.sum() if mask is not None else torch.full((), targets.numel(), device=targets.device)


class CausalLMObjective:
    """Next-token cross-entropy over every target (pretraining) or over loss_mask == 1 (SFT), computed by the model's
    output layer from its hidden states (`llm.model.transformer.OutputHead`), so that the micro-batch's logits are
    held one chunk at a time."""

    token_mask = metric_mask = "loss_mask"

    def __call__(self, engine, batch: dict[str, torch.Tensor]) -> MicroStep:
        out = engine(batch["tokens"], batch["targets"], batch.get("loss_mask"), segment_ids=batch.get("segment_ids"))
        return MicroStep(out.ce_loss, loss_bearing_tokens(batch), aux=out.aux_loss)


def real_tokens(mask: torch.Tensor) -> torch.Tensor:
    """`[batch, seq]` 1 on the real input tokens of right-padded rows whose `mask` marks the reply's targets (DPO's
    and GRPO's rows: prompt, reply, then padding): every position up to the row's last masked one."""
    return mask.flip(-1).float().cummax(-1).values.flip(-1)


class DPOObjective:
    """Direct Preference Optimization (Rafailov et al., 2023), or IPO (Azar et al., 2023) with loss='ipo'.

    `sft_weight` > 0 adds that much of the chosen replies' mean token negative log-likelihood (as in
    RPO, Pang et al., 2024), which keeps DPO from lowering the likelihood of the answers it prefers.
    """

    token_mask = metric_mask = None  # means over pairs

    def __init__(self, reference, beta: float, loss: str = "sigmoid", sft_weight: float = 0.0) -> None:
        self.reference, self.beta, self.loss, self.sft_weight = reference, beta, loss, sft_weight

    def _pair_logps(self, model, tokens, targets, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(chosen, rejected) log-probabilities summed over the masked positions of each row, in fp32, and the
        model's load-balancing loss (MoE)."""
        out = model(tokens, targets, token_mask=real_tokens(mask), logps_temperature=1.0)
        return *(out.token_logps * mask).sum(-1).chunk(2), out.aux_loss

    def __call__(self, engine, batch: dict[str, torch.Tensor]) -> MicroStep:
        tokens, targets, mask = (torch.cat([batch[f"chosen_{k}"], batch[f"rejected_{k}"]])
                                 for k in ("tokens", "targets", "mask"))
        policy_chosen, policy_rejected, aux = self._pair_logps(engine, tokens, targets, mask)
        with torch.no_grad():
            ref_chosen, ref_rejected, _ = self._pair_logps(self.reference, tokens, targets, mask)
        chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
        margin = chosen_ratio - rejected_ratio
        if self.loss == "ipo":
            loss = ((margin - 1 / (2 * self.beta)) ** 2).mean()
        else:
            loss = -F.logsigmoid(self.beta * margin).mean()
        if self.sft_weight > 0:
            chosen_tokens = mask.chunk(2)[0].sum(-1).clamp(min=1)
            loss = loss - self.sft_weight * (policy_chosen / chosen_tokens).mean()
        chosen_reward, rejected_reward = self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach()
        metrics = {"rewards/chosen": chosen_reward.mean(), "rewards/rejected": rejected_reward.mean(),
                   "rewards/accuracy": (chosen_reward > rejected_reward).float().mean(),
                   "rewards/margin": (chosen_reward - rejected_reward).mean()}
        return MicroStep(loss, mask.sum(), metrics, aux)


class GRPOObjective:
    """Group Relative Policy Optimization (Shao et al., 2024) on one micro-batch of scored rollouts.

    The batch holds `tokens`, `targets`, `mask` (1 on completion tokens), `advantages` (one per completion) and,
    with the KL term on, `ref_logps`. Per completion token, with ratio r = pi / pi_rollout and advantage A:

        grpo    -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)        (clip_high > clip_low: DAPO's clip-higher)
        cispo   -stopgrad(clip(r, 1 - clip_low, 1 + clip_high)) A log pi  (MiniMax-M1: every token keeps a gradient)

    plus kl_coef * KL(pi || pi_ref) by the unbiased estimator exp(ref - logp) - (ref - logp) - 1 (Schulman, 2020),
    averaged per completion and then over completions (DeepSeekMath), or over all completion tokens
    (`token_mean`, DAPO). pi_rollout is the policy that sampled the batch: the first update of a batch computes
    it (the optimizer has not stepped yet) and keeps it in the batch as `old_logps` for the later updates.
    Metrics: `kl` (mean per completion token) and `clip_fraction` (share of completion tokens whose ratio is
    clipped, where clipping removes the gradient for grpo), token means whichever mean the loss is.
    """

    metric_mask = "mask"

    def __init__(self, g: GRPOConfig) -> None:
        self.g = g
        self.token_mask = "mask" if g.token_mean else None  # else a mean over completions

    def _mean(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.g.token_mean:
            return (per_token * mask).sum() / mask.sum().clamp(min=1)
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()

    def __call__(self, engine, batch: dict[str, torch.Tensor]) -> MicroStep:
        g, mask = self.g, batch["mask"].float()
        out = engine(batch["tokens"], batch["targets"], token_mask=real_tokens(mask), logps_temperature=g.temperature)
        logps = out.token_logps
        old_logps = batch.setdefault("old_logps", logps.detach())
        completion = mask.bool()  # exponents off it are 0: a prompt or padding position far off (exp > fp32) was
        ratio = torch.exp(torch.where(completion, logps - old_logps, 0.0))  # inf there, and inf * 0 a NaN loss
        advantages = batch["advantages"].unsqueeze(-1)
        low, high = 1 - g.clip_low, 1 + g.clip_high
        if g.loss == "cispo":
            per_token = -ratio.clamp(low, high).detach() * advantages * logps
            clipped = (ratio < low) | (ratio > high)
        else:
            per_token = -torch.min(ratio * advantages, ratio.clamp(low, high) * advantages)
            clipped = ((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))
        n_tokens = mask.sum().clamp(min=1)
        metrics = {"clip_fraction": (clipped.float() * mask).sum() / n_tokens}
        if "ref_logps" in batch:
            delta = torch.where(completion, batch["ref_logps"] - logps, 0.0)
            kl = torch.exp(delta) - delta - 1
            per_token = per_token + g.kl_coef * kl
            metrics["kl"] = (kl.detach() * mask).sum() / n_tokens
        return MicroStep(self._mean(per_token, mask), mask.sum(), metrics, out.aux_loss)


class DistillObjective:
    """Distillation from a frozen teacher engine (same tokenizer and vocabulary, any shape) on pretraining or SFT
    micro-batches (`llm.model.token_losses.distillation_loss`; packed SFT samples reach the teacher with their
    segment ids too). The teacher gives its final hidden states and the student's output layer computes the loss
    with the teacher's output weight (gathered under ZeRO-3), a chunk of positions at a time, so that neither
    model's logits are made whole (`llm.model.token_losses.linear_distillation`).

    Metrics: `ce` (the student's cross-entropy) and `distill_kl` (the KL at temperature T, before the T^2 factor).
    In evaluation (the engine in eval mode) the loss is the student's cross-entropy alone and the teacher is not
    run, so a distilled run's val_loss compares with any other run's on the same data."""

    token_mask = metric_mask = "loss_mask"

    def __init__(self, teacher, alpha: float, temperature: float) -> None:
        self.teacher, self.alpha, self.temperature = teacher, alpha, temperature

    def __call__(self, engine, batch: dict[str, torch.Tensor]) -> MicroStep:
        tokens, targets, segment_ids = batch["tokens"], batch["targets"], batch.get("segment_ids")
        mask, loss_tokens = batch.get("loss_mask"), loss_bearing_tokens(batch)
        if not getattr(engine, "module", engine).training:  # DeepSpeed's engine passes train()/eval() to its module
            return CausalLMObjective()(engine, batch)
        with torch.no_grad():
            teacher_hidden = self.teacher(tokens, segment_ids=segment_ids, hidden_only=True).hidden
        teacher_weight = getattr(self.teacher, "module", self.teacher).output.weight  # an engine's, or a model's
        with gathered([teacher_weight]):
            distill = Distillation(teacher_hidden, teacher_weight.detach(), self.alpha, self.temperature)
            out = engine(tokens, targets, mask, segment_ids=segment_ids, distill=distill)
        metrics = {"ce": out.ce_loss.detach(), "distill_kl": out.distill_kl.detach()}
        return MicroStep(out.distill_loss, loss_tokens, metrics, out.aux_loss)
