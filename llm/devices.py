"""Where and in which precision a model runs for inference: the best device present (CUDA, then Apple's MPS, then
the CPU) and a dtype it computes well in, unless the user says otherwise (`--device`, `--dtype`)."""

from __future__ import annotations

import re

import torch

from kernels.runtime import cuda_has_bf16, triton_runs_on
from llm.errors import UserError
from llm.model import Transformer

DEVICES = ("auto", "cuda", "mps", "cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def exact_dtype(device: torch.device) -> torch.dtype:
    """float64, for sums that must not round (a step's losses and token counts over micro-batches and ranks, an
    evaluation's nats, sampling at a tiny temperature), or float32 on Apple's MPS, which has no float64 (a float64
    tensor there is a TypeError: training, sampling and eval failed at once)."""
    return torch.float32 if device.type == "mps" else torch.float64


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (CUDA and MPS run it after the call returns; the CPU has none queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


MPS_OUT_OF_MEMORY = "MPS backend out of memory"
"""How Apple's MPS backend begins the RuntimeError it raises when it runs out of memory (it has no
torch.OutOfMemoryError)."""
CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"
"""What torch's CPU allocator says when the host refuses an allocation (larger than it can ever hold, or beyond a
`ulimit -v`; memory that runs out by degrees is the kernel's OOM killer's, a SIGKILL)."""


def out_of_memory(exc: BaseException) -> str | None:
    """Where `exc` is a device's (or the host's) refusal of memory, what it was asked for ("2.00 GiB", "53687091200
    bytes", "" where torch does not say); else None."""
    said = str(exc)
    if not (isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and (
            said.startswith(MPS_OUT_OF_MEMORY) or CPU_OUT_OF_MEMORY in said))):
        return None
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ ?[KMGTP]?i?B\b|\d+ bytes)", said)
    return asked.group(1) if asked else ""


def mps_available() -> bool:
    return torch.backends.mps.is_available()


def best_device(cuda: bool, mps: bool) -> str:
    return "cuda" if cuda else "mps" if mps else "cpu"


def default_dtype(device: str, bf16_supported: bool) -> str:
    """bf16 on GPUs that have it, fp16 on older GPUs and on MPS, fp32 on the CPU (its half-precision matmuls are
    slower than fp32 on most CPUs)."""
    if device == "cuda":
        return "bf16" if bf16_supported else "fp16"
    return "fp16" if device == "mps" else "fp32"


def resolve(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """(device, dtype) for `--device` and `--dtype`, each 'auto' or a name; a device that is not present is refused."""
    cuda, mps = torch.cuda.is_available(), mps_available()
    if device == "auto":
        device = best_device(cuda, mps)
    elif device not in DEVICES:
        raise UserError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    elif (device == "cuda" and not cuda) or (device == "mps" and not mps):
        raise UserError(f"--device {device}: no {device.upper()} device is available here; use --device cpu or auto")
    if dtype == "auto":
        dtype = default_dtype(device, cuda and cuda_has_bf16())
    elif dtype not in DTYPES:
        raise UserError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    return torch.device(device), DTYPES[dtype]


def place(model: Transformer, device: torch.device, dtype: torch.dtype) -> Transformer:
    """Cast `model`'s parameters to `dtype` where they are (the host, for a loaded model), then move it to `device`;
    buffers keep their precision (the RoPE tables stay fp32, as rotations in bf16 would lose the position information
    of far tokens). Cast first: moved first, the device would hold the whole fp32 model before the cast (an imported
    8B model: 32 GB where bf16 needs 16 GB, out of memory on a 24 GB card it fits in). A model trained with our
    Triton kernels (model.kernels=triton, on a GPU) runs PyTorch's ops where they cannot run (a CPU, a Mac)."""
    if model.cfg.kernels == "triton" and not triton_runs_on(device):
        model.use_kernels("auto")
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model.to(device)
