"""Kernel library: the ops the model calls, dispatched to an implementation.

Today every op runs its plain-torch reference (`kernels.reference`); the Triton kernels plug in
here behind the same signatures, so the model does not change when they arrive.
"""

from kernels.reference import apply_rope, attention, rms_norm, swiglu

__all__ = ["apply_rope", "attention", "rms_norm", "swiglu"]
