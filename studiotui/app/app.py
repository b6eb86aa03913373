"""The dashboard: a view of the controller's ClusterState and a keyboard for its commands.

The app either drives a live Controller (built from an inventory inside the app's
own event loop) or shows a fixed ClusterState with no I/O at all, which is what the
snapshot tests use. Every command runs in a worker and every failure becomes a
notification plus a Log entry; the operator never sees a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, cast

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.theme import Theme
from textual.widgets import Footer, Header, Input, Static, TabbedContent, TabPane, TextArea

from studiotui.app.dialogs import (
    ConfirmScreen,
    HelpScreen,
    NodeLogScreen,
    QuitScreen,
)
from studiotui.app.guard import guard_actions
from studiotui.app.host import Dashboard
from studiotui.app.model_files import ModelFiles
from studiotui.app.palette import StudioCommands
from studiotui.app.panes.filter import Filterable, FilterBar
from studiotui.app.panes.log import LogPane
from studiotui.app.panes.models import ModelRow, ModelsPane, read_catalog
from studiotui.app.panes.nodes import SORT_KEYS, NodesPane
from studiotui.app.panes.placements import PlacementsPane
from studiotui.app.panes.rdma import RdmaPane
from studiotui.app.panes.topology import TopologyPane
from studiotui.app.place.flow import Placer
from studiotui.app.screens.benchmark import BenchmarkScreen
from studiotui.app.screens.jobs import FinetuneForm, JobsScreen
from studiotui.app.themes import DEFAULT_THEME, load_themes, load_ui, save_ui
from studiotui.cluster import local_cluster, stops
from studiotui.cluster.controller import RUNNER_OVERHEAD_BYTES, Controller
from studiotui.cluster.session import wait_until_up
from studiotui.core.benchmark import Sizes
from studiotui.core.catalog import models_stamp
from studiotui.core.inventory import Inventory, NodeSpec
from studiotui.core.model_facts import ModelDirError, read_model
from studiotui.core.model_folders import (
    empty_note,
)
from studiotui.core.placement import Plan, format_bytes
from studiotui.core.state import ClusterState, LogEntry, LogLevel
from studiotui.core.text import counted
from studiotui.provision.deploy import Outcome, provision_logged
from studiotui.provision.restart import Restarted, has_kept, keep_placements, restart_nodes
from studiotui.tune import finetune as ft

# Telemetry from N nodes arrives as N updates a second, nearly together; drawing
# once per burst keeps an idle dashboard cheap.
COALESCE_S = 0.15
UP_TIMEOUT_S = 30.0
# How often the model folders' stamp is read (one stat a directory), and how long a
# directory that cannot be read must be left alone before it is shown as broken
# rather than as a model still being written (a download, a copy).
MODELS_CHECK_S = 3.0
MODELS_SETTLE_S = 20.0
# One meaning of "memory" on every screen; said in the key help.
MEMORY_HELP = (
    "Memory in use is what each node reports: total minus available on a real Mac "
    "(a simulated node counts its agent's and shards' own memory). The Nodes pane, "
    'the place preview\'s "memory now" and `studiotui status` all show that figure; '
    '"after loading" adds the shard\'s weights and KV cache, about '
    f"{format_bytes(RUNNER_OVERHEAD_BYTES)} for its process and what shards still loading "
    "will take."
)


# Keys bound in more than one place, said once for all of them.
KEY_MEANINGS = {
    "space": "Mark the selected node (from any pane): p places on the marked nodes",
    "escape": (
        "Back: close a dialog, leave the chat; on a filtered table, clear the filter; "
        "on the dashboard, clear the marks"
    ),
}

# The app's own keys that mean something only on the dashboard.
DASHBOARD_ACTIONS = frozenset(
    {
        "help",
        "node_logs",
        "restart_node",
        "measure_links",
        "place",
        "unload",
        "place_again",
        "provision",
        "next_theme",
        "chat",
        "benchmark",
        "refresh",
        "show_tab",
        "focus_nodes",
        "mark_node",
        "finetune",
        "jobs",
        "filter",
        "model_folders",
        "fetch_hub",
        "delete_model",
    }
)


@dataclass
class Startup:
    """What to do before (and while) the dashboard shows: the first-run work."""

    start_agents: list[NodeSpec] = field(default_factory=list)
    demo_model: Path | None = None  # written if missing
    place_demo: bool = False
    note: str = ""  # told first, so the operator knows why things start by themselves


# Something run beside the dashboard once its controller is up (the API server, given by
# the command line: the dashboard does not import the API); closed when it quits.
ServiceStarter = Callable[[Controller], Awaitable[Any]]


@guard_actions
class StudioApp(Dashboard):
    TITLE = "studiotui"
    CSS_PATH: ClassVar[list[str | Path]] = [  # type: ignore[assignment]
        "app.tcss",
        "panes/nodes.tcss",
        "dialogs.tcss",
    ]
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (130, "-wide")]  # noqa: RUF012 - as Textual types it
    VERTICAL_BREAKPOINTS = [(0, "-short"), (40, "-tall")]  # noqa: RUF012 - as Textual types it
    COMMANDS: ClassVar[set[Any]] = App.COMMANDS | {StudioCommands}
    BINDINGS: ClassVar[list[BindingType]] = [
        # The footer shows what a newcomer needs first and fits 80 columns; every other
        # key is in `?` (key_rows lists them all) and in the command palette.
        Binding("p", "place", "Place", id="place"),
        Binding("u", "unload", "Unload", id="unload"),
        Binding("c", "chat", "Chat", id="chat"),
        Binding("question_mark", "help", "Help", key_display="?", id="help"),
        Binding("q", "quit", "Quit", id="quit"),
        Binding("l", "node_logs", "Logs", show=False, id="node-logs"),
        Binding("r", "restart_node", "Restart node", show=False, id="restart-node"),
        Binding("m", "measure_links", "Measure links", show=False, id="measure-links"),
        Binding("R", "place_again", "Place again", key_display="R", show=False, id="place-again"),
        Binding(
            "F",
            "fetch_model",
            "Fetch model to nodes",
            key_display="F",
            show=False,
            id="fetch-model",
        ),
        Binding("P", "provision", "Provision", key_display="P", show=False, id="provision"),
        Binding("t", "next_theme", "Theme", show=False, id="next-theme"),
        Binding("f", "finetune", "Fine-tune", show=False, id="finetune"),
        Binding("J", "jobs", "Jobs", key_display="J", show=False, id="jobs"),
        Binding("b", "benchmark", "Benchmark", show=False, id="benchmark"),
        # f5 only: ctrl+r is the chat's Regenerate, and a key means one thing.
        Binding("f5", "refresh", "Refresh", show=False, id="refresh"),
        Binding("1", "show_tab('tab-topology')", "Topology", show=False, id="tab-topology"),
        Binding("2", "show_tab('tab-rdma')", "RDMA", show=False, id="tab-rdma"),
        Binding("3", "show_tab('tab-placements')", "Placements", show=False, id="tab-placements"),
        Binding("4", "show_tab('tab-models')", "Models", show=False, id="tab-models"),
        Binding("5", "focus_nodes", "Nodes", show=False, id="focus-nodes"),
        # From any pane: the Nodes pane's own space binding, for the selected node.
        Binding("space", "mark_node", "Mark node", show=False, id="mark-node-anywhere"),
        # Priority: run at once, before the keys typed right behind it are handed to
        # the pane that has the keys ("/l" opened a node's log); a box being typed in
        # keeps its "/" (check_action).
        Binding(
            "slash",
            "filter",
            "Filter the table with the keys (Nodes, Models, Placements); esc clears",
            key_display="/",
            show=False,
            priority=True,
            id="filter",
        ),
    ]

    def __init__(
        self,
        home: Path,
        inventory: Inventory | None = None,
        *,
        state: ClusterState | None = None,
        models: list[ModelRow] | None = None,
        startup: Startup | None = None,
        services: Sequence[ServiceStarter] = (),
    ) -> None:
        super().__init__()
        if inventory is None and state is None:
            raise ValueError("StudioApp needs an inventory (live) or a state (fixed view)")
        self.home = home
        self.inventory = inventory
        self.startup = startup
        # A `down` after this dashboard started is the operator's word: its start (a
        # browser tab still starting) leaves those agents stopped.
        self.started_at = time.time()
        self.starters = list(services)  # started beside the dashboard once nodes answer
        self.services: list[Any] = []  # what they started (each has `close()`)
        self.controller: Controller | None = None
        self.cluster = state or ClusterState(name=inventory.name if inventory else "cluster")
        self.fixed = state is not None
        self._fixed_models = models
        self._pending: ClusterState | None = None
        self._scheduled = False
        self._broken_view = False
        self._models_stamp: tuple[tuple[str, int], ...] = ()
        self._models_held = False
        self._models_checking = False
        self.ui = load_ui(home)
        self._studio_themes: list[str] = []
        themes, problems = load_themes()
        # The default first, so "next theme" starts from where a new user is.
        for theme in sorted(themes, key=lambda t: (t.name != DEFAULT_THEME, t.name)):
            self.register_theme(theme)
            self._studio_themes.append(theme.name)
        self._theme_problems = problems
        self.exit_note = ""  # printed by `studiotui` once the terminal is back
        self.placer = Placer(self)
        self.model_files = ModelFiles(self)
        # What the Benchmark screen measures with (tests make it small).
        self.benchmark_sizes = Sizes()
        wanted = self.ui.get("theme")
        if not isinstance(wanted, str) or wanted not in self.available_themes:
            wanted = DEFAULT_THEME if DEFAULT_THEME in self.available_themes else "textual-dark"
        self.theme = wanted
        keymap = self.ui.get("keymap")
        if isinstance(keymap, dict):
            self.set_keymap({str(k): str(v) for k, v in keymap.items()})

    # ---- layout ---------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="top"):
            yield NodesPane(id="nodes")
            with TabbedContent(id="top-tabs", initial="tab-topology"):
                with TabPane("Topology", id="tab-topology"):
                    yield TopologyPane(id="topology")
                with TabPane("RDMA", id="tab-rdma"):
                    yield RdmaPane(id="rdma")
        with Horizontal(id="bottom"):
            with TabbedContent(id="bottom-tabs", initial="tab-placements"):
                with TabPane("Placements", id="tab-placements"):
                    yield PlacementsPane(id="placements")
                with TabPane("Models", id="tab-models"):
                    yield ModelsPane(id="models")
                    yield Static(id="models-note")
            yield LogPane(id="log")
        yield FilterBar(id="filter-bar")
        yield Footer()

    def on_mount(self) -> None:
        self.theme_changed_signal.subscribe(self, self._remember_theme)
        nodes = self.query_one(NodesPane)
        sort = self.ui.get("sort")
        if sort in SORT_KEYS:
            nodes.sort_by = sort
        nodes.focus()
        self.watch(nodes, "sort_by", self._remember_sort, init=False)
        groups = self.inventory.groups if self.inventory else {}
        nodes.set_groups(groups)
        self.query_one(PlacementsPane).groups = groups
        for problem in self._theme_problems:
            self.report(f"theme file skipped: {problem}", "warning")
        if self.fixed:
            self._show(self.cluster)
            # The folder by its name, not its path: a fixed view draws the same anywhere.
            self.query_one(ModelsPane).show(self._fixed_models or [], "STUDIOTUI_HOME/models")
            return
        assert self.inventory is not None
        self.controller = Controller(self.home, self.inventory)
        self.controller.subscribe(self._on_state)
        self._show(self.controller.state)
        self.background(self._start(), "starting")
        self.background(self.scan_models(settle=True), "reading models")
        self.set_interval(MODELS_CHECK_S, self._check_models)

    def _check_models(self) -> None:
        if not self._models_checking:
            self._models_checking = True
            self.background(self._check_models_once(), "checking the model folders")

    async def _check_models_once(self) -> None:
        """A model written while the dashboard runs (`studiotui demo-model`, a download
        in another terminal) shows without f5: the folders' stamp is read in a thread
        (a network folder can block), the headers only when it changed."""
        try:
            stamp = await asyncio.to_thread(models_stamp, self.home)
            if stamp != self._models_stamp or self._models_held:
                await self.scan_models(settle=True)
        finally:
            self._models_checking = False

    async def on_unmount(self) -> None:
        for service in self.services:
            with contextlib.suppress(Exception):
                await service.close()
        if self.controller is not None:
            controller, self.controller = self.controller, None
            # The app is gone: nobody is left to tell about a failed close.
            with contextlib.suppress(Exception):
                await controller.close()

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    # ---- state → panes --------------------------------------------------------------------

    def _on_state(self, state: ClusterState) -> None:
        """Controller listener: runs in the controller's tasks, so only note and schedule."""
        self._pending = state
        if not self._scheduled and self.is_running:
            self._scheduled = True
            self.set_timer(COALESCE_S, self._apply_pending)

    def _apply_pending(self) -> None:
        self._scheduled = False
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._show(state)

    def _show(self, state: ClusterState) -> None:
        self.cluster = state
        try:
            nodes = self.query_one(NodesPane)
            nodes.update_nodes(state.nodes)
            self.query_one(TopologyPane).show(state, nodes.selected)
            self.query_one(RdmaPane).show(state.nodes)
            self.query_one(PlacementsPane).show(state.placements, self.theme, self.theme_variables)
            self.query_one(LogPane).show(state.log)
            up = sum(n.state == "up" for n in state.nodes)
            count = len(state.placements)
            self.sub_title = (
                f"{state.name} · {up}/{len(state.nodes)} nodes up · "
                f"{count} placement{'s' if count != 1 else ''}"
            )
        except Exception as exc:
            # A view bug must not kill the dashboard; say it once, not every second.
            if not self._broken_view:
                self._broken_view = True
                self.report(f"display error: {type(exc).__name__}: {exc}", "error")

    def on_nodes_pane_selected(self, event: NodesPane.Selected) -> None:
        self.query_one(TopologyPane).show(self.cluster, event.name)

    def _remember_theme(self, theme: Theme) -> None:
        # Tables hold Rich colours, which do not follow the theme by themselves.
        self.call_later(self._redraw_for_theme)
        try:
            save_ui(self.home, theme=theme.name)
        except OSError as exc:
            self.report(f"cannot save the theme choice to {self.home}: {exc}", "warning")

    def _remember_sort(self, key: str) -> None:
        try:
            save_ui(self.home, sort=key)
        except OSError as exc:
            self.report(f"cannot save the sort order to {self.home}: {exc}", "warning")

    def _redraw_for_theme(self) -> None:
        self._show(self.cluster)

    # ---- reporting ------------------------------------------------------------------------

    def report(self, text: str, level: LogLevel = "info") -> None:
        """Tell the operator: a notification for warnings and errors, a Log entry always."""
        if level in ("warning", "error"):
            severity: SeverityLevel = "error" if level == "error" else "warning"
            self.notify(text, severity=severity, timeout=8 if level == "error" else 5)
        else:
            self.notify(text, timeout=3)
        if self.controller is not None:
            self.controller.record(text, level)
        else:
            entry = LogEntry(time=time.time(), level=level, text=text)
            self.cluster = replace(self.cluster, log=(*self.cluster.log, entry))
            if self.is_mounted_ready:
                self.query_one(LogPane).show(self.cluster.log)

    @property
    def is_mounted_ready(self) -> bool:
        try:
            self.query_one(LogPane)
        except Exception:
            return False
        return True

    def background(self, work: Awaitable[Any], what: str) -> None:
        """Run a command without blocking the keys; its failure is reported, not raised."""

        async def guarded() -> None:
            try:
                await work
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.report(f"{what} failed: {exc}", "error")

        self.run_worker(guarded(), group=what, exit_on_error=False)

    def need_controller(self, what: str) -> Controller | None:
        if self.controller is None:
            self.report(f"{what}: no cluster is connected (this is a fixed view)", "warning")
        return self.controller

    def _selected_node(self, what: str) -> str | None:
        name = self.query_one(NodesPane).selected
        if name is None:
            self.report(f"{what}: no node is selected", "warning")
        return name

    # ---- startup --------------------------------------------------------------------------

    async def _start(self) -> None:
        ctl = self.controller
        assert ctl is not None and self.inventory is not None
        plan = self.startup or Startup()
        if plan.note:
            ctl.record(plan.note)
        if plan.start_agents:
            await self._start_agents(ctl, plan.start_agents)
        await ctl.start(telemetry=True)
        nodes = ctl.state.nodes
        down = [n.name for n in nodes if n.state != "up"]
        summary = f"cluster {ctl.state.name}: {len(nodes) - len(down)}/{len(nodes)} nodes up"
        if down:
            ssh = any(not self.inventory.node(n).is_local for n in down)
            # A new cluster.toml's Macs have no agent yet: say what starts one.
            how = (
                "P on a node provisions it (installs and starts its agent; "
                "studiotui provision does every node), r restarts one installed"
                if ssh
                else "r on a node restarts its agent"
            )
            self.report(f"{summary}; not answering: {', '.join(down)}: {how}", "warning")
        else:
            ctl.record(summary)
        for starter in self.starters:
            await self._start_service(ctl, starter)
        # Jobs outlive a dashboard: the ones still running are followed again at once.
        self.background(self._reattach_jobs(), "finding jobs")
        if plan.demo_model is not None:
            await self._demo(ctl, plan.demo_model, plan.place_demo)

    async def _start_service(self, ctl: Controller, starter: ServiceStarter) -> None:
        try:
            self.services.append(await starter(ctl))
        except OSError as exc:
            self.report(f"cannot start a service beside the dashboard: {exc}", "error")

    async def _start_agents(self, ctl: Controller, nodes: list[NodeSpec]) -> None:
        assert self.inventory is not None
        started = []
        left = []
        for node in nodes:
            # Asked again before each start: the `down` may come while they start.
            recorded = stops.read_stops(self.home, self.inventory.name)
            when = stops.stopped_since(recorded, node.name, self.started_at)
            if when is not None:
                ctl.record(
                    f"{node.name} was stopped by `studiotui down` at "
                    f"{time.strftime('%H:%M:%S', time.localtime(when))}, after this "
                    "dashboard started: not started again (r starts it)"
                )
                continue
            pid = await asyncio.to_thread(
                local_cluster.start_agent, self.home, node, self.inventory
            )
            started.append(f"{node.name} (pid {pid})")
            left.append(node)
        nodes = left
        if not nodes:
            return
        ctl.record(f"started local agent{'s' if len(started) > 1 else ''} {', '.join(started)}")
        missing = await wait_until_up(ctl, [n.name for n in nodes], timeout=UP_TIMEOUT_S)
        for name in missing:
            tail = local_cluster.agent_output_tail(self.inventory.node(name))
            self.report(
                f"{name} did not answer within {UP_TIMEOUT_S:.0f} s; its output ends: "
                f"{tail or '(nothing)'}",
                "error",
            )

    async def _demo(self, ctl: Controller, path: Path, place: bool) -> None:
        damage = await asyncio.to_thread(demo_damage, path)
        if damage is not None:
            if damage:
                # Ours and deterministic: written again rather than failing the start.
                self.report(f"the demo model is damaged ({damage}): writing it again", "warning")
            else:
                ctl.record(f"writing the demo model to {path}")
            from worker.shared.demo_model import DemoModelError, DemoSpec, write_demo_model

            try:
                # It recites a passage about itself, so the first chat reads as an answer.
                await asyncio.to_thread(write_demo_model, path, DemoSpec(recite=True))
            except DemoModelError as exc:  # not ours (a model of the operator's), no room
                self.report(f"cannot write the demo model: {exc}", "error")
                return
            finally:
                await self.scan_models()
        if not place or ctl.state.placement(path.name) is not None:
            return
        up = [n.name for n in ctl.state.nodes if n.state == "up"]
        if not up:
            self.report("no node is up, so the demo model was not placed", "warning")
            return
        # Planned first, so the progress lists the nodes in ring order, as the log and
        # the ring do; place() loads exactly this plan or refuses.
        _info, the_plan = await asyncio.to_thread(ctl.preview, path, up)
        ring = [s.node for s in the_plan.shards] if isinstance(the_plan, Plan) else up
        pane = self.query_one(PlacementsPane)
        pane.start_progress(f"placing {path.name} on {', '.join(ring)}", ring)
        try:
            await ctl.place(
                path,
                up,
                progress=pane.progress,
                expected=the_plan if isinstance(the_plan, Plan) else None,
            )
        finally:
            pane.end_progress()
        self.notify(f"placement {path.name} is ready")

    async def scan_models(self, settle: bool = False) -> None:
        """Read the catalog in a thread and show it; `settle` (the periodic check) leaves
        out directories still being written, f5 shows everything as it is."""
        pane = self.query_one(ModelsPane)
        shown = frozenset(r.key for r in pane.rows_shown if r.problem)
        listing = await asyncio.to_thread(
            read_catalog, self.home, MODELS_SETTLE_S if settle else 0.0, shown
        )
        self._models_stamp, self._models_held = listing.stamp, listing.held
        # Directories beside the models that hold none: a count under the table, not
        # a red row each and a log warning at every start.
        pane.show(listing.rows, listing.where, empty_note(listing.empty))
        for row in pane.new_problems(listing.rows):
            if self.controller is not None:
                self.controller.record(f"model {row.name} skipped: {row.problem}", "warning")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Dashboard keys act on the dashboard only: over the chat (and dialogs) they
        neither fire nor crowd the footer, so each screen's footer shows its own keys."""
        if action == "filter" and isinstance(self.focused, (Input, TextArea)):
            return False
        return not (action in DASHBOARD_ACTIONS and len(self.screen_stack) > 1)

    # ---- quitting -------------------------------------------------------------------------

    def local_agents_running(self) -> list[NodeSpec]:
        """This cluster's agents that run on this machine and are still running."""
        if self.inventory is None:
            return []
        return [n for n in self.inventory.nodes if n.is_local and local_cluster.running_pid(n)]

    async def action_quit(self) -> None:
        """Quit; with local agents running, say they stay (and offer to stop them)."""
        running = self.local_agents_running()
        if not running or isinstance(self.screen, QuitScreen):
            # q again on the question: quit, keeping the cluster (and saying so).
            self.exit_note = keep_note(len(running)) if running else ""
            self.exit()
            return
        shards = sum(
            len(n.shards) for n in self.cluster.nodes if n.name in {r.name for r in running}
        )
        held = f" holding {shards} shard{'s' if shards != 1 else ''}" if shards else ""
        question = (
            f"The local cluster keeps running after you quit: {len(running)} agent"
            f"{'s' if len(running) != 1 else ''}{held}. `studiotui down` stops it later; "
            "`studiotui` comes back to it."
        )
        self.push_screen(QuitScreen(question), self._quit_answered)

    def _quit_answered(self, answer: str | None) -> None:
        if answer == "keep":
            self.exit_note = keep_note(len(self.local_agents_running()))
            self.exit()
        elif answer == "stop":
            self.background(self._stop_cluster_and_quit(), "stopping the local cluster")

    def action_quit_and_stop(self) -> None:
        self.background(self._stop_cluster_and_quit(), "stopping the local cluster")

    async def _stop_cluster_and_quit(self) -> None:
        running = self.local_agents_running()
        self.report(f"stopping {len(running)} local agent{'s' if len(running) != 1 else ''}…")
        for node in running:
            await asyncio.to_thread(local_cluster.stop_agent, node)
        if self.controller is not None:
            self.controller.forget_placements_on([n.name for n in running])
        self.exit_note = (
            f"stopped the local cluster ({len(running)} agents); `studiotui` starts it again"
        )
        self.exit()

    # ---- actions --------------------------------------------------------------------------

    def action_chat(self) -> None:
        from studiotui.app.screens.chat import ChatScreen

        # One chat screen for the app's life: coming back is instant and finds it as left.
        if not self.is_screen_installed("chat"):
            self.install_screen(ChatScreen(), "chat")
        if not isinstance(self.screen, ChatScreen):
            self.push_screen("chat")

    def jobs_screen(self) -> JobsScreen:
        """The Jobs screen, made once: it keeps following jobs while it is not shown."""
        if not self.is_screen_installed("jobs"):
            self.install_screen(JobsScreen(), "jobs")
        return cast(JobsScreen, self.get_screen("jobs"))

    async def _reattach_jobs(self) -> None:
        screen = self.jobs_screen()
        running = await screen.find_jobs()
        if running:
            self.report(f"following job {', '.join(running)} again: J shows it")

    def action_jobs(self) -> None:
        screen = self.jobs_screen()
        if not isinstance(self.screen, JobsScreen):
            self.push_screen(screen)

    def action_finetune(self) -> None:
        """The fine-tuning form for the model selected in the Models pane."""
        ctl = self.need_controller("fine-tune")
        row = self.query_one(ModelsPane).selected_row
        if ctl is None:
            return
        if row is None or not row.placeable:
            self.report("fine-tune: select a model in the Models pane (4) first", "warning")
            return
        marked = sorted(self.query_one(NodesPane).marked)
        nodes = marked or [n.name for n in ctl.state.nodes if n.state == "up"]
        name = f"{row.name}-{time.strftime('%Y%m%d-%H%M%S')}"

        def answered(req: Any) -> None:
            if req is not None:
                screen = self.jobs_screen()
                self.push_screen(screen)
                screen.start(req)

        self.push_screen(FinetuneForm(row.name, row.path, nodes, name), answered)

    def action_benchmark(self) -> None:
        # The marked nodes, else every node that is up (as placing does).
        marked = sorted(self.query_one(NodesPane).marked) or None
        self.push_screen(BenchmarkScreen(marked, self.benchmark_sizes))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.key_rows(), [MEMORY_HELP]))

    def key_rows(self) -> list[tuple[str, str]]:
        """One row per key, each with the one thing it does."""
        found = self.ui.get("keymap")
        keymap: dict[str, str] = found if isinstance(found, dict) else {}
        rows: dict[str, str] = {}
        for binding in [*self.BINDINGS, *NodesPane.BINDINGS, *ModelsPane.BINDINGS]:
            assert isinstance(binding, Binding)
            key = keymap.get(binding.id, binding.key) if binding.id else binding.key
            shown = binding.key_display or key.replace(",", " / ")
            rows.setdefault(shown, KEY_MEANINGS.get(shown, binding.description))
        rows.setdefault("ctrl+p", "Command palette: every action, theme switching")
        rows.setdefault("tab", "Move between panes")
        return list(rows.items())

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        # Textual's own Theme, Quit and Keys entries would stand next to ours (themes
        # by name, Quit that asks about the cluster, Help: keys): list each once.
        for command in super().get_system_commands(screen):
            if command.title not in ("Theme", "Quit", "Keys"):
                yield command

    def palette_actions(self) -> list[tuple[str, str, str]]:
        """(title, help, action) for the command palette."""
        return [
            ("Place selected model", "on the marked nodes (or all up): preview first", "place"),
            *[
                (f"Place selected model on group {g}", ", ".join(m), f"place_group('{g}')")
                for g, m in (self.inventory.groups.items() if self.inventory else ())
            ],
            ("Unload selected placement", "stop its shards and free the memory", "unload"),
            (
                "Place selected placement again",
                "a broken or failed one: unload it, preview its model again",
                "place_again",
            ),
            (
                "Fetch selected model to nodes",
                "each marked (or up) node its share: from the hub for a hub model",
                "fetch_model",
            ),
            (
                "Fine-tune selected model",
                "LoRA (QLoRA if quantized) on the marked (or up) nodes: a form first",
                "finetune",
            ),
            ("Jobs", "fine-tuning jobs on the nodes: progress, loss, stop, resume", "jobs"),
            ("Mark selected node", "toggle: marked nodes are where p places", "mark_node"),
            ("Clear marks", "unmark every node", "clear_marks"),
            ("Rescan models", "read the model folders and the HF cache again", "rescan_models"),
            (
                "Model folders: add or remove",
                "where models are looked for (config.toml models_dirs): a in Models",
                "model_folders",
            ),
            (
                "Fetch a model from the hub",
                "org/name: each marked (or up) node downloads its share: H in Models",
                "fetch_hub",
            ),
            (
                "Delete selected model",
                "its files on this machine, asking first; not one a placement uses: D",
                "delete_model",
            ),
            ("Filter the table", "the Nodes, Models or Placements table: / · esc clears", "filter"),
            ("Provision selected node", "install and start its agent over SSH", "provision"),
            ("Restart selected node", "stop and start its agent", "restart_node"),
            ("Re-measure links", "latency and bandwidth between nodes", "measure_links"),
            (
                "Benchmark the cluster",
                "MLX GFLOP/s and GB/s per node, links, the group, placements' streams; "
                "saved runs to compare",
                "benchmark",
            ),
            ("Open logs of selected node", "the agent's own log", "node_logs"),
            ("Refresh", "ask every agent again; re-read models", "refresh"),
            ("Sort nodes", "cycle: name, memory, cpu, state", "sort_nodes"),
            ("Next theme", "cycle the studio themes", "next_theme"),
            ("Help: keys", "every key of the dashboard", "help"),
            ("Quit", "the local cluster keeps running (asks first)", "quit"),
            (
                "Quit and stop the local cluster",
                "stop this machine's agents, then quit",
                "quit_and_stop",
            ),
        ]

    def theme_names(self) -> list[str]:
        others = sorted(n for n in self.available_themes if n not in self._studio_themes)
        return [*self._studio_themes, *others]

    def use_theme(self, name: str) -> None:
        if name not in self.available_themes:
            self.report(f"no theme named {name!r}", "warning")
            return
        self.theme = name

    def action_next_theme(self) -> None:
        names = self._studio_themes or self.theme_names()
        index = names.index(self.theme) + 1 if self.theme in names else 0
        self.use_theme(names[index % len(names)])
        self.notify(f"theme: {self.theme}", timeout=2)

    def action_show_tab(self, tab: str) -> None:
        for tabs in self.query(TabbedContent):
            if tabs.query(f"#{tab}"):
                tabs.active = tab
                # A number key is the keyboard's way in: its table takes the arrows.
                for table in tabs.query(f"#{tab} DataTable"):
                    table.focus()
                    break

    def action_focus_nodes(self) -> None:
        self.query_one(NodesPane).focus()

    def action_sort_nodes(self) -> None:
        self.query_one(NodesPane).action_cycle_sort()

    def action_node_logs(self) -> None:
        name = self._selected_node("logs")
        ctl = self.need_controller("logs") if name else None
        if name and ctl:
            self.push_screen(NodeLogScreen(name, self._read_log))

    async def _read_log(self, name: str) -> list[str]:
        ctl = self.controller
        if ctl is None:
            raise RuntimeError("no cluster is connected")
        try:
            return await ctl.read_log(name)
        except Exception as exc:
            if ctl is self.controller:
                ctl.record(f"cannot read the log of {name}: {exc}", "error")
            raise

    def action_restart_node(self) -> None:
        name = self._selected_node("restart")
        ctl = self.need_controller("restart") if name else None
        if name and ctl:
            self.background(self._ask_restart(ctl, name), f"restarting {name}")

    async def _ask_restart(self, ctl: Controller, name: str) -> None:
        """Restart at once a node that holds nothing; ask first when it holds shards or
        runs a rank of a job (a restart ends the job on every node)."""
        node = ctl.state.node(name)
        held = sorted({s.placement for s in node.shards}) if node else []
        running = sorted(await ft.jobs_on(ctl, [name]))
        if not held and not running:
            await self._restart(ctl, name)
            return

        def answered(yes: bool | None) -> None:
            if yes and self.controller is ctl:
                self.background(self._restart(ctl, name), f"restarting {name}")

        said = []
        if held:
            said.append(
                f"It holds shards of {', '.join(held)}; they stop with the agent (answers "
                "in progress fail) and are loaded again on the same layers when it is back."
            )
        if running:
            said.append(
                f"It runs {counted(len(running), 'job')} ({', '.join(running)}): a "
                "restart ends it on every node (resume it later from its last save)."
            )
        self.push_screen(ConfirmScreen(f"Restart {name}? {' '.join(said)}"), answered)

    async def _restart(self, ctl: Controller, name: str) -> None:
        """What `studiotui restart NAME` does (`restart_nodes`), said in the log."""
        self.report(f"restarting {name}…")
        done = await restart_nodes(ctl, [name], timeout=UP_TIMEOUT_S)
        for outcome in done.outcomes:
            self.report(str(outcome), "info" if outcome.ok else "error")
        self._report_reloads(done)

    def _report_reloads(self, done: Restarted) -> None:
        """What a restart or a provisioning did to the placements, in the log."""
        for text in done.dropped:
            self.report(text, "warning")
        for text in done.lost:
            self.report(text, "error")
        # reload_shards logged these already; a notification says them too.
        for result in done.reloads:
            self.notify(result.text, severity="information" if result.ok else "error")
        for text in done.broken:
            self.report(text, "error")

    def action_provision(self) -> None:
        ctl = self.need_controller("provisioning")
        name = self._selected_node("provisioning") if ctl is not None else None
        if ctl is not None and name is not None:
            self.background(self._provision(ctl, name), f"provisioning {name}")

    async def _provision(self, ctl: Controller, name: str) -> None:
        """Provision the node, each step in the log; the shards `down` kept for it are
        loaded again, as `studiotui provision` does (`keep_placements`)."""
        if not has_kept(ctl, [name]):
            await provision_logged(ctl, [name])
            return

        async def bounce() -> list[Outcome]:
            outcomes = await provision_logged(ctl, [name])  # logged there
            said = "the worker could not be built (see the log)"
            return [outcomes.get(name) or Outcome(name, "failed", said)]

        self._report_reloads(await keep_placements(ctl, [name], bounce, doing="provisioning"))

    def action_measure_links(self) -> None:
        ctl = self.need_controller("measuring links")
        if ctl is not None:
            self.background(ctl.measure_links(), "measuring links")

    def action_refresh(self) -> None:
        ctl = self.need_controller("refresh")
        if ctl is not None:
            self.background(ctl.refresh(), "refreshing")
            self.background(self.scan_models(), "reading models")

    # ---- placing (the flow lives in place_flow.py) ----------------------------------------

    def action_place(self) -> None:
        self.placer.place_selected()

    def action_place_group(self, group: str) -> None:
        members = self.inventory.groups.get(group, ()) if self.inventory else ()
        self.placer.place_selected(tuple(members), f"group {group}")

    def on_models_pane_dropped(self, event: ModelsPane.Dropped) -> None:
        self.placer.open(event.model, event.target.nodes, event.target.label)

    def action_unload(self) -> None:
        self.placer.unload_selected()

    def action_place_again(self) -> None:
        self.placer.place_again()

    def action_fetch_model(self) -> None:
        self.model_files.fetch_selected()

    def action_mark_node(self) -> None:
        self.query_one(NodesPane).action_toggle_mark()

    def action_clear_marks(self) -> None:
        self.query_one(NodesPane).action_clear_marks()

    def action_rescan_models(self) -> None:
        if not self.fixed:
            self.background(self.scan_models(), "reading models")

    # ---- the `/` filter ---------------------------------------------------------------

    def action_filter(self) -> None:
        """`/`: the filter box for the table that has the keys (else the one in view
        below: Placements or Models)."""
        panes: list[tuple[Filterable, Any, str]] = [
            (self.query_one(NodesPane), self.query_one(NodesPane), "nodes"),
            (self.query_one(ModelsPane), self.query_one(ModelsPane), "models"),
            (self.query_one(PlacementsPane), self.query_one(PlacementsPane), "placements"),
        ]
        focused = self.focused
        for target, widget, what in panes:
            if focused is not None and (focused is widget or widget in focused.ancestors):
                self.query_one(FilterBar).open(target, what)
                return
        models = self.query_one("#bottom-tabs", TabbedContent).active == "tab-models"
        target, _widget, what = panes[1] if models else panes[2]
        self.query_one(FilterBar).open(target, what)

    # ---- model folders, the hub, deleting (the Models pane's a, H, D: model_files.py) ----

    def action_model_folders(self) -> None:
        self.model_files.folders()

    def action_fetch_hub(self) -> None:
        self.model_files.fetch_hub()

    def action_delete_model(self) -> None:
        self.model_files.delete_selected()


def demo_damage(path: Path) -> str | None:
    """Why the first run's demo model at `path` cannot be used as it is: "" when it is
    not there, the Models pane's own reason (`read_model`'s checks: a cut safetensors
    file, a damaged config or tokenizer) when it is damaged, None when it is fine."""
    if not path.exists():
        return ""
    try:
        read_model(path)
    except ModelDirError as exc:
        return exc.message
    return None


def keep_note(agents: int) -> str:
    return (
        f"the local cluster keeps running ({agents} agent{'s' if agents != 1 else ''}): "
        "`studiotui down` stops it, `studiotui` comes back to it"
    )
