"""Attention on PyTorch's own fused paths: what backend 'torch' (and 'auto' where no Triton kernel is verified) runs.

- Plain causal / full attention: `F.scaled_dot_product_attention`, which picks flash, cuDNN or
  memory-efficient kernels on CUDA (a dense mask only for a causal q shorter than k, chunked prefill).
- Packed sequences (`segment_ids`), never through a `[seq, seq]` mask:
  on CUDA GPUs of compute capability 8.0 and later FlexAttention (compiled once per process) with a block mask
  built from the segments' bounds, so blocks outside a token's segment are skipped; elsewhere one SDPA call per
  segment (the CPU, and GPUs before Ampere: V100, T4, RTX 20xx, where FlexAttention has no compiled kernel and
  PyTorch's eager fallback builds the whole score matrix, its fp16 backward failing on mixed dtypes).
- An explicit boolean mask (KV cache with left padding) or dropout: SDPA with that mask or dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kernels import reference
from kernels.segments import run_bounds

FLEX_BLOCK = 128
_compiled_flex = None


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                     attn_mask: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    """SDPA with a boolean `attn_mask` `[batch, 1, seq_q, seq_k]` (True = may attend) and/or dropout; the causal
    mask (bottom-right aligned) is combined with `attn_mask` when `causal`."""
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    causal = causal and seq_q > 1
    if causal and (attn_mask is not None or seq_q != seq_k):
        tril = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(diagonal=seq_k - seq_q)
        attn_mask = tril if attn_mask is None else attn_mask & tril
        causal = False
    k, v, gqa = reference.grouped_kv(q, k, v, attn_mask, q.device.type)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal,
                                          scale=scale, enable_gqa=gqa)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None,
              segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    if segment_ids is None:
        return reference.attention(q, k, v, causal, scale)
    if flex_attention_compiles(q.device):
        return flex_segment_attention(q, k, v, causal, scale, segment_ids, compiled=True)
    return per_segment_attention(q, k, v, causal, scale, segment_ids)


FLEX_MIN_CAPABILITY = (8, 0)
"""The oldest GPUs FlexAttention compiles a kernel for: below Ampere PyTorch runs its eager dense fallback."""


def flex_attention_compiles(device: torch.device) -> bool:
    """Whether packed attention on `device` runs compiled FlexAttention (a CUDA GPU of sm_80 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FLEX_MIN_CAPABILITY


def per_segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                          segment_ids: torch.Tensor) -> torch.Tensor:
    """One SDPA call per segment (a run of equal ids); reads the bounds on the host, so meant for the CPU."""
    start, end = run_bounds(segment_ids)
    gqa = q.shape[1] != k.shape[1]
    rows = []
    for b, (starts, ends) in enumerate(zip(start.tolist(), end.tolist())):
        pieces = [F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e],
                                                 is_causal=causal, scale=scale, enable_gqa=gqa)
                  for i, (s, e) in enumerate(zip(starts, ends)) if i == 0 or s != starts[i - 1]]
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)


def segment_block_mask(segment_ids: torch.Tensor, causal: bool, block: int = FLEX_BLOCK) -> BlockMask:
    """FlexAttention block mask of packed segments: per query block, the key blocks inside the segments of its rows,
    marked full where every pair is visible; built from the segments' bounds, O(batch * (seq / block)^2)."""
    seq = segment_ids.shape[1]
    start, end = run_bounds(segment_ids)
    n_blocks = -(-seq // block)
    first = torch.arange(n_blocks, device=segment_ids.device) * block
    last = (first + block).clamp(max=seq) - 1
    lo, hi = start[:, first].long(), end[:, last].long()  # keys seen by some row of the block: [lo, hi)
    if causal:
        hi = torch.minimum(hi, last + 1)
    key_first, key_last = first[None, None, :], last[None, None, :]
    touched = (key_first < hi[:, :, None]) & (key_last >= lo[:, :, None])
    one_segment = start[:, first] == start[:, last]
    full = one_segment[:, :, None] & (key_first >= lo[:, :, None]) & (key_last < end[:, first, None])
    if causal:
        full = full & (key_last <= first[None, :, None])
    partial = touched & ~full

    def blocks(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = selected.sum(-1, dtype=torch.int32)
        indices = torch.argsort(~selected, dim=-1, stable=True).to(torch.int32)  # selected blocks first, in order
        return counts[:, None], indices[:, None]

    def same_segment(b, h, q_idx, kv_idx):
        visible = start[b, q_idx] == start[b, kv_idx]
        return visible & (kv_idx <= q_idx) if causal else visible

    return BlockMask.from_kv_blocks(*blocks(partial), *blocks(full), BLOCK_SIZE=block, mask_mod=same_segment,
                                    seq_lengths=(seq, seq))


def flex_segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                           segment_ids: torch.Tensor, compiled: bool) -> torch.Tensor:
    """FlexAttention over packed segments; `compiled` runs the fused kernel (CUDA), else the eager reference."""
    global _compiled_flex
    run = flex_attention
    if compiled:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        run = _compiled_flex
    return run(q, k, v, block_mask=segment_block_mask(segment_ids, causal), scale=scale,
               enable_gqa=q.shape[1] != k.shape[1])
