"""Whether a TCP port can be bound: one answer for the agent choosing a shard's ports
and the operator laying out or starting a simulated cluster."""

from __future__ import annotations

import contextlib
import errno
import socket

# The agent's exit status when it cannot bind its control socket, so `provision` says
# why from the status rather than from the words of its log.
EXIT_BIND_FAILED = 2
EXIT_PORT_IN_USE = 12
EXIT_NOT_AN_ADDRESS = 13


def bind_exit_status(error_number: int | None) -> int:
    """The agent's exit status for a bind that failed with `error_number`."""
    if error_number == errno.EADDRINUSE:
        return EXIT_PORT_IN_USE
    if error_number == errno.EADDRNOTAVAIL:
        return EXIT_NOT_AN_ADDRESS
    return EXIT_BIND_FAILED


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
