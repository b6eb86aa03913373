"""Memory promised to a placement whose files are still being copied, seen by another
operator: real agents on two SSH nodes (a private loopback sshd; the agents run here
on its addresses, each with its own home).

The first placement is held in its copy by a real stall: its node's sshd is stopped
(SIGSTOP), so the operator's SFTP copy waits for the handshake as it would on a slow or
hung link, while its shard is already prepared on the node. A second controller (what
another CLI or a restarted TUI is) then sees, from the agent's own report, the plan's
weights and KV reserve promised there: a second placement of the same size on that node
is refused with a message naming the first, and fits the other node. When the copy
gives up (the SSH handshake's timeout), the first placement is rolled back and its
memory given back: the second fits where it was refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from studiotui.cluster import local_cluster
from studiotui.cluster.controller import Controller, PlacementError
from studiotui.core.inventory import Inventory
from studiotui.core.memory import RUNNER_OVERHEAD_BYTES, node_promised_bytes
from studiotui.core.model_facts import read_model
from studiotui.core.placement import Plan, Refusal
from tests.support.sshd import SshdServer, ssh_node, sshd_factory  # noqa: F401 - the fixture
from worker.shared.demo_model import DemoSpec, write_demo_model

SPEC = DemoSpec(arch="llama", layers=4, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=5)
PORT = 59940


async def _until(ctl: Controller, check: Callable[[], bool], what: str) -> None:
    for _ in range(150):
        await ctl.refresh(timeout=1.0)
        if check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"never saw {what}: {ctl.state.nodes}")


def test_a_placement_being_copied_holds_its_memory_for_every_operator(
    sshd_factory: Callable[..., SshdServer],  # noqa: F811
    tmp_path: Path,
) -> None:
    server = sshd_factory()
    model = write_demo_model(tmp_path / "models" / "tiny", SPEC)
    nodes = tuple(
        ssh_node(server, a, f"mac-{a[-2:]}", tmp_path / "nodes", PORT) for a in server.addresses[:2]
    )
    nodes = tuple(replace(n, memory_gb=0.5) for n in nodes)
    held, other = (n.name for n in nodes)
    inv = Inventory(name="desk", nodes=nodes)
    home = tmp_path / "home"
    home.mkdir()
    server.write_known_hosts(home / "known_hosts")
    pids = [local_cluster.start_agent(home, node, inv) for node in nodes]
    sshd_pid = server.pid
    assert sshd_pid is not None
    # The KV cache per token of this model, to size a placement to most of a node.
    facts = read_model(model).facts
    per_token = sum(facts.kv_bytes(1000, 1)) / 1000

    async def run() -> None:
        placing, watching = Controller(home, inv), Controller(home, inv)
        try:
            await _until(
                watching, lambda: all(n.state == "up" for n in watching.state.nodes), "both up"
            )
            node = watching.state.node(held)
            assert node is not None
            room = node.memory_free - node_promised_bytes(node) - RUNNER_OVERHEAD_BYTES
            # Most of the node: one such placement fits, two do not.
            context = int(0.6 * room / per_token)
            _, first = watching.preview(model, [held], context, streams=1)
            assert isinstance(first, Plan), first
            os.kill(sshd_pid, signal.SIGSTOP)  # the copy stalls in its SSH handshake
            try:
                task = asyncio.ensure_future(
                    placing.place(model, [held], "first", context_tokens=context, streams=1)
                )

                def prepared() -> bool:
                    n = watching.state.node(held)
                    return n is not None and any(
                        s.placement == "first" and s.state == "prepared" for s in n.shards
                    )

                await _until(watching, prepared, "the first placement prepared")
                assert not task.done()
                node = watching.state.node(held)
                assert node is not None
                (shard,) = node.shards
                # The agent's own report: the plan's weights and KV, nothing loaded.
                planned = first.shards[0]
                assert (shard.weight_bytes, shard.kv_bytes) == (
                    planned.weight_bytes,
                    planned.kv_bytes,
                )
                # ...and its prompt cache's budget (default: what the node could spare
                # when it was placed).
                assert shard.prompt_cache_bytes > 0
                assert node_promised_bytes(node) == (
                    planned.weight_bytes + planned.kv_bytes + shard.prompt_cache_bytes
                )
                _, second = watching.preview(model, [held], context, streams=1)
                assert isinstance(second, Refusal), second
                assert "placement 'first' (copying its files) is promised" in second.reason
                assert f"on {held}" in second.reason
                _, elsewhere = watching.preview(model, [other], context, streams=1)
                assert isinstance(elsewhere, Plan), elsewhere
                # The placing controller (no telemetry here: only what it asks) knew it
                # as soon as its shard was prepared, not at a later refresh.
                for _ in range(100):
                    mine_now = placing.state.node(held)
                    if mine_now is not None and any(
                        s.placement == "first" for s in mine_now.shards
                    ):
                        break
                    await asyncio.sleep(0.05)
                _, mine = placing.preview(model, [held], context, streams=1)
                assert isinstance(mine, Refusal) and "'first'" in mine.reason, mine
                # The copy gives up at the SSH handshake's timeout: rolled back.
                try:
                    await task
                    raise AssertionError("the stalled copy must fail")
                except PlacementError as exc:
                    assert "rolled back" in str(exc) and held in str(exc), exc
            finally:
                os.kill(sshd_pid, signal.SIGCONT)
            await _until(
                watching,
                lambda: not any(n.shards for n in watching.state.nodes),
                "the shard unloaded",
            )
            _, again = watching.preview(model, [held], context, streams=1)
            assert isinstance(again, Plan), again
        finally:
            await placing.close()
            await watching.close()

    try:
        asyncio.run(run())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(sshd_pid, signal.SIGCONT)
        for pid in pids:
            local_cluster.kill_pid(pid)
