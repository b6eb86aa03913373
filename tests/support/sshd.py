"""pytest fixtures around the real loopback sshd (`studiotui.bench.sshd`).

conftest.py registers them for every test:

* `sshd_server`: one sshd shared by the session;
* `sshd_factory`: private servers a test may break (e.g. by changing a host key);
* `ssh_nodes`: "Macs" reached through the shared sshd, one per loopback address, their
  work folders' agents stopped when the test ends; provisioned unless asked not to;
* `agents`: work folders whose agents are stopped when the test ends.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from studiotui.bench.provision import kill_local_agents
from studiotui.bench.sshd import DEFAULT_ADDRESSES, SshdError, SshdServer, start_sshd
from studiotui.core.inventory import Inventory, NodeSpec
from studiotui.provision.deploy import CheckoutWheel, provision

__all__ = [
    "DEFAULT_ADDRESSES",
    "SshNodes",
    "SshdError",
    "SshdServer",
    "agents",
    "free_port",
    "make_node",
    "ssh_node",
    "ssh_nodes",
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


@pytest.fixture
def agents() -> Iterator[list[Path]]:
    """Work dirs whose agents are stopped (by pid file) when the test ends, pass or fail."""
    workdirs: list[Path] = []
    try:
        yield workdirs
    finally:
        kill_local_agents(workdirs)


def free_port(addresses: Sequence[str]) -> int:
    """A control port whose pair (port, port+1) is free on every address."""
    for _ in range(200):
        port = random.randrange(54000, 60000, 20)
        try:
            for addr in addresses:
                for p in (port, port + 1):
                    with socket.socket() as s:
                        s.bind((addr, p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


def make_node(
    server: SshdServer,
    addr: str,
    name: str,
    root: Path,
    control_port: int,
    python: str,
    /,
    **changes: Any,
) -> NodeSpec:
    # A work folder whose path needs quoting in every remote command.
    node = ssh_node(server, addr, name, root / "nodes dir 'q'", control_port)
    return replace(node, **{"python": python, **changes})


@dataclass(frozen=True)
class SshNodes:
    """Nodes on the shared sshd, as `ssh_nodes` made them: `mac-NN` on 127.0.0.NN."""

    nodes: tuple[NodeSpec, ...]
    inventory: Inventory
    home: Path

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]


@pytest.fixture
def ssh_nodes(
    sshd_server: SshdServer,
    tmp_path: Path,
    wheel: CheckoutWheel,
    node_python: str,
    agents: list[Path],
) -> Callable[..., Awaitable[SshNodes]]:
    """`await ssh_nodes(n)`: n nodes on the shared sshd with one free control port, the
    operator's home at tmp_path/home, provisioned (every node up, host keys accepted)
    unless `provisioned=False`; their agents are stopped when the test ends."""

    async def make(count: int = 2, *, provisioned: bool = True) -> SshNodes:
        addrs = list(sshd_server.addresses[:count])
        port = free_port(addrs)
        nodes = tuple(
            make_node(sshd_server, a, f"mac-{a[-2:]}", tmp_path, port, node_python) for a in addrs
        )
        agents.extend(Path(n.workdir) for n in nodes)
        made = SshNodes(nodes, Inventory(name="desk", nodes=nodes), tmp_path / "home")
        if provisioned:
            outcomes = await provision(
                made.home,
                made.inventory,
                wheel=wheel,
                user_known_hosts=None,
                accept_new_host_keys=True,
            )
            assert all(o.status == "up" for o in outcomes.values()), outcomes
        return made

    return make
