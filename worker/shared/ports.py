"""Whether a TCP port can be bound: one answer for the agent choosing a shard's ports
and the operator laying out or starting a simulated cluster."""

from __future__ import annotations

import contextlib
import socket


def port_free(address: str, port: int) -> bool:
    """Nothing listens on address:port now (an agent could bind it)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        # As ZeroMQ binds: a port whose last connections linger in TIME_WAIT (agents
        # `down` just stopped) is free to it, and only a live socket holds it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True
