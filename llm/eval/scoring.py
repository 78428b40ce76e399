"""Scoring token sequences with a model: the log-likelihood of the last tokens of each sequence given the ones
before it, in batches. Perplexity (`llm.eval.perplexity`) and the lm-evaluation-harness wrapper
(`llm.eval.harness`) both score through `score_sequences`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from llm.devices import exact_dtype
from llm.model import Transformer
from llm.model.token_losses import cross_entropy


@dataclass(frozen=True)
class Score:
    nats: float
    """Negative log-likelihood of the scored tokens, summed (float64)."""
    greedy: bool
    """Whether every scored token is the model's most likely next token."""
    tokens: int
    """How many tokens were scored."""


@torch.no_grad()
def score_sequences(model: Transformer, sequences: Sequence[np.ndarray], scored: Sequence[int], batch_size: int,
                    pad_id: int = 0, context_only: Sequence[Sequence[int]] | None = None) -> Iterator[Score]:
    """For each sequence of n tokens, the model reads its first n - 1 tokens and the last `scored` of its n - 1
    targets count, less those at the sequence's `context_only` positions (read, never scored: a document's BOS).
    Sequences are right-padded into batches of `batch_size` (padding is never attended to: the mask is causal);
    yields one `Score` per sequence, in order."""
    device = next(model.parameters()).device
    for first in range(0, len(sequences), batch_size):
        group, counts = sequences[first:first + batch_size], scored[first:first + batch_size]
        unscored = context_only[first:first + batch_size] if context_only is not None else [()] * len(group)
        width = max(len(s) for s in group) - 1
        tokens = torch.full((len(group), width), pad_id, dtype=torch.long)
        targets = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.bool)
        for row, (sequence, count, positions) in enumerate(zip(group, counts, unscored, strict=True)):
            n = len(sequence) - 1
            tokens[row, :n] = torch.from_numpy(np.asarray(sequence[:-1], dtype=np.int64))
            targets[row, :n] = torch.from_numpy(np.asarray(sequence[1:], dtype=np.int64))
            mask[row, n - count:n] = True
            mask[row, [p - 1 for p in positions]] = False  # position p is target p - 1
        tokens, targets, mask = tokens.to(device), targets.to(device), mask.to(device)
        logits = model(tokens).logits
        nats = cross_entropy(logits, targets).to(exact_dtype(logits.device))  # a chunk of positions at a time, in fp32
        nats = (nats * mask).sum(1)
        greedy = ((logits.argmax(-1) == targets) | ~mask).all(1)
        for value, is_greedy, count in zip(nats.tolist(), greedy.tolist(), mask.sum(1).tolist(), strict=True):
            yield Score(value, is_greedy, count)
