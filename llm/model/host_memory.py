"""Refuse a model this host cannot hold before any of it is allocated, and generations on the CPU that cannot fit.

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
CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")
CGROUP_FILES = {"": ("", "memory.max", "memory.current", "inactive_file"),
                "memory": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}
"""Where each cgroup version keeps a group's memory limit and use, by the controller field of a /proc/self/cgroup
line ('' in v2's unified hierarchy): the folder below CGROUP_ROOT, the limit's file, the use's file, and the line of
memory.stat that counts the page cache the kernel would drop first."""


def _read_number(path: Path) -> int | None:
    try:
        value = path.read_text().strip()
    except OSError:
        return None
    return int(value) if value.isdigit() else None


def _dropped_first(stat: Path, key: str) -> int:
    """The bytes of the `key` line of a group's memory.stat (its inactive page cache), 0 where unknown."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return 0
    return next((int(value) for name, _, value in (line.partition(" ") for line in lines)
                 if name == key and value.isdigit()), 0)


def cgroup_memory(root: Path, membership: Path) -> list[tuple[int, int]]:
    """(limit, use) of every cgroup that `membership` (/proc/self/cgroup) lists, or that holds one of those, and sets
    a memory limit, in the cgroup v2 and v1 hierarchies under `root` (/sys/fs/cgroup): a container, a SLURM job or a
    systemd slice may hold less than the host. The use is the group's working set, as the kubelet counts it: its
    memory less the inactive page cache the kernel would drop before it ran out (0 where unknown). Groups this
    process cannot see (another namespace's paths) and unlimited ones ('max') give none."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return []
    groups = []
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, _, group_path = rest.partition(":")
        for controller, (folder, limit_file, use_file, dropped_first) in CGROUP_FILES.items():
            if controller not in controllers.split(","):  # "" is v2's line
                continue
            hierarchy = root / folder
            group = hierarchy.joinpath(*[part for part in group_path.split("/") if part not in ("", ".", "..")])
            for level in (group, *group.parents):
                limit = _read_number(level / limit_file)
                if limit is not None:
                    use = _read_number(level / use_file) or 0
                    groups.append((limit, max(0, use - _dropped_first(level / "memory.stat", dropped_first))))
                if level == hierarchy:
                    break
    return groups


def cgroup_memory_limits(root: Path, membership: Path) -> list[int]:
    """The memory limits of `cgroup_memory`'s groups."""
    return [limit for limit, _ in cgroup_memory(root, membership)]


def usable_memory() -> int:
    """Bytes of memory this process may use: the host's, or the lowest limit of its cgroups where that is lower."""
    return min([psutil.virtual_memory().total, *cgroup_memory_limits(CGROUP_ROOT, MEMBERSHIP)])


def free_memory() -> tuple[int, str]:
    """Bytes this process may take, and where they are as the end of a sentence: the host's available memory (free,
    and cache the kernel can drop), or what its cgroups' limits leave of it beside the groups' working sets
    (`cgroup_memory`) where that is less. A buffer sized against the host's total memory, or a cgroup's whole limit,
    instead is written in full at once (a KV cache), so the OOM killer ended the process (a server with every
    request in it) where other processes, or this one's own model, held the difference."""
    available = psutil.virtual_memory().available
    left = min((limit - use for limit, use in cgroup_memory(CGROUP_ROOT, MEMBERSHIP)), default=available)
    if left < available:
        left = max(left, 0)
        return left, (f"the {left / GIB:,.1f} GiB of memory the limit of this process's cgroup (a container's or a "
                      "job's) leaves free")
    return available, f"the {available / GIB:,.1f} GiB of memory this host has free"


def whose_memory(available: int) -> str:
    """Whose `available` bytes (from `usable_memory`) are: the host's, or its cgroup's where that limit is lower."""
    if available >= psutil.virtual_memory().total:
        return "this host's"
    return "the limit of this process's cgroup (a container's or a job's):"


def check_fits_in_memory(cfg: ModelConfig, copies: int = 1, remedy: str = "",
                         teacher: ModelConfig | None = None) -> None:
    """UserError (ending with `remedy`) when `copies` fp32 copies of the model `cfg` describes (one per rank on this
    host, and each rank's frozen reference), each with a frozen `teacher` where one is given (distillation), need
    more than this host's memory (or its cgroup's limit, where lower): they cannot fit, whatever else."""
    parameters = cfg.parameter_count
    taught = 0 if teacher is None else teacher.parameter_count
    needed, available = FP32_BYTES * (parameters + taught) * copies, usable_memory()
    if needed <= available:
        return
    built = ""
    if copies > 1 or teacher is not None:
        models = f"{copies} copies of it" if copies > 1 else "it"
        beside = "" if teacher is None else f", and beside {'each copy' if copies > 1 else 'it'} a teacher of " \
            f"{taught:,} parameters"
        built = (f"; this host builds {models} (each rank's model, and its frozen reference where the stage has "
                 f"one){beside} before DeepSpeed partitions them, {needed / GIB:,.1f} GiB")
    raise UserError(f"the model has {parameters:,} parameters, {FP32_BYTES * parameters / GIB:,.1f} GiB in fp32"
                    f"{built}: more than {whose_memory(available)} {available / GIB:,.1f} GiB of memory{remedy}")


def check_generation_fits_in_memory(cfg: ModelConfig, batch: int, positions: int) -> None:
    """Refuse a batch whose generations on the CPU cannot fit in this host's memory (or its cgroup's limit, where
    lower): an estimate of the largest forward's tensors (the uncached one over every position: KV cache, attention
    scores and the feed-forward's activations, in fp32, and the last position's logits; an upper bound). --batch
    100000 of a tiny model ended in the OOM killer's SIGKILL, without a word, after filling 24 GiB. (A GPU says so
    itself: `torch.OutOfMemoryError`.)"""
    per_position = (2 * cfg.n_layers * cfg.kv_heads * cfg.attention_head_dim + cfg.n_heads * positions
                    + 3 * cfg.ffn_hidden_dim + 4 * cfg.dim)
    needed = FP32_BYTES * batch * (positions * per_position + cfg.vocab_size)  # logits: the last position's
    available = usable_memory()
    if needed > available:
        raise UserError(f"--batch {batch} of {positions} positions needs about {needed / GIB:,.1f} GiB for its "
                        f"generations on the CPU (KV cache, attention, logits), more than {whose_memory(available)} "
                        f"{available / GIB:,.1f} GiB; lower --batch or the token counts")
