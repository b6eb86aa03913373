"""The prefix cache of a placement on real agents: its entries on disk named by the
model's bytes (the controller's content digest), and `--prompt-cache 0` keeping none.

A model folder whose files were copied again (new times, the same bytes) keeps its
entries; one whose weights were replaced under the same path never serves the old
weights' entries: its answer equals mlx-lm's on the new weights.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from studiotui.cluster.errors import PlacementRefused
from studiotui.core.placement import Plan
from studiotui.core.traffic import placement_cache
from tests.support.answers import greedy_turn
from tests.support.cluster_fixture import LocalCluster
from tests.support.ring_harness import CHUNK
from worker.shared.demo_model import DemoSpec, write_demo_model

N = 4
PROMPT = list(range(40, 64))


def _spec(seed: int) -> DemoSpec:
    return DemoSpec(
        arch="qwen3", dtype="float32", seed=seed, layers=5, hidden=64, heads=4, kv_heads=2
    )


def _reference(model: Path, prompt: list[int]) -> list[int]:
    loaded, _ = mlx_lm.load(str(model))
    steps = generate_step(mx.array(prompt), loaded, max_tokens=N, prefill_step_size=CHUNK)
    return [int(t) for t, _ in steps]


async def _placed_turn(
    cluster: LocalCluster, model: Path, name: str, **options: Any
) -> tuple[list[int], int]:
    """Place `model` on two nodes, answer PROMPT once, unload (the shards' writes to
    disk finish as they stop)."""
    ctl = cluster.controller()
    try:
        await ctl.refresh()
        nodes = list(cluster.inventory.names)[:2]
        await ctl.place(model, nodes, name, prefill_chunk=CHUNK, **options)
        got = await greedy_turn(ctl, name, PROMPT, N)
        await ctl.unload(name)
        return got
    finally:
        await ctl.close()


@pytest.mark.integration
def test_disk_entries_are_the_model_s_bytes_not_its_path(
    engine_cluster: LocalCluster, tmp_path: Path
) -> None:
    model = write_demo_model(tmp_path / "model", _spec(31))
    other = write_demo_model(tmp_path / "other", _spec(32))
    first_ref, other_ref = _reference(model, PROMPT), _reference(other, PROMPT)
    assert first_ref != other_ref  # else the test could not tell the weights apart

    first = asyncio.run(_placed_turn(engine_cluster, model, "dk"))
    assert first == (first_ref, 0)

    # Copied again: the same bytes with new times. The entries are still the model's
    # (from disk: nothing of the first placement is in memory any more).
    later = time.time() + 60
    for f in model.iterdir():
        if f.is_file() and not f.name.startswith("."):
            os.utime(f, (later, later))
    again = asyncio.run(_placed_turn(engine_cluster, model, "dk"))
    assert again == (first_ref, len(PROMPT) - 1)

    # Other weights under the same path: the old entries are never read.
    for f in other.glob("*.safetensors"):
        shutil.copyfile(f, model / f.name)
    replaced = asyncio.run(_placed_turn(engine_cluster, model, "dk"))
    assert replaced == (other_ref, 0)


@pytest.mark.integration
def test_prompt_cache_0_keeps_nothing(engine_cluster: LocalCluster, tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "model", _spec(33))
    expected = _reference(model, PROMPT)

    async def run() -> tuple[list[tuple[list[int], int]], Any, list[int]]:
        ctl = engine_cluster.controller()
        try:
            await ctl.refresh()
            nodes = list(engine_cluster.inventory.names)[:2]
            result = await ctl.place(model, nodes, "off", prefill_chunk=CHUNK, prompt_cache=0)
            budgets = [s.prompt_cache_bytes for s in result.plan.shards]
            turns = [await greedy_turn(ctl, "off", PROMPT, N) for _ in range(2)]
            # The shards' figures come with their telemetry, once a second.
            await asyncio.sleep(2.5)
            await ctl.refresh()
            placement = ctl.state.placement("off")
            assert placement is not None
            figures = placement_cache(placement)
            await ctl.unload("off")
            return turns, figures, budgets
        finally:
            await ctl.close()

    turns, figures, budgets = asyncio.run(run())
    assert budgets == [0, 0]
    assert turns == [(expected, 0), (expected, 0)]
    assert (figures.entries, figures.bytes, figures.disk_bytes) == (0, 0, 0)
    assert figures.misses == 0 and figures.hits == 0


@pytest.mark.integration
def test_a_disk_budget_beyond_a_node_s_free_disk_is_refused_before_loading(
    engine_cluster: LocalCluster, tmp_path: Path
) -> None:
    model = write_demo_model(tmp_path / "model", _spec(34))
    free = shutil.disk_usage(engine_cluster.home).free  # the simulated nodes share it
    asked = (free // 1024**3 + 100) * 1024**3

    async def run() -> tuple[str, Any, list[int], list[int | None]]:
        ctl = engine_cluster.controller()
        try:
            await ctl.refresh()
            nodes = list(engine_cluster.inventory.names)[:2]
            said = ""
            try:
                await ctl.place(model, nodes, "big", prefill_chunk=CHUNK, prompt_cache_disk=asked)
            except PlacementRefused as exc:
                said = str(exc)
            placed = ctl.state.placement("big")
            # By default each node keeps at most half of its free disk.
            _, default = ctl.preview(model, nodes)
            assert isinstance(default, Plan)
            frees = [n.disk_free for name in nodes if (n := ctl.state.node(name))]
            return said, placed, [s.prompt_cache_disk_bytes for s in default.shards], frees
        finally:
            await ctl.close()

    said, placed, default_disk, frees = asyncio.run(run())
    assert placed is None
    assert f"a prompt cache of {asked / 1024**3:.1f} GB on disk does not fit" in said, said
    where = said.split("does not fit:", 1)[1]
    assert any(name in where for name in list(engine_cluster.inventory.names)[:2]), said
    assert "free for it on its disk" in where, said
    assert "--prompt-cache-disk " in said, said
    assert all(isinstance(f, int) and f > 0 for f in frees), frees
    assert all(0 < d <= min(f for f in frees if f) // 2 for d in default_disk), default_disk


@pytest.mark.integration
def test_a_placed_cache_s_disk_budget_is_spoken_for_when_the_next_is_placed(
    engine_cluster: LocalCluster, tmp_path: Path
) -> None:
    """A second placement on the same nodes counts on their free disk less what the
    first one's prompt cache may still write: a budget that fits the free disk alone
    is refused while the first is placed, and fits again once it is unloaded."""
    model = write_demo_model(tmp_path / "model", _spec(36))
    gb = 1024**3
    free = shutil.disk_usage(engine_cluster.home).free  # the simulated nodes share it
    # Each of two nodes keeps half of a budget: the first holds 0.5 F a node; the second
    # asks 0.8 F a node, which the free disk alone (F) would hold.
    first, second = free // gb * gb, (free * 8 // 5) // gb * gb

    async def run() -> tuple[str, list[int], bool]:
        ctl = engine_cluster.controller()
        try:
            await ctl.refresh()
            nodes = list(engine_cluster.inventory.names)[:2]
            await ctl.place(model, nodes, "one", prefill_chunk=CHUNK, prompt_cache_disk=first)
            await ctl.refresh()
            held = [
                s.prompt_cache_disk_bytes
                for name in nodes
                if (n := ctl.state.node(name))
                for s in n.shards
                if s.placement == "one"
            ]
            said = ""
            try:
                await ctl.place(model, nodes, "two", prefill_chunk=CHUNK, prompt_cache_disk=second)
            except PlacementRefused as exc:
                said = str(exc)
            await ctl.unload("one")
            await ctl.refresh()
            _, after = ctl.preview(model, nodes, prompt_cache_disk=second)
            return said, held, isinstance(after, Plan)
        finally:
            await ctl.close()

    said, held, fits_after = asyncio.run(run())
    assert len(held) == 2 and all(h > 0 for h in held), held
    assert f"a prompt cache of {second / gb:.1f} GB on disk does not fit" in said, said
    assert "free for it on its disk" in said, said
    assert fits_after, "with the first unloaded, the same budget fits the free disk"


@pytest.mark.integration
def test_two_placements_of_one_model_keep_their_own_entries(
    engine_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Each placement's shards write and count their own folder: one placement never
    finds (or evicts) the other's files, and placed again under its name it finds its
    own."""
    model = write_demo_model(tmp_path / "model", _spec(35))
    expected = _reference(model, PROMPT)

    async def run() -> list[tuple[list[int], int]]:
        ctl = engine_cluster.controller()
        try:
            await ctl.refresh()
            nodes = list(engine_cluster.inventory.names)[:2]
            placed = await ctl.place(model, nodes, "one", prefill_chunk=CHUNK)
            first = await greedy_turn(ctl, "one", PROMPT, N)
            await ctl.unload("one")  # its writes finish
            await ctl.place(model, nodes, "two", prefill_chunk=CHUNK)
            # The same split as before (the layers name the entries too).
            await ctl.place(model, nodes, "one", prefill_chunk=CHUNK, expected=placed.plan)
            other = await greedy_turn(ctl, "two", PROMPT, N)
            own = await greedy_turn(ctl, "one", PROMPT, N)
            await ctl.unload("one")
            await ctl.unload("two")
            return [first, other, own]
        finally:
            await ctl.close()

    first, other, own = asyncio.run(run())
    assert first == (expected, 0)
    assert other == (expected, 0), "another placement's entries are not this one's"
    assert own == (expected, len(PROMPT) - 1), "placed again, its own entries came back"
