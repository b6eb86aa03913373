"""`studiotui down` from another terminal, seen by an open dashboard (real agents, Pilot).

The dashboard says the nodes were stopped by `down`, not that they fell silent and
need a restart; a dashboard that started before the `down` (a browser tab still
starting) does not start those agents again.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from studiotui.app.app import Startup, StudioApp
from studiotui.cluster import local_cluster
from studiotui.core.inventory import dump_inventory
from tests.support.cluster_fixture import LocalCluster, placed_cluster
from tests.support.pilot_helpers import until
from worker.shared.demo_model import DemoSpec

pytestmark = pytest.mark.integration
BASE, PORT = 248, 57800  # 127.0.0.248-249
SIZE = (160, 48)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=3)
    yield from placed_cluster(tmp_path_factory.mktemp("app-down"), 2, BASE, PORT, spec)


def cli(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own, as from another terminal."""
    path = cluster.home / "down-cluster.toml"
    path.write_text(dump_inventory(cluster.inventory))
    env = {**os.environ, "STUDIOTUI_HOME": str(cluster.home), "NO_COLOR": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "studiotui", "-i", str(path), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    print(done.stdout, done.stderr)
    return done


async def test_down_from_another_terminal_is_said_as_such(cluster: LocalCluster) -> None:
    names = list(cluster.inventory.names)
    app = StudioApp(cluster.home, cluster.inventory)
    async with app.run_test(size=SIZE) as pilot:

        def up() -> list[str]:
            ctl = app.controller
            return [n.name for n in ctl.state.nodes if n.state == "up"] if ctl else []

        await until(pilot, lambda: sorted(up()) == sorted(names), 30, "both nodes up")
        await pilot.pause(1.5)  # telemetry flowing: the nodes are watched for silence
        down = await asyncio.to_thread(cli, cluster, "down")
        assert down.returncode == 0
        await until(pilot, lambda: not up(), 30, "both nodes down")
        await pilot.pause(1.0)
        assert app.controller is not None
        log = app.controller.state.log
        said = "\n".join(f"{e.level}: {e.text}" for e in log)
        for name in names:
            assert f"{name} is stopped by `studiotui down` at" in said, said
            node = app.controller.state.node(name)
            assert node is not None and node.message.startswith("stopped by `studiotui down`")
            assert node.stopped_at is not None  # what decisions read, not the words
        assert "silent since" not in said, said
        assert not [e for e in log if e.level == "error"], said
    assert cli(cluster, "up").returncode == 0


async def test_a_dashboard_started_before_down_does_not_start_the_agents_again(
    cluster: LocalCluster,
) -> None:
    nodes = list(cluster.inventory.nodes)
    # Made (its start under way) before the `down`, as a browser tab still starting.
    app = StudioApp(cluster.home, cluster.inventory, startup=Startup(start_agents=nodes))
    assert cli(cluster, "down").returncode == 0
    assert all(local_cluster.running_pid(n) is None for n in nodes)
    async with app.run_test(size=SIZE) as pilot:
        await until(
            pilot,
            lambda: (
                app.controller is not None
                and sum("not started again" in e.text for e in app.controller.state.log) == 2
            ),
            30,
            "the dashboard said it leaves both stopped",
        )
        await pilot.pause(1.0)
        assert all(local_cluster.running_pid(n) is None for n in nodes)
    assert cli(cluster, "up").returncode == 0
    assert all(local_cluster.running_pid(n) is not None for n in nodes)
