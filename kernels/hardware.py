"""GPU facts in one place: dense peak TFLOP/s per device and dtype (for MFU and benchmarks), shared-memory limits.

Peaks are the vendors' dense (not sparse) figures for the SXM / full-power parts: tensor-core bf16/fp16
with fp32 accumulation, and plain fp32 on the CUDA cores (torch's default fp32 matmul does not use TF32).
"""

from __future__ import annotations

import math
import re

import torch

# (pattern matched against torch.cuda.get_device_name(), bf16/fp16 dense TFLOP/s, fp32 TFLOP/s); first match wins
_PEAKS: list[tuple[str, float, float]] = [
    (r"H100.*PCIe", 756.0, 51.2),
    (r"GH200|H200|H100|H800", 989.5, 67.0),
    (r"A100|A800", 312.0, 19.5),
    (r"L40S", 362.05, 91.6),
    (r"\bL4\b", 121.0, 30.3),
    (r"\bA10\b", 125.0, 31.2),
    (r"4090", 165.2, 82.6),
    (r"3090", 71.0, 35.6),
]

# largest dynamic shared memory one block may use, bytes (cudaDevAttrMaxSharedMemoryPerBlockOptin)
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def peak_tflops(device_name: str, dtype: torch.dtype) -> float:
    """Dense peak TFLOP/s of `device_name` in `dtype` (bf16/fp16 tensor cores, fp32 CUDA cores); NaN when unknown."""
    for pattern, half, single in _PEAKS:
        if re.search(pattern, device_name):
            return single if dtype == torch.float32 else half
    return math.nan
