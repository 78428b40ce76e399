"""Fused SwiGLU gate: y = silu(a) * b, forward and backward in one pass each (memory-bound, fp32 inside)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.runtime import KERNEL_DTYPES, Launch, check_dtypes

BLOCK = 1024


@triton.jit(do_not_specialize=["n"])
def _swiglu_fwd(A, B, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n"])
def _swiglu_bwd(DY, A, B, DA, DB, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    tl.store(DA + offs, (dy * b * sig * (1.0 + a * (1.0 - sig))).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dy * silu).to(DB.dtype.element_ty), mask=mask)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.contiguous(), b.contiguous()
        y = torch.empty_like(a)
        n = a.numel()
        if n:
            _swiglu_fwd[(triton.cdiv(n, BLOCK),)](a, b, y, n, BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(a, b)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        a, b = ctx.saved_tensors
        dy = dy.contiguous()
        da, db = torch.empty_like(a), torch.empty_like(b)
        n = a.numel()
        if n:
            _swiglu_bwd[(triton.cdiv(n, BLOCK),)](dy, a, b, da, db, n, BLOCK=BLOCK, num_warps=4)
        return da, db


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for tensors of the same shape."""
    if a.shape != b.shape:
        raise ValueError(f"swiglu needs equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")
    check_dtypes("swiglu", a, b)
    return SwiGLUFunction.apply(a, b)


def launches(arch: int) -> list[Launch]:
    """Forward and backward for every dtype, on meta tensors."""
    out = []
    config = [triton.Config({}, num_warps=4, num_stages=1)]
    for dtype in KERNEL_DTYPES:
        x = torch.empty(4096, dtype=dtype, device="meta")
        labels = {"dtype": str(dtype).removeprefix("torch.")}
        out.append(Launch("swiglu_fwd", _swiglu_fwd, (x, x, x, x.numel()), {"BLOCK": BLOCK}, config, labels))
        out.append(Launch("swiglu_bwd", _swiglu_bwd, (x, x, x, x, x, x.numel()), {"BLOCK": BLOCK}, config, labels))
    return out
