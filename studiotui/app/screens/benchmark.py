"""The Benchmark screen: run the cluster benchmark with its progress, see the figures
drawn, and compare two saved runs side by side.

The run itself is `studiotui.cluster.benchmark.Benchmark` on the dashboard's controller,
in a worker (the keys stay answered); the drawings are `views.benchmark`'s, the same
the command line prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, cast

from rich.console import RenderableType
from rich.constrain import Constrain
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, ProgressBar, Static
from textual.worker import Worker

from studiotui.app.guard import guard_actions
from studiotui.app.host import Dashboard
from studiotui.cluster.benchmark import Benchmark
from studiotui.core import benchmark as figures
from studiotui.core.benchmark import Run, Sizes, Step
from studiotui.core.errors import StudioError
from studiotui.views.benchmark import compare_markdown, compare_table, markdown, report


def run_row(run: Run, marked: bool) -> tuple[Text, Text, str, Text]:
    """One saved run in the list: mark, its id (UTC time and cluster), nodes, failures."""
    failed = len(run.errors)
    return (
        Text("◆" if marked else "", style="bold"),
        Text(run.id),
        str(len(run.nodes)),
        Text(str(failed) if failed else "", style="red"),
    )


def step_lines(steps: list[Step]) -> Text:
    """The steps of a running benchmark so far: ✓ done, ✗ failed (with why), ▸ running."""
    text = Text()
    for step in steps:
        mark, style = {"done": ("✓", "green"), "failed": ("✗", "red")}.get(
            step.state, ("▸", "bold")
        )
        text.append(f"{mark} ", style=style)
        text.append(step.label)
        if step.detail:
            text.append(f" · {step.detail}", style="red" if step.state == "failed" else "dim")
        text.append("\n")
    return text


@guard_actions
class BenchmarkScreen(Screen[None]):
    CSS_PATH = "benchmark.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "leave", "Back", id="benchmark-back"),
        Binding("r", "run", "Run benchmark", id="benchmark-run"),
        Binding("space", "mark", "Mark to compare", id="benchmark-mark"),
        Binding("c", "compare", "Compare", id="benchmark-compare"),
        Binding("e", "export", "Export Markdown", id="benchmark-export"),
    ]

    def __init__(self, nodes: list[str] | None = None, sizes: Sizes | None = None) -> None:
        super().__init__(id="benchmark-screen")
        self.nodes = nodes
        self.sizes = sizes or Sizes()
        self.runs: list[Run] = []
        self.marked: list[str] = []  # run ids, oldest mark first
        self.shown: Run | tuple[Run, Run] | None = None
        self.running: Worker[None] | None = None
        self.steps: dict[str, Step] = {}  # the running benchmark's steps so far

    @property
    def dashboard(self) -> Dashboard:
        return cast(Dashboard, self.app)

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="bench-main"):
            with Vertical(id="bench-left"):
                yield DataTable(id="bench-runs", cursor_type="row", zebra_stripes=True)
                yield Static("", id="bench-hint")
            with Vertical(id="bench-right"):
                with Vertical(id="bench-progress"):
                    yield Static("", id="bench-step")
                    yield ProgressBar(id="bench-bar", show_eta=False)
                with VerticalScroll(id="bench-results"):
                    yield Static("", id="bench-view")
        yield Footer()

    def on_mount(self) -> None:
        self.title = "Benchmark"
        who = ", ".join(self.nodes) if self.nodes else "every node that is up"
        self.sub_title = f"{who} · r runs · space marks two runs · c compares"
        left = self.query_one("#bench-left", Vertical)
        left.border_title = "Saved runs"
        self.query_one("#bench-results").border_title = "Figures"
        table = self.query_one("#bench-runs", DataTable)
        table.add_columns("", "run (UTC time, cluster)", "nodes", "failed")
        self.query_one("#bench-progress").display = False
        self.reload()
        table.focus()

    # ---- the saved runs -------------------------------------------------------------------

    def reload(self, select: str | None = None) -> None:
        self.runs = figures.saved(self.dashboard.home)
        self.marked = [m for m in self.marked if any(r.id == m for r in self.runs)]
        table = self.query_one("#bench-runs", DataTable)
        table.clear()
        for run in self.runs:
            table.add_row(*run_row(run, run.id in self.marked), key=run.id)
        where = f"STUDIOTUI_HOME/{figures.BENCHMARKS_DIR}"
        hint = f"{len(self.runs)} saved in {where}" if self.runs else f"no run saved in {where}"
        self.query_one("#bench-hint", Static).update(Text(hint, style="dim"))
        ids = [r.id for r in self.runs]
        if select in ids:
            table.move_cursor(row=ids.index(select))
        if self.runs and not isinstance(self.shown, tuple):
            self.show(self.runs[ids.index(select)] if select in ids else self.runs[0])
        elif not self.runs:
            self.query_one("#bench-view", Static).update(
                Text("No benchmark yet: r measures the cluster.", style="dim")
            )

    def selected(self) -> Run | None:
        table = self.query_one("#bench-runs", DataTable)
        if not self.runs or not 0 <= table.cursor_row < len(self.runs):
            return None
        return self.runs[table.cursor_row]

    @on(DataTable.RowHighlighted, "#bench-runs")
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        run = self.selected()
        if run is not None and self.running is None:
            self.show(run)

    def _width(self) -> int:
        width = self.query_one("#bench-results").size.width
        return max(60, width - 4) if width else 100

    def show(self, what: Run | tuple[Run, Run]) -> None:
        self.shown = what
        view: RenderableType
        if isinstance(what, tuple):
            # At most the pane's width: the Static draws at the table's own width
            # otherwise, and at 80 columns the A, B and change columns fell off the edge.
            view = Constrain(compare_table(*what), self._width())
            self.query_one("#bench-results").border_title = f"A {what[0].id} · B {what[1].id}"
        else:
            view = report(what, self._width())
            self.query_one("#bench-results").border_title = f"Figures · {what.id}"
        self.query_one("#bench-view", Static).update(view)

    def on_resize(self) -> None:
        if self.shown is not None and self.running is None:
            self.show(self.shown)

    # ---- keys -------------------------------------------------------------------------------

    def action_leave(self) -> None:
        if self.running is not None:
            self.running.cancel()
            self.dashboard.report("benchmark stopped; nothing was saved", "warning")
        self.app.pop_screen()

    def action_mark(self) -> None:
        run = self.selected()
        if run is None:
            return
        if run.id in self.marked:
            self.marked.remove(run.id)
        else:
            self.marked = [*self.marked[-1:], run.id]  # the last two marked
        self.reload(select=run.id)

    def action_compare(self) -> None:
        """The two marked runs side by side (older as A); with one or none marked, the
        selected run against the one saved before it."""
        by_id = {r.id: r for r in self.runs}
        pair = [by_id[m] for m in self.marked if m in by_id]
        if len(pair) < 2:
            run = self.selected()
            if run is None or self.runs.index(run) + 1 >= len(self.runs):
                self.dashboard.report(
                    "compare: mark two runs with space (or select one saved after another)",
                    "warning",
                )
                return
            pair = [self.runs[self.runs.index(run) + 1], run]
        older, newer = sorted(pair, key=lambda r: r.id)
        self.show((older, newer))

    def action_export(self) -> None:
        shown = self.shown
        if shown is None:
            self.dashboard.report("export: no run is shown", "warning")
            return
        folder = figures.runs_dir(self.dashboard.home)
        if isinstance(shown, tuple):
            path, text = folder / f"{shown[0].id}-vs-{shown[1].id}.md", compare_markdown(*shown)
        else:
            path, text = folder / f"{shown.id}.md", markdown(shown)
        folder.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        self.dashboard.report(f"wrote {path}")

    def action_run(self) -> None:
        if self.running is not None:
            self.dashboard.report("a benchmark is already running", "warning")
            return
        ctl = self.dashboard.need_controller("benchmark")
        if ctl is None:
            return
        self.query_one("#bench-progress").display = True
        self.query_one("#bench-step", Static).update("asking the nodes…")
        self.steps = {}
        self.query_one("#bench-results").border_title = "Steps"
        self.query_one("#bench-bar", ProgressBar).update(total=None, progress=0)
        self.running = self.run_worker(self._run(), group="benchmark", exit_on_error=False)

    async def _run(self) -> None:
        ctl = self.dashboard.controller
        assert ctl is not None
        try:
            run = await Benchmark(ctl, self.nodes, self.sizes, self.on_step).run()
        except StudioError as exc:
            self.dashboard.report(f"benchmark: {exc}", "error")
            return
        finally:
            self.running = None
            self.query_one("#bench-progress").display = False
        path = figures.save(self.dashboard.home, run)
        failed = f"; {len(run.errors)} step(s) failed" if run.errors else ""
        text = f"benchmark {run.id} saved to {path}{failed}"
        self.dashboard.report(text, "warning" if run.errors else "info")
        self.shown = None
        self.reload(select=run.id)

    def on_step(self, step: Step) -> None:
        """Each step as it starts, what its node says it is at, and when it ends: on the
        progress line and in the list of steps so far."""
        self.steps[step.label] = step
        what = f"{step.label}: {step.detail}" if step.detail else step.label
        line = f"step {step.index} of {step.total} · {what}"
        self.query_one("#bench-step", Static).update(line)
        done = step.index - (step.state == "running")
        self.query_one("#bench-bar", ProgressBar).update(total=step.total, progress=done)
        self.query_one("#bench-view", Static).update(step_lines(list(self.steps.values())))
        if step.state == "failed":
            self.dashboard.report(f"benchmark: {step.label} failed: {step.detail}", "warning")
