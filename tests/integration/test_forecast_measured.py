"""The forecast against `studiotui benchmark` on three shapes, with four real agents on
127.0.0.101-104:59860: a 2-stage pipeline, a 2-node tensor group (ring backend) and a
4-bit MoE on 2 stages, measured in one benchmark run together with each node's device
(its decode step per layer of each kind) and the group's small all-reduce. The forecast
is then priced from that run's figures and set beside what the same run measured.

This compares two measurements of the same machine in the same run, so a load that
comes and goes weighs on both, though not always alike. The machine the suite runs on
is shared (two cores, many processes): two quiet runs there gave 0.91/0.99/1.12x and
1.04/0.82/1.02x (pipeline, tensor, MoE), inside the 25 % aimed at; a third, beside
other engineers' benchmarks, measured the tensor group at 12.6 tok/s against 54-65
before (2.87x), the ring's two ranks starved of the cores while the all-reduce it was
priced from had been timed at a quieter moment. So this test asks for a factor of 2 —
the forecast was 2.4x (pipeline) to 7x (MoE) high before it used a benchmark's
figures —, and a run outside it is measured once more (benchmark and forecast anew)
before it fails: a burst of other work can fall on one of the two timings only (the
tensor group was once priced at 0.45x beside a full suite), but a forecast that is wrong
is wrong twice. Run with -s, it prints each ratio."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from studiotui.cluster.benchmark import Benchmark
from studiotui.core import benchmark as bm
from studiotui.core.benchmark import Sizes
from studiotui.core.forecast import describe, forecast, links_from_state
from studiotui.core.placement import Plan
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model

BASE, PORT = 101, 59860
SIZES = Sizes(
    matmul_n=256,
    copy_mib=16,
    seconds=0.2,
    link_seconds=0.1,
    link_pings=11,
    group_reps=3,
    stream_counts=(1,),
    stream_tokens=24,
    prompt_tokens=16,
)
BOUND = 2.0


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("forecast-home"), 4, BASE, PORT)


def test_the_forecast_after_a_benchmark_lands_near_what_it_measures(
    four: LocalCluster, tmp_path: Path
) -> None:
    dense = write_demo_model(tmp_path / "dense", DemoSpec(layers=8))
    moe = write_demo_model(tmp_path / "moe", DemoSpec(arch="qwen3_moe", layers=8, quantize="4"))
    a, b, c, d = four.inventory.names
    shapes = {  # placement: (model, nodes, tensor)
        "pipe": (dense, [a, b], 1),
        "tp": (dense, [c, d], 2),
        "moe": (moe, [a, b], 1),
    }

    async def go() -> dict[str, tuple[float, float, str]]:  # placement: forecast, measured
        ctl = four.controller()
        plans: dict[str, Plan] = {}
        try:
            await ctl.refresh()
            # Before any benchmark, a forecast says that nothing measured it.
            info, verdict = ctl.preview(dense, [a, b], 4096, 1, 1)
            assert isinstance(verdict, Plan)
            guess = forecast(info.facts, verdict, ctl.node_chips([a, b]), [], streams=1)
            assert not guess.measured and "not measured" in describe(guess)
            out = {}
            for name, (model, nodes, tensor) in shapes.items():
                result = await ctl.place(model, nodes, name, streams=1, tensor=tensor)
                plans[name] = result.plan
            try:
                run = await Benchmark(ctl, None, SIZES, placements=list(shapes)).run()
            finally:
                for name in shapes:
                    await ctl.unload(name)
            assert run.errors == []
            bm.save(four.home, run)
            links = links_from_state(ctl.state)
            for name, (model, nodes, _) in shapes.items():
                info, _ = ctl.preview(model, nodes, 4096, 1, plans[name].tensor)
                chips = ctl.node_chips(nodes)
                guess = forecast(
                    info.facts,
                    plans[name],
                    chips,
                    links,
                    streams=1,
                    prompt_tokens=SIZES.prompt_tokens + SIZES.stream_tokens // 2,
                )
                assert guess.measured, name
                (placed,) = [p for p in run.placements if p.name == name]
                assert placed.shape == plans[name].shape
                last = ctl.last_measured(model.name, plans[name].shape)
                assert last is not None and last.run == run.id
                figures = f"{chips[nodes[0]].decode_us} {run.group}"
                out[name] = (
                    guess.tps_1,
                    placed.points[0].decode_tps,
                    describe(guess, last) + figures,
                )
            return out
        finally:
            await ctl.close()

    def off(found: dict[str, tuple[float, float, str]]) -> list[str]:
        return [
            f"{name}: forecast {guessed:.1f} tok/s, measured {measured:.1f} "
            f"({guessed / measured:.2f}x)"
            for name, (guessed, measured, _) in found.items()
            if not 1 / BOUND <= guessed / measured <= BOUND
        ]

    found = asyncio.run(go())
    if off(found):
        # One more whole run (benchmark and forecast anew) when a burst of other work
        # fell on one of the two timings only: a forecast that is wrong is wrong twice.
        print("outside the bound, measured again:", off(found))
        found = asyncio.run(go())
    for name, (guessed, measured, said) in found.items():
        print(f"forecast {name}: {guessed:.1f} vs measured {measured:.1f} tok/s")
        assert "last measured" in said and "not measured" not in said
    assert not off(found), off(found)
