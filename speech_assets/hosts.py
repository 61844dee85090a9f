"""Host names and ``host:port`` endpoints from the settings: checked before they reach a command
line (ours, torchrun's, or a remote shell's through ``ssh``)."""

from __future__ import annotations

import ipaddress
import re
import socket

# RFC 1123 labels: letters, digits and inner hyphens; a name never starts with "-" (an option to ssh)
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def is_host(value: str) -> bool:
    """Whether ``value`` is an IP address or a DNS host name (nothing a shell or ssh reads as more)."""
    if not isinstance(value, str) or not value or len(value) > 253:
        return False
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        pass
    return all(_LABEL.fullmatch(label) for label in value.removesuffix(".").split("."))


def check_host(value: str, what: str = "host") -> str:
    """``value`` if it is a host name or address; ``ValueError`` naming ``what`` otherwise."""
    if not is_host(value):
        raise ValueError(f"{what} {value!r} is not a host name or IP address")
    return value


def check_endpoint(value: str, what: str = "endpoint") -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` (``[v6]:port`` for an IPv6 address); ``ValueError`` otherwise."""
    host, colon, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not isinstance(_address(host), ipaddress.IPv6Address):
            host = ""
    if not colon or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536 or not is_host(host):
        raise ValueError(f"{what} {value!r} is not host:port (a host name or IP address, and a port 1-65535)")
    return host, int(port)


def _address(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
