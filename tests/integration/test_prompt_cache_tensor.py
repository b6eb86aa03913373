"""The prefix cache on a tensor group whose ranks do not hold the same entries.

Each rank of a group keeps its own slice of every entry, on its own node's disk. When
one rank's file is damaged, the ranks agree before any of them reuses the entry, so
none computes from a state its partner lacks: the request prefills in full on every
rank and answers as mlx-lm does; the next one reuses the entry stored anew.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from studiotui.core.placement import Plan
from tests.support.answers import greedy_turn, greedy_with_margins
from tests.support.cluster_fixture import LocalCluster
from worker.prompt_cache import safetensors_metadata
from worker.shared.demo_model import DemoSpec, write_demo_model

pytestmark = pytest.mark.integration

PROMPT = list(range(40, 62))
N = 8
MARGIN = 1e-2
SPEC = DemoSpec(
    arch="qwen3",
    layers=4,
    hidden=128,
    heads=8,
    kv_heads=4,
    intermediate=384,
    dtype="float32",
    seed=41,
)


def _reference(model: Path) -> tuple[list[int], int]:
    """mlx-lm's greedy tokens, and how many of them a group's sums can be held to (up
    to the first step whose top two are within MARGIN)."""
    tokens, margins = greedy_with_margins(model, PROMPT, N)
    judged = next((i for i, m in enumerate(margins) if m < MARGIN), len(margins))
    return tokens, judged


@pytest.mark.parametrize("nodes", [2, 4])
def test_a_damaged_entry_on_one_rank_makes_every_rank_prefill(
    engine_cluster: LocalCluster, tmp_path: Path, nodes: int
) -> None:
    """One group (the head's), and a pipeline of two groups (the damage on the last
    stage's follower, which learns of the entry from the ring's frame)."""
    model = write_demo_model(tmp_path / "dense", dataclasses.replace(SPEC))
    want, judged = _reference(model)
    assert judged >= 4, "margins too thin to judge"
    names = list(engine_cluster.inventory.names)[:nodes]

    async def place_and_ask(
        times: int, expected: Plan | None = None
    ) -> tuple[Plan, list[tuple[list[int], int]]]:
        ctl = engine_cluster.controller()
        try:
            await ctl.refresh()
            result = await ctl.place(
                model, names, "tp-cache", prefill_chunk=8, tensor=2, expected=expected
            )
            assert isinstance(result.plan, Plan)
            assert len(result.plan.shards) == nodes // 2
            got = [
                await asyncio.wait_for(greedy_turn(ctl, "tp-cache", PROMPT, N), 120)
                for _ in range(times)
            ]
            # Unloaded as soon as the answer is done: each stage still keeps its entry.
            await ctl.unload("tp-cache")
            return result.plan, got
        finally:
            await ctl.close()

    began = time.time()
    plan, [first] = asyncio.run(place_and_ask(1))
    group = plan.shards[-1].group
    assert len(group) == 2
    assert first[1] == 0 and first[0][:judged] == want[:judged]

    # The follower's file of the entry loses its data (its header, and so the index
    # every rank rebuilds from its own files, stays as it was).
    follower = next(n for n in engine_cluster.inventory.nodes if n.name == group[1])

    def written() -> list[Path]:
        return [
            f
            for f in Path(follower.workdir).expanduser().glob("prompt-cache/*/*.safetensors")
            if f.stat().st_mtime >= began
            and safetensors_metadata(f).get("held") == str(len(PROMPT) + N - 1)
        ]

    files = written()
    assert len(files) == 1, files
    raw = files[0].read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")
    files[0].write_bytes(raw[: header + 16])

    # The same plan again (the same stages on the same nodes), so the damaged file is
    # the one the last stage's follower reads.
    _, [again, third] = asyncio.run(place_and_ask(2, expected=plan))
    assert again[1] == 0, "one rank lacked the entry: every rank prefilled"
    assert again[0][:judged] == want[:judged]
    # The full prefill stored the entry anew on both ranks: reused whole now.
    assert third[1] >= len(PROMPT) - 1
    assert third[0][:judged] == want[:judged]
