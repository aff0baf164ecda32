"""Picking a port for the rendezvous (standard library only: the launcher uses it)."""

from __future__ import annotations

import random
import socket

_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PICK = 10000


def pick_rendezvous_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A port that is free on ``host`` now, for rank 0 to host the rendezvous on.

    Chosen at random *below* the kernel's ephemeral range when there is room: a port
    found by binding port 0 is the one the kernel tends to hand to the next
    ``bind(0)``, which is exactly what every worker's own listener does next, so the
    rendezvous would race the workers for it. Falls back to binding port 0.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    if low - _LOWEST_PICK >= 1000:
        for _ in range(attempts):
            port = random.randrange(_LOWEST_PICK, low)
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
