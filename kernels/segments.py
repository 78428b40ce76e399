"""Packed sequences: the run of equal segment ids each token belongs to.

Packed SFT windows hold several samples in one row, each sample a contiguous run of one segment id
(padding, if any, one more run). A token attends only inside its run. The kernels need, per token,
where its run starts and ends, to skip key blocks outside it; computed here with a few vectorised
ops on the ids' device (no host synchronisation).
"""

from __future__ import annotations

import torch


def run_bounds(segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) int32 `[batch, seq]`: token i's run of equal ids is `start[i] <= j < end[i]`."""
    seq = segment_ids.shape[-1]
    index = torch.arange(seq, device=segment_ids.device).expand_as(segment_ids)
    changes = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.ones_like(segment_ids, dtype=torch.bool)
    first[:, 1:] = changes
    last = torch.ones_like(segment_ids, dtype=torch.bool)
    last[:, :-1] = changes
    start = torch.where(first, index, 0).cummax(dim=1).values
    end = torch.where(last, index + 1, seq).flip(1).cummin(dim=1).values.flip(1)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def check_segment_ids(segment_ids: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    """segment_ids must be integers `[batch, seq]` with seq the length of both q and k."""
    batch, seq_q, seq_k = q.shape[0], q.shape[-2], k.shape[-2]
    if segment_ids.dtype.is_floating_point or segment_ids.dtype == torch.bool or segment_ids.shape != (batch, seq_q) \
            or seq_q != seq_k:
        raise ValueError(f"attention: segment_ids must be integers [batch, seq] = [{batch}, {seq_q}] with as many keys "
                         f"as queries; got {segment_ids.dtype} {tuple(segment_ids.shape)} for {seq_k} keys")


def same_segment(segment_ids: torch.Tensor) -> torch.Tensor:
    """Dense bool `[batch, 1, seq, seq]`: whether tokens i and j lie in one run of equal ids (the test oracles' mask;
    the kernels never build it)."""
    start, _ = run_bounds(segment_ids)
    return (start[:, :, None] == start[:, None, :]).unsqueeze(1)
