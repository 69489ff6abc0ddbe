"""TEST ONLY: what the loopback interface of this machine offers."""

from __future__ import annotations

import socket


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False
