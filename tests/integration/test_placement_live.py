"""Placing on a real cluster: refusals, rollback, several placements at once."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from studiotui.cluster.controller import PlacementError
from tests.integration.test_engine import collect, prompt_tokens
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model


@pytest.fixture()
def small_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """Three agents of their own (127.0.0.91-93:58500), stopped by pid afterwards."""
    yield from cluster_fixture(tmp_path / "home", 3, 91, 58500, memory_gb=2.0)


def _model(tmp: Path, name: str, **kw: int) -> Path:
    spec = DemoSpec(
        layers=kw.get("layers", 6),
        hidden=kw.get("hidden", 64),
        heads=4,
        kv_heads=2,
        dtype="float32",
        seed=kw.get("seed", 1),
    )
    return write_demo_model(tmp / name, spec)


@pytest.mark.parametrize("when", ["first progress", "victim loaded"])
def test_node_killed_during_load_leaves_nothing_loaded(
    small_cluster: LocalCluster, tmp_path: Path, when: str
) -> None:
    model = _model(tmp_path, "m")
    victim = small_cluster.inventory.nodes[2].name

    async def run() -> tuple[str, dict[str, list[str]]]:
        ctl = small_cluster.controller()
        killed = False
        victim_complete = 0

        def progress(node: str, done: int, total: int) -> None:
            # "victim loaded": its second done == total is its shard saying ready, after
            # which only the last check of every node can tell it is gone.
            nonlocal killed, victim_complete
            victim_complete += node == victim and done == total
            if not killed and (when == "first progress" or victim_complete == 2):
                killed = True
                os.kill(small_cluster.pids[victim], signal.SIGKILL)

        try:
            await ctl.refresh()
            try:
                await ctl.place(model, list(small_cluster.inventory.names), "doomed", progress)
                error = "placed?!"
            except PlacementError as exc:
                error = str(exc)
            await ctl.refresh()
            held = {n.name: [s.placement for s in n.shards] for n in ctl.state.nodes}
            return error, held
        finally:
            await ctl.close()

    error, held = asyncio.run(run())
    print(error)
    assert "rolled back" in error and f"{victim} stopped answering" in error
    assert all(not shards for shards in held.values()), held


def test_an_agent_busy_for_seconds_while_loading_does_not_fail_the_placement(
    small_cluster: LocalCluster, tmp_path: Path
) -> None:
    """An agent that answers a health check late while a shard loads (here: stopped
    for 3 s as the check goes out, as a loaded machine can hold one off the CPU; short
    of ZeroMQ's 4 s heartbeat, so its connection stays up) is slow, not gone: only
    30 s of silence, or its connection dropping, ends a load (README)."""
    model = _model(tmp_path, "m")
    victim = small_cluster.inventory.nodes[1].name
    pid = small_cluster.pids[victim]
    held: list[float] = []

    async def run() -> list[str]:
        ctl = small_cluster.controller()
        peer = ctl.peer(victim)
        send = peer.stream
        loading: list[str] = []

        def late(kind: str, timeout: float = 5.0, **fields: Any) -> AsyncIterator[dict[str, Any]]:
            loading.extend([kind] if kind == "load_shard" else [])
            if kind == "hello" and loading and not held:  # the first check while loading
                held.append(timeout)
                os.kill(pid, signal.SIGSTOP)
                asyncio.get_running_loop().call_later(timeout + 1.0, os.kill, pid, signal.SIGCONT)
            return send(kind, timeout, **fields)

        try:
            await ctl.refresh()
            peer.stream = late  # type: ignore[method-assign]
            result = await ctl.place(model, list(small_cluster.inventory.names), "slow")
            await ctl.unload("slow")
            return list(result.placement.nodes)
        finally:
            os.kill(pid, signal.SIGCONT)
            await ctl.close()

    assert sorted(asyncio.run(run())) == sorted(small_cluster.inventory.names)
    assert held, "no health check went out while the shards loaded"


def test_two_placements_answer_at_once_and_overcommit_is_refused(
    small_cluster: LocalCluster, tmp_path: Path
) -> None:
    a = _model(tmp_path, "a", seed=1)
    b = _model(tmp_path, "b", seed=2, layers=4)
    huge = _model(tmp_path, "huge", layers=2, hidden=64)
    names = list(small_cluster.inventory.names)

    async def run() -> tuple[list[list[int]], list[list[int]], str]:
        ctl = small_cluster.controller()
        try:
            await ctl.refresh()
            await ctl.place(a, names[:2], "left")
            await ctl.place(b, names[2:], "right")
            ta, tb = prompt_tokens(a), prompt_tokens(b)
            alone = [
                (await collect(ctl, "left", ta, 24))[0],
                (await collect(ctl, "right", tb, 24))[0],
            ]
            both = await asyncio.gather(collect(ctl, "left", ta, 24), collect(ctl, "right", tb, 24))
            # A context no group can hold: the planner must refuse, with numbers.
            _info, verdict = ctl.preview(huge, names[:2], context_tokens=10_000_000)
            refusal = getattr(verdict, "reason", "planned?!")
            await ctl.unload("left")
            await ctl.unload("right")
            return alone, [t for t, _, _ in both], refusal
        finally:
            await ctl.close()

    alone, both, refusal = asyncio.run(run())
    assert both == alone
    assert "GB" in refusal and "needs" in refusal


def test_place_deploys_the_previewed_plan_or_refuses_if_it_no_longer_fits(
    small_cluster: LocalCluster, tmp_path: Path
) -> None:
    from dataclasses import replace

    from studiotui.core.placement import Plan

    model = _model(tmp_path, "p", layers=5)
    names = list(small_cluster.inventory.names)

    async def run() -> tuple[list[list[int]], list[list[int]], str, list[str]]:
        ctl = small_cluster.controller()
        try:
            await ctl.refresh()
            _info, seen = ctl.preview(model, names)
            assert isinstance(seen, Plan)
            greedy = replace(
                seen,
                shards=tuple(replace(s, free_after=s.free_before - 10**12) for s in seen.shards),
            )
            try:
                await ctl.place(model, names, "stale", expected=greedy)
                stale = "placed?!"
            except PlacementError as exc:
                stale = str(exc)
            left = [p.name for p in ctl.state.placements]
            placed = await ctl.place(model, names, "seen", expected=seen)
            layers = placed.placement.layers
            await ctl.unload("seen")
            return [[s.start, s.end] for s in seen.shards], layers, stale, left
        finally:
            await ctl.close()

    planned, layers, stale, left = asyncio.run(run())
    assert layers == planned
    assert "changed since the preview" in stale and "preview again" in stale
    assert left == []


def test_a_shard_killed_for_memory_while_loading_is_reported_and_rolled_back(
    small_cluster: LocalCluster, tmp_path: Path
) -> None:
    """The victim's shard process is frozen as it starts (a load that makes no
    progress, like a slow disk), then killed with SIGKILL as macOS and Linux end a
    process that ran out of memory: heartbeats keep the frozen load alive, the kill is
    reported as out of memory while loading, and no shard is left on any node."""
    import psutil

    model = _model(tmp_path, "oom")
    victim = small_cluster.inventory.nodes[1].name
    agent = psutil.Process(small_cluster.pids[victim])
    frozen_s = 6.0

    async def freeze_then_kill(heard: list[tuple[float, int]]) -> float:
        while True:
            runners = [p for p in agent.children() if "worker.runner" in " ".join(p.cmdline())]
            if runners:
                break
            await asyncio.sleep(0.005)
        runners[0].send_signal(signal.SIGSTOP)  # still importing: nowhere near ready
        stopped = time.monotonic()
        await asyncio.sleep(frozen_s)
        runners[0].send_signal(signal.SIGKILL)
        return stopped

    async def run() -> tuple[str, dict[str, list[str]], list[float], float]:
        ctl = small_cluster.controller()
        heard: list[tuple[float, int]] = []

        def progress(node: str, done: int, total: int) -> None:
            if node == victim:
                heard.append((time.monotonic(), done))

        try:
            await ctl.refresh()
            killer = asyncio.create_task(freeze_then_kill(heard))
            try:
                await ctl.place(model, list(small_cluster.inventory.names), "oom", progress)
                error = "placed?!"
            except PlacementError as exc:
                error = str(exc)
            stopped = await killer
            await ctl.refresh()
            held = {n.name: [s.placement for s in n.shards] for n in ctl.state.nodes}
            return error, held, [t for t, _ in heard], stopped
        finally:
            await ctl.close()

    error, held, heard_at, stopped = asyncio.run(run())
    print(error)
    assert "rolled back" in error and f"{victim}: out of memory while loading" in error
    assert "killed by SIGKILL" in error
    assert all(not shards for shards in held.values()), held
    # While the runner was frozen, the node kept saying "still loading".
    during = [t for t in heard_at if stopped < t < stopped + frozen_s]
    assert len(during) >= 2, heard_at
