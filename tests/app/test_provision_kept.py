"""The dashboard's `P` on a node that `studiotui down` stopped loads its kept shards again.

Two real local nodes hold a 2-stage pipeline of a tiny demo model. `studiotui down` on
the second keeps its shard in mind; `P` on that node in the dashboard starts its agent
and loads the shard again on the same layers, as `studiotui provision` and `restart` do
(`keep_placements`), and the placement is ready again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from studiotui.app.app import StudioApp
from studiotui.app.panes.nodes import NodesPane
from studiotui.cli.main import main
from studiotui.core.inventory import dump_inventory
from tests.support.cluster_fixture import LocalCluster, placed_cluster
from tests.support.pilot_helpers import until
from worker.shared.demo_model import DemoSpec

pytestmark = pytest.mark.integration
BASE, PORT = 228, 59910  # 127.0.0.228-229
SIZE = (120, 40)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=3)
    yield from placed_cluster(tmp_path_factory.mktemp("provision-kept"), 2, BASE, PORT, spec)


async def test_provisioning_a_node_down_stopped_loads_its_kept_shard_again(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    last = cluster.inventory.names[1]
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(cluster.inventory))
    monkeypatch.setenv("STUDIOTUI_HOME", str(cluster.home))
    before = cluster.controller()
    try:
        await before.refresh()
        placed = before.state.placements[0]
        layers = sorted((s.node, s.start, s.end) for s in placed.shards)
    finally:
        await before.close()
    # The CLI runs its own event loop: in a thread of its own, as from another terminal.
    assert await asyncio.to_thread(main, ["-i", str(inventory), "down", last]) == 0

    app = StudioApp(cluster.home, cluster.inventory)
    async with app.run_test(size=SIZE) as pilot:

        def placement_state() -> str:
            p = app.controller.state.placement(placed.name) if app.controller else None
            return p.state if p else "gone"

        await until(
            pilot,
            lambda: app.controller is not None and placement_state() not in ("ready", "gone"),
            30,
            "the placement is known, not whole",
        )
        app.query_one(NodesPane).select(last)
        await pilot.press("5", "P")
        await until(pilot, lambda: placement_state() == "ready", 90, "placement ready again")
        said = " ".join(n.message for n in app._notifications)
        assert f"placement {placed.name!r}: reloaded its shards on {last}" in said, said
        # Each step logged once, in words: a local node's start is not "start start".
        logged = [e.text for e in app.controller.state.log] if app.controller else []
        assert f"{last}: start… local agent" in logged, logged
        assert not [t for t in logged if "start start" in t], logged
        p = app.controller.state.placement(placed.name) if app.controller else None
        assert p is not None and sorted((s.node, s.start, s.end) for s in p.shards) == layers
