"""The Jobs screen under Pilot, against a real local cluster of 2 agents: a job started
before the dashboard was opened is found and followed, stopped and resumed with its
keys, and the form from the Models pane starts a new one."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import DataTable, Input, Static

from studiotui.app.app import StudioApp
from studiotui.app.panes.models import ModelsPane
from studiotui.app.screens.jobs import FinetuneForm, JobsScreen, loss_chart
from studiotui.cluster import jobs
from studiotui.core.jobs import Point
from studiotui.tune import finetune as ft
from tests.support.app_fixtures import fixed_state
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from tests.support.pilot_helpers import until
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.manifest import CACHE_NAME

pytestmark = pytest.mark.integration
BASE, PORT = 165, 58900  # 127.0.0.165-166
SIZE = (160, 48)


def test_loss_chart_draws_both_series() -> None:
    train = tuple(Point(i, 5.0 - i * 0.1) for i in range(1, 31))
    chart = loss_chart(train, (Point(0, 5.2), Point(30, 4.0)), width=60, height=8).plain
    lines = chart.splitlines()
    assert lines[0].startswith("5.20 │") and lines[7].startswith("2.00 │")  # highest, lowest
    assert chart.count("•") >= 20 and chart.count("◆") == 2 + 1  # + the legend's
    # The first train point is near the top left, the last at the bottom right.
    assert "•" in lines[1][:12] and lines[7].rstrip().endswith("•")
    assert "no loss" in loss_chart((), (), 40).plain


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("jobs-home"), 2, BASE, PORT)


def _cells(table: DataTable[Any], row: int) -> list[str]:
    return [str(c) for c in table.get_row_at(row)]


async def test_jobs_screen_reattaches_stops_resumes_and_starts(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = cluster.home
    spec = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=2)
    model = write_demo_model(home / "models" / "tiny", spec)
    data = tmp_path / "data.jsonl"
    rows = [{"text": f"item {i} is filed under shelf {i % 5}"} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    nodes = tuple(cluster.inventory.names)

    # Started by another process (the CLI, a dashboard since closed): it runs on the nodes.
    async def start_elsewhere() -> None:
        ctl = cluster.controller()
        try:
            await ctl.start(telemetry=False)
            req = ft.FinetuneRequest(
                str(model), str(data), nodes, "earlier", iters=2000, batch_size=4, save_every=4
            )
            await ft.launch(ctl, ft.prepare(ctl, req))
        finally:
            await ctl.close()

    await start_elsewhere()
    # Every report of the base's hashing as the screen shows it, and the thread each
    # came from: the hashing must run off the loop (the keys stay answered).
    shown: list[tuple[str, int, int] | None] = []
    hashed_on: set[bool] = set()
    real_show, real_hashed = JobsScreen._show_hashing, JobsScreen._hashed

    def show(screen: JobsScreen, hashing: tuple[str, int, int] | None) -> None:
        real_show(screen, hashing)
        shown.append(hashing)
        block = screen.query_one("#jobs-hashing", Static)
        assert block.display == (hashing is not None)
        if hashing is not None:
            said = str(block.content)
            assert "hashing tiny to stamp the adapter with its base (once: cached)" in said
            assert "operator" in said  # the gauge, as the placement preview shows it

    def hashed(screen: JobsScreen, model: str, done: int, total: int) -> None:
        hashed_on.add(threading.current_thread() is threading.main_thread())
        real_hashed(screen, model, done, total)

    monkeypatch.setattr(JobsScreen, "_show_hashing", show)
    monkeypatch.setattr(JobsScreen, "_hashed", hashed)
    app = StudioApp(home, cluster.inventory)
    async with app.run_test(size=SIZE) as pilot:
        await until(
            pilot,
            lambda: app.controller is not None and app.cluster.nodes[0].state == "up",
            30,
            "nodes up",
        )
        # Found and followed again as soon as the dashboard is up, said in the Log.
        await until(
            pilot,
            lambda: any("following job earlier again" in e.text for e in app.cluster.log),
            30,
            "the job found again",
        )
        await pilot.press("J")
        screen = app.screen
        assert isinstance(screen, JobsScreen)
        table = screen.query_one("#jobs-list", DataTable)
        plot = screen.query_one("#jobs-plot", Static)

        def earlier() -> Any:
            return screen.watches["earlier"].progress if "earlier" in screen.watches else None

        await until(
            pilot, lambda: (p := earlier()) is not None and p.iteration >= 4, 60, "progress"
        )
        await pilot.pause(0.3)
        assert _cells(table, 0)[:3] == ["earlier", "finetune", "running"]
        assert "•" in str(plot.content)  # the loss plot is drawn
        node_rows = screen.query_one("#jobs-nodes", DataTable)
        assert [_cells(node_rows, i)[0] for i in range(2)] == list(nodes)
        assert "MB" in _cells(node_rows, 0)[3] or "KB" in _cells(node_rows, 0)[3]
        summary = str(screen.query_one("#jobs-summary", Static).content)
        assert "tok/s" in summary and "ETA" in summary
        # The peak beside the memory, by the same rule: under 1 GB in MB, not "0.08 GB".
        await until(pilot, lambda: _cells(node_rows, 0)[4] != "", 30, "a peak reported")
        peak = _cells(node_rows, 0)[4]
        assert peak.split()[1] in ("KB", "MB") or float(peak.split()[0]) >= 1, peak

        # At 80 columns the list's last column, the nodes, is whole on the screen.
        await pilot.resize_terminal(80, 24)

        def nodes_shown() -> bool:
            fits = table.virtual_size.width <= table.scrollable_content_region.width
            return fits and _cells(table, 0)[7] in (", ".join(nodes), "l1, l2", "2 nodes")

        await until(pilot, nodes_shown, 10, f"the nodes whole at 80 columns: {_cells(table, 0)}")
        await pilot.resize_terminal(*SIZE)

        await pilot.press("s")
        await until(pilot, lambda: earlier().state == "stopped", 20, "stopped")
        stopped_at = earlier().saved_iteration
        assert stopped_at is not None

        # The base's hashes forgotten: resuming stamps the adapter with its identity
        # again, so it is hashed as the first time, shown in bytes.
        (model / CACHE_NAME).unlink()
        size = sum(p.stat().st_size for p in model.iterdir() if not p.name.startswith("."))
        await pilot.press("r")
        await until(
            pilot,
            lambda: earlier().state == "running" and earlier().start_iteration > 0,
            30,
            "resumed",
        )
        # Resumed from the last save every rank finished: a stop can land after one rank
        # wrote a save and before the other did, so it may be one save earlier (saves come
        # every max(report interval, save_every) = 10 iterations for 2000 iterations).
        assert stopped_at - 10 <= earlier().start_iteration <= stopped_at
        reports = [h for h in shown if h is not None]
        assert reports, "the base's first hashing was not shown"
        assert reports[0] == ("tiny", 0, size) and reports[-1] == ("tiny", size, size), shown
        assert shown[-1] is None and screen.hashing is None  # gone once the job started
        assert hashed_on == {False}, "the base was hashed on the event loop"
        shown.clear()
        await pilot.press("s")
        await until(pilot, lambda: earlier().state == "stopped", 20, "stopped again")
        # Stopping an ended job says so instead of nothing.
        await pilot.press("s")
        said = [str(n.message) for n in app._notifications]
        assert "job 'earlier' is stopped: nothing to stop" in said, said

        # A new job from the Models pane's form.
        await pilot.press("escape")
        await pilot.press("4")
        models = app.query_one(ModelsPane)
        await until(pilot, lambda: models.select_model("tiny"), 20, "the model listed")
        await pilot.press("f")
        form = app.screen
        assert isinstance(form, FinetuneForm)
        form.query_one("#ft-data", Input).value = str(data)
        form.query_one("#ft-iters", Input).value = "4"
        form.query_one("#ft-batch", Input).value = "4"
        form.query_one("#ft-lr", Input).value = "1e-3"
        form.query_one("#ft-name", Input).value = "fromform"
        form.query_one("#ft-name", Input).focus()
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, JobsScreen), 5, "the jobs screen")
        await until(
            pilot,
            lambda: (
                "fromform" in screen.watches and screen.watches["fromform"].progress.state == "done"
            ),
            60,
            "the form's job done",
        )
        assert screen.watches["fromform"].progress.iteration == 4
        assert shown == [None], shown  # the base's hashes were cached: nothing to show
        # Done: its adapter is fetched from its first node to where `place` finds it.
        fetched = home / "adapters" / "fromform" / "adapters.safetensors"
        await until(pilot, fetched.is_file, 30, "the form's adapter fetched")
        record = jobs.load_record(home, "fromform")
        assert record is not None
        on_node = Path(cluster.inventory.node(record.nodes[0]).workdir) / "jobs" / "fromform"
        assert fetched.read_bytes() == (on_node / "adapters" / "adapters.safetensors").read_bytes()

    # A dashboard opened afterwards shows the ended jobs, without announcing them again.
    again = StudioApp(home, cluster.inventory)
    async with again.run_test(size=SIZE) as pilot:
        await until(
            pilot,
            lambda: again.controller is not None and again.cluster.nodes[0].state == "up",
            30,
            "nodes up",
        )
        later = again.jobs_screen()

        def shown_done() -> bool:
            watch = later.watches.get("fromform")
            return watch is not None and watch.progress.state == "done"

        await until(pilot, shown_done, 30, "the ended job shown")
        await pilot.pause(1.0)
        said = [e.text for e in again.cluster.log]
        assert not [t for t in said if t.startswith(("job 'fromform'", "job 'earlier'"))], said
    await asyncio.sleep(0)


async def test_the_finetune_form_reaches_every_field_at_80x24(tmp_path: Path) -> None:
    # At 80x24 the form is taller than the screen: the fields below Batch and the
    # buttons were cut off, so tab focused fields no one could see.
    app = StudioApp(tmp_path, state=fixed_state())
    async with app.run_test(size=(80, 24)) as pilot:
        app.push_screen(FinetuneForm("m", "/models/m", ["local-1", "local-2"], "m-lora"))
        await pilot.pause()
        form = app.screen
        for wanted in ("#ft-name", "#ft-start"):
            widget = form.query_one(wanted)
            widget.focus()
            await pilot.pause(0.2)
            region = widget.region
            assert region.height > 0 and region.y >= 0 and region.bottom <= 24, (wanted, region)
            # Drawn where it is, not hidden below the dialog's bottom border.
            assert region.bottom <= form.query_one("#finetune-dialog").region.bottom - 1


async def test_the_jobs_nodes_table_fits_at_80_columns(tmp_path: Path) -> None:
    # Beside the plot at 80 columns it had 30: "peak" and "note" were cut ("pe").
    app = StudioApp(tmp_path, state=fixed_state())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("J")
        screen = app.screen
        assert isinstance(screen, JobsScreen)
        await pilot.pause(0.2)
        nodes = screen.query_one("#jobs-nodes", DataTable)
        assert nodes.virtual_size.width <= nodes.scrollable_content_region.width, (
            nodes.virtual_size,
            nodes.scrollable_content_region,
        )
        plot = screen.query_one("#jobs-plot", Static)
        assert plot.region.height >= 8 and plot.region.bottom <= 23  # above the footer
