"""Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * w over the last dim (after Liger-Kernel's rms_norm).

Both passes work on blocks of ROWS rows x BLOCK columns: several rows per program for small hidden
sizes (a 512-wide row alone would leave most of a program idle), one row for large ones.
Forward: one program per row block; rstd kept in fp32 for backward.
Backward: a fixed number of programs (a few per SM) each stride over row blocks with no branch in the
loop (rows past the end are masked to zero); each keeps its partial dW in fp32 registers, and the
partials are summed afterwards in a fixed order (no float atomics), so dW is deterministic.
Arithmetic is fp32 throughout; values are cast on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.runtime import KERNEL_DTYPES, Launch, check_dtypes, interpreting, num_programs_for, warps_for

INTERPRETED = interpreting()
ROW_ELEMENTS = 4096  # a row block holds about this many elements
BLOCKS = tuple(2 ** p for p in range(6, 15))  # row widths (powers of two) the compile check covers: 64 ... 16384


@triton.jit(do_not_specialize=["n_rows", "n_cols"])
def _rmsnorm_fwd(X, W, Y, RSTD, stride_x, stride_y, n_rows, n_cols, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    mask = (rows[:, None] < n_rows) & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols"])
def _rmsnorm_bwd(DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_x, stride_dx, n_rows, n_cols,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    dw = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for start in range(pid * ROWS, n_rows, tl.num_programs(0) * ROWS):
        rows = start + tl.arange(0, ROWS).to(tl.int64)
        mask = (rows[:, None] < n_rows) & col_ok[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
        x_hat = x * rstd[:, None]
        dw += dy * x_hat
        wdy = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :] * dy
        dx = rstd[:, None] * (wdy - x_hat * (tl.sum(x_hat * wdy, axis=1) / n_cols)[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * n_cols + cols, tl.sum(dw, axis=0), mask=col_ok)


def _layout(n_cols: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK, warps) for rows of n_cols elements."""
    block = triton.next_power_of_2(n_cols)
    rows = max(1, ROW_ELEMENTS // block) if not INTERPRETED else 4
    return rows, block, warps_for(rows * block)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def fwd_args(x2, weight, y, rstd, eps: float):
    n_rows, n_cols = x2.shape
    rows, block, _ = _layout(n_cols)
    return (x2, weight, y, rstd, x2.stride(0), y.stride(0), n_rows, n_cols, eps), {"ROWS": rows, "BLOCK": block}


def bwd_args(dy2, x2, weight, rstd, dx, partial):
    n_rows, n_cols = x2.shape
    rows, block, _ = _layout(n_cols)
    args = (dy2, x2, weight, rstd, dx, partial, dy2.stride(0), x2.stride(0), dx.stride(0), n_rows, n_cols)
    return args, {"ROWS": rows, "BLOCK": block}


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = _as_rows(x)
        n_rows, n_cols = x2.shape
        y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        if n_rows:
            args, constexprs = fwd_args(x2, weight, y, rstd, eps)
            _rmsnorm_fwd[(triton.cdiv(n_rows, constexprs["ROWS"]),)](*args, **constexprs,
                                                                    num_warps=_layout(n_cols)[2])
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = _as_rows(dy)
        dx = torch.empty_like(x2)
        rows, _, warps = _layout(n_cols)
        programs = num_programs_for(triton.cdiv(n_rows, rows), x2.device)
        partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x2.device)
        if n_rows:
            args, constexprs = bwd_args(dy2, x2, weight, rstd, dx, partial)
            _rmsnorm_bwd[(programs,)](*args, **constexprs, num_warps=warps)
        dw = partial.sum(0).to(weight.dtype) if n_rows else torch.zeros_like(weight)
        return dx.view(dy.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any leading shape, any strides) with `weight` of that dim's length."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} must be [{x.shape[-1]}], the last dim of x "
                         f"{tuple(x.shape)}")
    check_dtypes("rms_norm", x)
    if not x.shape[-1]:  # rows of nothing: nothing to launch (and no row layout of width 0)
        return reference.rms_norm(x, weight, eps)
    return RMSNormFunction.apply(x, weight.contiguous(), eps)


def launches(arch: int) -> list[Launch]:
    """Every row width (power of two) and dtype, forward and backward, on meta tensors."""
    out = []
    for dtype in KERNEL_DTYPES:
        for block in BLOCKS:
            def t(*shape, dt=dtype):
                return torch.empty(shape, dtype=dt, device="meta")
            x, w, rstd, partial = t(64, block), t(block), t(64, dt=torch.float32), t(8, block, dt=torch.float32)
            labels = {"dtype": str(dtype).removeprefix("torch."), "hidden": block}
            config = [triton.Config({}, num_warps=_layout(block)[2], num_stages=1)]
            args, constexprs = fwd_args(x, w, x, rstd, 1e-6)
            out.append(Launch("rmsnorm_fwd", _rmsnorm_fwd, args, constexprs, config, labels))
            args, constexprs = bwd_args(x, x, w, rstd, x, partial)
            out.append(Launch("rmsnorm_bwd", _rmsnorm_bwd, args, constexprs, config, labels))
    return out
