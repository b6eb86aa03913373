"""The Jobs screen: cluster jobs as they run on the nodes, and the fine-tuning form.

Jobs run on the nodes; this screen follows them (`tune.finetune.attach`, which resumes
from the last event it saw) and shows per node state and memory, the rates, the time
left and the train and validation loss over iterations. Opened after a restart, it
finds the jobs the nodes still run (`job_status`) and follows them again. `s` stops
the selected job, `r` resumes it from its last saved adapter.

Starting a job (the form, `r`) stamps the adapter with its base's identity, which the
first time reads every byte of the base (minutes for hundreds of GB; cached beside its
files after): that hashing runs off the loop and is shown in bytes, as the placement
preview shows it, and so are the copies of the base and the data to remote nodes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, cast

from rich.cells import cell_len
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, DataTable, Footer, Input, Label, Static

from studiotui.app.guard import guard_actions
from studiotui.app.host import Dashboard
from studiotui.app.panes.placements import progress_lines
from studiotui.app.render import node_abbreviations
from studiotui.cluster import jobs
from studiotui.cluster.adapter_fetch import fetch_adapter
from studiotui.core.errors import StudioError
from studiotui.core.jobs import JobProgress, JobWatch, Point
from studiotui.core.placement import format_bytes
from studiotui.core.rates import Paced, Rates
from studiotui.core.state import LogLevel
from studiotui.core.text import counted
from studiotui.tune import finetune as ft

JOB_LIST_COLUMNS = ("job", "kind", "state", "iteration", "loss", "tok/s", "ETA", "nodes")
PLOT_HEIGHT = 10
REDRAW_EVERY_S = 0.25
UNKNOWN_JOB = "no node up knows it: down, or forgotten there"
TRAIN_MARK, VAL_MARK = "•", "◆"


def loss_chart(
    train: tuple[Point, ...], val: tuple[Point, ...], width: int, height: int = PLOT_HEIGHT
) -> Text:
    """Train (•) and validation (◆) loss over iterations, scaled to width × height
    characters, with the loss range on the left and the iterations below."""
    points = [*train, *val]
    if not points:
        return Text("no loss reported yet", style="dim")
    lo = min(p.value for p in points)
    hi = max(p.value for p in points)
    first = min(p.iteration for p in points)
    last = max(p.iteration for p in points)
    label = max(len(f"{hi:.2f}"), len(f"{lo:.2f}"))
    cols = max(8, width - label - 2)
    grid = [[" "] * cols for _ in range(height)]
    styles = [[""] * cols for _ in range(height)]

    def place(series: tuple[Point, ...], mark: str, style: str) -> None:
        for p in series:
            x = 0 if last == first else round((p.iteration - first) / (last - first) * (cols - 1))
            y = 0 if math.isclose(hi, lo) else round((p.value - lo) / (hi - lo) * (height - 1))
            row = height - 1 - y
            grid[row][x], styles[row][x] = mark, style

    place(train, TRAIN_MARK, "cyan")
    place(val, VAL_MARK, "magenta")
    out = Text()
    for r in range(height):
        edge = f"{hi:.2f}" if r == 0 else f"{lo:.2f}" if r == height - 1 else ""
        out.append(f"{edge:>{label}} │")
        for c in range(cols):
            out.append(grid[r][c], style=styles[r][c] or None)
        out.append("\n")
    out.append(" " * label + " └" + "─" * cols + "\n")
    left, right = str(first), str(last)
    out.append(" " * (label + 2) + left + right.rjust(cols - len(left)) + "\n")
    out.append(f"{TRAIN_MARK} train  ", style="cyan")
    out.append(f"{VAL_MARK} validation", style="magenta")
    return out


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s"


def nodes_cell(names: Sequence[str], room: int) -> str:
    """A job's nodes in at most `room` cells: the names, else short ones (l1, l2), else
    how many (the Nodes table below names them all)."""
    short = node_abbreviations(names)
    for text in (", ".join(names), ", ".join(short[n] for n in names)):
        if cell_len(text) <= room:
            return text
    return counted(len(names), "node")


def summary(p: JobProgress) -> str:
    loss = f"{p.train_loss[-1].value:.3f}" if p.train_loss else "-"
    val = f"{p.val_loss[-1].value:.3f}" if p.val_loss else "-"
    rate = f"{p.iterations_per_second:.2f}" if p.iterations_per_second else "-"
    tokens = f"{p.tokens_per_second:.0f}" if p.tokens_per_second else "-"
    saved = f", saved at {p.saved_iteration}" if p.saved_iteration else ""
    text = (
        f"{p.name}: {p.state} · iteration {p.iteration}/{p.total or '?'} · train loss {loss} · "
        f"validation loss {val} · {rate} it/s · {tokens} tok/s · ETA {duration(p.eta_s)}{saved}"
    )
    return f"{text}\n{p.message}" if p.message else text


def hashing_content(
    hashing: tuple[str, int, int], rates: Rates | None = None, width: int = 20
) -> Content:
    """The first hashing of a job's base, in bytes, as the placement preview shows it:
    the operator's gauge beside the nodes' (placements pane)."""
    model, done, total = hashing
    said = f"hashing {model} to stamp the adapter with its base (once: cached)…"
    gauge = progress_lines({"operator": (done, total)}, width, rates)
    return Content("\n").join([Content.styled(said, "$text-muted"), *gauge])


def copying_content(
    model: str, copying: dict[str, tuple[int, int]], rates: Rates | None = None, width: int = 20
) -> Content:
    """The copies of a job's base (then each node's share of the data) to its remote
    nodes: one gauge per node in bytes, as the placements pane shows a placement's."""
    said = f"copying {model} and the data to the nodes that do not hold them…"
    gauges = progress_lines(copying, width, rates)
    return Content("\n").join([Content.styled(said, "$text-muted"), *gauges])


@guard_actions
class FinetuneForm(ModalScreen[ft.FinetuneRequest | None]):
    """What a fine-tuning job needs, for the model chosen in the Models pane."""

    DEFAULT_CSS = """
    FinetuneForm { align: center middle; }
    #finetune-dialog {
        width: 80; max-width: 95%; height: auto; max-height: 95%;
        border: round $primary; background: $surface; padding: 0 1;
    }
    #finetune-dialog Input { margin-bottom: 0; }
    #ft-problem { height: auto; }
    #ft-buttons { height: auto; }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="finetune-cancel"),
    ]

    def __init__(self, model: str, model_path: str, nodes: list[str], name: str) -> None:
        super().__init__(id="finetune-form")
        self.model_name, self.model_path = model, model_path
        self.nodes, self.job_name = nodes, name

    def compose(self) -> ComposeResult:
        # A scroll: at 80x24 the form is taller than the screen, and a focused field
        # must scroll into view rather than sit below the border.
        with VerticalScroll(id="finetune-dialog") as dialog:
            dialog.border_title = f"Fine-tune {self.model_name} (LoRA)"
            dialog.border_subtitle = "enter starts · esc cancels"
            fields = (
                ("data", "Data: a .jsonl file or a folder of documents", ""),
                ("nodes", "Nodes (a group or comma list)", ",".join(self.nodes)),
                ("iters", "Iterations", "100"),
                ("rank", "LoRA rank", "8"),
                ("batch", "Batch (split over the nodes)", "8"),
                ("lr", "Learning rate", "1e-5"),
                ("name", "Job name", self.job_name),
            )
            for key, label, value in fields:
                yield Label(label)
                yield Input(value=value, id=f"ft-{key}")
            yield Static("", id="ft-problem")
            with Horizontal(id="ft-buttons"):
                yield Button("Start", id="ft-start", variant="primary")
                yield Button("Cancel", id="ft-cancel")

    def on_mount(self) -> None:
        self.query_one("#ft-data", Input).focus()

    def _value(self, key: str) -> str:
        return self.query_one(f"#ft-{key}", Input).value.strip()

    def request(self) -> ft.FinetuneRequest:
        """The form as a request; a field that is not a number says so."""
        try:
            numbers = (
                int(self._value("iters")),
                int(self._value("rank")),
                int(self._value("batch")),
            )
            rate = float(self._value("lr"))
        except ValueError:
            raise ft.FinetuneError("iterations, rank and batch are whole numbers") from None
        if not self._value("data"):
            raise ft.FinetuneError("give the training data (a .jsonl file or a folder)")
        nodes = tuple(n.strip() for n in self._value("nodes").split(",") if n.strip())
        return ft.FinetuneRequest(
            model=self.model_path,
            data=str(Path(self._value("data")).expanduser()),
            nodes=nodes,
            name=self._value("name"),
            iters=numbers[0],
            lora_rank=numbers[1],
            batch_size=numbers[2],
            learning_rate=rate,
        )

    def _submit(self) -> None:
        try:
            req = self.request()
            ft.check_request(req)
        except StudioError as exc:
            self.query_one("#ft-problem", Static).update(Text(str(exc), style="red"))
            return
        self.dismiss(req)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "ft-start":
            self._submit()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)


@guard_actions
class JobsScreen(Screen[None]):
    CSS_PATH = "jobs.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "back", "Back", id="jobs-back"),
        Binding("s", "stop_job", "Stop job", id="jobs-stop"),
        Binding("r", "resume_job", "Resume job", id="jobs-resume"),
        Binding("f5", "refresh_jobs", "Refresh", id="jobs-refresh"),
    ]

    def __init__(self) -> None:
        super().__init__(id="jobs-screen")
        self.watches: dict[str, JobWatch] = {}
        self.records: dict[str, jobs.JobRecord] = {}
        self.following: dict[str, asyncio.Task[Any]] = {}
        self.selected: str | None = None
        self._redraw_due = False
        # A job being started whose base is hashed for the first time: (its model's
        # name, bytes hashed, of); None when nothing is hashed.
        self.hashing: tuple[str, int, int] | None = None
        self._hashing_paced = Paced()
        # Its copies to remote nodes (local ones read the operator's folder): the base's
        # name and, by node, bytes copied of the step's (the model's, then the data's).
        self.copying: tuple[str, dict[str, tuple[int, int]]] | None = None
        self._copying_paced = Paced()
        self.rates = Rates()

    @property
    def dash(self) -> Dashboard:
        return cast(Dashboard, self.app)

    def compose(self) -> ComposeResult:
        with Vertical(id="jobs-body"):
            table: DataTable[Any] = DataTable(id="jobs-list", cursor_type="row")
            table.border_title = "Jobs"
            yield table
            yield Static("", id="jobs-summary")
            yield Static("", id="jobs-hashing")
            with Horizontal(id="jobs-detail"):
                nodes: DataTable[Any] = DataTable(id="jobs-nodes", cursor_type="none")
                nodes.border_title = "Nodes"
                yield nodes
                plot = Static("", id="jobs-plot")
                plot.border_title = "Loss over iterations"
                yield plot
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#jobs-list", DataTable).add_columns(*JOB_LIST_COLUMNS)
        self.query_one("#jobs-nodes", DataTable).add_columns(
            "node", "rank", "state", "memory", "peak", "note"
        )
        self.action_refresh_jobs()

    # ---- following ------------------------------------------------------------------------

    def action_refresh_jobs(self) -> None:
        self.dash.background(self.find_jobs(), "listing jobs")

    async def find_jobs(self) -> list[str]:
        """The jobs this operator started (records) and what the nodes say of them; a
        job still running is followed (again, after a restart). Those running, by name."""
        running: list[str] = []
        ctl = self.dash.controller
        for record in jobs.all_records(self.dash.home):
            self.records[record.name] = record
            self.watches.setdefault(
                record.name, JobWatch(record.name, record.kind, [*record.nodes])
            )
        if ctl is not None:
            up = [n.name for n in ctl.state.nodes if n.state == "up"]
            found = await jobs.status(ctl, up)
            for name, ranks in found.items():
                known = self.records.get(name)
                if known is None:
                    continue
                states = {r.state for r in ranks.values()}
                if states & {"running", "starting", "silent"}:
                    running.append(name)
                if states & {"running", "starting", "silent"} or any(
                    r.seq > self.watches[name].since(n) for n, r in ranks.items()
                ):
                    self.follow(known)
            for name, record in self.records.items():
                self._unknown_unless_heard(name, record, found)
        self.redraw()
        return running

    def _unknown_unless_heard(
        self,
        name: str,
        record: jobs.JobRecord,
        found: Mapping[str, object],
    ) -> None:
        """A recorded job no node up reports, never heard of in this session: its
        state is unknown (as `studiotui jobs` says), not "starting" for ever."""
        watch = self.watches[name]
        follower = self.following.get(name)
        if name in found or (follower is not None and not follower.done()):
            return
        if watch.progress.ended or any(watch.since(n) for n in record.nodes):
            return
        watch.finish("unknown", UNKNOWN_JOB)
        for node in record.nodes:
            watch.beat(node, "unknown", UNKNOWN_JOB)

    def follow(self, record: jobs.JobRecord) -> None:
        running = self.following.get(record.name)
        if running is not None and not running.done():
            return
        ctl = self.dash.controller
        if ctl is None:
            return
        watch = self.watches.setdefault(
            record.name, JobWatch(record.name, record.kind, [*record.nodes])
        )
        if watch.progress.ended:
            # Followed again (resumed): a fresh ending is to come.
            watch.finish("running")

        async def run() -> None:
            try:
                end = await ft.attach(ctl, record, watch, self.redraw)
            except Exception as exc:  # said in the Log, never a traceback
                self.dash.report(f"following job {record.name!r} failed: {exc}", "error")
                return
            if jobs.end_said(self.dash.home, record.name, end):
                # Announced by an earlier dashboard: shown in the table, not news.
                self.redraw()
                return
            jobs.say_end(self.dash.home, record.name, end)
            level: LogLevel = (
                "info" if end.state == "done" else "error" if end.state == "failed" else "warning"
            )
            self.dash.report(
                f"job {record.name!r} {end.state}{': ' + end.message if end.message else ''}", level
            )
            if end.state == "done" and record.kind == ft.KIND:
                # Its adapter, brought from its node to where `place --adapter` finds it.
                try:
                    where = await fetch_adapter(ctl, record)
                    self.dash.report(f"adapter of job {record.name!r} is at {where}", "info")
                except StudioError as exc:
                    self.dash.report(f"adapter of job {record.name!r} not fetched: {exc}", "error")
            self.redraw()

        self.following[record.name] = asyncio.create_task(run())

    def start(self, req: ft.FinetuneRequest, resume: bool = False) -> None:
        self.dash.background(self._start(req, resume), f"starting job {req.name}")

    async def _start(self, req: ft.FinetuneRequest, resume: bool) -> None:
        ctl = self.dash.controller
        if ctl is None:
            self.dash.report("fine-tune: no cluster is connected", "warning")
            return
        # Reading and checking the data may take a moment: off the screen's loop.
        prepared = await asyncio.to_thread(ft.prepare, ctl, req, resuming=resume)
        model = prepared.info.name
        try:
            # The base's identity is hashed in a thread of launch's (asyncio.to_thread):
            # its reports come from there.
            # The copies' reports come from the loop (the agents' streams, SFTP).
            record = await ft.launch(
                ctl,
                prepared,
                resume=resume,
                hashing=lambda d, t: self._hashed(model, d, t),
                progress=lambda n, d, t: self._copied(model, n, d, t),
            )
        finally:
            self._show_hashing(None)
            self.copying = None
            self._show_start()
        self.records[record.name] = record
        self.watches[record.name] = JobWatch(record.name, record.kind, [*record.nodes])
        self.selected = record.name
        self.follow(record)
        self.redraw()

    def _hashed(self, model: str, done: int, total: int) -> None:
        """From the hashing thread: shown at the start, the end, and at most
        SHOWN_EVERY_S apart between (core.rates.Paced)."""
        if self._hashing_paced.due(done, total, time.monotonic()):
            self.app.call_from_thread(self._show_hashing, (model, done, total))

    def _show_hashing(self, hashing: tuple[str, int, int] | None) -> None:
        self.hashing = hashing
        if hashing is not None:
            self.rates.update("operator", hashing[1], hashing[2], time.monotonic())
        self._show_start()

    def _copied(self, model: str, node: str, done: int, total: int) -> None:
        """On the loop: a node's copy so far, drawn at most SHOWN_EVERY_S apart
        besides each step's start and end (a copy reports every chunk)."""
        now = time.monotonic()
        copying = self.copying[1] if self.copying is not None else {}
        self.copying = (model, {**copying, node: (done, total)})
        self.rates.update(node, done, total, now)
        if self._copying_paced.due(done, total, now):
            self._show_start()

    def _show_start(self) -> None:
        """A job's start as it goes: its base's first hashing, then its copies."""
        if not self.is_mounted:
            return
        parts = []
        if self.hashing is not None:
            parts.append(hashing_content(self.hashing, self.rates))
        if self.copying is not None:
            parts.append(copying_content(*self.copying, self.rates))
        shown = self.query_one("#jobs-hashing", Static)
        shown.display = bool(parts)
        shown.update(Content("\n").join(parts) if parts else "")

    # ---- keys -----------------------------------------------------------------------------

    def _chosen(self, what: str) -> jobs.JobRecord | None:
        name = self.selected
        if name is None or name not in self.records:
            self.dash.report(f"{what}: select a job first", "warning")
            return None
        return self.records[name]

    def action_stop_job(self) -> None:
        record = self._chosen("stop")
        ctl = self.dash.controller
        if record is None or ctl is None:
            return
        # An ended job has nothing to stop: say so (the key seemed to do nothing).
        watch = self.watches.get(record.name)
        if watch is not None and watch.progress.ended:
            state = watch.progress.state
            self.dash.report(f"job {record.name!r} is {state}: nothing to stop", "warning")
            return
        self.dash.background(
            jobs.stop(ctl, record.name, list(record.nodes)), f"stopping {record.name}"
        )

    def action_resume_job(self) -> None:
        record = self._chosen("resume")
        ctl = self.dash.controller
        if record is None or ctl is None:
            return
        if not self.watches[record.name].progress.ended:
            self.dash.report(f"job {record.name!r} is still running", "warning")
            return
        req = ft.resume_request(ctl, record.name)
        self.start(replace(req), resume=True)

    def action_back(self) -> None:
        self.app.pop_screen()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id != "jobs-list" or event.row_key.value is None:
            return
        chosen = str(event.row_key.value)
        if chosen != self.selected:  # a redraw puts the cursor back: that is no choice
            self.selected = chosen
            self.redraw()

    # ---- drawing --------------------------------------------------------------------------

    def on_resize(self) -> None:
        self.redraw()  # the nodes column fits the width: a finished job draws no more

    def redraw(self) -> None:
        """Draw soon: events come as fast as steps (many a second); drawn at most
        REDRAW_EVERY_S apart, so the keys stay answered."""
        if not self.is_mounted or self._redraw_due:
            return
        self._redraw_due = True
        self.set_timer(REDRAW_EVERY_S, self._redraw_now)

    def _redraw_now(self) -> None:
        self._redraw_due = False
        if not self.is_mounted:
            return
        table = self.query_one("#jobs-list", DataTable)
        names = sorted(
            self.watches, key=lambda n: self.records[n].started if n in self.records else 0
        )
        if self.selected not in self.watches and names:
            self.selected = names[-1]
        # Columns too: a DataTable column keeps the width of its widest cell ever, and
        # the nodes' cell narrows with the screen.
        table.clear(columns=True)
        table.add_columns(*JOB_LIST_COLUMNS)
        rows = {}
        for name in names:
            p = self.watches[name].progress
            rows[name] = [
                name,
                p.kind,
                p.state,
                f"{p.iteration}/{p.total or '?'}",
                f"{p.train_loss[-1].value:.3f}" if p.train_loss else "",
                f"{p.tokens_per_second:.0f}" if p.tokens_per_second else "",
                duration(p.eta_s),
            ]
        # The nodes come last and take what the other columns leave (each column has a
        # cell of padding either side), so they are never cut off at the screen's edge.
        widths = [
            max([cell_len(c), *(cell_len(r[i]) for r in rows.values())]) + 2
            for i, c in enumerate(JOB_LIST_COLUMNS[:-1])
        ]
        room = table.scrollable_content_region.width - sum(widths) - 2
        for name, row in rows.items():
            nodes = [n.node for n in self.watches[name].progress.nodes]
            table.add_row(*row, nodes_cell(nodes, max(room, len("nodes"))), key=name)
        if self.selected in names:
            table.move_cursor(row=names.index(self.selected), animate=False)
        self._detail()

    def _detail(self) -> None:
        nodes = self.query_one("#jobs-nodes", DataTable)
        nodes.clear()
        plot = self.query_one("#jobs-plot", Static)
        if self.selected is None or self.selected not in self.watches:
            self.query_one("#jobs-summary", Static).update("no jobs yet: f on a model starts one")
            plot.update("")
            return
        p = self.watches[self.selected].progress
        self.query_one("#jobs-summary", Static).update(summary(p))
        for n in p.nodes:
            colour = {"failed": "red", "done": "green", "silent": "yellow"}.get(n.state, "")
            nodes.add_row(
                n.node,
                str(n.rank),
                Text(n.state, style=colour),
                format_bytes(n.memory) if n.memory else "",
                # mlx-lm reports the peak in GB (bytes / 1e9): shown by the same rule
                # as the memory beside it ("76 MB", "1.2 GB"), not "0.08 GB".
                format_bytes(round(n.peak_memory_gb * 1e9)) if n.peak_memory_gb else "",
                n.message[:60],
            )
        width = max(20, plot.size.width - 2 if plot.size.width else 60)
        plot.update(loss_chart(p.train_loss, p.val_loss, width))
