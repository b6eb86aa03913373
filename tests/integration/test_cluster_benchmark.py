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
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from studiotui import __version__
from studiotui.cli.main import main
from studiotui.cluster.benchmark import Benchmark, build_id
from studiotui.cluster.controller import Controller
from studiotui.cluster.peers import AgentError
from studiotui.core import benchmark as bm
from studiotui.core.benchmark import DTYPES, BenchmarkError, Sizes, Step
from studiotui.core.inventory import dump_inventory
from tests.support.benchmark_fixtures import TINY, size_args
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control

BASE, PORT = 231, 59700
TINY_ARGS = size_args(TINY)
# What the agent's children run: a device measurement, a group job's rank.
DEVICE_BENCH, RANK = "worker.device_bench", "spec.json"


@pytest.fixture(scope="module")
def bench_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("benchmark-home"), 2, BASE, PORT)


def children(agent: psutil.Process, word: str) -> list[psutil.Process]:
    """The agent's child processes whose command line holds `word` (a device
    measurement's `worker.device_bench`, a rank's `spec.json`)."""
    found = []
    for p in agent.children():
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            if word in " ".join(p.cmdline()):
                found.append(p)
    return found


async def first_child(
    agent: psutil.Process, word: str, task: asyncio.Task | None = None, within: float = 20.0
) -> psutil.Process:
    """The agent's first child process holding `word`, once there is one; the test fails
    if none comes within `within` seconds, or `task` (what starts it) ends first."""
    deadline = time.monotonic() + within
    while not (found := children(agent, word)):
        assert time.monotonic() < deadline, f"no {word} process appeared"
        assert task is None or not task.done(), f"ended before a {word} process appeared"
        await asyncio.sleep(0.1)
    return found[0]


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
                assert (await ctl.peer(name).ask("job_status", control.JobsFound)).jobs == []
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
        said = capsys.readouterr()
        assert bm.from_json(json.loads(said.out)) == second  # stdout: the run
        # The command to compare is on one line, to be pasted (it was folded at 80).
        assert f"`studiotui benchmark --compare {second.id} latest`" in said.err, said.err
        assert second.id != run.id and second.placements == () and second.group is not None
        text = md.read_text()
        for heading in ("## Nodes", "## Links", "## Group", "| node | device | float32"):
            assert heading in text
        assert main(["benchmark", "--list"]) == 0
        listed = capsys.readouterr().out
        assert run.id in listed and second.id in listed
        # --json with --list is JSON too (it printed the table), the ids --compare takes.
        assert main(["benchmark", "--list", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [r["id"] for r in rows] == [second.id, run.id]
        assert rows[0]["nodes"] == names and bm.read(Path(rows[0]["path"])) == second
        # Beside --compare or --list a measuring option would be ignored: refused.
        for argv, words in (
            (["--compare", run.id, "latest", "--quick"], "--compare reads saved runs"),
            (["--list", "--size", "matmul_n=64"], "--list reads saved runs"),
            (["--list", "--compare", run.id, "latest"], "--compare and --list are two"),
        ):
            assert main(["benchmark", *argv]) == 2, argv
            err = " ".join(capsys.readouterr().err.split())
            assert words in err and "Traceback" not in err, err
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


def test_what_would_waste_a_run_is_refused_before_measuring(
    bench_cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `--markdown` file was written last, so a typo in its folder cost the whole run's
    minutes; `--size stream_tokens=64000` (a typo for 64) asked for hours of decoding.
    Each is refused in words naming it (a size with its bounds and its default), and
    nothing is measured."""
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(bench_cluster.inventory))
    home = tmp_path / "home"
    missing = tmp_path / "no" / "run.md"
    sizes = (
        ("stream_tokens=64000", "stream_tokens must be between 1 and 4096, not 64000"),
        ("stream_counts=1,2,4,80", "stream_counts must each be between 1 and 64, not 80"),
        ("group_reps=500000", "group_reps must be between 1 and 1000, not 500000"),
        ("prompt_tokens=1280000", "prompt_tokens must be between 1 and 32768"),
    )
    cases = [
        (["--markdown", str(missing)], [f"--markdown {missing}", "there is no folder"]),
        (["--markdown", str(tmp_path)], [f"--markdown {tmp_path}", "is a folder"]),
        *(
            ([f"--size={size}"], [f"--size: {words}", f"give {size.partition('=')[0]} a value"])
            for size, words in sizes
        ),
    ]
    os.environ["STUDIOTUI_HOME"] = str(home)
    try:
        for args, expected in cases:
            capsys.readouterr()
            assert main(["-i", str(inventory), "benchmark", *TINY_ARGS, *args]) == 2
            err = capsys.readouterr().err
            assert all(words in err for words in expected), err
            assert "Traceback" not in err and "asking the nodes" not in err
            assert bm.saved(home) == []  # nothing was measured
    finally:
        os.environ.pop("STUDIOTUI_HOME", None)


def test_a_placement_that_does_not_exist_is_refused_before_the_bar_shows(
    bench_cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`benchmark --placement nope` drew its progress bar ("asking the nodes") and then
    refused; now the words come alone."""
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(bench_cluster.inventory))
    os.environ["STUDIOTUI_HOME"] = str(bench_cluster.home)
    try:
        code = main(["-i", str(inventory), "benchmark", *TINY_ARGS, "--placement", "nope"])
    finally:
        os.environ.pop("STUDIOTUI_HOME", None)
    err = capsys.readouterr().err
    assert code == 2 and "placement 'nope' does not exist" in err, err
    assert "asking the nodes" not in err and "Traceback" not in err


def test_a_killed_measurement_fails_alone_and_the_agent_carries_on(
    bench_cluster: LocalCluster,
) -> None:
    name = bench_cluster.inventory.names[0]
    agent = psutil.Process(bench_cluster.pids[name])

    async def go() -> None:
        ctl = bench_cluster.controller()
        peer = ctl.peer(name)
        try:
            # Sizes the program itself refuses come back in its words.
            bad = {"matmul_n": 128, "copy_mib": 4, "seconds": 0.1, "dtypes": ["int4"]}
            with pytest.raises(AgentError, match="int4") as refused:
                await peer.request("device_bench", timeout=30, sizes=bad)
            assert refused.value.code == "bench_failed"
            long = {"matmul_n": 256, "copy_mib": 4, "seconds": 30.0}
            task = asyncio.create_task(peer.request("device_bench", timeout=60, sizes=long))
            measuring = await first_child(agent, DEVICE_BENCH)
            # The agent's loop is free while its device is measured.
            assert (await peer.ask("hello", control.HelloReply, timeout=3)).name == name
            with pytest.raises(AgentError, match="already runs") as busy:
                await peer.request("device_bench", timeout=5, sizes=long)
            assert busy.value.code == "busy"
            os.kill(measuring.pid, signal.SIGKILL)
            with pytest.raises(AgentError, match="SIGKILL"):
                await task
            assert (await peer.ask("hello", control.HelloReply, timeout=3)).name == name
            assert children(agent, DEVICE_BENCH) == []
        finally:
            await ctl.close()

    asyncio.run(go())


def test_a_given_up_measurement_ends_on_the_node_at_once(bench_cluster: LocalCluster) -> None:
    """Cancelling a run (Esc on the Benchmark screen, Ctrl-C) while a node measures its
    device ends the node's measuring process: the next measurement starts at once, not
    after the given-up one's remaining seconds ("a benchmark already runs")."""
    name = bench_cluster.inventory.names[0]
    agent = psutil.Process(bench_cluster.pids[name])

    async def go() -> None:
        ctl = bench_cluster.controller()
        try:
            # 30 s a figure, four figures: two minutes of measuring if left to run.
            slow = replace(TINY, seconds=30.0)
            task = asyncio.create_task(Benchmark(ctl, [name], slow).run())
            measuring = await first_child(agent, DEVICE_BENCH, task)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert not measuring.is_running() or measuring.status() == psutil.STATUS_ZOMBIE
            assert children(agent, DEVICE_BENCH) == []
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

    async def go() -> bm.Run:
        ctl = bench_cluster.controller()
        try:
            # Enough steps of the product (the most a run may ask, of a product sized
            # to a few ms) that it is still running when its rank dies.
            long = replace(TINY, matmul_n=512, group_reps=1000, stream_counts=())
            task = asyncio.create_task(Benchmark(ctl, None, long).run())
            await first_child(victim, RANK, task, within=60)
            await asyncio.sleep(0.5)
            for rank in children(victim, RANK):
                rank.send_signal(signal.SIGKILL)
            run = await asyncio.wait_for(task, 60)
            for name in names:  # both agents answer, no rank is left anywhere
                hello = await ctl.peer(name).ask("hello", control.HelloReply, timeout=3)
                assert hello.name == name
            return run
        finally:
            await ctl.close()

    run = asyncio.run(go())
    group = run.group
    assert group is not None and group.gflops is None
    assert names[1] in group.error and "SIGKILL" in group.error, group.error
    assert [n.name for n in run.nodes if not n.error] == names and len(run.links) == 1
    for pid in bench_cluster.pids.values():
        assert children(psutil.Process(pid), RANK) == []


def test_a_saved_run_names_the_checkout_it_was_built_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run's build is the version and `git describe` of this checkout (its commit),
    and the version alone where git cannot say (no git on the PATH)."""
    repo = Path(__file__).resolve().parents[2]

    def git(*argv: str) -> list[str]:
        done = subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True)
        return done.stdout.split()

    # The commit, or a tag on it (describe names the tag alone then).
    names = [git("rev-parse", "--short=7", "HEAD")[0], *git("tag", "--points-at", "HEAD")]
    build = build_id()
    assert build.startswith(f"{__version__} (") and any(n in build for n in names), build
    monkeypatch.setenv("PATH", "")
    assert build_id() == __version__
