"""The forecast against `studiotui benchmark` on three shapes, with four real agents on
127.0.0.101-104:59860: a 2-stage pipeline, a 2-node tensor group (ring backend) and a
4-bit MoE on 2 stages, measured in one benchmark run together with each node's device
(its decode step per layer of each kind, a dense layer whole and as a 2-way rank's
slice), the links between the nodes and the group's small all-reduce. The forecast is
then priced from that run's figures and set beside what the same run measured.

Each shape must land within GOAL, 25 %, of what the run measured, unless the host's
own speed moved more than that during the run. That is measured in the same run
(tests/support/host_speed.py): one fixed decode step timed on each CPU right after each
node's device figures and before and after each placement's streams. On the virtual
machines this runs on, the same step pinned to one CPU takes ~6 ms for some seconds and
~10 ms for the next, so device figures taken at one moment and streams timed at another
can differ by that much whatever the forecast does; then the bound is the step's own
slowest over its fastest time in the run, never past QUIET_BOUND, 1.5x, on a host
nothing else kept busy and BOUND, 2x, on one something did. A run outside its bound is
measured once more (benchmark and forecast anew) before it fails: a burst can fall on
one of the two timings only, but a forecast that is wrong is wrong twice.

One exception, measured rather than assumed: a tensor group's two ranks on this one
host busy-poll the ring at every all-reduce, so when other programs keep the host's
cores busy (the test counts the CPU time spent outside the cluster's own processes
during the run) a rank waits for the scheduler as well as for its peer, and the group
decodes several times slower than any figure of a quiet moment forecasts (8-42 tok/s
against 56-78 not starved). Then the tensor group's forecast is held to the bound on
the low side only (never too pessimistic); the pipeline and the MoE are held to it on
both. Run with -s, it prints each ratio, the host's own spread and the outside load."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from studiotui.cluster.benchmark import Benchmark
from studiotui.core import benchmark as bm
from studiotui.core.benchmark import Sizes, Step
from studiotui.core.forecast import describe, forecast, links_from_state
from studiotui.core.placement import Plan
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from tests.support.host_speed import HostSpeed
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
# Within 25 % of what the benchmark measured, unless the host's own speed moved more
# during the run (then that much: see `allowed`) ...
GOAL = 1.25
# ... and never past 2x when other programs kept the host busy, ...
BOUND = 2.0
# ... nor past 1.5x when nothing did (docs/forecast.md: 0.76 to 1.44 in such runs).
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

    async def go(first: bool, host: HostSpeed) -> dict[str, tuple[float, float, str]]:
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
                run = await Benchmark(
                    ctl, None, SIZES, on_step=host_at(host), placements=list(shapes)
                ).run()
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

    def off(found: dict[str, tuple[float, float, str]], busy: bool, spread: float) -> list[str]:
        bound = allowed(spread, busy)
        return [
            f"{name}: forecast {guessed:.1f} tok/s, measured {measured:.1f} "
            f"({guessed / measured:.2f}x, allowed {bound:.2f}x)"
            for name, (guessed, measured, _) in found.items()
            if guessed / measured < 1 / bound
            or (guessed / measured > bound and not (busy and name == "tp"))
        ]

    def measured(first: bool) -> tuple[dict[str, tuple[float, float, str]], bool, float]:
        """The run's figures, whether other programs kept the host busy meanwhile, and
        how far the host's own speed moved during the run."""
        began, ours = time.monotonic(), _cluster_cpu_s(four)
        busy = _busy_cpu_s()
        with HostSpeed() as host:
            found = asyncio.run(go(first, host))
        wall = time.monotonic() - began
        outside = (_busy_cpu_s() - busy - (_cluster_cpu_s(four) - ours) - host.cpu_s) / wall
        spread = host.spread()
        print(
            f"outside the cluster: {outside:.2f} cores busy, load {os.getloadavg()}; the host's "
            f"own step {spread:.2f}x slower at its slowest than at its fastest "
            f"({', '.join(f'{t * 1e3:.1f}' for t in host.samples)} ms)"
        )
        return found, outside > BUSY_CORES, spread

    found, busy, spread = measured(True)
    missed = off(found, busy, spread)
    if missed:
        print("outside the bound, measured again:", missed)
        found, busy, spread = measured(False)
    for name, (guessed, measured_tps, said) in found.items():
        print(
            f"forecast {name}: {guessed:.1f} vs measured {measured_tps:.1f} tok/s "
            f"({guessed / measured_tps:.2f}x; the host's own speed moved {spread:.2f}x)"
        )
        assert "last measured" in said and "not measured" not in said
    missed = off(found, busy, spread)
    assert not missed, missed


def allowed(spread: float, busy: bool) -> float:
    """How far (as a ratio either way) the forecast may land from what the run measured:
    GOAL, or what the host's own speed moved during the run when that is more (no
    forecast can be closer than the machine is to itself), never past the cap."""
    return min(max(GOAL, spread), BOUND if busy else QUIET_BOUND)


def test_the_bound_is_the_goal_unless_the_host_itself_moved_more() -> None:
    assert allowed(1.05, busy=False) == GOAL
    assert allowed(1.4, busy=False) == 1.4
    assert allowed(2.2, busy=False) == QUIET_BOUND
    assert allowed(2.2, busy=True) == BOUND


def host_at(host: HostSpeed) -> Callable[[Step], None]:
    """A benchmark's step listener that samples the host's speed right after each
    node's device figures and before and after each placement's streams (the run
    waits meanwhile: nothing of the cluster's runs beside a sample)."""

    def on_step(step: Step) -> None:
        what = step.label.partition(": ")[2]
        if (what == "device" and step.state == "done") or (
            what.endswith("stream") and step.state in ("running", "done")
        ):
            host.sample()

    return on_step


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
