"""Per-token losses over the vocabulary (cross-entropy, log-probabilities of targets, distillation's KL) computed a
chunk of positions at a time, so that a large vocabulary's logits are never all turned into fp32 at once.

Computed whole, a loss over `[batch, seq, vocab]` logits holds an fp32 copy of them and its log-softmax for the
backward, and the backward adds fp32 gradients of each: about 14 bytes per logit beside the logits themselves. At a
Qwen-sized vocabulary (152 k) and 32 k positions per micro-batch that is 70 GB for the loss alone, out of memory on an
80 GB GPU whatever the model. Here each chunk of positions (`CHUNK_ELEMENTS` logits) is computed in fp32 on its own
and, where gradients flow, recomputed in the backward (`torch.utils.checkpoint`): what stays is the logits (as the
model made them) and their gradient. Every value equals the whole computation's, bit for bit: each position's loss
depends on its own row of logits only.

Training's cross-entropy goes further (`linear_cross_entropy`, which the model's output layer runs given targets:
`llm.model.transformer.OutputHead`): the output projection and the loss are fused, so that beyond one chunk the
`[positions, vocab]` logits and their gradient are never made whole, in the forward or in the backward; one chunk's
exist at a time (as in Liger-Kernel's FusedLinearCrossEntropy). Of the two ways to have the gradients without keeping
the chunks, recomputing each chunk's logits in the backward (as `per_position` does) or computing the gradients of
the hidden states and of the weight chunk by chunk in the forward (the loss's normalisation, the mask's sum, is known
there) and only scaling them by the incoming gradient in the backward, this takes the second, by cost:
- FLOPs: the head's three matmuls (logits, the input's gradient, the weight's), as the whole computation has them;
  recomputation adds a fourth, a third more of the head's, which is a quarter of a small model with a large
  vocabulary (Qwen2.5-0.5B: 136 M of 494 M parameters).
- Precision: the weight's gradient is summed over the chunks in fp32 (then stored in the weight's dtype); autograd
  would sum the recomputed chunks' gradients in bf16, one rounding per chunk. The gradients kept are of the masked
  sum of the losses, divided by the token count only with the incoming gradient (fp16's loss scale) in the
  backward: (softmax - one_hot) / tokens alone is below fp16's range for most logits.
- Memory: what it keeps for the backward (one gradient the size of the hidden states, one the size of the weight,
  in their dtypes) is what the backward makes anyway, only made earlier; the fp32 sum of the weight's gradient lives
  during the forward of the loss.
The gradients are made only where they are wanted: with grad mode on, for whichever of the hidden states and the
weight requires one (LoRA's frozen head: the hidden states' only); evaluation computes the loss alone.

Distillation's loss is a mean over the loss-bearing positions as the cross-entropy is, and is fused the same way
(`linear_distillation`): the student's output layer is given the teacher's final hidden states and output weight, and
each chunk makes both models' logits, the loss and its gradients.

DPO and GRPO want the log-probability of each target (`linear_token_logps`, which the output layer runs given targets
and a temperature) and combine them into their loss afterwards, so the gradient reaching each position is known only
in the backward: there each chunk's logits are made again from the kept hidden states and weight (one matmul more
than the whole computation, no logits kept), and the weight's gradient is again summed in fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 1 << 24
"""Logits (positions x vocabulary) of one chunk: 64 MiB in fp32."""


def chunk_positions(vocab: int) -> int:
    """Positions in one chunk of logits over `vocab`: at least one, and at most `CHUNK_ELEMENTS` logits (a row
    longer than that is a chunk alone)."""
    return max(1, CHUNK_ELEMENTS // vocab)


def per_position(fn: Callable[..., torch.Tensor], logits: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """`fn` over the positions of `logits` `[..., vocab]` and of `others` (each `[...]` or `[..., vocab]`, the same
    leading shape), a chunk of rows at a time; `fn` takes the rows `[n, vocab]` (and `[n]` / `[n, vocab]`) and
    returns one value per row `[n]`. Returns `[...]`."""
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    rows = [logits.reshape(-1, vocab), *(t.reshape(-1, *t.shape[len(shape):]) for t in others)]
    size = chunk_positions(vocab)
    if rows[0].shape[0] <= size:
        return fn(*rows).reshape(shape)
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in rows)
    chunks = zip(*(t.split(size) for t in rows), strict=True)  # one split each: its backward is one concatenation
    return torch.cat([checkpoint(fn, *chunk, use_reentrant=False) if recompute else fn(*chunk)
                      for chunk in chunks]).reshape(shape)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="none")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 at every position `[...]` (`targets` `[...]`)."""
    return per_position(_cross_entropy, logits, targets)


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) at every position `[...]`, in fp32, of the distribution softmax(logits / temperature)."""

    def logps(rows: torch.Tensor, row_targets: torch.Tensor) -> torch.Tensor:
        rows = rows.float() if temperature == 1.0 else rows.float() / temperature
        return torch.log_softmax(rows, dim=-1).gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)

    return per_position(logps, logits, targets)


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(softmax(teacher / T) || softmax(student / T)) at every position `[...]`, in fp32, summed over the
    vocabulary."""

    def kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        teacher_logps = torch.log_softmax(teacher.float() / temperature, dim=-1)
        student_logps = torch.log_softmax(student.float() / temperature, dim=-1)
        return F.kl_div(student_logps, teacher_logps, log_target=True, reduction="none").sum(-1)

    return per_position(kl, student_logits, teacher_logits)


def _mask_and_total(targets: torch.Tensor, loss_mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the loss mask flat in fp32 or None, the count of loss-bearing positions in fp32, at least 1)."""
    if loss_mask is None:
        return None, torch.full((), targets.numel(), dtype=torch.float32, device=targets.device)
    mask = loss_mask.reshape(-1).to(torch.float32)
    return mask, mask.sum().clamp(min=1.0)


def _masked_mean(per_token: torch.Tensor, mask: torch.Tensor | None, total: torch.Tensor) -> torch.Tensor:
    return per_token.mean() if mask is None else (per_token * mask).sum() / total


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy in fp32 of the logits `F.linear(hidden, weight)` (`hidden` `[..., dim]`, `weight`
    `[vocab, dim]`) against `targets` `[...]`, over the positions where `loss_mask` is 1 (all without a mask), made a
    chunk of positions at a time and never kept: neither the logits nor their gradient exist whole, in the forward
    or in the backward (see the module docstring)."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    mask, total = _mask_and_total(targets, loss_mask)
    return _gradients_in_forward(hidden, weight, total, functools.partial(_cross_entropy_chunks, hidden, weight,
                                                                          targets, mask, total))[0]


class Distillation(NamedTuple):
    """What distillation gives the student's output layer (`linear_distillation`): the teacher's side of the KL."""

    teacher_hidden: torch.Tensor
    """`[..., teacher dim]`: the teacher's final hidden states, normalised (its output layer's input)."""
    teacher_weight: torch.Tensor
    """`[vocab, teacher dim]`: the teacher's output weight (gathered under ZeRO-3), frozen."""
    alpha: float
    temperature: float


def linear_distillation(hidden: torch.Tensor, weight: torch.Tensor, distill: Distillation, targets: torch.Tensor,
                        loss_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`distillation_loss` of the student's logits `F.linear(hidden, weight)` and the teacher's
    `F.linear(distill.teacher_hidden, distill.teacher_weight)`, made a chunk of positions at a time with the
    gradients in the forward, as `linear_cross_entropy` (the loss is a mean over the masked positions, known there):
    neither model's logits exist whole. Returns (loss, ce, kl); only the loss has a gradient."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    teacher = distill._replace(teacher_hidden=distill.teacher_hidden.reshape(-1, distill.teacher_hidden.shape[-1]))
    mask, total = _mask_and_total(targets, loss_mask)
    return _gradients_in_forward(hidden, weight, total, functools.partial(_distillation_chunks, hidden, weight,
                                                                          teacher, targets, mask, total))


def _gradients_in_forward(hidden: torch.Tensor, weight: torch.Tensor, total: torch.Tensor,
                          chunks: Callable[[bool, bool], tuple]) -> tuple[torch.Tensor, ...]:
    """(loss, *metrics) of `chunks(need_hidden, need_weight)`, which returns them with the gradients of the loss times
    `total` for `hidden` and `weight` (None where not needed), through `_GradientsInForward` where a gradient is
    wanted."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _GradientsInForward.apply(hidden, weight, total, chunks)
    loss, metrics, _, _ = chunks(False, False)
    return loss, *metrics


class _GradientsInForward(torch.autograd.Function):
    """A loss over chunks of `F.linear(hidden, weight)` whose gradients its `chunks` computes in the forward; the
    backward only scales them. Its other outputs are metrics, without gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, total, chunks):
        loss, metrics, grad_hidden, grad_weight = chunks(*ctx.needs_input_grad[:2])
        ctx.save_for_backward(grad_hidden, grad_weight, total)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(*metrics)
        return loss, *metrics

    @staticmethod
    def backward(ctx, grad_loss, *metrics_grads):
        """The saved gradients are of the masked sum, not the mean: divided by the token count here, with the
        incoming gradient (under fp16, the loss scale), never alone, which in fp16 would flush most to zero."""
        grad_hidden, grad_weight, total = ctx.saved_tensors  # not scaled in place: a second backward finds them
        factor = grad_loss / total
        return (None if grad_hidden is None else grad_hidden * factor.to(grad_hidden.dtype),
                None if grad_weight is None else (grad_weight * factor).to(ctx.weight_dtype), None, None)


def _gradient_buffers(hidden: torch.Tensor, weight: torch.Tensor, need_hidden: bool,
                      need_weight: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Where the chunks put their gradients: the hidden states' (their dtype), the weight's (summed in fp32)."""
    return (torch.empty_like(hidden) if need_hidden else None,
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None)


def _weight_gradient(grad_weight: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's summed gradient in the weight's dtype, but fp32 for an fp16 weight, whose range a sum over the
    positions may exceed before the backward divides it by their count."""
    return grad_weight if grad_weight is None or weight.dtype == torch.float16 else grad_weight.to(weight.dtype)


def _cross_entropy_chunks(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          mask: torch.Tensor | None, total: torch.Tensor, need_hidden: bool, need_weight: bool):
    """(loss, no metrics, gradient of the masked sum of the positions' losses (the loss times `total`) for `hidden`
    `[n, dim]` or None, and for `weight` (`_weight_gradient`) or None), one chunk of logits at a time. A position's
    loss is F.cross_entropy's, -log_softmax at its target; the gradient of its logits, (softmax - one_hot(target)) *
    mask, is made in place of that chunk's log-softmax."""
    per_token = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
    grad_hidden, grad_weight = _gradient_buffers(hidden, weight, need_hidden, need_weight)
    for rows in _chunk_rows(hidden.shape[0], weight.shape[0]):
        chunk, chunk_targets = hidden[rows], targets[rows, None]
        logps = _chunk_logps(chunk, weight, 1.0)
        per_token[rows] = -logps.gather(-1, chunk_targets).squeeze(-1)
        if need_hidden or need_weight:
            grad = _softmax_minus_one_hot(logps, chunk_targets)
            grad = (grad if mask is None else grad.mul_(mask[rows].unsqueeze(-1))).to(hidden.dtype)
            _add_chunk_gradients(grad, chunk, weight, rows, grad_hidden, grad_weight)
            del grad
        del logps  # before the next chunk's logits: one chunk's at a time
    return _masked_mean(per_token, mask, total), (), grad_hidden, _weight_gradient(grad_weight, weight)


def _distillation_chunks(hidden: torch.Tensor, weight: torch.Tensor, teacher: Distillation, targets: torch.Tensor,
                         mask: torch.Tensor | None, total: torch.Tensor, need_hidden: bool, need_weight: bool):
    """(loss, (ce, kl), gradients as `_cross_entropy_chunks`'s) of `distillation_loss`, one chunk of positions at a
    time. The gradient of a position's logits z, for the teacher's t at temperature T, is
    (1 - alpha) (softmax(z) - one_hot(target)) + alpha T (softmax(z / T) - softmax(t / T))."""
    alpha, temperature = teacher.alpha, teacher.temperature
    per_ce = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
    per_kl = torch.empty_like(per_ce)
    grad_hidden, grad_weight = _gradient_buffers(hidden, weight, need_hidden, need_weight)
    for rows in _chunk_rows(hidden.shape[0], weight.shape[0]):
        chunk, chunk_targets = hidden[rows], targets[rows, None]
        logps = _chunk_logps(chunk, weight, 1.0)
        softened = logps if temperature == 1.0 else _chunk_logps(chunk, weight, temperature)
        teacher_logps = _chunk_logps(teacher.teacher_hidden[rows], teacher.teacher_weight, temperature)
        per_ce[rows] = -logps.gather(-1, chunk_targets).squeeze(-1)
        per_kl[rows] = F.kl_div(softened, teacher_logps, log_target=True, reduction="none").sum(-1)
        if need_hidden or need_weight:
            towards_teacher = softened.exp().sub_(teacher_logps.exp_()).mul_(alpha * temperature)
            grad = _softmax_minus_one_hot(logps, chunk_targets).mul_(1 - alpha).add_(towards_teacher)
            del towards_teacher
            grad = (grad if mask is None else grad.mul_(mask[rows].unsqueeze(-1))).to(hidden.dtype)
            _add_chunk_gradients(grad, chunk, weight, rows, grad_hidden, grad_weight)
            del grad
        del logps, softened, teacher_logps  # before the next chunk's logits: one chunk's at a time
    ce, kl = _masked_mean(per_ce, mask, total), _masked_mean(per_kl, mask, total)
    loss = (1 - alpha) * ce + alpha * temperature ** 2 * kl
    return loss, (ce, kl), grad_hidden, _weight_gradient(grad_weight, weight)


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean token cross-entropy in fp32 over positions where loss_mask is 1 (all positions without a mask), a chunk
    of positions at a time."""
    return _masked_mean(cross_entropy(logits, targets).reshape(-1), *_mask_and_total(targets, loss_mask))


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                      loss_mask: torch.Tensor | None, alpha: float,
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, ce, kl) of knowledge distillation (Hinton et al., 2015), in fp32, each a mean over the positions whose
    loss mask is 1 (all without a mask):

        loss = (1 - alpha) * CE(student, targets) + alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))

    The forward KL sums over the whole vocabulary; T^2 keeps its gradients the size of the cross-entropy's as T
    grows (the softened distributions' gradients shrink by 1/T^2)."""
    ce = masked_cross_entropy(student_logits, targets, loss_mask)
    kl = _masked_mean(forward_kl(student_logits, teacher_logits, temperature).reshape(-1),
                      *_mask_and_total(targets, loss_mask))
    return (1 - alpha) * ce + alpha * temperature ** 2 * kl, ce, kl


def _chunk_logps(chunk: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax in fp32 of one chunk's logits at `temperature`, as `token_logps` computes it from the logits."""
    logits = F.linear(chunk, weight).float()
    return torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)


def linear_token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    """log p(target) at every position `[...]`, in fp32, of softmax(F.linear(hidden, weight) / temperature)
    (`hidden` `[..., dim]`, `weight` `[vocab, dim]`), a chunk of positions at a time: the logits are never whole, and
    the backward makes each chunk's again (see the module docstring)."""
    shape = targets.shape
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearTokenLogps.apply(hidden, weight, targets, temperature).reshape(shape)
    logps = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
    for rows in _chunk_rows(hidden.shape[0], weight.shape[0]):
        logps[rows] = _chunk_logps(hidden[rows], weight, temperature).gather(-1, targets[rows, None]).squeeze(-1)
    return logps.reshape(shape)


def _chunk_rows(positions: int, vocab: int) -> list[slice]:
    size = chunk_positions(vocab)
    return [slice(start, start + size) for start in range(0, positions, size)]


class _LinearTokenLogps(torch.autograd.Function):
    """`linear_token_logps` keeping the hidden states and the weight, each chunk's logits made again in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        with torch.no_grad():
            logps = linear_token_logps(hidden, weight, targets, temperature)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature = temperature
        return logps

    @staticmethod
    def backward(ctx, grad_logps):
        """d log p(t) / d logits = (one_hot(t) - softmax) / T, times the incoming gradient of each position."""
        hidden, weight, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        scale = grad_logps.float() / -ctx.temperature
        for rows in _chunk_rows(hidden.shape[0], weight.shape[0]):
            chunk, chunk_targets = hidden[rows], targets[rows, None]
            grad = _softmax_minus_one_hot(_chunk_logps(chunk, weight, ctx.temperature), chunk_targets)
            _add_chunk_gradients(grad.mul_(scale[rows, None]).to(hidden.dtype), chunk, weight, rows, grad_hidden,
                                 grad_weight)
            del grad  # before the next chunk's logits: one chunk's at a time
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def _softmax_minus_one_hot(logps: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """softmax - one_hot(targets) of a chunk's log-softmax `[n, vocab]` (`targets` `[n, 1]`), made in its place: the
    gradient of -log p(target) for the chunk's logits."""
    minus_one = torch.full(targets.shape, -1.0, device=logps.device)
    return logps.exp_().scatter_add_(-1, targets, minus_one)


def _add_chunk_gradients(grad_logits: torch.Tensor, chunk: torch.Tensor, weight: torch.Tensor, rows: slice,
                         grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None) -> None:
    """From a chunk's logits' gradient (in the hidden states' dtype): its rows of the hidden states' gradient, and
    its share of the weight's, summed into `grad_weight` (fp32 for a bf16 or fp16 weight)."""
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden[rows])
    if grad_weight is not None:
        if grad_weight.dtype == grad_logits.dtype:
            grad_weight.addmm_(grad_logits.t(), chunk)
        else:
            grad_weight += grad_logits.t() @ chunk
