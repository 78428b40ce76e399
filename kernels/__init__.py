"""Kernel library: RMSNorm, RoPE, attention and SwiGLU, each as Triton kernels with forward and
backward (`kernels.rmsnorm`, `.rope`, `.flash_attention`, `.swiglu_gate`) and a plain-torch reference
(`kernels.reference`, the oracle for tests and the fallback where Triton cannot run).

The functions here dispatch on `backend`:
- "auto": a Triton kernel only on a CUDA device whose compute capability is in `VERIFIED` for that op (its
  compiled kernel was checked there), else the torch path (PyTorch's fused SDPA for attention);
- "triton": always Triton (CUDA, or the interpreter under TRITON_INTERPRET=1; an error elsewhere);
- "torch": always the torch path.
Packed samples (`segment_ids`), an explicit mask and attention dropout take the torch path.
Triton modules are imported on first use, so TRITON_INTERPRET takes effect whenever it is set before that.
"""

from __future__ import annotations

import importlib

import torch

from kernels import reference
from kernels.runtime import triton_can_run

BACKENDS = ("auto", "triton", "torch")

VERIFIED: dict[str, frozenset[tuple[int, int]]] = {"rms_norm": frozenset(), "apply_rope": frozenset(),
                                                   "attention": frozenset(), "swiglu": frozenset()}
"""CUDA compute capabilities on which each op's compiled Triton kernel was checked against the reference;
`auto` uses Triton only there."""


def _use_triton(t: torch.Tensor, backend: str, op: str) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_can_run(t):
            raise RuntimeError("kernels: backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 on the CPU")
        return True
    if backend == "auto":
        return t.is_cuda and torch.cuda.get_device_capability(t.device) in VERIFIED[op]
    raise ValueError(f"kernels: backend must be one of {BACKENDS}, got {backend!r}")


def _triton_op(module: str, name: str):
    return getattr(importlib.import_module(f"kernels.{module}"), name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    if _use_triton(x, backend, "rms_norm"):
        return _triton_op("rmsnorm", "rms_norm")(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_offset: int = 0,
               positions: torch.Tensor | None = None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    if positions is None and _use_triton(q, backend, "apply_rope"):
        return _triton_op("rope", "apply_rope")(q, k, cos, sin, position_offset)
    return reference.apply_rope(q, k, cos, sin, position_offset, positions)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None,
              segment_ids: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              backend: str = "auto") -> torch.Tensor:
    plain = segment_ids is None and attn_mask is None and dropout_p == 0.0
    if plain and _use_triton(q, backend, "attention"):
        return _triton_op("flash_attention", "attention")(q, k, v, causal, scale)
    return reference.attention(q, k, v, causal, scale, segment_ids, attn_mask, dropout_p)


def swiglu(a: torch.Tensor, b: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    if _use_triton(a, backend, "swiglu"):
        return _triton_op("swiglu_gate", "swiglu")(a, b)
    return reference.swiglu(a, b)


__all__ = ["BACKENDS", "apply_rope", "attention", "reference", "rms_norm", "swiglu"]
