"""Next-token choice: greedy, or sampling with temperature, top-k, top-p and a repetition penalty."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from llm.devices import exact_dtype


class InvalidSampling(ValueError):
    """A sampling parameter out of its range: `field` names it (a SamplingParams field), `reason` says what it must
    be ("must be ..., got ..."), for callers that name the field their own way (a flag, a request field)."""

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name} {reason}")
        self.field, self.reason = field_name, reason


def _is_unicode(text: str) -> bool:
    """Whether `text` holds no lone surrogate (what Python makes of a command line's bytes that are not UTF-8): such
    a stop string could never match generated text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


SAMPLING_RANGES = {
    "max_new_tokens": (lambda v: v >= 0, "an integer >= 0"),
    "temperature": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    "top_k": (lambda v: v >= 0, "an integer >= 0 (0: off)"),
    "top_p": (lambda v: math.isfinite(v) and 0 < v <= 1, "a number in (0, 1]"),
    "repetition_penalty": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    "seed": (lambda v: v is None or -2**63 <= v < 2**63, "a 64-bit integer, in [-2**63, 2**63)"),  # OpenAI's, vLLM's
    "stop": (lambda v: "" not in v and all(_is_unicode(s) for s in v),
             "strings that are not empty, of valid Unicode"),
}
"""Each SamplingParams field's check, and what it must be, for the message."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    """0 means greedy (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches p (1 = off)."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens already in the prompt or output (CTRL-style: logit / p if > 0 else * p)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation (not included in the output)."""
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, (valid, expected) in SAMPLING_RANGES.items():
            value = getattr(self, name)
            if not valid(value):
                raise InvalidSampling(name, f"must be {expected}, got {value!r}")


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits `[batch, vocab]` (float32); seen: bool `[batch, vocab]` of tokens already present. Stays finite for
    any penalty > 0 (a tiny one would otherwise overflow a logit to inf, and the softmax to NaN)."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    largest = torch.finfo(logits.dtype).max
    return torch.where(seen, penalized.clamp(-largest, largest), logits)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    threshold = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < threshold, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cumulative - sorted_logits.softmax(-1) >= p  # tokens after the set already reaching p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def choose_next(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor,
                generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids `[batch]` from last-position logits `[batch, vocab]`."""
    logits = apply_repetition_penalty(logits.float(), seen, params.repetition_penalty)
    if params.temperature == 0:
        return logits.argmax(-1)
    # in float64 (a tiny temperature is 0 in float32) and with the largest logit shifted to 0 first, so that a tiny
    # temperature sends the others towards -inf (greedy in the limit) instead of overflowing to inf and a NaN softmax;
    # on MPS, without float64, in float32 at a temperature of at least its smallest normal number, the same limit
    dtype = exact_dtype(logits.device)
    logits = (logits.to(dtype) - logits.amax(-1, keepdim=True)) / max(params.temperature, torch.finfo(dtype).tiny)
    logits = filter_top_p(filter_top_k(logits, params.top_k), params.top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
