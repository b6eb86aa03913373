"""pytest fixtures around the real loopback sshd (`studiotui.bench.sshd`).

Usage from a conftest::

    from tests.sshd import sshd_server  # noqa: F401  (session fixture)

or, for a private server a test may break (e.g. by changing its host key)::

    from tests.sshd import sshd_factory  # noqa: F401
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from studiotui.bench.sshd import DEFAULT_ADDRESSES, SshdError, SshdServer, start_sshd
from studiotui.core.inventory import NodeSpec

__all__ = [
    "DEFAULT_ADDRESSES",
    "SshdError",
    "SshdServer",
    "ssh_node",
    "sshd_factory",
    "sshd_server",
]


def ssh_node(server: SshdServer, addr: str, name: str, root: Path, port: int) -> NodeSpec:
    """A node reached through `server` on `addr`, its agent's work folder root/name."""
    return NodeSpec(
        name=name,
        host=addr,
        port=server.port,
        user=server.user,
        identity=str(server.client_key),
        address=addr,
        control_port=port,
        workdir=str(root / name),
        memory_gb=2.0,
    )


@pytest.fixture(scope="session")
def sshd_server() -> Iterator[SshdServer]:
    """One sshd shared by the session; tests must not change its host key."""
    server = start_sshd()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def sshd_factory() -> Iterator[Callable[..., SshdServer]]:
    """Start private servers that the test may break; all stopped at teardown."""
    servers: list[SshdServer] = []

    def make(addresses: Sequence[str] = DEFAULT_ADDRESSES) -> SshdServer:
        server = start_sshd(addresses)
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.cleanup()
