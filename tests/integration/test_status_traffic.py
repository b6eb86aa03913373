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
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from studiotui.cli import status_cmd
from studiotui.core.inventory import dump_inventory
from tests.support.cluster_fixture import LocalCluster, placed_cluster
from worker.shared.demo_model import DemoSpec
from worker.shared.protocol import control

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
    assert await status_cmd.cmd_status(args, cluster.home) == 0
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
            if isinstance(msg, control.Delta):
                got.extend(msg.tokens)
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
        # The shards report once a second, and an idle-looking report is said at once
        # (no 2 s watch): the first look may still be a report from before the request.
        for _ in range(5):
            [busy] = (await _status(cluster, capsys))["placements"]
            if busy["in_flight"]:
                break
            await asyncio.sleep(0.5)
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


async def test_piped_status_at_80_columns_keeps_each_shard_on_one_line(
    cluster: LocalCluster,
) -> None:
    """`studiotui status | less` on a terminal of 80 columns: every line fits, and each
    node's shard reads `demo[0:2] ready` whole; the columns that do not fit are
    given up (the version first) rather than a cell folded over two lines."""
    path = cluster.home / "cluster.toml"
    path.write_text(dump_inventory(cluster.inventory))
    env = {**os.environ, "STUDIOTUI_HOME": str(cluster.home), "NO_COLOR": "1", "COLUMNS": "80"}
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "studiotui", "-i", str(path), "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, out.stdout
    for node in cluster.inventory.nodes:
        [row] = [line for line in lines if f" {node.name} " in line]
        assert re.search(r"demo\[\d+:\d+\] ready", row), out.stdout
        assert node.address in row, out.stdout  # the address stays while room is left
