"""The forecast against `studiotui benchmark` on three shapes, with four real agents on
127.0.0.101-104:59860: a 2-stage pipeline, a 2-node tensor group (ring backend) and a
4-bit MoE on 2 stages, measured in one benchmark run together with each node's device
(its decode step per layer of each kind, a dense layer whole and as a 2-way rank's
slice), the links between the nodes and the group's small all-reduce. The forecast is
then priced from that run's figures and set beside what the same run measured.

This compares two measurements of the same machine in the same run, so a load that
comes and goes weighs on both, though not always alike; a run outside the bound is
measured once more (benchmark and forecast anew) before it fails: a burst of other work
can fall on one of the two timings only, but a forecast that is wrong is wrong twice.
Each shape must land within QUIET_BOUND, 1.5×, of what the run measured when nothing
else kept the host busy, and within BOUND, 2×, when something did (before the forecast
used a benchmark's figures it was 2.4× to 7× high). 1.5× failed beside other
benchmarks (the pipeline once at 2.93×, its stream timed in a burst); docs/forecast.md
gives the ratios measured, with the load.

One exception, measured rather than assumed: a tensor group's two ranks on this one
host busy-poll the ring at every all-reduce, so when other programs keep the host's
cores busy (the test counts the CPU time spent outside the cluster's own processes
during the run) a rank waits for the scheduler as well as for its peer, and the group
decodes several times slower than any figure of a quiet moment forecasts (8-42 tok/s
against 56-78 not starved). Then the tensor group's forecast
is held to the bound on the low side only (never too pessimistic); the pipeline and the
MoE are held to it on both. Run with -s, it prints each ratio and the outside load."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
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
    seconds=0.5,
    link_seconds=0.1,
    link_pings=11,
    group_reps=3,
    stream_counts=(1,),
    stream_tokens=64,
    prompt_tokens=16,
)
BOUND = 2.0
# ... and on a host that nothing else kept busy during the run (docs/forecast.md: 0.92
# to 1.38 in such runs).
QUIET_BOUND = 1.5
# Cores' worth of CPU time that programs outside the cluster used during the run, above
# which the host counts as busy (see the module's docstring).
BUSY_CORES = 0.5


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

    async def go(first: bool) -> dict[str, tuple[float, float, str]]:  # forecast, measured
        ctl = four.controller()
        plans: dict[str, Plan] = {}
        try:
            await ctl.refresh()
            if first:  # before any benchmark, a forecast says that nothing measured it
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
                print(
                    f"{name}: first token forecast {guess.ttft_ms:.0f} ms, "
                    f"measured {placed.points[0].ttft_ms:.0f} ms"
                )
                out[name] = (
                    guess.tps_1,
                    placed.points[0].decode_tps,
                    describe(guess, last) + figures,
                )
            return out
        finally:
            await ctl.close()

    def off(found: dict[str, tuple[float, float, str]], busy: bool) -> list[str]:
        bound = BOUND if busy else QUIET_BOUND
        return [
            f"{name}: forecast {guessed:.1f} tok/s, measured {measured:.1f} "
            f"({guessed / measured:.2f}x)"
            for name, (guessed, measured, _) in found.items()
            if guessed / measured < 1 / bound
            or (guessed / measured > bound and not (busy and name == "tp"))
        ]

    def measured(first: bool) -> tuple[dict[str, tuple[float, float, str]], bool]:
        """The run's figures, and whether other programs kept the host busy meanwhile."""
        began, ours = time.monotonic(), _cluster_cpu_s(four)
        busy = _busy_cpu_s()
        found = asyncio.run(go(first))
        wall = time.monotonic() - began
        outside = (_busy_cpu_s() - busy - (_cluster_cpu_s(four) - ours)) / wall
        print(f"outside the cluster: {outside:.2f} cores busy, load {os.getloadavg()}")
        return found, outside > BUSY_CORES

    found, busy = measured(True)
    if off(found, busy):
        print("outside the bound, measured again:", off(found, busy))
        found, busy = measured(False)
    for name, (guessed, measured_tps, said) in found.items():
        print(f"forecast {name}: {guessed:.1f} vs measured {measured_tps:.1f} tok/s")
        assert "last measured" in said and "not measured" not in said
    assert not off(found, busy), off(found, busy)


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent working (not idle), all cores."""
    t = psutil.cpu_times()
    return float(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))


def _cluster_cpu_s(cluster: LocalCluster) -> float:
    """CPU seconds of this test's process and of the cluster's agents, with everything
    they started (runners, measuring processes, ranks), finished ones included."""
    procs = [psutil.Process()]
    for pid in cluster.pids.values():
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
            if proc.pid != os.getpid():  # the agents' reaped children; the test's are agents
                total += t.children_user + t.children_system
            for child in proc.children(recursive=True) if proc.pid != os.getpid() else []:
                c = child.cpu_times()
                total += c.user + c.system + c.children_user + c.children_system
        except psutil.NoSuchProcess:
            continue
    return total
