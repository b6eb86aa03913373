"""Jobs in the dashboard as found by hand, on one real local node.

- A job this operator recorded that no node knows any more (its agents restarted
  since) shows as unknown on the Jobs screen, as `studiotui jobs` says, not as
  "starting 0/?" for ever (a job that had finished, after the local cluster was
  stopped and started again).
- `r` on a node running a rank of a job asks first: it restarted at once and the
  job failed on every node.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import DataTable

from studiotui.app.app import StudioApp
from studiotui.app.dialogs import ConfirmScreen
from studiotui.app.screens.jobs import UNKNOWN_JOB, JobsScreen
from studiotui.cluster import jobs
from studiotui.tune import finetune as ft
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from tests.support.pilot_helpers import until
from worker.shared.demo_model import DemoSpec, write_demo_model

pytestmark = pytest.mark.integration
BASE, PORT = 213, 59970  # 127.0.0.213
SIZE = (120, 40)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("jobs-unknown-home"), 1, BASE, PORT)


async def test_a_job_no_node_knows_is_unknown(cluster: LocalCluster) -> None:
    node = cluster.inventory.names[0]
    jobs.save_record(cluster.home, jobs.JobRecord("gone", "finetune", (node,), "ring"))
    app = StudioApp(cluster.home, cluster.inventory)
    async with app.run_test(size=SIZE) as pilot:
        await until(
            pilot,
            lambda: app.controller is not None and app.cluster.nodes[0].state == "up",
            30,
            "node up",
        )
        await pilot.press("J")
        screen = app.screen
        assert isinstance(screen, JobsScreen)
        await until(
            pilot,
            lambda: (
                "gone" in screen.watches and screen.watches["gone"].progress.state != "starting"
            ),
            30,
            "the job's state settled",
        )
        await pilot.pause(0.3)
        progress = screen.watches["gone"].progress
        assert progress.state == "unknown" and progress.eta_s is None
        table = screen.query_one("#jobs-list", DataTable)
        row: list[Any] = [str(c) for c in table.get_row_at(0)]
        assert row[:4] == ["gone", "finetune", "unknown", "0/?"], row
        nodes = screen.query_one("#jobs-nodes", DataTable)
        assert [str(c) for c in nodes.get_row_at(0)][2:] == ["unknown", "", "", UNKNOWN_JOB]


async def test_restarting_a_node_that_runs_a_job_asks_first(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    node = cluster.inventory.names[0]
    spec = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=3)
    model = write_demo_model(cluster.home / "models" / "tiny", spec)
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"item {i} on shelf {i % 5}"}) + "\n" for i in range(40))
    )
    ctl = cluster.controller()
    await ctl.start(telemetry=False)
    try:
        req = ft.FinetuneRequest(str(model), str(data), (node,), "long", iters=5000, batch_size=4)
        await ft.launch(ctl, ft.prepare(ctl, req))
        app = StudioApp(cluster.home, cluster.inventory)
        async with app.run_test(size=SIZE) as pilot:
            await until(
                pilot,
                lambda: app.controller is not None and app.cluster.nodes[0].state == "up",
                30,
                "node up",
            )
            await pilot.press("5", "r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 15, "asked")
            assert isinstance(app.screen, ConfirmScreen)
            question = app.screen.question
            assert f"Restart {node}?" in question and "It runs 1 job (long)" in question
            await pilot.press("n")
            await pilot.pause(1.0)
            ranks = (await jobs.status(ctl, [node]))["long"]
            assert ranks[node].state in ft.RUNNING, ranks  # still training: nothing restarted
    finally:
        await jobs.stop(ctl, "long", [node])
        await ctl.close()
