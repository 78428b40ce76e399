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

INTERPRET_ENV = "TRITON_INTERPRET"


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


def interpreting() -> bool:
    """Whether this process runs Triton kernels in the interpreter: as Triton was imported, or will be (from
    TRITON_INTERPRET) when it has not been imported yet."""
    language = sys.modules.get("triton.language")
    if language is None:
        return os.environ.get(INTERPRET_ENV, "0") == "1"
    return type(language.standard.sum).__name__ == "InterpretedFunction"


def triton_runs_on(device: torch.device) -> bool:
    """Whether backend 'triton' can run on `device`: a CUDA device, or any device in an interpreting process."""
    return device.type == "cuda" or interpreting()


def triton_module_for(name: str, t: torch.Tensor) -> ModuleType:
    """The module `kernels.<name>` for tensors like `t`: CUDA tensors, or CPU tensors in an interpreting process."""
    if not triton_runs_on(t.device):
        raise KernelUnavailableError(
            f"kernels: backend 'triton' needs CUDA tensors (got {t.device.type}); on the CPU Triton runs only in its "
            f"interpreter, which tests ask for with {INTERPRET_ENV}=1 set before Triton is imported; "
            "use backend 'auto' or 'torch' here")
    return importlib.import_module(f"kernels.{name}")


def arch_family(capability: tuple[int, int]) -> int:
    """The tile table a device uses: 90 for Hopper and newer, 80 for Ampere/Ada (and older, where Triton runs)."""
    return 90 if capability[0] >= 9 else 80


def device_arch(t: torch.Tensor) -> int:
    return arch_family(torch.cuda.get_device_capability(t.device))


def num_programs_for(n_items: int, device: torch.device) -> int:
    """Programs for a persistent loop over `n_items`: a few per SM on a GPU, few under the interpreter."""
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(n_items, target))


def warps_for(elements: int) -> int:
    """Warps for a memory-bound tile of `elements`: about 8 elements per thread, 1 to 16 warps."""
    return min(16, max(1, elements // 256))
