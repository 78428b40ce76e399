"""Where the Triton kernels can run, and launch sizes shared by the kernels."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_can_run(t: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU tensors under the interpreter."""
    return t.is_cuda or interpreting()


def num_programs_for(n_rows: int, device: torch.device) -> int:
    """Programs for a row-parallel reduction: a few per SM on a GPU, few under the interpreter."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 8
    return max(1, min(n_rows, target))


def row_warps(block: int) -> int:
    """Warps for one row of `block` elements."""
    return min(16, max(1, block // 256))
