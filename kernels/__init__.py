"""Kernel library: RMSNorm, RoPE, attention and SwiGLU as Triton kernels with forward and backward
(`kernels.rmsnorm`, `.rope`, `.flash_attention`, `.swiglu_gate`), plain-torch references (`kernels.reference`,
the test oracle) and PyTorch's fused attention paths (`kernels.torch_attention`).

Every function here takes `backend`:
- "torch": the PyTorch path (the reference ops; for attention SDPA / FlexAttention / per-segment SDPA);
- "triton": the Triton kernel, compiled for the tensors' CUDA device; on CPU tensors it runs in Triton's
  interpreter only in a process started with TRITON_INTERPRET=1 (what the tests ask for; see
  `kernels.runtime`), and raises KernelUnavailableError otherwise;
- "auto" (the one definition): on a CUDA device, the Triton kernel when (op, compute capability) is in
  `VERIFIED` (and, for attention, the head dim is one the kernel takes), else the torch path; on the CPU and on
  devices below compute capability 8.0 (`runtime.MIN_CAPABILITY`), where backend 'triton' is refused, the torch
  path. `auto` never selects the interpreter.

`VERIFIED` lists the (op, capability) pairs whose compiled kernels passed tests/test_kernels_gpu.py on a
device of that capability and beat the torch path there in `python -m kernels.bench` (kernels/BENCHMARKS.md).
On an H200 (9, 0), with Triton 3.6: RMSNorm (1.1-5.3x eager) and RoPE (2.6-14x) are in; SwiGLU passed but
ran at 0.7-0.8x eager, and attention passed but its backward ran at 0.55-1.05x SDPA's flash, so `auto` keeps
PyTorch's paths for those two.
"""

from __future__ import annotations

import torch

from kernels import reference, torch_attention
from kernels.runtime import (
    KernelUnavailableError,
    interpreting,
    rows_addressable,
    takes_dtypes,
    triton_module_for,
    triton_runs_on,
)
from kernels.segments import check_segment_ids

BACKENDS = ("auto", "triton", "torch")
OPS = ("rms_norm", "apply_rope", "attention", "swiglu")

VERIFIED: frozenset[tuple[str, tuple[int, int]]] = frozenset({("rms_norm", (9, 0)), ("apply_rope", (9, 0))})


def choose_backend(op: str, t: torch.Tensor, backend: str, *others: torch.Tensor) -> str:
    """'triton' or 'torch' for `op` on tensors like `t` (see the module docstring for what 'auto' means); `others`
    are the op's other inputs that must share t's dtype (auto leaves float64, or mixed dtypes, to torch)."""
    if backend not in BACKENDS:
        raise ValueError(f"kernels: backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if t.is_cuda and not interpreting() and triton_runs_on(t.device) and takes_dtypes(t, *others) \
            and (op, torch.cuda.get_device_capability(t.device)) in VERIFIED:
        return "triton"
    return "torch"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    if choose_backend("rms_norm", x, backend) == "triton":
        return triton_module_for("rmsnorm", x).rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_offset: int = 0,
               positions: torch.Tensor | None = None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[b, h, s, d]` and k `[b, hk, s, d]` by table rows position_offset + s, or by `positions[b, s]`."""
    reference.check_rope_args(q, k, cos, sin, position_offset, positions)
    if choose_backend("apply_rope", q, backend, k) == "triton" and (backend == "triton" or
                                                                     rows_addressable(q, k, dims=3)):
        return triton_module_for("rope", q).apply_rope(q, k, cos, sin, position_offset, positions)
    return reference.apply_rope(q, k, cos, sin, position_offset, positions)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None,
              segment_ids: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              backend: str = "auto") -> torch.Tensor:
    """Attention `[b, h, s_q, d]`. `segment_ids` `[b, s]` (s_q == s_k) keeps each token inside its segment;
    `attn_mask` (bool `[b, 1, s_q, s_k]`, True = may attend) and `dropout_p` > 0 always go to SDPA."""
    if segment_ids is not None:
        check_segment_ids(segment_ids, q, k)
    if attn_mask is not None or dropout_p > 0:
        if segment_ids is not None:
            raise ValueError("attention: segment_ids cannot be combined with attn_mask or dropout")
        choose_backend("attention", q, backend)  # validates the name
        return torch_attention.masked_attention(q, k, v, causal, scale, attn_mask, dropout_p)
    if choose_backend("attention", q, backend, k, v) == "triton":
        flash = triton_module_for("flash_attention", q)
        if backend == "triton" or flash.supports(q.shape[-1]) and flash.addressable(q, k, v):  # auto: others to torch
            return flash.attention(q, k, v, causal, scale, segment_ids)
    return torch_attention.attention(q, k, v, causal, scale, segment_ids)


def swiglu(a: torch.Tensor, b: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    if choose_backend("swiglu", a, backend, b) == "triton":
        return triton_module_for("swiglu_gate", a).swiglu(a, b)
    return reference.swiglu(a, b)


__all__ = ["BACKENDS", "OPS", "VERIFIED", "KernelUnavailableError", "apply_rope", "attention", "choose_backend",
           "reference", "rms_norm", "swiglu"]
