"""DeepSpeed hostfiles (`HOST slots=N` per line, `#` comments), checked before anything starts.

DeepSpeed's own parser accepts a zero-slot host and reports other mistakes as tracebacks; here every
problem is one message with the file and line.
"""

from __future__ import annotations

import re
from pathlib import Path

from llm.errors import UserError

_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.:\-\[\]]+)\s+slots\s*=\s*(?P<slots>-?\d+)$")


def read_hostfile(path: str | Path) -> dict[str, int]:
    """{host: slots} in file order."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: hostfile not found")
    hosts: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if not match:
            raise UserError(f"{path}:{number}: expected 'HOST slots=N', got {raw.strip()!r}")
        host, slots = match["host"], int(match["slots"])
        if host in hosts:
            raise UserError(f"{path}:{number}: host '{host}' is listed twice (first at line {first_seen[host]})")
        if slots < 1:
            raise UserError(f"{path}:{number}: host '{host}' has slots={slots}; it needs at least 1")
        hosts[host], first_seen[host] = slots, number
    if not hosts:
        raise UserError(f"{path}: no hosts listed")
    return hosts


def check_filter(hosts: dict[str, int], spec: str, option: str, hostfile: str | Path) -> None:
    """`--include/--exclude` in DeepSpeed's syntax (`host1@host2:0,2`) may only name hosts of the hostfile and,
    after the colon, slot indices that host has."""
    for part in spec.split("@"):
        host, _, slots = part.partition(":")
        if host not in hosts:
            raise UserError(f"{option} {spec}: host '{host}' is not in {hostfile} ({', '.join(hosts)})")
        for slot in filter(None, slots.split(",")):
            if not slot.isdigit() or int(slot) >= hosts[host]:
                raise UserError(f"{option} {spec}: host '{host}' has slots 0-{hosts[host] - 1}, not '{slot}'")
