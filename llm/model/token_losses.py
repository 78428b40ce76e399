"""Per-token losses over the vocabulary (cross-entropy, log-probabilities of targets, distillation's KL) computed a
chunk of positions at a time, so that a large vocabulary's logits are never all turned into fp32 at once.

Computed whole, a loss over `[batch, seq, vocab]` logits holds an fp32 copy of them and its log-softmax for the
backward, and the backward adds fp32 gradients of each: about 14 bytes per logit beside the logits themselves. At a
Qwen-sized vocabulary (152 k) and 32 k positions per micro-batch that is 70 GB for the loss alone, out of memory on an
80 GB GPU whatever the model. Here each chunk of positions (`CHUNK_ELEMENTS` logits) is computed in fp32 on its own
and, where gradients flow, recomputed in the backward (`torch.utils.checkpoint`): what stays is the logits (as the
model made them) and their gradient. Every value equals the whole computation's, bit for bit: each position's loss
depends on its own row of logits only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 1 << 24
"""Logits (positions x vocabulary) of one chunk: 64 MiB in fp32."""


def per_position(fn: Callable[..., torch.Tensor], logits: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """`fn` over the positions of `logits` `[..., vocab]` and of `others` (each `[...]` or `[..., vocab]`, the same
    leading shape), a chunk of rows at a time; `fn` takes the rows `[n, vocab]` (and `[n]` / `[n, vocab]`) and
    returns one value per row `[n]`. Returns `[...]`."""
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    rows = [logits.reshape(-1, vocab), *(t.reshape(-1, *t.shape[len(shape):]) for t in others)]
    size = max(1, CHUNK_ELEMENTS // vocab)
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
