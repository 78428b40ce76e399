"""SLURM node lists (`SLURM_JOB_NODELIST`) as host names.

`scontrol show hostnames` is the authority and is used when it is on PATH; elsewhere (a login node without SLURM's
tools, tests) the list is expanded here with the same rules: comma-separated items, each a name with any number of
bracket groups, a group holding comma-separated numbers and ranges whose width (zero padding) is that of the
range's first number, groups expanded left to right with the leftmost varying slowest:
`rack[1-2]-n[08-10]-ib,login` -> rack1-n08-ib, rack1-n09-ib, rack1-n10-ib, rack2-n08-ib, ..., login.
"""

from __future__ import annotations

import itertools
import math
import re
import shutil
import subprocess

from llm.errors import UserError

_ITEM = re.compile(r"(?:[^,\[\]]|\[[^\[\]]*\])+")
_GROUP = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_items(nodelist: str) -> list[str]:
    """Top-level comma-separated items (commas inside brackets belong to a group)."""
    items, position = [], 0
    while position < len(nodelist):
        match = _ITEM.match(nodelist, position)
        if not match:
            raise UserError(f"cannot read the SLURM node list {nodelist!r} at character {position + 1}")
        items.append(match.group())
        position = match.end()
        if position < len(nodelist):
            if nodelist[position] != ",":
                raise UserError(f"cannot read the SLURM node list {nodelist!r} at character {position + 1}")
            position += 1
            if position == len(nodelist):
                raise UserError(f"cannot read the SLURM node list {nodelist!r}: it ends with ','")
    return items


def _ranges(group: str, nodelist: str) -> list[tuple[str, str]]:
    """'07-09,12' -> [('07', '09'), ('12', '12')]."""
    ranges = []
    for part in group.split(","):
        match = _RANGE.fullmatch(part)
        if not match or (match[2] is not None and int(match[2]) < int(match[1])):
            raise UserError(f"cannot read the SLURM node list {nodelist!r}: '[{group}]' is not a list of numbers "
                            "and ascending ranges")
        ranges.append((match[1], match[2] or match[1]))
    return ranges


def _numbers(ranges: list[tuple[str, str]]) -> list[str]:
    """[('07', '09'), ('12', '12')] -> ['07', '08', '09', '12']."""
    return [str(n).zfill(len(first)) for first, last in ranges for n in range(int(first), int(last) + 1)]


def _parsed(nodelist: str) -> list[list]:
    """Each item of a node list as its parts: literal text, then a group's ranges, then text, and so on."""
    if not nodelist.strip():
        raise UserError("the SLURM node list is empty")
    return [[text if i % 2 == 0 else _ranges(text, nodelist) for i, text in enumerate(_GROUP.split(item))]
            for item in _split_items(nodelist.strip())]  # literal, group, literal, group, ..., literal


def nodelist_size(nodelist: str) -> int:
    """How many hosts a node list names, counted without listing them (`node[1-20000000]` is 20,000,000)."""
    return sum(math.prod(sum(int(last) - int(first) + 1 for first, last in part) for part in parts[1::2])
               for parts in _parsed(nodelist))


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a SLURM node list, in order."""
    hosts = []
    for parts in _parsed(nodelist):
        choices = [[part] if i % 2 == 0 else _numbers(part) for i, part in enumerate(parts)]
        hosts += ["".join(chosen) for chosen in itertools.product(*choices)]
    return hosts


def slurm_hosts(nodelist: str, path: str | None = None) -> list[str]:
    """The hosts of `nodelist`: from `scontrol show hostnames` when it is on `path` (default: PATH), else expanded
    here."""
    scontrol = shutil.which("scontrol", path=path)
    if scontrol is None:
        return expand_nodelist(nodelist)
    result = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
    hosts = result.stdout.split()
    if result.returncode != 0 or not hosts:
        reason = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}, no output"])[-1]
        raise UserError(f"scontrol show hostnames {nodelist!r} failed: {reason}")
    return hosts
