"""Plain-torch reference implementations: the oracle for kernel tests and the fallback off-GPU.

Layouts shared with the Triton kernels and the model:
- q `[batch, n_heads, seq, head_dim]`, k and v `[batch, n_kv_heads, seq_k, head_dim]`;
- RoPE tables `cos`, `sin` of shape `[max_positions, head_dim // 2]` (rotate-half layout),
  rows `position_offset ... position_offset + seq - 1` applied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_offset: int = 0,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (rotate-half layout) by the table rows starting at `position_offset`, or by the row of each
    token given in `positions` `[batch, seq]`."""
    if positions is not None:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [batch, 1, seq, head_dim // 2]
    else:
        seq = q.shape[-2]
        c, s = cos[position_offset:position_offset + seq], sin[position_offset:position_offset + seq]
    return rotate(q, c, s), rotate(k, c, s)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None,
              segment_ids: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0) -> torch.Tensor:
    """Softmax attention with grouped-query heads; a causal mask is aligned bottom-right when q is shorter than k.
    `segment_ids` `[batch, seq]` keeps each token inside its own packed sample; `attn_mask` (bool, True = attend)
    is applied as given."""
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        attn_mask = (same & torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril()).unsqueeze(1)
    if attn_mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=gqa)
    if dropout_p > 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=gqa)
    if causal and seq_q == 1:  # one query after its keys (a decode step) sees every key
        causal = False
    if causal and seq_q != seq_k:
        mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(diagonal=seq_k - seq_q)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b."""
    return F.silu(a) * b
