"""A job this operator recorded that no node knows any more (its agents restarted
since) shows as unknown on the Jobs screen, as `studiotui jobs` says, not as
"starting 0/?" for ever. Found by hand: a job that had finished, after the local
cluster was stopped and started again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from textual.widgets import DataTable

from studiotui.app.app import StudioApp
from studiotui.app.screens.jobs import UNKNOWN_JOB, JobsScreen
from studiotui.cluster import jobs
from tests.cluster_fixture import LocalCluster, cluster_fixture
from tests.pilot_helpers import until

pytestmark = pytest.mark.integration
BASE, PORT = 213, 59970  # 127.0.0.213


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("jobs-unknown-home"), 1, BASE, PORT)


async def test_a_job_no_node_knows_is_unknown(cluster: LocalCluster) -> None:
    node = cluster.inventory.names[0]
    jobs.save_record(cluster.home, jobs.JobRecord("gone", "finetune", (node,), "ring"))
    app = StudioApp(cluster.home, cluster.inventory)
    async with app.run_test(size=(120, 40)) as pilot:
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
