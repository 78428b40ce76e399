"""GPU facts in one place: dense peak TFLOP/s per device and dtype (for MFU and benchmarks), shared-memory limits.

Peaks are the vendors' datasheet figures, dense (not the 2:1 sparse figure the datasheets print beside them), for
the part torch names: tensor-core bf16/fp16 with fp32 accumulation (what training runs), and plain fp32 on the
CUDA cores (torch's default fp32 matmul does not use TF32). GeForce cards accumulate in fp32 at half their fp16
rate: theirs is the fp32-accumulate figure. V100 and T4 have no bf16 tensor cores: theirs is the fp16 figure (bf16
runs emulated there, far below it).
"""

from __future__ import annotations

import math
import re

import torch

# (pattern matched against torch.cuda.get_device_name(), bf16/fp16 dense TFLOP/s, fp32 TFLOP/s); first match wins,
# so a variant comes before its family (H100 NVL, H100 PCIe, then H100 SXM)
_PEAKS: list[tuple[str, float, float]] = [
    # Blackwell (HGX B200: 18 PFLOPS dense per 8 GPUs; GB200 NVL72: 10 PFLOPS sparse per superchip of 2 GPUs)
    (r"GB200", 2500.0, 80.0),
    (r"\bB200\b", 2250.0, 75.0),
    # Hopper
    (r"H[12]00 NVL", 835.5, 60.0),
    (r"H[18]00.*PCIe", 756.0, 51.2),
    (r"GH200|H200|H100|H800", 989.5, 67.0),
    (r"\bH20\b", 148.0, 44.0),
    # Ampere
    (r"A100|A800", 312.0, 19.5),
    (r"\bA30\b", 165.0, 10.3),
    (r"\bA40\b", 149.7, 37.4),
    (r"\bA10G\b", 70.0, 35.0),  # AWS's part, no NVIDIA datasheet: 80 SMs at 1.71 GHz, GeForce-rate tensor cores
    (r"\bA10\b", 125.0, 31.2),
    (r"RTX A6000", 154.8, 38.7),
    (r"RTX A5000", 111.1, 27.8),
    (r"RTX A4000", 76.7, 19.2),
    # Ada
    (r"L40S", 362.05, 91.6),
    (r"\bL40\b", 181.05, 90.5),
    (r"\bL4\b", 121.0, 30.3),
    (r"RTX 6000 Ada", 364.2, 91.1),
    # Volta, Turing (fp16 only)
    (r"V100S", 130.0, 16.4),
    (r"V100.*PCIE", 112.0, 14.0),
    (r"V100", 125.0, 15.7),
    (r"\bT4\b", 65.0, 8.1),
    # GeForce
    (r"4090", 165.2, 82.6),
    (r"3090", 71.0, 35.6),
]

# largest dynamic shared memory one block may use, bytes (cudaDevAttrMaxSharedMemoryPerBlockOptin): Ampere A100,
# other Ampere, Ada, Hopper, data-centre Blackwell (B200, GB200), consumer Blackwell (RTX 50)
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}


def peak_tflops(device_name: str, dtype: torch.dtype) -> float:
    """Dense peak TFLOP/s of `device_name` in `dtype` (bf16/fp16 tensor cores, fp32 CUDA cores); NaN when unknown."""
    for pattern, half, single in _PEAKS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return single if dtype == torch.float32 else half
    return math.nan
