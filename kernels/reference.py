"""Plain-torch reference implementations: the oracle for kernel tests and the torch path for RMSNorm, RoPE, SwiGLU.

Layouts shared with the Triton kernels and the model:
- q `[batch, n_heads, seq, head_dim]`, k and v `[batch, n_kv_heads, seq_k, head_dim]`;
- RoPE tables `cos`, `sin` of shape `[max_positions, head_dim // 2]` (rotate-half layout), applied at
  rows `position_offset ... position_offset + seq - 1`, or at `positions[b, s]` per token;
- segment ids `[batch, seq]`: a token attends only to keys of its segment, the run of equal consecutive ids it
  lies in (packed samples, each a run of one id; an id that comes back later starts another segment). Here as a
  dense mask: this is the oracle; `kernels.torch_attention` is the torch path that avoids the `[seq, seq]` mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.segments import same_segment


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for half types, the input's own dtype when wider (float64 makes the test oracle)."""
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, computed in fp32 (or wider) and cast back to x's dtype."""
    xc = x.to(_compute_dtype(x))
    normed = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.to(xc.dtype)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x `[..., seq, head_dim]` by angles whose cos/sin broadcast to `[..., seq, head_dim // 2]`."""
    half = x.shape[-1] // 2
    dtype = _compute_dtype(x)
    x1, x2, cos, sin = x[..., :half].to(dtype), x[..., half:].to(dtype), cos.to(dtype), sin.to(dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def check_rope_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_offset: int,
                    positions: torch.Tensor | None) -> None:
    """ValueError unless q `[b, h, s, d]` and k `[b, h_kv, s, d]` (d even) fit tables `[n, d // 2]` alike, and the
    rows asked for (`position_offset` + s, or `positions` `[b, s]`, one of them) lie in the tables. The values of
    `positions` are not checked (that would cost a host synchronisation per call on a GPU)."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rope: q and k must be [batch, heads, seq, head_dim], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    seq, head_dim = q.shape[-2], q.shape[-1]
    if (head_dim % 2 or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[-1] != head_dim // 2
            or k.shape[-2:] != q.shape[-2:] or k.shape[0] != q.shape[0]):
        raise ValueError(f"apply_rope: q {tuple(q.shape)}, k {tuple(k.shape)} and tables {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)} disagree")
    if positions is not None:
        if position_offset:
            raise ValueError("apply_rope: give positions or position_offset, not both")
        if positions.shape != (q.shape[0], seq):
            raise ValueError(f"apply_rope: positions {tuple(positions.shape)} must be [batch, seq] = "
                             f"[{q.shape[0]}, {seq}]")
    elif position_offset < 0:
        raise ValueError(f"apply_rope: position_offset must be >= 0, got {position_offset}")
    elif position_offset + seq > cos.shape[0]:
        raise ValueError(f"apply_rope: positions up to {position_offset + seq} exceed the table's {cos.shape[0]}")


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_offset: int = 0,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the table rows `position_offset + s`, or by rows `positions[b, s]` (int64 `[batch, seq]`)."""
    if positions is not None:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [batch, 1, seq, head_dim // 2]
    else:
        seq = q.shape[-2]
        c, s = cos[position_offset:position_offset + seq], sin[position_offset:position_offset + seq]
    return rotate(q, c, s), rotate(k, c, s)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None,
              segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention with grouped-query heads; a causal mask is aligned bottom-right when q is shorter than k;
    with `segment_ids` (seq_q == seq_k) a token sees only keys of its own segment (run of equal ids)."""
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if causal and seq_q == 1:  # one query after its keys (a decode step) sees every key
        causal = False
    if segment_ids is None and (not causal or seq_q == seq_k):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if causal:
        mask = mask.tril(diagonal=seq_k - seq_q)
    if segment_ids is not None:
        mask = mask & same_segment(segment_ids)
    k, v, gqa = grouped_kv(q, k, v, mask, q.device.type)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def grouped_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
               device_type: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k, v, enable_gqa) for an SDPA call on `device_type` where k/v may have fewer heads than q (GQA).

    On CUDA, torch documents `enable_gqa` for its flash and math backends only, and flash takes no mask: a masked
    GQA call (batched generation over left-padded prompts, GRPO's rollouts) ran on the math backend, which builds
    the fp32 scores [batch, heads, seq_q, seq_k] of every layer (64 rows x 16 heads x 2k tokens: 16 GiB). So there
    k/v are repeated to q's head count (query head h reads k/v head h // group, the grouping `enable_gqa` uses) and
    the call, without `enable_gqa`, may take the memory-efficient backend: a copy of k/v instead of the scores. On
    the CPU the flash kernel takes a mask with `enable_gqa`, and without a mask flash takes it on CUDA."""
    gqa = q.shape[1] != k.shape[1]
    if gqa and attn_mask is not None and device_type == "cuda":
        group = q.shape[1] // k.shape[1]
        return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
    return k, v, gqa


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b."""
    return F.silu(a) * b
