"""The Benchmark screen driven by Pilot: opened from the palette and by its key, it runs
the benchmark on two real agents (127.0.0.236-237:59750, tiny sizes) with its progress,
draws the figures, lists the saved runs and compares two. The snapshot shows two fixed
saved runs in a fixed view (no I/O)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from textual.widgets import DataTable, Static

from studiotui.app.app import StudioApp
from studiotui.app.screens.benchmark import BenchmarkScreen
from studiotui.cluster import links as links_module
from studiotui.core import benchmark as bm
from studiotui.core.benchmark import Step
from tests.support.app_fixtures import fixed_models, fixed_state
from tests.support.benchmark_fixtures import TINY, sample_run
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from tests.support.pilot_helpers import run_from_palette, until

BASE, PORT = 236, 59750
SIZE = (160, 48)


@pytest.fixture(scope="module")
def screen_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("bench-screen-home"), 2, BASE, PORT)


def shown(screen: BenchmarkScreen) -> str:
    """What the figures pane draws, line by line, as text."""
    view = screen.query_one("#bench-view", Static)
    return "\n".join(view.render_line(y).text for y in range(view.size.height))


async def test_the_screen_runs_draws_saves_and_compares(screen_cluster: LocalCluster) -> None:
    home, inv = screen_cluster.home, screen_cluster.inventory
    app = StudioApp(home, inv)
    app.benchmark_sizes = TINY
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "2/2 nodes up" in str(app.sub_title), 20, "nodes up")
        await run_from_palette(pilot, app, "benchmark", "Benchmark the cluster")
        screen = app.screen
        assert isinstance(screen, BenchmarkScreen)
        assert "No benchmark yet" in shown(screen)
        await pilot.press("r")
        progress = screen.query_one("#bench-progress")
        await until(pilot, lambda: progress.display, 5, "the progress shows")
        # Each step is listed as it comes: the first node's device is measured first.
        await until(pilot, lambda: "✓ local-1: device" in shown(screen), 60, "a step done")
        assert "step " in str(screen.query_one("#bench-step", Static).render())
        await until(pilot, lambda: len(screen.runs) == 1, 90, "the run is saved")
        assert not progress.display
        run = screen.runs[0]
        assert run.errors == [] and [n.name for n in run.nodes] == list(inv.names)
        labels = list(screen.steps)
        assert labels[0] == f"{inv.names[0]}: device" and labels[-1].startswith("group of 2")
        assert {s.state for s in screen.steps.values()} == {"done"}
        text = shown(screen)
        for word in ("GFLOP/s", "Gbit/s", "sum of parts", *inv.names):
            assert word in text, word
        assert bm.find(home, "latest") == run  # saved where the command line finds it

        # Back, then in by the key: a second (older) run saved beside it compares.
        await pilot.press("escape")
        assert not isinstance(app.screen, BenchmarkScreen)
        older = replace(run, id=f"00000000-000000-{run.cluster}", build="0.0.9 (older)")
        bm.save(home, older)
        await pilot.press("b")
        screen = app.screen
        assert isinstance(screen, BenchmarkScreen)
        assert [r.id for r in screen.runs] == [run.id, older.id]
        await pilot.press("space", "down", "space", "c")
        compared = shown(screen)
        assert run.id in compared and older.id in compared and "B vs A" in compared
        assert str(screen.query_one("#bench-results").border_title).startswith(f"A {older.id}")
        await pilot.press("e")
        assert (home / "benchmarks" / f"{older.id}-vs-{run.id}.md").exists()
        table = screen.query_one("#bench-runs", DataTable)
        assert table.row_count == 2


async def test_the_periodic_link_measurement_waits_while_a_benchmark_runs(
    screen_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dashboard measures the links every LINKS_EVERY_S (300 s); run here every
    0.2 s, it measured all through a benchmark, disturbing its figures. None may end
    between the benchmark's first step and its last, and they go on after it."""
    monkeypatch.setattr(links_module, "LINKS_FIRST_S", 0.0)
    monkeypatch.setattr(links_module, "LINKS_EVERY_S", 0.2)
    app = StudioApp(screen_cluster.home, screen_cluster.inventory)
    app.benchmark_sizes = TINY
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "2/2 nodes up" in str(app.sub_title), 20, "nodes up")
        ctl = app.controller
        assert ctl is not None

        def measured() -> list[float]:
            return [e.time for e in ctl.state.log if re.fullmatch(r"measured \d+ links", e.text)]

        await until(pilot, lambda: len(measured()) >= 2, 30, "the periodic measurement")
        await pilot.press("b")
        screen = app.screen
        assert isinstance(screen, BenchmarkScreen)
        # When each step was said: the run's first and last step are inside the pause.
        said: list[tuple[float, Step]] = []
        on_step = screen.on_step

        def timed(step: Step) -> None:
            said.append((time.time(), step))
            on_step(step)

        screen.on_step = timed  # type: ignore[method-assign]
        saved = len(screen.runs)  # the module's other test saves runs here too
        await pilot.press("r")
        await until(pilot, lambda: len(screen.runs) > saved, 90, "the run is saved")
        assert screen.runs[0].errors == [] and screen.runs[0].seconds > 0
        first, last = said[0][0], said[-1][0]
        assert said[-1][1].state == "done" and last - first > 0.5  # several periods long
        assert [t for t in measured() if first <= t <= last] == []
        await until(pilot, lambda: max(measured()) > last, 20, "measuring again after it")


async def test_a_fixed_view_lists_runs_but_cannot_run(tmp_path: Path) -> None:
    bm.save(tmp_path, sample_run())
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("b")
        screen = app.screen
        assert isinstance(screen, BenchmarkScreen)
        await pilot.press("r")
        assert any("no cluster is connected" in n.message for n in app._notifications)
        assert screen.running is None and "studio-1" in shown(screen)


async def test_at_80_columns_the_figures_get_the_whole_width(tmp_path: Path) -> None:
    """At 80 × 24 the saved runs sit above the figures: beside them (48 columns) the node
    table's figure columns were squeezed to nothing and no number could be read."""
    bm.save(tmp_path, sample_run())
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("b")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, BenchmarkScreen)
        assert screen.query_one("#bench-results").size.width >= 76
        text = shown(screen)
        for word in ("float32", "bfloat16", "20,000", "40,000", "GFLOP/s"):
            assert word in text, word
        assert screen.query_one("#bench-runs", DataTable).row_count == 1


async def test_at_80_columns_a_comparison_keeps_its_figures_in_view(tmp_path: Path) -> None:
    """The compare table was drawn at its own width, wider than the pane: the A, B and
    change columns were cut off at the right edge."""
    bm.save(tmp_path, sample_run("20260101-000000-desk"))
    bm.save(tmp_path, sample_run("20260102-000000-desk", scale=1.1))
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("b", "space", "down", "space", "c")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, BenchmarkScreen) and isinstance(screen.shown, tuple)
        text = shown(screen)
        row = next(line for line in text.splitlines() if "matmul float32" in line)
        assert "20,000" in row and "22,000" in row and "+10.0 %" in row, row
        assert max(len(line.rstrip()) for line in text.splitlines()) <= 76


def test_benchmark_screen_snapshot(snap_compare, tmp_path: Path) -> None:
    bm.save(tmp_path, sample_run("20260101-000000-desk"))
    bm.save(tmp_path, sample_run("20260102-000000-desk", scale=1.1))
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    assert snap_compare(app, terminal_size=SIZE, press=["b"])


def test_benchmark_compare_snapshot(snap_compare, tmp_path: Path) -> None:
    bm.save(tmp_path, sample_run("20260101-000000-desk"))
    bm.save(tmp_path, sample_run("20260102-000000-desk", scale=1.1))
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    assert snap_compare(app, terminal_size=SIZE, press=["b", "space", "down", "space", "c"])
