"""Checks on the addresses a server is about to bind: exposure without a key, ports already taken.

Used by `pdserve serve`, `pdserve proxy` and `pdserve render` before they do anything slow (loading a
model), so that a busy port or an open door is reported in one line at once. Standard library only.
"""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine (`0.0.0.0`, `::` and names do not)."""
    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def exposure_warning(program: str, host: str, api_key: str | None, flag: str = "--api-key") -> str | None:
    """A warning line when a server binds a non-loopback address without an API key, else None."""
    if api_key or is_loopback(host):
        return None
    return (
        f"{program} binds {host}, which other machines can reach, without {flag}: anyone who can connect "
        f"can use it. Set {flag} (or bind 127.0.0.1) unless a firewall or gateway in front does the checking."
    )


def port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound right now (something listens there), or None if it can.

    Binds with SO_REUSEADDR like uvicorn and the KV side channel do, so connections in TIME_WAIT from a
    previous run do not count; the probe socket is closed at once (a race with another process binding
    the port in between is still possible and then fails as before, just later).
    """
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, family, socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot resolve {host}: {e.strerror}"
    address = infos[0][4] if infos else (host, port)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            return f"{host}:{port} is not free ({e.strerror or e})"
    return None
