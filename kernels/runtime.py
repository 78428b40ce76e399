"""Where the Triton kernels run: compiled for a CUDA device, or in Triton's CPU interpreter.

The interpreter is a mode of the whole process, fixed when Triton is first imported: `triton.jit`
reads TRITON_INTERPRET as it decorates a function, and Triton's own library (`tl.sum`, `tl.max`,
`tl.cdiv`, ...) is decorated when `triton.language` is imported. So the kernel modules are imported
lazily, on first use, and a process either interprets every Triton kernel or compiles every one.
Interpreter tests (tests/test_kernels.py) set TRITON_INTERPRET=1 before that import; compiled runs (the
GPU tests, the compile check) happen in processes where it is unset.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from kernels.hardware import SHARED_MEMORY_LIMIT

INTERPRET_ENV = "TRITON_INTERPRET"
MIN_CAPABILITY = (8, 0)  # Ampere: the kernels are compiled and checked for sm_80 on; below it (V100, T4) no bf16
# tensor cores, and a T4 has 64 KiB of shared memory a block, where the 99 KiB family's tiles use up to 88.5 KiB
ATTENTION_HEAD_DIMS = range(32, 129, 16)  # what the attention kernel takes (and the compile check covers)
HEAD_DIMS_TEXT = f"{ATTENTION_HEAD_DIMS[0]} to {ATTENTION_HEAD_DIMS[-1]} in steps of {ATTENTION_HEAD_DIMS.step}"


@dataclass
class Launch:
    """One launch configuration of a kernel, as the compile check compiles it: the jitted function, its
    arguments (meta tensors stand for tensors), constexprs, the tile/warp/stage configs the dispatcher may
    pick for it, and labels for the report."""

    kernel: str
    fn: Any
    args: tuple
    constexprs: dict
    configs: list
    labels: dict = field(default_factory=dict)


class KernelUnavailableError(RuntimeError):
    """backend='triton' was asked for where Triton cannot run."""


def rows_addressable(*tensors: torch.Tensor, dims: int = 2) -> bool:
    """Whether a kernel that addresses the last `dims` dimensions of each tensor in 32-bit integers reaches every
    element: attention a position and a channel of one (batch, head) (2), RoPE a head too (3). An offset of 2^31
    elements or more wrapped around and read or wrote other memory (512k positions of 32 heads of 128, as the
    model's transposed q is laid out; 300k positions of 64 contiguous heads, for RoPE)."""
    return all(sum((size - 1) * abs(stride) for size, stride in zip(t.shape[-dims:], t.stride()[-dims:], strict=True))
               < 2**31 for t in tensors)


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What the kernels compute with (in fp32 inside): float64 was taken and computed in fp32, or failed to compile."""


def takes_dtypes(*tensors: torch.Tensor) -> bool:
    """Whether the tensors share one of KERNEL_DTYPES."""
    return tensors[0].dtype in KERNEL_DTYPES and all(t.dtype == tensors[0].dtype for t in tensors)


def check_dtypes(op: str, *tensors: torch.Tensor) -> None:
    if not takes_dtypes(*tensors):
        raise ValueError(f"{op}: the Triton kernel takes tensors of one dtype, float32, bfloat16 or float16, got "
                         f"{', '.join(str(t.dtype).removeprefix('torch.') for t in tensors)}; use the torch backend "
                         "for others")


def check_rows_addressable(op: str, *tensors: torch.Tensor, dims: int = 2) -> None:
    if not rows_addressable(*tensors, dims=dims):
        shapes = ", ".join(f"{tuple(t.shape)} (strides {t.stride()})" for t in tensors)
        raise ValueError(f"{op}: the Triton kernel addresses a head's positions in 32-bit offsets, which {shapes} "
                         "pass; use model.kernels=torch (or auto) at this length")


def interpreting() -> bool:
    """Whether this process runs Triton kernels in the interpreter: as Triton was imported, or will be (from
    TRITON_INTERPRET) when it has not been imported yet."""
    language = sys.modules.get("triton.language")
    if language is None:
        return os.environ.get(INTERPRET_ENV, "0") == "1"
    return type(language.standard.sum).__name__ == "InterpretedFunction"


def cuda_has_bf16() -> bool:
    """Whether the CUDA GPU computes in bf16 natively (Ampere and newer). torch's `is_bf16_supported()` also says yes
    for GPUs that only emulate it (T4, V100, RTX 20: no bf16 tensor cores, many times slower than fp16)."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def triton_unavailable(device: torch.device) -> str | None:
    """Why backend 'triton' cannot run on `device` (one line), or None: it runs on CUDA devices of compute capability
    MIN_CAPABILITY or newer, and on any device in an interpreting process."""
    if interpreting():
        return None
    if device.type != "cuda":
        return (f"kernels: backend 'triton' needs CUDA tensors (got {device.type}); on the CPU Triton runs only in its "
                f"interpreter, which tests ask for with {INTERPRET_ENV}=1 set before Triton is imported; "
                "use backend 'auto' or 'torch' here")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"kernels: the Triton kernels need compute capability {'.'.join(map(str, MIN_CAPABILITY))} or newer; "
                f"{torch.cuda.get_device_name(device)} is {'.'.join(map(str, capability))}: use model.kernels=torch")
    return None


def triton_runs_on(device: torch.device) -> bool:
    """Whether backend 'triton' can run on `device` (see triton_unavailable)."""
    return triton_unavailable(device) is None


def triton_module_for(name: str, t: torch.Tensor) -> ModuleType:
    """The module `kernels.<name>` for tensors like `t`, where Triton runs on them (else KernelUnavailableError)."""
    if reason := triton_unavailable(t.device):
        raise KernelUnavailableError(reason)
    return importlib.import_module(f"kernels.{name}")


def arch_family(capability: tuple[int, int], shared_memory: int) -> int:
    """The tile table (`flash_attention.TILES`) of a device of compute `capability` with `shared_memory` bytes per
    block: 90 for Hopper-class parts (227 KiB), 80 for the A100 class (163 KiB), 86 for the rest (99 KiB: sm_86 A10,
    A40, RTX 3090; sm_89 L4, L40, RTX 4090; consumer Blackwell)."""
    if capability[0] >= 9 and shared_memory >= SHARED_MEMORY_LIMIT[90]:
        return 90
    return 80 if shared_memory >= SHARED_MEMORY_LIMIT[80] else 86


KNOWN_SHARED_MEMORY = {(8, 0): SHARED_MEMORY_LIMIT[80], (8, 7): SHARED_MEMORY_LIMIT[80],
                       (9, 0): SHARED_MEMORY_LIMIT[90], (10, 0): SHARED_MEMORY_LIMIT[90]}
"""Shared memory per block by compute capability, for a torch that does not report it (before 2.7, and ROCm
builds); any other device is taken to have the least (99 KiB), whose tiles fit every device."""


def device_arch(t: torch.Tensor) -> int:
    """The tile table of `t`'s CUDA device."""
    properties = torch.cuda.get_device_properties(t.device)
    capability = (properties.major, properties.minor)
    shared = getattr(properties, "shared_memory_per_block_optin", 0) or KNOWN_SHARED_MEMORY.get(
        capability, SHARED_MEMORY_LIMIT[86])
    return arch_family(capability, shared)


def num_programs_for(n_items: int, device: torch.device) -> int:
    """Programs for a persistent loop over `n_items`: a few per SM on a GPU, few under the interpreter."""
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(n_items, target))


def warps_for(elements: int) -> int:
    """Warps for a memory-bound tile of `elements`: about 8 elements per thread, 1 to 16 warps."""
    return min(16, max(1, elements // 256))
