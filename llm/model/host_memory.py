"""Refuse a model this host cannot hold before any of it is allocated.

Every rank builds the whole model in fp32 host memory (with a frozen reference or teacher beside it where the stage
has one) before DeepSpeed partitions or moves it, and inference loads it whole. A size such as `model.dim=10**12`
otherwise ends in torch's allocator traceback, or in the kernel's OOM killer after minutes of swapping.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from llm.config import ModelConfig
from llm.errors import UserError

FP32_BYTES = 4
GIB = 1 << 30
CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")
"""A container's memory limit (cgroup v2, at the root of its cgroup namespace), where one is set: a container may
hold less than the host. Limits of nested groups (a SLURM job's) and of cgroup v1 are not read: the host's total
stands for them, which can only let through a model that then fails to allocate, never refuse one that fits."""


def usable_memory() -> int:
    """Bytes of memory this process may use: the host's, or its container's limit where that is lower."""
    total = psutil.virtual_memory().total
    try:
        limit = CGROUP_LIMIT.read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def check_fits_in_memory(cfg: ModelConfig, copies: int = 1, remedy: str = "") -> None:
    """UserError (ending with `remedy`) when `copies` fp32 copies of the model `cfg` describes (one per rank on this
    host, and each rank's frozen reference) need more than this host's memory: they cannot fit, whatever else."""
    parameters = cfg.parameter_count
    needed, available = FP32_BYTES * parameters * copies, usable_memory()
    if needed <= available:
        return
    copied = (f"; this host builds {copies} copies of it (each rank's model, and its frozen reference where the stage "
              f"has one) before DeepSpeed partitions them, {needed / GIB:,.1f} GiB" if copies > 1 else "")
    raise UserError(f"the model has {parameters:,} parameters, {FP32_BYTES * parameters / GIB:,.1f} GiB in fp32"
                    f"{copied}: more than this host's {available / GIB:,.1f} GiB of memory{remedy}")
