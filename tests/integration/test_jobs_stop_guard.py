"""`studiotui restart` / `down` / `provision --upgrade` on a node running a rank of a job
refuse, naming the job.

Two real local nodes; a fine-tuning job runs on the first. Restarting or stopping it
(named, or as one of all the nodes) would end the job on every node without a word:
the verb refuses before stopping anything, naming the job, its node and `--yes`, and
the job trains on. The idle node restarts as before; `down --yes` stops the job's node.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from studiotui.cli.main import main
from studiotui.cluster import jobs, local_cluster
from studiotui.core.inventory import dump_inventory
from studiotui.tune import finetune as ft
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model

pytestmark = pytest.mark.integration
BASE, PORT = 226, 59930  # 127.0.0.226-227


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("jobs-guard-home"), 2, BASE, PORT)


async def _launch(cluster: LocalCluster, node: str, data: Path) -> None:
    spec = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=3)
    model = write_demo_model(cluster.home / "models" / "tiny", spec)
    ctl = cluster.controller()
    await ctl.start(telemetry=False)
    try:
        req = ft.FinetuneRequest(str(model), str(data), (node,), "long", iters=5000, batch_size=4)
        await ft.launch(ctl, ft.prepare(ctl, req))
    finally:
        await ctl.close()


async def _ranks(cluster: LocalCluster, node: str) -> dict[str, str]:
    ctl = cluster.controller()
    try:
        return {n: r.state for n, r in (await jobs.status(ctl, [node])).get("long", {}).items()}
    finally:
        await ctl.close()


def test_restart_and_down_refuse_to_end_a_running_job_without_yes(
    cluster: LocalCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    busy, idle = cluster.inventory.names
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"item {i} on shelf {i % 5}"}) + "\n" for i in range(40))
    )
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(cluster.inventory))
    monkeypatch.setenv("STUDIOTUI_HOME", str(cluster.home))
    monkeypatch.setenv("COLUMNS", "300")

    def cli(*argv: str) -> tuple[int, str]:
        code = main(["-i", str(inventory), *argv])
        out = capsys.readouterr()
        return code, " ".join((out.out + out.err).split())

    asyncio.run(_launch(cluster, busy, data))
    pid = local_cluster.running_pid(cluster.inventory.node(busy))
    for argv in (
        ["restart", busy],
        ["down", busy],
        ["down"],
        ["restart"],
        ["provision", "--upgrade", busy],
        ["provision", "--upgrade"],
    ):
        code, said = cli(*argv)
        assert code == 2, (argv, said)
        doing = {"restart": "restarting", "provision": "upgrading"}.get(argv[0], "stopping")
        assert f"{doing} {busy} would end job 'long' (a rank of it runs on {busy})" in said
        assert "nothing was stopped" in said and "anyway, add --yes" in said, said
        assert "studiotui jobs stop long" in said, said
        ranks = asyncio.run(_ranks(cluster, busy))
        assert ranks[busy] in ft.RUNNING, (argv, ranks)  # trains on
    assert local_cluster.running_pid(cluster.inventory.node(busy)) == pid  # never stopped

    # A node that runs no rank restarts as before.
    code, said = cli("restart", idle)
    assert code == 0 and f"{idle}" in said and "would end" not in said, said

    # --yes goes ahead: the job's node is stopped.
    code, said = cli("down", "--yes", busy)
    assert code == 0, said
    assert local_cluster.running_pid(cluster.inventory.node(busy)) is None
