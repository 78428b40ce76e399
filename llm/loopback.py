"""Whether an address names this machine only: the launcher refuses such a rendezvous address for ranks on several
machines, and the server asks for an API key when it listens anywhere else (and checks Host headers when not)."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(address: str) -> bool:
    """Whether `address` is a loopback IP address (127.0.0.0/8, ::1, an IPv6 zone allowed, not an IPv4 one) or
    localhost (RFC 6761: also its subdomains, and the fully qualified spelling with a final dot). A host's own name is
    not judged by what it resolves to here: Debian's /etc/hosts maps it to 127.0.1.1 on the host itself, and other
    hosts resolve it to its real address."""
    name = address.lower().rstrip(".")
    if name in ("localhost", "localhost.localdomain") or name.endswith(".localhost"):
        return True
    ip = _ip_address(name)
    return ip is not None and ip.is_loopback


def is_unspecified(address: str) -> bool:
    """Whether `address` is 0.0.0.0 or :: (in any spelling): a listener binds to it to mean every interface, a
    connection to it reaches its own host."""
    ip = _ip_address(address)
    return ip is not None and ip.is_unspecified


def _ip_address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address `name` spells, as the resolver reads it: an IPv4 one mapped into IPv6 (::ffff:127.0.0.1) as
    itself, and the IPv4 shorthands (127.1, 0) too; None for a host name."""
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(name))
        except OSError:
            return None
    return (ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else ip


def is_loopback_host(host: str) -> bool:
    """Whether a bind address or Host header value (a port and IPv6 brackets allowed) names this machine only."""
    name = host.strip()
    if name.startswith("["):
        name = name[1:name.find("]")]
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    return is_loopback(name)
