"""A prepared shard's lease, on a real agent: the memory promised to a placement
whose operator went away mid-copy is given back, to every operator, once the lease
lapses; a shard its controller keeps renewing stays prepared.

The lease is the prepare request's own (lease_s, seconds instead of the 5 minutes an
agent gives by default); the renewals are the controller's own (keep_leases, every
half second instead of 30 s). Nothing sleeps in product code. A placement loaded
with that short lease stays: a shard loading or loaded has no lease.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest

from studiotui.cluster.controller import Controller
from studiotui.cluster.peers import AgentError
from studiotui.core.memory import RUNNER_OVERHEAD_BYTES, node_promised_bytes
from studiotui.core.model_facts import read_model
from studiotui.core.placement import Plan, Refusal
from tests.support.cluster_fixture import LocalCluster, start_cluster, stop_cluster
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control

pytestmark = pytest.mark.integration
BASE, PORT = 171, 59390
NODE = "local-1"
LEASE_S = 2.0
PROMISE = {"weight_bytes": 3 << 20, "kv_bytes": 5 << 20, "adapter_bytes": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    running = start_cluster(tmp_path_factory.mktemp("lease-home"), 1, BASE, PORT)
    try:
        yield running
    finally:
        stop_cluster(running)


def prepared(ctl: Controller) -> dict[str, str]:
    node = ctl.state.node(NODE)
    assert node is not None
    return {s.placement: s.state for s in node.shards}


def promised(ctl: Controller) -> int:
    node = ctl.state.node(NODE)
    assert node is not None
    return node_promised_bytes(node)


async def until(ctl: Controller, ok: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        await ctl.refresh(timeout=1.0)
        if ok():
            return
        assert time.monotonic() < deadline, f"never saw {what}: {prepared(ctl)}"
        await asyncio.sleep(0.2)


async def prepare(ctl: Controller, name: str, lease_s: float) -> None:
    await ctl.peer(NODE).ask(
        "prepare_shard", control.Prepared, placement=name, lease_s=lease_s, **PROMISE
    )


def test_a_lapsed_lease_frees_the_promise_and_a_renewed_one_holds(cluster: LocalCluster) -> None:
    async def run() -> None:
        placing, watching = cluster.controller(), cluster.controller()
        try:
            await until(watching, lambda: NODE in str(watching.state.nodes), 10, "the node")
            before = promised(watching)
            await prepare(placing, "kept", LEASE_S)
            await prepare(placing, "abandoned", LEASE_S)
            await until(
                watching,
                lambda: prepared(watching) == {"kept": "prepared", "abandoned": "prepared"},
                10,
                "both prepared",
            )
            # Both promised to every operator, as their plans said.
            promise = PROMISE["weight_bytes"] + PROMISE["kv_bytes"]
            assert promised(watching) == before + 2 * promise
            # The placing controller keeps renewing one; the other's operator is gone.
            keeper = asyncio.create_task(placing.keep_leases("kept", [NODE], every=0.5))
            try:
                await until(
                    watching,
                    lambda: "abandoned" not in prepared(watching),
                    10 * LEASE_S,
                    "the abandoned shard dropped",
                )
                assert promised(watching) == before + promise
                # Held past its lease several times over while renewed.
                dropped = time.monotonic()
                while time.monotonic() - dropped < 2 * LEASE_S:
                    await watching.refresh(timeout=1.0)
                    assert prepared(watching) == {"kept": "prepared"}
                    await asyncio.sleep(0.3)
            finally:
                keeper.cancel()
                await asyncio.gather(keeper, return_exceptions=True)
            # Renewals stop: it lapses too, and the agent's log says why it went.
            await until(watching, lambda: not prepared(watching), 10 * LEASE_S, "kept dropped")
            assert promised(watching) == before
            logged = "\n".join(await watching.read_log(NODE))
            for name in ("abandoned", "kept"):
                assert f"shard {name} dropped: prepared but not renewed" in logged, logged
            # A renewal for what is no longer prepared says so; a bad lease is refused.
            assert await placing.renew_leases("kept", [NODE]) == [NODE]
            with pytest.raises(AgentError, match="lease_s must be positive"):
                await prepare(placing, "bad", 0.0)
        finally:
            await placing.close()
            await watching.close()

    asyncio.run(run())


def test_a_loaded_shard_outlives_its_lease(cluster: LocalCluster) -> None:
    spec = DemoSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32")
    model = write_demo_model(cluster.home / "models" / "leased", spec)

    async def run() -> None:
        ctl = cluster.controller()
        ctl.lease_s, ctl.lease_renew_s = LEASE_S, 0.5
        try:
            await until(ctl, lambda: NODE in str(ctl.state.nodes), 10, "the node")
            await ctl.place(model, [NODE], "leased", context_tokens=256, streams=1)
            loaded = time.monotonic()
            while time.monotonic() - loaded < 2 * LEASE_S:
                await ctl.refresh(timeout=1.0)
                assert prepared(ctl) == {"leased": "ready"}
                await asyncio.sleep(0.3)
            # Its renewals stopped once it loaded: nothing is prepared to renew.
            assert await ctl.renew_leases("leased", [NODE]) == [NODE]
            await ctl.unload("leased")
        finally:
            await ctl.close()

    asyncio.run(run())


def test_a_preview_in_the_prepare_round_trip_counts_the_placement_being_decided(
    cluster: LocalCluster,
) -> None:
    """The memory a placement is planned onto is the placing controller's from the plan
    on, not from the node's reply: the agent is held (SIGSTOP) while its prepare_shard
    is in flight, and a preview then refuses, naming the placement, what it would have
    offered again."""
    spec = DemoSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32")
    model = write_demo_model(cluster.home / "models" / "unreported", spec)
    agent = cluster.pids[NODE]

    async def run() -> None:
        ctl = cluster.controller()
        try:
            await until(ctl, lambda: NODE in str(ctl.state.nodes), 10, "the node")
            node = ctl.state.node(NODE)
            assert node is not None
            per_token = sum(read_model(model).facts.kv_bytes(1000, 1)) / 1000
            room = node.memory_free - node_promised_bytes(node) - RUNNER_OVERHEAD_BYTES
            context = int(0.6 * room / per_token)  # one fits, two do not
            _, alone = ctl.preview(model, [NODE], context, streams=1)
            assert isinstance(alone, Plan), alone
            task = asyncio.ensure_future(
                ctl.place(model, [NODE], "first", context_tokens=context, streams=1)
            )
            # Every turn of the loop: the first one after place() sent its prepare_shard
            # sees the unreported promise, before any reply can have been read.
            for _ in range(10_000):
                if "first" in ctl.unreported_promises:
                    break
                assert not task.done(), task
                await asyncio.sleep(0)
            os.kill(agent, signal.SIGSTOP)
            try:
                assert ctl.unreported_promises["first"][NODE] >= alone.shards[0].kv_bytes
                assert not any(s.placement == "first" for s in node.shards)
                _, second = ctl.preview(model, [NODE], context, streams=1)
                assert isinstance(second, Refusal), second
                assert "placement 'first' (being prepared) is promised" in second.reason
            finally:
                os.kill(agent, signal.SIGCONT)
            await task
            assert "first" not in ctl.unreported_promises  # the node's report holds it now
            _, third = ctl.preview(model, [NODE], context, streams=1)
            assert isinstance(third, Refusal), third
            await ctl.unload("first")
        finally:
            await ctl.close()

    asyncio.run(run())
