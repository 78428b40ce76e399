"""Rotary position embedding in the rotate-half layout, q and k in one launch (forward and backward).

x = [x1, x2] (halves of head_dim); y = [x1 cos - x2 sin, x2 cos + x1 sin] with the table row of each
token: `position_offset + s`, or `positions[b, s]` (packed samples restart at 0). The backward pass is
the inverse rotation (sin negated). One program per (block of BLOCK_S tokens, batch) loads the cos/sin
rows of its tokens once and rotates every query head, then every key head (GQA/MQA head counts differ);
any strides; outputs keep the inputs' memory layout. The programs lie on grid axis 0 only (`grid`): CUDA
limits axes 1 and 2 to 65535, which a batch may pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.runtime import KERNEL_DTYPES, Launch, check_dtypes, check_rows_addressable, interpreting

INTERPRETED = interpreting()
TILE_ELEMENTS = 2048  # tokens x half head dim handled per head iteration
# head dim -> the head dims that share its kernels (the tile width, and whether half of it is a multiple of 16,
# which Triton specialises on): the compile check's labels
HEAD_DIMS = {32: "32", 48: "48", 64: "64", 128: "96,128", 112: "80,112"}


@triton.jit
def _rotate_heads(X, Y, stride_xh, stride_xs, stride_xd, stride_yh, stride_ys, stride_yd, tokens, mask, cos, sin,
                  n_heads, half, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)[None, :]
    x_tok = X + tokens[:, None] * stride_xs
    y_tok = Y + tokens[:, None] * stride_ys
    for h in range(n_heads):
        x = x_tok + h * stride_xh
        x1 = tl.load(x + d * stride_xd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x + (d + half) * stride_xd, mask=mask, other=0.0).to(tl.float32)
        y = y_tok + h * stride_yh
        tl.store(y + d * stride_yd, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=mask)
        tl.store(y + (d + half) * stride_yd, (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seq", "n_q_heads", "n_k_heads", "position_offset"])
def _rope(Q, K, QO, KO, COS, SIN, POS,
          stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
          stride_qob, stride_qoh, stride_qos, stride_qod, stride_kob, stride_koh, stride_kos, stride_kod,
          stride_cos, stride_pos, seq, n_q_heads, n_k_heads, position_offset, half,
          SIGN: tl.constexpr, POSITIONS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    n_blocks = tl.cdiv(seq, BLOCK_S)
    pid = tl.program_id(0)
    b = (pid // n_blocks).to(tl.int64)
    tokens = (pid % n_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
    token_ok = tokens < seq
    d_ok = tl.arange(0, BLOCK_D) < half
    if POSITIONS:
        rows = tl.load(POS + b * stride_pos + tokens, mask=token_ok, other=0)
    else:
        rows = (position_offset + tokens).to(tl.int64)
    mask = token_ok[:, None] & d_ok[None, :]
    table = rows[:, None] * stride_cos + tl.arange(0, BLOCK_D)[None, :]
    cos = tl.load(COS + table, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + table, mask=mask, other=0.0).to(tl.float32) * SIGN
    _rotate_heads(Q + b * stride_qb, QO + b * stride_qob, stride_qh, stride_qs, stride_qd, stride_qoh, stride_qos,
                  stride_qod, tokens, mask, cos, sin, n_q_heads, half, BLOCK_D)
    _rotate_heads(K + b * stride_kb, KO + b * stride_kob, stride_kh, stride_ks, stride_kd, stride_koh, stride_kos,
                  stride_kod, tokens, mask, cos, sin, n_k_heads, half, BLOCK_D)


def _layout(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_S) for a head dim."""
    block_d = triton.next_power_of_2(head_dim // 2)
    return block_d, (8 if INTERPRETED else max(1, TILE_ELEMENTS // block_d))


def rope_args(q, k, qo, ko, cos, sin, positions, position_offset: int, sign: int):
    block_d, block_s = _layout(q.shape[-1])
    has_positions = positions.ndim == 2  # the placeholder for 'no positions' is an empty 1-d tensor
    args = (q, k, qo, ko, cos, sin, positions, *q.stride(), *k.stride(), *qo.stride(), *ko.stride(), cos.stride(0),
            positions.stride(0) if has_positions else 0, q.shape[2], q.shape[1], k.shape[1], position_offset,
            q.shape[-1] // 2)
    return args, {"SIGN": sign, "POSITIONS": has_positions, "BLOCK_D": block_d, "BLOCK_S": block_s}


def grid(batch: int, seq: int, block_s: int) -> tuple[int]:
    """The launch grid: one program per (block of `block_s` tokens, batch), the blocks of a batch row consecutive,
    all on axis 0, for CUDA allows 2^31 - 1 programs on axis 0 but 65535 on axes 1 and 2."""
    return (triton.cdiv(seq, block_s) * batch,)


def _rotate(q, k, cos, sin, positions, position_offset: int, sign: int) -> tuple[torch.Tensor, torch.Tensor]:
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if qo.numel() or ko.numel():
        args, constexprs = rope_args(q, k, qo, ko, cos, sin, positions, position_offset, sign)
        _rope[grid(q.shape[0], q.shape[2], constexprs["BLOCK_S"])](*args, **constexprs, num_warps=4)
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, positions, position_offset: int):
        ctx.save_for_backward(cos, sin, positions)
        ctx.position_offset = position_offset
        return _rotate(q, k, cos, sin, positions, position_offset, 1)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, positions = ctx.saved_tensors
        dq, dk = _rotate(dq, dk, cos, sin, positions, ctx.position_offset, -1)
        return dq, dk, None, None, None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_offset: int = 0,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[b, h, s, d]` and k `[b, h_kv, s, d]` by table rows position_offset + s, or rows `positions[b, s]`,
    arguments checked by `kernels.apply_rope` (`reference.check_rope_args`)."""
    check_dtypes("apply_rope", q, k)
    check_rows_addressable("apply_rope", q, k, dims=3)
    positions = (torch.empty(0, dtype=torch.int64, device=q.device) if positions is None else
                 positions.to(torch.int64).contiguous())
    return RoPEFunction.apply(q, k, cos.contiguous(), sin.contiguous(), positions, position_offset)


def launches(arch: int) -> list[Launch]:
    """Every head dim and dtype, forward and backward, with table offsets and with per-token positions."""
    out = []
    for dtype in KERNEL_DTYPES:
        for head_dim, served in HEAD_DIMS.items():
            q = torch.empty(2, 256, 8, head_dim, dtype=dtype, device="meta").transpose(1, 2)
            k = torch.empty(2, 256, 2, head_dim, dtype=dtype, device="meta").transpose(1, 2)
            table = torch.empty(4096, head_dim // 2, dtype=torch.float32, device="meta")
            for positions in (torch.empty(0, dtype=torch.int64, device="meta"),
                              torch.empty(2, 256, dtype=torch.int64, device="meta")):
                for sign, name in ((1, "rope_fwd"), (-1, "rope_bwd")):
                    args, constexprs = rope_args(q, k, q, k, table, table, positions, 0, sign)
                    labels = {"dtype": str(dtype).removeprefix("torch."), "head_dim": served,
                                  "positions": constexprs["POSITIONS"]}
                    out.append(Launch(name, _rope, args, constexprs, [triton.Config({}, num_warps=4, num_stages=1)],
                                      labels))
    return out
