"""The cluster benchmark against two real agents on 127.0.0.231-232:59700: each node's
device measured with MLX in a process of its agent's, both directions of the link over
CURVE ZeroMQ, the group's product over `mx.distributed` (ring) launched by the agents,
a placement's streams; the run saved, read back, compared and written as Markdown, by
the library and by the command line. Sizes are tiny: this checks the figures are real
measurements (positive, finite, consistent), not how fast anything is."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from studiotui import __version__
from studiotui.cli.main import main
from studiotui.cluster.benchmark import Benchmark
from studiotui.cluster.controller import Controller
from studiotui.cluster.peers import AgentError
from studiotui.core import benchmark as bm
from studiotui.core.benchmark import DTYPES, BenchmarkError, Sizes, Step
from studiotui.core.inventory import dump_inventory
from tests.benchmark_fixtures import TINY, size_args
from tests.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control

BASE, PORT = 231, 59700
TINY_ARGS = size_args(TINY)


@pytest.fixture(scope="module")
def bench_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("benchmark-home"), 2, BASE, PORT)


def positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def test_a_run_measures_every_part_and_round_trips(
    bench_cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_demo_model(
        tmp_path / "tiny",
        DemoSpec(arch="llama", layers=4, hidden=64, heads=4, kv_heads=2, dtype="float32"),
    )
    names = list(bench_cluster.inventory.names)
    steps: list[Step] = []

    async def go() -> bm.Run:
        ctl = bench_cluster.controller()
        try:
            await ctl.place(model, names, "tiny", prefill_chunk=64)
            try:
                run = await Benchmark(ctl, None, TINY, steps.append).run()
            finally:
                await ctl.unload("tiny")
            # The bulk stream stops on time: at most a few messages are queued ahead
            # (1 GiB, the cap, was queued at once when the marks were overwritten).
            (quick,) = await ctl.link_results(names[0], [names[1]], {"bulk_seconds": 0.05})
            assert 0 < quick["sent_bytes"] < 256 << 20 and quick["received_bytes"] > 0
            # The group's ranks ended and their job records were forgotten.
            for name in names:
                assert (await ctl.peer(name).request("job_status"))["jobs"] == []
            return run
        finally:
            await ctl.close()

    run = asyncio.run(go())
    assert run.errors == [] and run.cluster == bench_cluster.inventory.name
    assert run.build.startswith(__version__) and run.machine["host"] and run.date.endswith("Z")
    assert [n.name for n in run.nodes] == names
    for node in run.nodes:
        assert set(node.gflops) == set(DTYPES) and all(map(positive, node.gflops.values()))
        assert node.device == "cpu" and all(n >= 64 for n in node.matmul_n.values())
        assert positive(node.copy_gbs) and positive(node.read_gbs)
    (link,) = run.links
    assert {link.a, link.b} == set(names) and link.kind == "loopback"
    assert all(map(positive, (link.latency_us, link.latency_pad_us, link.gbps, link.gbps_back)))
    group = run.group
    assert group is not None and group.backend == "ring" and group.nodes == tuple(names)
    assert group.launcher == "jobs"  # started and followed as a cluster job
    assert positive(group.gflops) and positive(group.step_s) and positive(group.compute_s)
    # The sum of parts is the nodes' own float32 figures; the product was checked whole.
    assert group.parts_gflops == pytest.approx(sum(n.gflops["float32"] for n in run.nodes))
    assert group.max_error is not None and group.max_error < 1e-5
    (placed,) = run.placements
    # The ring's order follows the measured links: either node may be the head.
    assert placed.name == "tiny" and set(placed.nodes) == set(names) and placed.admitted >= 1
    assert [p.streams for p in placed.points] == [1, 2, 4, 8]
    for point in placed.points:
        assert point.tokens == point.streams * TINY.stream_tokens
        assert positive(point.tps) and positive(point.ttft_ms)
    assert all(math.isfinite(v) and v >= 0 for v in bm.finite_figures(run))
    # Every planned step was said to start and to end, in order, none failed.
    labels = bm.plan_steps(names, ["tiny"], TINY.stream_counts)
    ends = [s for s in steps if s.state != "running"]
    assert [s.label for s in ends] == labels and {s.state for s in ends} == {"done"}
    assert any(s.detail == "matmul bfloat16" for s in steps)  # the node's own sub-steps

    # Saved and read back whole; the command line compares it with a run of its own.
    home = bench_cluster.home
    assert bm.read(bm.save(home, run)) == run
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(bench_cluster.inventory))
    md = tmp_path / "run.md"
    os.environ["STUDIOTUI_HOME"] = str(home)
    try:
        time.sleep(1.1)  # ids are to the second
        capsys.readouterr()
        argv = ["-i", str(inventory), "benchmark", *TINY_ARGS, "--json", "--markdown", str(md)]
        assert main(argv) == 0
        second = bm.find(home, "latest")
        assert bm.from_json(json.loads(capsys.readouterr().out)) == second  # stdout: the run
        assert second.id != run.id and second.placements == () and second.group is not None
        text = md.read_text()
        for heading in ("## Nodes", "## Links", "## Group", "| node | device | float32"):
            assert heading in text
        assert main(["benchmark", "--list"]) == 0
        listed = capsys.readouterr().out
        assert run.id in listed and second.id in listed
        compared = tmp_path / "compare.md"
        assert main(["benchmark", "--compare", run.id, "latest", "--markdown", str(compared)]) == 0
        table = compared.read_text()
        assert f"A: {run.label}" in table and f"B: {second.label}" in table
        row = next(line for line in table.splitlines() if "matmul float32" in line)
        cells = [c.strip() for c in row.split("|")]
        assert cells[5] != "–" and cells[6] != "–"  # both runs' figures, side by side
    finally:
        os.environ.pop("STUDIOTUI_HOME", None)


def test_sizes_and_groups_are_refused_before_any_node_is_asked(
    bench_cluster: LocalCluster,
) -> None:
    async def go(**kw: object) -> None:
        ctl = bench_cluster.controller()
        try:
            await Benchmark(ctl, **kw).run()  # type: ignore[arg-type]
        finally:
            await ctl.close()

    with pytest.raises(BenchmarkError, match="unknown node"):
        asyncio.run(go(nodes=["nowhere"]))
    with pytest.raises(BenchmarkError, match="placement 'ghost' does not exist"):
        asyncio.run(go(sizes=TINY, placements=["ghost"]))
    with pytest.raises(BenchmarkError, match="matmul_n"):
        asyncio.run(go(sizes=Sizes(matmul_n=8)))


def test_with_no_node_up_it_says_so(bench_cluster: LocalCluster, tmp_path: Path) -> None:
    async def go() -> None:
        # Another home has other keys: the agents answer none of its requests.
        ctl = Controller(tmp_path / "other-home", bench_cluster.inventory)
        try:
            await Benchmark(ctl, sizes=TINY).run()
        finally:
            await ctl.close()

    with pytest.raises(BenchmarkError, match=r"^no node is up: start the cluster"):
        asyncio.run(go())


def test_a_markdown_file_that_cannot_be_written_is_refused_before_measuring(
    bench_cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was written last, so a typo in its folder cost the whole run's minutes."""
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(bench_cluster.inventory))
    home = tmp_path / "home"
    os.environ["STUDIOTUI_HOME"] = str(home)
    try:
        for where, words in (
            (tmp_path / "no" / "run.md", "there is no folder"),
            (tmp_path, "is a folder"),
        ):
            capsys.readouterr()
            argv = ["-i", str(inventory), "benchmark", *TINY_ARGS, "--markdown", str(where)]
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert f"--markdown {where}" in err and words in err, err
            assert "Traceback" not in err
            assert bm.saved(home) == []  # nothing was measured
    finally:
        os.environ.pop("STUDIOTUI_HOME", None)


def test_sizes_past_their_bounds_are_refused_before_any_node_is_asked(
    bench_cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--size stream_tokens=64000` (a typo for 64) asked for hours of decoding; it is
    refused, naming the size, its bound and its default, and nothing is measured."""
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(bench_cluster.inventory))
    home = tmp_path / "home"
    os.environ["STUDIOTUI_HOME"] = str(home)
    try:
        for size, words in (
            ("stream_tokens=64000", "stream_tokens must be between 1 and 4096, not 64000"),
            ("stream_counts=1,2,4,80", "stream_counts must each be between 1 and 64, not 80"),
            ("group_reps=500000", "group_reps must be between 1 and 1000, not 500000"),
            ("prompt_tokens=1280000", "prompt_tokens must be between 1 and 32768"),
        ):
            capsys.readouterr()
            argv = ["-i", str(inventory), "benchmark", *TINY_ARGS, f"--size={size}"]
            assert main(argv) == 2
            err = capsys.readouterr().err
            name = size.partition("=")[0]
            assert f"--size: {words}" in err and f"give {name} a value within them" in err, err
            assert "Traceback" not in err and "asking the nodes" not in err
            assert bm.saved(home) == []  # nothing was measured
    finally:
        os.environ.pop("STUDIOTUI_HOME", None)


def test_a_killed_measurement_fails_alone_and_the_agent_carries_on(
    bench_cluster: LocalCluster,
) -> None:
    name = bench_cluster.inventory.names[0]
    agent = psutil.Process(bench_cluster.pids[name])

    def measuring() -> list[psutil.Process]:
        return [p for p in agent.children() if "worker.device_bench" in " ".join(p.cmdline())]

    async def go() -> None:
        ctl = bench_cluster.controller()
        peer = ctl.peer(name)
        try:
            # Sizes the program itself refuses come back in its words.
            bad = {"matmul_n": 128, "copy_mib": 4, "seconds": 0.1, "dtypes": ["int4"]}
            with pytest.raises(AgentError, match="int4"):
                await peer.request("device_bench", timeout=30, sizes=bad)
            long = {"matmul_n": 256, "copy_mib": 4, "seconds": 30.0}
            task = asyncio.create_task(peer.request("device_bench", timeout=60, sizes=long))
            deadline = time.monotonic() + 20
            while not measuring():
                assert time.monotonic() < deadline, "no measuring process appeared"
                await asyncio.sleep(0.1)
            # The agent's loop is free while its device is measured.
            assert (await peer.request("hello", timeout=3))["name"] == name
            with pytest.raises(AgentError, match="already runs"):
                await peer.request("device_bench", timeout=5, sizes=long)
            os.kill(measuring()[0].pid, signal.SIGKILL)
            with pytest.raises(AgentError, match="SIGKILL"):
                await task
            assert (await peer.request("hello", timeout=3))["name"] == name
            assert measuring() == []
        finally:
            await ctl.close()

    asyncio.run(go())


def test_a_given_up_measurement_ends_on_the_node_at_once(bench_cluster: LocalCluster) -> None:
    """Cancelling a run (Esc on the Benchmark screen, Ctrl-C) while a node measures its
    device ends the node's measuring process: the next measurement starts at once, not
    after the given-up one's remaining seconds ("a benchmark already runs")."""
    name = bench_cluster.inventory.names[0]
    agent = psutil.Process(bench_cluster.pids[name])

    def measuring() -> list[psutil.Process]:
        found = []
        for p in agent.children():
            with contextlib.suppress(psutil.Error):
                if "worker.device_bench" in " ".join(p.cmdline()):
                    found.append(p)
        return found

    async def go() -> None:
        ctl = bench_cluster.controller()
        try:
            # 30 s a figure, four figures: two minutes of measuring if left to run.
            slow = replace(TINY, seconds=30.0)
            task = asyncio.create_task(Benchmark(ctl, [name], slow).run())
            deadline = time.monotonic() + 20
            while not measuring():
                assert time.monotonic() < deadline and not task.done(), "no measuring process"
                await asyncio.sleep(0.1)
            pid = measuring()[0].pid
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
            assert measuring() == []
            again = await ctl.peer(name).request(
                "device_bench", timeout=60, sizes=TINY.device_spec()
            )
            figures = ctl.peer(name).read(again, control.DeviceBenchDone).figures
            assert figures.matmul and all(f.gflops > 0 for f in figures.matmul.values())
        finally:
            await ctl.close()

    asyncio.run(go())


def test_one_node_is_its_device_alone(bench_cluster: LocalCluster) -> None:
    name = bench_cluster.inventory.names[1]

    async def go() -> bm.Run:
        ctl = bench_cluster.controller()
        try:
            return await Benchmark(ctl, [name], TINY).run()
        finally:
            await ctl.close()

    run = asyncio.run(go())
    assert [n.name for n in run.nodes] == [name] and run.errors == []
    assert run.links == () and run.group is None and run.placements == ()
    assert any("one node" in note for note in run.notes)


def test_a_rank_killed_mid_product_fails_the_group_alone(bench_cluster: LocalCluster) -> None:
    """The group's job fails naming the node whose rank died; the other rank is ended,
    both agents carry on, and the run keeps its other figures."""
    names = list(bench_cluster.inventory.names)
    victim = psutil.Process(bench_cluster.pids[names[1]])

    def ranks(agent: psutil.Process) -> list[psutil.Process]:
        found = []
        for p in agent.children():
            with contextlib.suppress(psutil.Error):
                if "spec.json" in " ".join(p.cmdline()):
                    found.append(p)
        return found

    async def go() -> bm.Run:
        ctl = bench_cluster.controller()
        try:
            # Enough steps of the product (the most a run may ask, of a product sized
            # to a few ms) that it is still running when its rank dies.
            long = replace(TINY, matmul_n=512, group_reps=1000, stream_counts=())
            task = asyncio.create_task(Benchmark(ctl, None, long).run())
            deadline = time.monotonic() + 60
            while not ranks(victim):
                assert time.monotonic() < deadline and not task.done(), "no rank appeared"
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            for rank in ranks(victim):
                rank.send_signal(signal.SIGKILL)
            run = await asyncio.wait_for(task, 60)
            for name in names:  # both agents answer, no rank is left anywhere
                assert (await ctl.peer(name).request("hello", timeout=3))["name"] == name
            return run
        finally:
            await ctl.close()

    run = asyncio.run(go())
    group = run.group
    assert group is not None and group.gflops is None
    assert names[1] in group.error and "SIGKILL" in group.error, group.error
    assert [n.name for n in run.nodes if not n.error] == names and len(run.links) == 1
    for pid in bench_cluster.pids.values():
        assert ranks(psutil.Process(pid)) == []
