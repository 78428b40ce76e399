"""Kernel library: RMSNorm, RoPE, attention and SwiGLU, each as Triton kernels with forward and
backward (`kernels.rmsnorm`, `.rope`, `.flash_attention`, `.swiglu_gate`) and a plain-torch reference
(`kernels.reference`, the oracle for tests and the fallback where Triton cannot run).

The functions here dispatch on `backend`:
- "auto": Triton on CUDA tensors or under TRITON_INTERPRET=1 (Triton's CPU interpreter), else the reference;
- "triton": always Triton (an error where it cannot run);
- "torch": always the reference.
Triton modules are imported on first use, so TRITON_INTERPRET takes effect whenever it is set before that.
"""

from __future__ import annotations

import importlib

import torch

from kernels import reference
from kernels.runtime import triton_can_run

BACKENDS = ("auto", "triton", "torch")


def _use_triton(t: torch.Tensor, backend: str) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_can_run(t):
            raise RuntimeError("kernels: backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 on the CPU")
        return True
    if backend == "auto":
        return triton_can_run(t)
    raise ValueError(f"kernels: backend must be one of {BACKENDS}, got {backend!r}")


def _triton_op(module: str, name: str):
    return getattr(importlib.import_module(f"kernels.{module}"), name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    if _use_triton(x, backend):
        return _triton_op("rmsnorm", "rms_norm")(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_offset: int = 0,
               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(q, backend):
        return _triton_op("rope", "apply_rope")(q, k, cos, sin, position_offset)
    return reference.apply_rope(q, k, cos, sin, position_offset)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None,
              backend: str = "auto") -> torch.Tensor:
    if _use_triton(q, backend):
        return _triton_op("flash_attention", "attention")(q, k, v, causal, scale)
    return reference.attention(q, k, v, causal, scale)


def swiglu(a: torch.Tensor, b: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    if _use_triton(a, backend):
        return _triton_op("swiglu_gate", "swiglu")(a, b)
    return reference.swiglu(a, b)


__all__ = ["BACKENDS", "apply_rope", "attention", "reference", "rms_norm", "swiglu"]
