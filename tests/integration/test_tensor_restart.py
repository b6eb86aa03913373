"""A placement with a tensor-parallel stage comes back whole after `down` + `restart`.

A 2-stage pipeline whose second stage is a tensor group of two (MLX's ring backend on
loopback): `studiotui down` on the group's follower stops its rank, and the other rank
is left in a group that lost a member; `studiotui restart` on that node relaunches the
whole group (both ranks, one new `mx.distributed` group) with the ports it had, and
the placement answers with the same greedy tokens as before. The one-node stage is
not touched (its runner keeps its pid). An agent restart of the group's leader, with
no `down` first, does the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from studiotui.cluster import keys
from studiotui.cluster.controller import join_seconds
from studiotui.cluster.peers import AgentError
from studiotui.core.placement import Plan
from tests.integration.test_faults import studiotui_cli
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control

pytestmark = pytest.mark.integration

BASE, PORT = 145, 58650  # 127.0.0.145-147
PROMPT = list(range(40, 62))
N_TOKENS = 12
NAME = "tp-restart"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("tp-restart-home"), 3, BASE, PORT, 2.0)


async def _answer(cluster: LocalCluster) -> tuple[str, list[int], dict[str, int]]:
    """The placement's state, its greedy answer (when ready) and its runners' pids."""
    ctl = cluster.controller()
    try:
        await ctl.refresh()
        p = ctl.state.placement(NAME)
        got: list[int] = []
        if p is not None and p.state == "ready":
            params = {"max_tokens": N_TOKENS, "ignore_eos": True}
            async for msg in ctl.generate(NAME, {"tokens": PROMPT}, params):
                if isinstance(msg, control.Delta):
                    got += msg.tokens
        pids: dict[str, int] = {}
        for node in p.nodes if p else ():
            reply = await ctl.peer(node).ask("list_shards", control.Shards)
            for shard in reply.shards:
                if shard.placement == NAME and shard.pid is not None:
                    pids[node] = shard.pid
        return (p.state if p else "gone"), got, pids
    finally:
        await ctl.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = DemoSpec(
        arch="qwen3", layers=4, hidden=128, heads=8, kv_heads=4, intermediate=384, seed=5
    )
    return write_demo_model(tmp_path_factory.mktemp("tp-restart-model") / "m", spec)


@pytest.fixture(scope="module")
def placed(cluster: LocalCluster, model: Path) -> dict[str, str]:
    """The placement: stage 1 alone, stage 2 a ring group of two. Its stages' nodes."""

    async def run() -> dict[str, str]:
        ctl = cluster.controller()
        try:
            await ctl.refresh()
            a, b, c = cluster.inventory.names
            _, two = ctl.preview(model, [a, b])
            assert isinstance(two, Plan) and len(two.shards) == 2
            head, tail = two.shards
            follower = c
            grouped = dataclasses.replace(
                two,
                shards=(
                    head,
                    dataclasses.replace(
                        tail, group=(tail.node, follower), backend="ring", backend_reason="test"
                    ),
                ),
            )
            await ctl.place(model, [a, b, c], NAME, expected=grouped, prefill_chunk=8)
            return {"head": head.node, "leader": tail.node, "follower": follower}
        finally:
            await ctl.close()

    return asyncio.run(run())


def test_down_then_restart_relaunches_the_tensor_group_and_it_answers_the_same(
    cluster: LocalCluster, placed: dict[str, str]
) -> None:
    state, before, pids = asyncio.run(_answer(cluster))
    assert state == "ready" and len(before) == N_TOKENS and len(pids) == 3

    follower = placed["follower"]
    down = studiotui_cli(cluster, "down", follower)
    assert down.returncode == 0, down.stderr
    assert f"studiotui restart {follower}" in down.stdout
    assert asyncio.run(_answer(cluster))[0] != "ready"

    again = studiotui_cli(cluster, "restart", follower)
    print(down.stdout, again.stdout, again.stderr, sep="\n")
    assert again.returncode == 0, again.stderr
    assert "tensor group formed again" in again.stdout
    state, after, new_pids = asyncio.run(_answer(cluster))
    assert state == "ready"
    assert after == before
    # Both ranks are new processes (one new group); the one-node stage kept its runner.
    assert new_pids[placed["head"]] == pids[placed["head"]]
    assert new_pids[placed["leader"]] != pids[placed["leader"]]
    assert new_pids[follower] != pids[follower]

    # An agent restart of the group's leader, no `down` first: the group comes back too.
    leader = placed["leader"]
    restarted = studiotui_cli(cluster, "restart", leader)
    print(restarted.stdout, restarted.stderr, sep="\n")
    assert restarted.returncode == 0, restarted.stderr
    state, third, last_pids = asyncio.run(_answer(cluster))
    assert state == "ready" and third == before
    assert last_pids[leader] != new_pids[leader] and last_pids[follower] != new_pids[follower]


def test_a_rank_that_never_comes_fails_the_load_naming_it_within_the_join_time(
    cluster: LocalCluster, model: Path
) -> None:
    """Rank 0 of a group of two is loaded on a real agent; rank 1's node is never asked.
    With the join time the operator sends (3 s, from STUDIOTUI_JOIN_S as the
    controller reads it), the load fails, from the runner through the agent, naming
    rank 1's node and what to do, rather than MLX waiting in its accept for ever."""
    join_s = join_seconds({"STUDIOTUI_JOIN_S": "3"})
    assert join_s == 3.0 and join_seconds({"STUDIOTUI_JOIN_S": "-1"}) == 300.0

    async def run() -> str:
        ctl = cluster.controller()
        try:
            await ctl.refresh()
            a, b, _ = cluster.inventory.names
            ports = await ctl.peer(a).ask(
                "prepare_shard", control.Prepared, placement="lonely", tensor=True
            )
            fields = {
                "placement": "lonely",
                "model_dir": str(model),
                "start": 0,
                "end": 4,
                "index": 0,
                "count": 1,
                "data_port": ports.data_port,
                "client_port": ports.client_port,
                "next_endpoint": f"tcp://{ctl.spec(a).address}:{ports.data_port}",
                "next_key": keys.node_public_key(cluster.home, a).decode(),
                "group": [a, b],
                "rank": 0,
                "backend": "ring",
                "group_addresses": [ctl.spec(a).address, ctl.spec(b).address],
                "group_ports": [ports.group_port, ports.group_port],
                "followers": [
                    [
                        f"tcp://{ctl.spec(b).address}:{ports.data_port}",
                        keys.node_public_key(cluster.home, b).decode(),
                    ]
                ],
                "join_s": join_s,
            }
            try:
                async for _msg in ctl.peer(a).stream("load_shard", timeout=30.0, **fields):
                    pass
            except AgentError as exc:
                return str(exc)
            finally:
                await ctl.peer(a).request("unload", placement="lonely")
            return "loaded?!"
        finally:
            await ctl.close()

    said = asyncio.run(run())
    a, b, _ = cluster.inventory.names
    assert f"the group of {a}, {b} did not form: rank 1 ({b}) was not there within 3 s" in said
    assert f"studiotui logs {b}" in said and "STUDIOTUI_JOIN_S=600" in said
