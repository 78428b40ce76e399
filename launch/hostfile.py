"""DeepSpeed hostfiles (`HOST slots=N` per line, `#` comments), checked before anything starts, and the hosts and
slots a job uses after `--include/--exclude/--nproc-per-node`, resolved as DeepSpeed's runner resolves them.

DeepSpeed's own parser accepts a zero-slot host and reports other mistakes as tracebacks; here every problem is one
message with the file and line. Host names end up in pdsh's `-w` list, on ssh's command line and in MPI host lists,
so only plain names and addresses pass: a host called `-Fevil` would be read by ssh as an option.
"""

from __future__ import annotations

import codecs
import ipaddress
import re
from pathlib import Path

from llm.errors import UserError

_LINE = re.compile(r"^(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\S+)(?:\s+(?P<rest>\S.*))?$")
"""`HOST slots=N`, then any other words, which DeepSpeed's runner ignores too (Open MPI's `max_slots=N`)."""
_SLOTS = re.compile(r"(?:^|\s)slots\s*=")
"""A second host's `slots=` among those other words: `node1 slots=2 node2 slots=2` left node2 out without a word."""
_INTEGER = re.compile(r"-?[0-9]+")
MAX_SLOTS_PER_HOST = 1024
"""The most ranks one host runs (slots, --nproc-per-node): far beyond any machine's accelerators or cores, and small
enough that a mistyped number is an error rather than an attempt to start it."""
_HOST_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
"""A DNS name, an /etc/hosts alias or an IPv4 address: no leading '-' (an option to ssh), no '@' or ',' (user and
list separators of pdsh), no brackets (pdsh would expand a range), no ':' (DeepSpeed's slot separator)."""
HOST_NAME_RULE = "letters, digits, '.', '-' and '_', starting and ending with a letter or digit"


def is_host_name(name: str) -> bool:
    """Whether `name` is a plain host name or IPv4 address that is safe on any command line."""
    return bool(_HOST_NAME.fullmatch(name))  # match: "$" also matches before a final newline


_IPV6_CHARACTERS = re.compile(r"[0-9A-Fa-f:.]+")
"""What an IPv6 address is written with: no zone (%eth0), where Python takes any characters."""


def is_ipv6_address(address: str) -> bool:
    """Whether `address` is an IPv6 address: only usable where DeepSpeed's `host:slots` syntax is not involved
    (--master-addr)."""
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return bool(_IPV6_CHARACTERS.fullmatch(address))


def check_address(address: str, option: str) -> None:
    """A `--master-addr`: a host name, an IPv4 or an IPv6 address, nothing a shell or ssh could read otherwise. One
    with a port (10.0.0.1:29500) passed for an IPv6 address, and node 1 then said it could not resolve it."""
    if is_host_name(address) or is_ipv6_address(address):
        return
    host, _, port = address.rpartition(":")
    if port.isascii() and port.isdigit() and is_host_name(host):
        raise UserError(f"{option} {address!r} holds a port: give the host alone ({option} {host}) and the port "
                        f"with --master-port {port}")
    raise UserError(f"{option} {address!r} is not a host name or IP address ({HOST_NAME_RULE})")


def read_integer(text: str) -> int | None:
    """`text` as an int when it is a decimal number in ASCII digits, else None (int() alone also reads '²', '٣', '1_0'
    and ' 1', and raises on more than 4300 digits)."""
    if not _INTEGER.fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _lines(path: Path) -> list[str]:
    """The file's lines as text (a byte order mark before the first, as Windows editors write, left out); a byte that
    is not UTF-8 is reported with its line and column."""
    lines = []
    for number, raw in enumerate(path.read_bytes().removeprefix(codecs.BOM_UTF8).splitlines(), start=1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise UserError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                            "a hostfile is plain text, one 'HOST slots=N' per line") from None
    return lines


def read_hostfile(path: str | Path) -> dict[str, int]:
    """{host: slots} in file order."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory, not a hostfile; give the file with one 'HOST slots=N' per line")
    if not path.exists():  # a pipe (`--hostfile <(...)`) is read as a file is: it was said not to be found
        raise UserError(f"{path}: hostfile not found")
    hosts: dict[str, int] = {}
    # host name in lower case (host names ignore case: NODE1 and node1 are one machine) -> (as written, line)
    first_seen: dict[str, tuple[str, int]] = {}
    for number, raw in enumerate(_lines(path), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        slots = read_integer(match["slots"]) if match else None
        if slots is None:
            raise UserError(f"{path}:{number}: expected 'HOST slots=N', got {raw.strip()!r}")
        host = match["host"]
        if match["rest"] and _SLOTS.search(match["rest"]):
            raise UserError(f"{path}:{number}: one host per line; {match['rest']!r} after host '{host}' would be "
                            "ignored")
        if not is_host_name(host):
            raise UserError(f"{path}:{number}: {host!r} is not a usable host name ({HOST_NAME_RULE})")
        if host.lower() in first_seen:
            spelling, line_number = first_seen[host.lower()]
            spelled = "" if spelling == host else f" as '{spelling}'; host names ignore case"
            raise UserError(f"{path}:{number}: host '{host}' is listed twice (first at line {line_number}{spelled})")
        if slots < 1:
            raise UserError(f"{path}:{number}: host '{host}' has slots={slots}; it needs at least 1")
        if slots > MAX_SLOTS_PER_HOST:
            raise UserError(f"{path}:{number}: host '{host}' has slots={slots}; at most {MAX_SLOTS_PER_HOST} ranks "
                            "run on one host")
        hosts[host], first_seen[host.lower()] = slots, (host, number)
    if not hosts:
        raise UserError(f"{path}: no hosts listed")
    return hosts


def hostfile_text(hosts: dict[str, int]) -> str:
    """`hosts` in the plain form every consumer parses alike (DeepSpeed's runner, Open MPI's mpirun)."""
    return "".join(f"{host} slots={slots}\n" for host, slots in hosts.items())


def check_filter(hosts: dict[str, int], spec: str, option: str, hostfile: str | Path) -> None:
    """`--include/--exclude` in DeepSpeed's syntax (`host1@host2:0,2`) may only name hosts of the hostfile and,
    after the colon, slot indices that host has."""
    for part in spec.split("@"):
        host, colon, slots = part.partition(":")
        if host not in hosts:
            raise UserError(f"{option} {spec}: host '{host}' is not in {hostfile} ({', '.join(hosts)})")
        for slot in slots.split(",") if colon else []:
            index = read_integer(slot)
            if index is None or not 0 <= index < hosts[host]:
                raise UserError(f"{option} {spec}: host '{host}' has slots 0-{hosts[host] - 1}, not '{slot}'")


def _spec(spec: str) -> dict[str, list[int] | None]:
    """`host1@host2:0,2` -> {host1: None (every slot), host2: [0, 2]}, for a spec `check_filter` accepted. A host
    named in several parts gets the slots of all of them, every slot only where none of them names slots
    (`h:0@h:1` -> {h: [0, 1]}, `h@h:1` -> {h: [1]}), as DeepSpeed's `parse_node_config_list` merges them."""
    merged: dict[str, list[int]] = {}
    for part in spec.split("@"):
        host, _, slots = part.partition(":")
        merged.setdefault(host, []).extend(int(slot) for slot in slots.split(",") if slots)
    return {host: sorted(set(slots)) or None for host, slots in merged.items()}


def active_slots(hosts: dict[str, int], include: str = "", exclude: str = "",
                 nproc_per_node: int | None = None) -> dict[str, list[int]]:
    """{host: slot indices} the job runs on, in hostfile order, hosts left without a slot dropped: what DeepSpeed's
    runner makes of the same hostfile and options (its `parse_inclusion_exclusion` and `--num_gpus`)."""
    slots = {host: list(range(count)) for host, count in hosts.items()}
    if include:
        chosen = _spec(include)
        slots = {host: sorted(set(chosen[host] or slots[host])) for host in slots if host in chosen}
    if exclude:
        dropped = _spec(exclude)
        slots = {host: [] if host in dropped and dropped[host] is None else
                 [slot for slot in indices if slot not in (dropped.get(host) or [])] for host, indices in slots.items()}
    if nproc_per_node:
        slots = {host: list(range(nproc_per_node)) for host in slots}
    return {host: indices for host, indices in slots.items() if indices}
