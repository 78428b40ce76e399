"""Rotary position embedding in the rotate-half layout, applied to q and k in one pass each.

x = [x1, x2] (halves of head_dim); y = [x1 cos - x2 sin, x2 cos + x1 sin] with the table rows
`position_offset + s`. The backward pass is the inverse rotation (sin negated). One program per
(batch, position) covers every head; q and k may have different head counts (GQA/MQA), any strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope(X, Y, COS, SIN, stride_xb, stride_xh, stride_xs, stride_xd, stride_yb, stride_yh, stride_ys, stride_cos,
          seq, n_heads, half, position_offset, SIGN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq
    s = pid % seq
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (d < half)
    row = (position_offset + s) * stride_cos
    cos = tl.load(COS + row + d, mask=d < half, other=0.0).to(tl.float32)
    sin = tl.load(SIN + row + d, mask=d < half, other=0.0).to(tl.float32) * SIGN
    x = X + b * stride_xb + s * stride_xs + heads * stride_xh
    x1 = tl.load(x + d * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + (d + half) * stride_xd, mask=mask, other=0.0).to(tl.float32)
    y = Y + b * stride_yb + s * stride_ys + heads * stride_yh
    tl.store(y + d, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=mask)
    tl.store(y + d + half, (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_offset: int, sign: int) -> torch.Tensor:
    batch, heads, seq, head_dim = x.shape
    y = torch.empty((batch, heads, seq, head_dim), dtype=x.dtype, device=x.device)
    if y.numel():
        half = head_dim // 2
        _rope[(batch * seq,)](x, y, cos, sin, *x.stride(), *y.stride()[:3], cos.stride(0), seq, heads, half,
                              position_offset, SIGN=sign, BLOCK_H=triton.next_power_of_2(heads),
                              BLOCK_D=triton.next_power_of_2(half), num_warps=4)
    return y


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_offset: int):
        ctx.save_for_backward(cos, sin)
        ctx.position_offset = position_offset
        return _rotate(q, cos, sin, position_offset, 1), _rotate(k, cos, sin, position_offset, 1)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        offset = ctx.position_offset
        return _rotate(dq, cos, sin, offset, -1), _rotate(dk, cos, sin, offset, -1), None, None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               position_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[b, h, s, d]` and k `[b, h_kv, s, d]` by table rows position_offset .. position_offset + s - 1."""
    seq, head_dim = q.shape[-2], q.shape[-1]
    if head_dim % 2 or cos.shape[-1] != head_dim // 2 or k.shape[-2:] != q.shape[-2:]:
        raise ValueError(f"apply_rope: q {tuple(q.shape)}, k {tuple(k.shape)} and tables {tuple(cos.shape)} disagree")
    if position_offset + seq > cos.shape[0]:
        raise ValueError(f"apply_rope: positions up to {position_offset + seq} exceed the table's {cos.shape[0]}")
    return RoPEFunction.apply(q, k, cos.contiguous(), sin.contiguous(), position_offset)
