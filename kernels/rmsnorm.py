"""Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * w over the last dim.

Forward: one program per row, the row in one block; rstd kept in fp32 for backward.
Backward: each program takes a contiguous run of rows, writes dx, and accumulates its partial dW in
fp32 registers; the partials are summed afterwards in a fixed order (no float atomics), so dW is
deterministic. Arithmetic is fp32 throughout; values are cast on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.runtime import num_programs_for, row_warps


@triton.jit
def _rmsnorm_fwd(X, W, Y, RSTD, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_bwd(DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_x, stride_dx, n_rows, n_cols, rows_per_program,
                 BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    row_start = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = row_start + i
        if row < n_rows:
            dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            x_hat = x * rstd
            wdy = w * dy
            dx = rstd * (wdy - x_hat * (tl.sum(x_hat * wdy, axis=0) / n_cols))
            tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * x_hat
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x2 = _as_rows(x)
        n_rows, n_cols = x2.shape
        y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n_cols)
        if n_rows:
            _rmsnorm_fwd[(n_rows,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), n_cols, eps, BLOCK=block,
                                    num_warps=row_warps(block))
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = _as_rows(dy)
        dx = torch.empty_like(x2)
        programs = num_programs_for(n_rows, x2.device)
        rows_per_program = triton.cdiv(n_rows, programs) if n_rows else 0
        partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(n_cols)
        if n_rows:
            _rmsnorm_bwd[(programs,)](dy2, x2, weight, rstd, dx, partial, dy2.stride(0), x2.stride(0), dx.stride(0),
                                      n_rows, n_cols, rows_per_program, BLOCK=block, num_warps=row_warps(block))
        dw = partial.sum(0).to(weight.dtype) if n_rows else torch.zeros_like(weight)
        return dx.view(dy.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any leading shape, any strides)."""
    return RMSNormFunction.apply(x, weight, eps)
