"""Rotary position embedding tables (rotate-half layout), with optional YaRN context extension.

The tables are `cos`, `sin` of shape `[positions, head_dim // 2]`; `kernels.apply_rope` applies them.
YaRN follows "YaRN: Efficient Context Window Extension of Large Language Models" (Peng et al., 2023)
as Hugging Face implements it (`_compute_yarn_parameters`, truncate true): low frequencies are interpolated by
`factor`, high ones kept, a linear ramp between, and the tables scaled by 0.1 * ln(factor) + 1. The ramp's
correction range is clamped to [0, head_dim - 1] (not head_dim // 2 - 1), as there and in the YaRN authors' code.
Llama 3.1's scaling follows Hugging Face's `_compute_llama3_parameters`: frequencies whose wavelength is above the
original length / low_freq_factor are divided by `factor`, those below original length / high_freq_factor kept,
and those between blended by where original length / wavelength falls from low to high; the tables are not scaled.
"""

from __future__ import annotations

import math

import torch

from llm.config import ModelConfig


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    def correction_dim(num_rotations: float) -> float:
        wavelengths = cfg.rope_original_max_seq_len / (num_rotations * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(cfg.rope_theta))

    low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    scaled = inv_freq / cfg.rope_factor * ramp + inv_freq * extrapolation_weight
    return scaled, yarn_attention_scale(cfg.rope_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    low, high = cfg.llama3_low_freq_factor, cfg.llama3_high_freq_factor
    rotations = cfg.rope_original_max_seq_len * inv_freq / (2 * math.pi)  # original length / wavelength
    smooth = ((rotations - low) / (high - low)).clamp(0, 1)  # 0: divided by factor, 1: kept
    return inv_freq / cfg.rope_factor * (1 - smooth) + inv_freq * smooth


def yarn_attention_scale(factor: float) -> float:
    """What YaRN scales the tables by (its attention temperature): 0.1 * ln(factor) + 1."""
    return 0.1 * math.log(factor) + 1.0


def rope_tables(cfg: ModelConfig, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the first `length` positions (default max_seq_len), each float32 `[length, head_dim // 2]` on
    the CPU (computed there in float64, whatever the default device; callers move them); a position's row does not
    depend on `length`."""
    with torch.device("cpu"):
        head_dim = cfg.attention_head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        scale = 1.0
        if cfg.rope_scaling == "yarn":
            inv_freq, scale = _yarn_inv_freq(inv_freq, head_dim, cfg)
        elif cfg.rope_scaling == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, cfg)
        angles = torch.outer(torch.arange(length or cfg.max_seq_len, dtype=torch.float64), inv_freq)
        return (angles.cos() * scale).float(), (angles.sin() * scale).float()


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Position of every token within its segment (`segment_ids` `[batch, seq]`, equal ids contiguous)."""
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values
