"""Unloading, as a watcher of the controller's state sees it (the dashboard). Found
by hand: after `u` and `y` the placement sat red as "broken · 2 of 4 nodes" while
its shards stopped one by one, then vanished."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from studiotui.core.state import ClusterState
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model

pytestmark = pytest.mark.integration
BASE, PORT = 217, 59980  # 127.0.0.217-219


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("unload-view-home"), 3, BASE, PORT)


async def test_an_unloaded_placement_leaves_the_view_without_turning_broken(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    spec = DemoSpec(layers=3, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=5)
    model = write_demo_model(tmp_path / "tiny", spec)
    ctl = cluster.controller()
    await ctl.start()  # with telemetry: every shard's going is published
    try:
        await ctl.place(model, list(cluster.inventory.names), "tiny")
        seen: list[str] = []

        def watch(state: ClusterState) -> None:
            seen.extend(p.state for p in state.placements if p.name == "tiny")

        ctl.subscribe(watch)
        await ctl.unload("tiny")
        # Until every node has reported its shard gone (telemetry, about 1 s apart).
        for _ in range(100):
            if not any(n.shards for n in ctl.state.nodes):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)
        assert not any(n.shards for n in ctl.state.nodes)
        assert ctl.state.placement("tiny") is None
        assert "broken" not in seen and "failed" not in seen, seen
        assert not any("'tiny' is broken" in e.text for e in ctl.state.log)
    finally:
        await ctl.close()
