"""A real local cluster for tests: agents on their own loopback addresses and port.

Every agent is stopped by the pid it was started with, even when a test fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from studiotui.cluster import local_cluster
from studiotui.cluster.controller import Controller
from studiotui.core.inventory import Inventory, local_inventory
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control


@dataclass(frozen=True)
class LocalCluster:
    home: Path
    inventory: Inventory
    pids: dict[str, int]

    def controller(self) -> Controller:
        return Controller(self.home, self.inventory)


def start_cluster(
    home: Path, n: int, base_octet: int, control_port: int, memory_gb: float = 8.0
) -> LocalCluster:
    inv = local_inventory(
        n, base_octet=base_octet, control_port=control_port, memory_gb=memory_gb, home=home
    )
    pids = {node.name: local_cluster.start_agent(home, node, inv) for node in inv.nodes}
    cluster = LocalCluster(home=home, inventory=inv, pids=pids)
    asyncio.run(wait_up(home, inv))
    return cluster


async def wait_up(home: Path, inventory: Inventory, timeout: float = 30.0) -> None:
    """Until every agent of `inventory` answers as up; fail naming those that do not."""
    ctl = Controller(home, inventory)
    try:
        deadline = time.monotonic() + timeout
        while True:
            await ctl.refresh(timeout=1.0)
            if all(n.state == "up" for n in ctl.state.nodes):
                return
            if time.monotonic() > deadline:
                down = [n.name for n in ctl.state.nodes if n.state != "up"]
                raise RuntimeError(f"agents {down} did not come up")
            await asyncio.sleep(0.2)
    finally:
        await ctl.close()


def stop_cluster(cluster: LocalCluster) -> None:
    for node in cluster.inventory.nodes:
        local_cluster.stop_agent(node)
        pid = cluster.pids[node.name]
        # The pid file may be gone (agent crashed or replaced); stop our pid anyway.
        local_cluster.kill_pid(pid)


def cluster_fixture(
    tmp: Path, n: int, base_octet: int, control_port: int, memory_gb: float = 8.0
) -> Iterator[LocalCluster]:
    cluster = start_cluster(tmp, n, base_octet, control_port, memory_gb)
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


def placed_cluster(
    home: Path, n: int, base_octet: int, control_port: int, spec: DemoSpec
) -> Iterator[LocalCluster]:
    """`n` agents holding one placement of a demo model made with `spec` over every
    node, warmed up: one short request has compiled MLX's kernels in every runner,
    once, before the tests that share the placement."""
    model = write_demo_model(home / "models" / "demo", spec)
    cluster = start_cluster(home, n, base_octet, control_port)
    try:
        asyncio.run(_place_warm(cluster, model))
        yield cluster
    finally:
        stop_cluster(cluster)


async def _place_warm(cluster: LocalCluster, model: Path) -> None:
    ctl = cluster.controller()
    try:
        await ctl.refresh()
        await ctl.place(model)
        request = {"messages": [{"role": "user", "content": "warm up"}]}
        async for _ in ctl.generate(None, request, {"max_tokens": 2}):
            pass
    finally:
        await ctl.close()


async def runner_pids(ctl: Controller, placement: str) -> dict[str, int]:
    """The pid of the placement's runner process on each node, as its agent says."""
    out = {}
    for name in ctl.inventory.names:
        reply = await ctl.peer(name).ask("list_shards", control.Shards)
        for shard in reply.shards:
            if shard.placement == placement and shard.pid is not None:
                out[name] = shard.pid
    return out
