"""`studiotui status --json` says what each placement is doing now, as the dashboard.

A real local cluster of two agents holds a two-stage placement. While a long greedy
answer streams, `status --json` reports the request in flight, tokens served and a
tok/s measured over its window; once the answer is cancelled, nothing is in flight
and the tokens served stay counted. The figures come from `core/traffic.py`, the
Placements pane's own source.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from studiotui.cli import commands
from studiotui.core.inventory import dump_inventory
from tests.cluster_fixture import LocalCluster, placed_cluster
from worker.shared.demo_model import DemoSpec

pytestmark = [pytest.mark.asyncio(loop_scope="function"), pytest.mark.timeout(180)]

BASE, PORT = 191, 58250  # 127.0.0.191-192


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = DemoSpec(layers=4, hidden=64, heads=4, kv_heads=2, dtype="float32")
    yield from placed_cluster(tmp_path_factory.mktemp("traffic-home"), 2, BASE, PORT, spec)


async def _status(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    path = cluster.home / "cluster.toml"
    path.write_text(dump_inventory(cluster.inventory))
    args = argparse.Namespace(json=True, inventory=path)
    assert await commands.cmd_status(args, cluster.home) == 0
    return json.loads(capsys.readouterr().out)


async def _settled(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The placement once nothing is in flight and its token count stands still."""
    for _ in range(20):
        [now] = (await _status(cluster, capsys))["placements"]
        if now["in_flight"] == 0 and now["tok_s"] == 0:
            return now
    raise AssertionError(f"still busy: {now}")


async def test_status_json_says_requests_in_flight_tokens_and_rate(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    # The warm-up's tokens may reach the counters a second late: idle once they stand.
    idle = await _settled(cluster, capsys)
    assert (idle["in_flight"], idle["tok_s"]) == (0, 0.0)
    served_before = idle["tokens"]

    ctl = cluster.controller()
    got: list[int] = []
    started = asyncio.Event()

    async def answer() -> None:
        params = {"max_tokens": 3500, "ignore_eos": True}
        async for msg in ctl.generate(idle["name"], {"tokens": list(range(5, 40))}, params):
            if msg["type"] == "delta":
                got.extend(msg["tokens"])
                started.set()

    await ctl.refresh()
    task = asyncio.create_task(answer())
    try:
        begun = asyncio.ensure_future(started.wait())
        await asyncio.wait({task, begun}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        begun.cancel()
        if task.done():
            task.result()  # its error, if it failed
        assert started.is_set(), "no token within 60 s"
        [busy] = (await _status(cluster, capsys))["placements"]
        assert not task.done(), "the answer ended before status looked: make it longer"
        print("while answering:", busy)
        assert busy["in_flight"] == 1, busy
        assert busy["tok_s"] > 0 and busy["tokens"] > served_before, busy
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await ctl.close()

    after = await _settled(cluster, capsys)
    assert after["tokens"] >= served_before + len(got), (after, len(got))
