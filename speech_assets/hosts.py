"""Host names and ``host:port`` endpoints from the settings: checked before they reach a command
line (ours, torchrun's, or a remote shell's through ``ssh``)."""

from __future__ import annotations

import ipaddress
import re

# RFC 1123 labels: letters, digits and inner hyphens; a name never starts with "-" (an option to ssh)
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# an IPv6 zone (RFC 4007): an interface name (at most 15 bytes on Linux) or index; Python's
# ipaddress takes any text after "%", spaces and "$(...)" included
_ZONE = re.compile(r"[A-Za-z0-9_.-]{1,15}")
# every character any host or endpoint may hold: nothing a shell, ssh or a TOML string reads as more
_HOST_CHARS = re.compile(r"[A-Za-z0-9.:%_-]+")


def is_host(value: str) -> bool:
    """Whether ``value`` is an IP address (an IPv6 one with an optional ``%zone``) or a DNS host
    name: nothing a shell or ssh reads as more."""
    if not isinstance(value, str) or not value or len(value) > 253 or not _HOST_CHARS.fullmatch(value):
        return False
    address, percent, zone = value.partition("%")
    if percent:
        return _ZONE.fullmatch(zone) is not None and isinstance(_address(address), ipaddress.IPv6Address)
    if _address(value) is not None:
        return True
    return ":" not in value and all(_LABEL.fullmatch(label) for label in value.removesuffix(".").split("."))


def check_host(value: str, what: str = "host") -> str:
    """``value`` if it is a host name or address; ``ValueError`` naming ``what`` otherwise."""
    if not is_host(value):
        raise ValueError(f"{what} {value!r} is not a host name or IP address")
    return value


def check_endpoint(value: str, what: str = "endpoint") -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` (``[v6]:port`` for an IPv6 address, brackets required);
    ``ValueError`` otherwise."""
    host, colon, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            host = ""
    elif ":" in host:
        host = ""  # "::1:80": which colon ends the address?
    if not colon or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536 or not is_host(host):
        raise ValueError(f"{what} {value!r} is not host:port (a host name or IP address, and a port 1-65535)")
    return host, int(port)


def _address(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        return None
