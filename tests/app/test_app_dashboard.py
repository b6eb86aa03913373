"""The dashboard driven by Textual's Pilot against a real local cluster of four agents.

The agents run on their own loopback range and port (picked free at start), in a
home of their own, and are stopped by pid when the module ends, failed or not.
Snapshot tests use a fixed ClusterState instead and do no I/O at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from textual.widgets import Static

from studiotui.app import launch
from studiotui.app.app import StudioApp
from studiotui.app.dialogs import ConfirmScreen, HelpScreen, NodeLogScreen, QuitScreen
from studiotui.app.launch import free_local_base
from studiotui.app.panes.log import LogPane
from studiotui.app.panes.models import ModelsPane
from studiotui.app.panes.nodes import NodesPane
from studiotui.app.panes.placements import PlacementsPane
from studiotui.app.panes.rdma import RdmaPane
from studiotui.app.render import Drawing
from studiotui.app.themes import load_ui
from studiotui.chat.commands import help_text
from studiotui.cli.main import build_parser
from studiotui.cli.serve import api_service
from studiotui.cluster import local_cluster
from studiotui.cluster.controller import DOWN_AFTER_S, Controller
from studiotui.cluster.session import wait_until_up
from studiotui.core.inventory import Inventory, NodeSpec, load_inventory, local_inventory
from tests.integration.test_engine import CHUNK, collect, prompt_tokens, reference_tokens
from tests.support.app_fixtures import fixed_models, fixed_state
from tests.support.cluster_fixture import runner_pids
from tests.support.pilot_helpers import run_from_palette
from worker import telemetry
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.telemetry import choose_power_source, choose_pressure_source

PORT = 57300  # far from the default 28500 and from other test modules
FIRST_BASE = 171
SIZE = (160, 48)


# --------------------------------------------------------------------------- helpers


def _start(home: Path, n: int, port: int, first: int) -> Inventory:
    base = free_local_base(n, control_port=port, first=first)
    inv = local_inventory(n, base_octet=base, control_port=port, home=home, memory_gb=16.0)
    try:
        for node in inv.nodes:
            local_cluster.start_agent(home, node, inv)
        missing = asyncio.run(_wait_up(home, inv))
        assert not missing, f"agents did not come up: {missing}"
    except BaseException:
        _stop(inv)
        raise
    return inv


async def _wait_up(home: Path, inv: Inventory) -> list[str]:
    ctl = Controller(home, inv)
    try:
        return await wait_until_up(ctl, list(inv.names), timeout=30.0)
    finally:
        await ctl.close()


def _stop(inv: Inventory) -> None:
    for node in inv.nodes:
        with contextlib.suppress(Exception):
            local_cluster.stop_agent(node)


async def until(pilot, predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Wait for the UI to show something, at most `timeout` seconds; return how long."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await pilot.pause(0.1)
    return time.monotonic() - start


def card_text(app: StudioApp, name: str) -> str:
    card = app.query_one(NodesPane).cards[name]
    return card.render().plain


def notes(app: StudioApp) -> list[str]:
    return [n.message for n in app._notifications]


def log_text(app: StudioApp) -> str:
    """The pane shows state on a coalescing timer, so wait for entries with `until`."""
    return app.query_one(LogPane).text


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Inventory]]:
    home = tmp_path_factory.mktemp("dashboard-home")
    inv = _start(home, 4, PORT, FIRST_BASE)
    try:
        yield home, inv
    finally:
        _stop(inv)


# --------------------------------------------------------------------------- live cluster


async def test_panes_show_the_real_agents(cluster: tuple[Path, Inventory]) -> None:
    home, inv = cluster
    app = StudioApp(home, inv)
    async with app.run_test(size=SIZE) as pilot:
        names = list(inv.names)

        def all_up() -> bool:
            return all(" up " in card_text(app, n) for n in names)

        await until(pilot, all_up, 10, "every node card says up")
        for node in inv.nodes:
            text = card_text(app, node.name)
            assert node.name in text
            assert "16.0 GB" in text  # the memory each agent advertises
            assert f"{node.address}:{node.control_port}" in text
        # Telemetry keeps arriving: the sparkline history grows.
        await until(
            pilot,
            lambda: len(app.cluster.nodes[0].memory_history) >= 2,
            5,
            "telemetry samples",
        )
        assert "4/4 nodes up" in app.sub_title

        # Idle with 4 nodes sending telemetry at 1 Hz the dashboard stays cheap: only
        # the changed cards redraw. (Headless, so this is the app's own work.)
        wall, cpu = time.monotonic(), time.process_time()
        await pilot.pause(2.0)
        share = (time.process_time() - cpu) / (time.monotonic() - wall)
        assert share < 0.10, f"idle dashboard used {share:.0%} of a core"

        drawing = str(app.query_one("#topology-drawing").content)
        for name in names:
            assert name in drawing
        assert "loopback · not measured" in drawing
        rdma = str(app.query_one("#rdma-body").content)
        assert "not a Mac" in rdma and "RDMA over Thunderbolt" in rdma
        await until(
            pilot,
            lambda: "cluster local: 4/4 nodes up" in log_text(app),
            3,
            "startup summary in the log",
        )
        assert isinstance(app.query_one(RdmaPane), RdmaPane)


async def test_keys_and_palette_do_what_they_say(cluster: tuple[Path, Inventory]) -> None:
    home, inv = cluster
    app = StudioApp(home, inv)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "4/4 nodes up" in app.sub_title, 10, "cluster up")

        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        help_text = str(app.screen.query_one("#help-body").content)
        for description in ("Quit", "Restart node", "Measure links", "Provision", "Logs", "Sort"):
            assert description in help_text
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)

        pane = app.query_one(NodesPane)
        assert pane.selected == "local-1"
        await pilot.press("j")
        assert pane.selected == "local-2"
        await pilot.press("l")
        assert isinstance(app.screen, NodeLogScreen)
        screen = app.screen
        await until(pilot, lambda: bool(screen.lines), 5, "the agent's log lines")
        assert any("local-2" in line for line in screen.lines)
        await pilot.press("escape")

        await pilot.press("s")
        assert pane.sort_by == "memory"
        assert load_ui(home)["sort"] == "memory"
        await pilot.press("s", "s", "s")
        assert pane.sort_by == "name"
        assert pane.order == sorted(inv.names)

        await pilot.press("m")
        n_links = len(inv.names) * (len(inv.names) - 1) // 2
        await until(pilot, lambda: len(app.controller.state.links) == n_links, 45, "links measured")
        await until(pilot, lambda: "measured" in log_text(app), 3, "log entry for links")
        # Every pair streamed over CURVE PUSH/PULL (bandwidth comes only from what the
        # receiving agent timed) and is called loopback from both ends' interfaces.
        for link in app.controller.state.links:
            assert link.kind == "loopback" and link.gbps and link.gbps > 0, link
            assert link.latency_us and link.latency_us > 0, link

        def legend() -> str:
            return str(app.query_one("#topology-drawing").content)

        await until(pilot, lambda: "not measured" not in legend(), 3, "measured links drawn")
        assert legend().count(" µs · ") >= n_links, legend()
        assert legend().count("loopback · ") >= n_links and " Gb/s" in legend(), legend()
        # Provisioning a local node starts its agent if needed and says how it went.
        app.action_provision()
        await until(pilot, lambda: "local agent" in log_text(app), 20, "provision outcome")

        await pilot.press("2")
        assert app.query_one("#top-tabs").active == "tab-rdma"
        await pilot.press("4")
        assert app.query_one("#bottom-tabs").active == "tab-models"

        # The palette runs the same actions…
        app.clear_notifications()
        first = app.controller.state.links[0].measured_at
        await run_from_palette(pilot, app, "measure", "measure links")
        await until(
            pilot,
            lambda: (
                app.controller.state.links and app.controller.state.links[0].measured_at > first
            ),
            45,
            "links measured again from the palette",
        )
        # …and switches themes, remembered in ui.json.
        await run_from_palette(pilot, app, "studio-l", "studio-light")
        await until(pilot, lambda: app.theme == "studio-light", 3, "theme switched")
        assert load_ui(home)["theme"] == "studio-light"

        # A failing command is a notification and a log entry, never a traceback.
        async def broken_read_log(name: str, lines: int = 200) -> list[str]:
            raise RuntimeError("agent said no")

        assert app.controller is not None
        app.controller.read_log = broken_read_log  # type: ignore[method-assign]
        await pilot.press("l")
        await until(pilot, lambda: any("agent said no" in n for n in notes(app)), 3, "notification")
        await until(pilot, lambda: "agent said no" in log_text(app), 3, "error in the log")
        body = str(app.screen.query_one("#logs-body").content)
        assert "cannot read the log of local-2: agent said no" in body
        await pilot.press("escape")
        # Quitting says the local cluster stays, and how to stop it; k keeps it.
        await pilot.press("q")
        await until(pilot, lambda: isinstance(app.screen, QuitScreen), 3, "the quit question")
        question = str(app.screen.query_one("#quit-body", Static).render())
        assert "keeps running" in question and "4 agents" in question
        assert "studiotui down" in question
        await pilot.press("k")
    assert app.return_code == 0
    assert "keeps running" in app.exit_note and "studiotui down" in app.exit_note
    assert all(local_cluster.running_pid(n) for n in inv.nodes)

    again = StudioApp(home, state=fixed_state())
    async with again.run_test(size=SIZE) as pilot:
        assert again.theme == "studio-light"
        await pilot.press("t")  # the key cycles the studio themes and remembers too
        assert again.theme != "studio-light"
    assert load_ui(home)["theme"] == again.theme
    (home / "ui.json").unlink()


async def test_restart_key_reloads_the_shard_and_the_answer_is_the_same(
    cluster: tuple[Path, Inventory], tmp_path: Path
) -> None:
    """`r` on a node holding a pipeline stage does what `studiotui restart` does: a new
    agent, a new runner for its shard on the same layers, the placement ready again
    with the same greedy tokens (mlx-lm's own), the other stage's runner untouched."""
    home, inv = cluster
    spec = DemoSpec(layers=4, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=11)
    model = write_demo_model(tmp_path / "restart-model", spec)
    tokens = prompt_tokens(model)
    expected = reference_tokens(model, tokens, 12)
    app = StudioApp(home, inv)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "4/4 nodes up" in app.sub_title, 10, "cluster up")
        ctl = app.controller
        assert ctl is not None
        await ctl.place(model, ["local-3", "local-4"], "rs", prefill_chunk=CHUNK)
        try:
            placement = app.controller.state.placement("rs")
            assert placement is not None and placement.state == "ready"
            layers = placement.layers
            head = placement.shards[0].node  # the head: the controller's way in, too
            other = placement.shards[1].node
            before = await runner_pids(ctl, "rs")
            assert (await collect(ctl, "rs", tokens, 12))[0] == expected
            agent_before = local_cluster.running_pid(inv.node(head))

            app.query_one(NodesPane).select(head)
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 5, "asked")
            question = app.screen.question
            assert "rs" in question and "loaded again" in question, question
            await pilot.press("y")
            # The outcome is said once the whole sequence is done, reload and check too.
            await until(
                pilot,
                lambda: f"{head}: restarted: agent" in log_text(app),
                90,
                "the restart done",
            )
            assert f"'rs': reloaded its shards on {head}" in log_text(app)
            assert "after the restart" not in log_text(app)  # nothing named not whole
            await until(pilot, lambda: placement_state(app, "rs") == "ready", 10, "rs ready")
            again = app.cluster.placement("rs")
            assert again is not None and again.layers == layers
            assert (await collect(ctl, "rs", tokens, 12))[0] == expected
            after = await runner_pids(ctl, "rs")
            assert after[head] != before[head] and after[other] == before[other]
            agent_after = local_cluster.running_pid(inv.node(head))
            assert agent_after is not None and agent_after != agent_before
            await until(pilot, lambda: " up " in card_text(app, head), 5, f"{head} up")
        finally:
            await ctl.unload("rs")


async def test_restart_key_relaunches_a_killed_shard_runner_and_the_answer_is_the_same(
    cluster: tuple[Path, Inventory], tmp_path: Path
) -> None:
    """A shard's runner killed: the placement fails; `r` on its node relaunches that
    runner on the same layers and the placement answers mlx-lm's greedy tokens again."""
    home, inv = cluster
    spec = DemoSpec(layers=4, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=12)
    model = write_demo_model(tmp_path / "runner-model", spec)
    tokens = prompt_tokens(model)
    expected = reference_tokens(model, tokens, 12)
    app = StudioApp(home, inv)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "4/4 nodes up" in app.sub_title, 10, "cluster up")
        ctl = app.controller
        assert ctl is not None
        await ctl.place(model, ["local-1", "local-2"], "rk", prefill_chunk=CHUNK)
        try:
            placement = app.controller.state.placement("rk")
            assert placement is not None and placement.state == "ready"
            layers = placement.layers
            tail = placement.shards[1].node
            before = await runner_pids(ctl, "rk")
            os.kill(before[tail], signal.SIGKILL)
            await until(pilot, lambda: placement_state(app, "rk") == "failed", 20, "rk failed")
            app.query_one(NodesPane).select(tail)
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 5, "asked")
            await pilot.press("y")
            await until(
                pilot,
                lambda: f"'rk': reloaded its shards on {tail}" in log_text(app),
                90,
                "the runner relaunched",
            )
            await until(pilot, lambda: placement_state(app, "rk") == "ready", 10, "rk ready")
            again = app.cluster.placement("rk")
            assert again is not None and again.layers == layers
            assert (await collect(ctl, "rk", tokens, 12))[0] == expected
            after = await runner_pids(ctl, "rk")
            assert after[tail] != before[tail]
        finally:
            await ctl.unload("rk")


async def test_restart_key_on_an_idle_node_asks_nothing(cluster: tuple[Path, Inventory]) -> None:
    home, inv = cluster
    node = inv.node("local-1")
    before = local_cluster.running_pid(node)
    app = StudioApp(home, inv)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "4/4 nodes up" in app.sub_title, 10, "cluster up")
        app.query_one(NodesPane).select("local-1")
        await pilot.press("r")
        assert not isinstance(app.screen, ConfirmScreen)
        await until(pilot, lambda: "local-1: restarted" in log_text(app), 30, "restart done")
        after = local_cluster.running_pid(node)
        assert after is not None and after != before
        assert f"(pid {after})" in log_text(app)
        await until(pilot, lambda: " up " in card_text(app, "local-1"), 5, "local-1 up")


def placement_state(app: StudioApp, name: str) -> str | None:
    found = app.cluster.placement(name)
    return found.state if found else None


async def test_killed_agent_is_shown_down(cluster: tuple[Path, Inventory]) -> None:
    home, inv = cluster
    node = inv.node("local-4")
    app = StudioApp(home, inv)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: "4/4 nodes up" in app.sub_title, 10, "cluster up")
            # Let telemetry flow so the node is "up" by telemetry, not only by hello.
            await until(pilot, lambda: app.cluster.nodes[3].memory_history != (), 5, "samples")
            pid = local_cluster.running_pid(node)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            # The controller calls a node down after DOWN_AFTER_S without telemetry; the
            # last sample may be up to a second old and liveness is checked every 0.5 s.
            took = await until(
                pilot,
                lambda: " down " in card_text(app, "local-4"),
                DOWN_AFTER_S + 2.0,
                "local-4 shown down",
            )
            assert took <= DOWN_AFTER_S + 2.0
            assert "no telemetry" in card_text(app, "local-4")
            await until(
                pilot, lambda: "local-4 is down" in log_text(app), 3, "node-down entry in the log"
            )
            assert "restart local-4" in log_text(app), "the entry should say what to do"
            assert "3/4 nodes up" in app.sub_title
            down_box = str(app.query_one("#topology-drawing").content)
            assert "down" in down_box
    finally:
        local_cluster.start_agent(home, node, inv)


@pytest.mark.integration  # it starts the first run's agents, without a cluster fixture
@pytest.mark.parametrize("platform", ["linux", "darwin"])
async def test_first_run_places_the_demo_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, platform: str
) -> None:
    """What `studiotui` does with no inventory: `launch.build_app` is the code the
    command runs before `app.run()`. On two nodes to keep it quick. "darwin" runs
    the macOS layout (127.0.0.1, a block of ports per node) live on this machine."""
    # The Models pane lists the Hugging Face cache too; this machine's must not count.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))
    monkeypatch.chdir(tmp_path)  # no ./cluster.toml
    monkeypatch.setattr(launch, "LOCAL_NODES", 2)
    home = tmp_path / "home"
    damaged = platform == "darwin"
    if damaged:
        # A demo model from an earlier run, cut short (a full disk, a killed copy): the
        # first run writes it again and says so, rather than failing to start shards.
        demo = write_demo_model(home / "models" / "demo", DemoSpec(recite=True))
        weights = demo / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    args = build_parser().parse_args([])
    app = launch.build_app(args, home, platform=platform)
    inv = app.inventory
    assert inv is not None and inv.names == ("local-1", "local-2")
    try:
        # The first run wrote its inventory where the next `studiotui` finds it.
        assert load_inventory(local_cluster.local_inventory_path(home)).nodes == inv.nodes
        if platform == "darwin":
            assert {n.address for n in inv.nodes} == {"127.0.0.1"}
            assert inv.nodes[1].control_port == inv.nodes[0].control_port + 100
        else:
            assert len({n.address for n in inv.nodes}) == 2
        seen_progress: list[str] = []
        async with app.run_test(size=SIZE) as pilot:
            pane = app.query_one(PlacementsPane)
            original = pane.progress

            def spy(node: str, done: int, total: int) -> None:
                seen_progress.append(node)
                original(node, done, total)

            pane.progress = spy  # type: ignore[method-assign]
            headers: list[list[str]] = []
            start = pane.start_progress

            def record(title: str, nodes: list[str], key: str = "") -> None:
                headers.append(list(nodes))
                start(title, nodes, key)

            pane.start_progress = record  # type: ignore[method-assign]
            # Every state the placement passes through, as the controller publishes it.
            states: list[str] = []
            assert app.controller is not None
            app.controller.subscribe(
                lambda st: states.extend(p.state for p in st.placements if p.name == "demo")
            )
            # The dashboard is there at once, before any agent answers.
            assert set(app.query_one(NodesPane).cards) == set(inv.names)
            await until(
                pilot,
                lambda: any(p.state == "ready" for p in app.cluster.placements),
                90,
                "demo placed and ready",
            )
            await pilot.pause(0.3)
            assert "no cluster.toml found: starting a simulated cluster of 2 nodes" in log_text(app)
            said = " ".join(log_text(app).split())
            assert ("the demo model is damaged (cannot read" in said) == damaged, said
            assert ("cut short" in said and "writing it again" in said) == damaged, said
            assert "starting failed" not in said, said
            # Loading is loading until a shard fails: never "broken" on the way to ready.
            assert "broken" not in states and states[-1] == "ready", states
            assert {"prepared", "loading"} & set(states), states
            table = pane.query_one("#placements-table")
            assert table.display and table.row_count == 1
            # The table's ring is short (l1[0:4]→l2[4:8]); the line under it is whole.
            ring = pane.query_one("#placement-ring", Drawing).content.plain
            assert all(name in ring for name in inv.names), ring
            assert str(table.get_row_at(0)[7]).count("[") == len(inv.names)
            assert set(seen_progress) == set(inv.names)
            # The progress lists the nodes in ring order, as the ring and the log do.
            demo_ring = [p.node for p in app.cluster.placements[0].ring]
            assert headers == [demo_ring], (headers, demo_ring)
            models = app.query_one(ModelsPane).rows_shown
            assert [(m.name, m.family, m.layers) for m in models] == [("demo", "llama", 8)]
            # Written with --recite: it answers with its passage (tests/integration/test_engine.py).
            config = json.loads((home / "models" / "demo" / "config.json").read_text())
            assert config["studiotui_demo"].get("recite") is True, config["studiotui_demo"]
            await until(
                pilot,
                lambda: "placement 'demo' is ready" in log_text(app),
                3,
                "ready entry in the log",
            )
            # Power and memory pressure, live from the real agents: what this machine
            # offers (RAPL, PSI) or the reason it gives none, never an invented figure.
            await until(
                pilot,
                lambda: all(n.power and n.pressure for n in app.cluster.nodes),
                15,
                "power and pressure reported",
            )
            facts = telemetry.gather_power_facts()
            power, pressure = choose_power_source(facts), choose_pressure_source(facts)
            for node in app.cluster.nodes:
                card = app.query_one(NodesPane).cards[node.name].render().plain
                assert "  pwr  " in card
                assert node.power["source"] == (power.kind or None)
                if not power.kind:
                    assert node.power_w is None and node.power["reason"] == power.reason
                    assert "n/a" in card
                    assert " W " not in app.query_one(NodesPane).border_subtitle
                if pressure.kind == "psi":
                    assert node.pressure["source"] == "psi" and 0 <= node.pressure_pct <= 100
                    assert "stall " in card and node.pressure_history
                    assert "stall ≤ " in app.query_one(NodesPane).border_subtitle
                else:
                    assert node.pressure["reason"] == pressure.reason
            # The second start finds the cluster it made, running: nothing to start.
            again = launch.build_app(args, home, platform=platform)
            assert again.inventory is not None and again.inventory.nodes == inv.nodes
            assert again.startup is not None
            assert again.startup.start_agents == [] and again.startup.demo_model is None
            # Quit, stopping the cluster: its agents are gone and so is the placement.
            await pilot.press("q")
            await until(pilot, lambda: isinstance(app.screen, QuitScreen), 3, "quit question")
            await pilot.press("s")
            await until(pilot, lambda: not app.is_running, 20, "stopped and quit")
        assert "stopped the local cluster (2 agents)" in app.exit_note
        assert not any(local_cluster.running_pid(n) for n in inv.nodes)
        after = Controller(home, inv)  # a dashboard started now lists no placement
        try:
            assert after.state.placements == ()
        finally:
            await after.close()
    finally:
        _stop(inv)


async def test_a_failing_action_is_reported_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(self: StudioApp) -> list[tuple[str, str]]:
        raise RuntimeError("boom")

    monkeypatch.setattr(StudioApp, "key_rows", boom)
    app = StudioApp(tmp_path, state=fixed_state())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await pilot.press("l")  # a fixed view has no cluster to read logs from
        await pilot.pause()
        assert "help failed: RuntimeError: boom" in notes(app)
        assert any("no cluster is connected" in n for n in notes(app))
        assert "help failed" in log_text(app)
        assert app.is_running


def test_free_local_base_steps_over_a_busy_range() -> None:
    first = FIRST_BASE + 40
    with socket.socket() as busy:
        busy.bind((f"127.0.0.{first + 1}", PORT + 90))
        assert free_local_base(4, control_port=PORT + 90, first=first) == first + 10


# --------------------------------------------------------------------------- snapshots


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The log shows local times; pin the zone so the snapshots match everywhere.
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("size", [(160, 48), (100, 30)], ids=["160x48", "100x30"])
def test_dashboard_snapshot(snap_compare, tmp_path: Path, utc: None, size: tuple[int, int]):
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    assert snap_compare(app, terminal_size=size)


def test_dashboard_snapshot_light_rdma(snap_compare, tmp_path: Path, utc: None) -> None:
    (tmp_path / "ui.json").write_text(json.dumps({"theme": "studio-light"}))
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    # "4" gives the Models table the keys, so the node moves first.
    assert snap_compare(app, terminal_size=(160, 48), press=["2", "j", "4"])


async def test_the_dashboard_can_serve_the_api_too(cluster: tuple[Path, Inventory]) -> None:
    import httpx

    home, inv = cluster
    keys = home / "keys.txt"
    keys.write_text("alice sk-alice\n")
    services = [api_service("127.0.0.1", 0, "k3y"), api_service("127.0.0.1", 0, None, keys)]
    app = StudioApp(home, inv, services=services)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: len(app.services) == 2, 15, "API servers started")
        server, keyed = app.services
        await until(
            pilot,
            lambda: "serving the HTTP API (OpenAI, Anthropic, Ollama)" in log_text(app),
            3,
            "serving entry in the log",
        )
        async with httpx.AsyncClient() as client:
            refused = await client.get(f"{server.url}/models")
            allowed = await client.get(
                f"{server.url}/models", headers={"Authorization": "Bearer k3y"}
            )
            # --api-key-file: the file's keys, read again when it changes.
            alice = {"Authorization": "Bearer sk-alice"}
            named = await client.get(f"{keyed.url}/models", headers=alice)
            keys.write_text("bob sk-bob\n")
            revoked = await client.get(f"{keyed.url}/models", headers=alice)
        assert refused.status_code == 401
        assert allowed.status_code == 200 and allowed.json()["object"] == "list"
        assert named.status_code == 200 and revoked.status_code == 401


# --------------------------------------------------------------------------- fixed view


async def test_the_log_follows_its_end_unless_scrolled_up(tmp_path: Path) -> None:
    """Entries written while the chat covers the dashboard still show on return; once
    the operator scrolls up the pane stays put and its border says so, until End."""
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    async with app.run_test(size=SIZE) as pilot:
        log = app.query_one(LogPane)
        for i in range(30):
            app.report(f"entry {i}")
        # Scrolling to the end waits for a refresh: on a loaded machine, more than one pause.
        await until(
            pilot,
            lambda: log.max_scroll_y > 0 and log.is_vertical_scroll_end,
            5,
            "the log at its end",
        )
        await pilot.press("c")
        for i in range(30, 34):
            app.report(f"entry {i}: " + "a long entry that wraps over lines " * (i % 4))
            await pilot.pause()
        await pilot.press("escape")
        for i in range(40, 44):
            app.report(f"entry {i}: " + "a long entry that wraps over lines " * (i % 4))
            await pilot.press("tab")
        await until(pilot, lambda: log.is_vertical_scroll_end, 5, "the log at its end again")
        assert not log.border_subtitle

        log.focus()
        await pilot.press("home")
        app.report("written while scrolled up")
        app.report("and another")
        await pilot.pause()
        assert log.scroll_y == 0
        assert "2 new below" in str(log.border_subtitle)
        await pilot.press("end")
        await until(
            pilot,
            lambda: log.is_vertical_scroll_end and log.border_subtitle == "",
            5,
            "the log at its end after End",
        )
        app.report("followed again")
        await until(pilot, lambda: log.is_vertical_scroll_end, 5, "the log following again")


async def test_unfocused_borders_show_in_the_light_theme(tmp_path: Path) -> None:
    (tmp_path / "ui.json").write_text(json.dumps({"theme": "studio-light"}))
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.theme == "studio-light" and app.query_one(NodesPane).has_focus
        background = app.screen.styles.background
        for selector in ("#log", "#top-tabs", "#bottom-tabs"):
            pane = app.query_one(selector)
            assert not pane.has_focus_within
            _kind, colour = pane.styles.border.top
            # Far enough from the background to be seen (white on white was ~0.01).
            gap = abs(colour.brightness - background.brightness)
            assert gap > 0.15, (selector, colour.hex, background.hex)


async def test_one_meaning_per_key_and_the_chat_keeps_its_own(tmp_path: Path) -> None:
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        keys = [key for key, _ in app.screen.rows]
        assert len(keys) == len(set(keys)), keys
        rows = dict(app.screen.rows)
        assert "close a dialog" in rows["escape"] and "clear the marks" in rows["escape"]
        assert "from any pane" in rows["space"] and rows["5"] == "Nodes"
        assert not any("ctrl+r" in key for key in keys), "ctrl+r is the chat's Regenerate"
        body = str(app.screen.query_one("#help-body").content)
        assert "Memory in use is what each node reports" in body and "memory now" in body
        await pilot.press("escape")

        # The palette lists each thing once: Textual's own Theme/Quit/Keys are ours.
        system = [c.title for c in app.get_system_commands(app.screen)]
        assert not {"Theme", "Quit", "Keys"} & set(system), system

        # space marks the selected node from another pane; 5 goes back to Nodes.
        nodes = app.query_one(NodesPane)
        await pilot.press("4")
        assert app.focused is not None and app.focused.id == "models"
        await pilot.press("space")
        assert nodes.marked == {nodes.selected}
        await pilot.press("5")
        assert nodes.has_focus

        def footer_actions() -> set[str]:
            return {
                b.binding.action
                for b in app.screen.active_bindings.values()
                if b.enabled and b.binding.show
            }

        assert "place" in footer_actions()
        # The chat: the Ask box has the keys whenever it opens, the footer its keys.
        await pilot.press("c")
        await pilot.pause()
        assert app.focused is not None and app.focused.id == "chat-prompt"
        shown = footer_actions()
        assert "regenerate" in shown and not {"place", "refresh", "unload", "help"} & shown
        app.screen.query_one("#chat-transcript").focus()
        await pilot.press("escape")  # from the conversation: back to the dashboard
        assert app.screen.id != "chat-screen"
        await pilot.press("c")
        await pilot.pause()
        assert app.focused is not None and app.focused.id == "chat-prompt"
        await pilot.press("h", "i")
        assert app.focused.value == "hi"  # type: ignore[attr-defined]


async def test_ssh_nodes_with_no_agent_at_start_are_told_how_to_get_one(tmp_path: Path) -> None:
    """A new cluster.toml's Macs answer nothing until provisioned: the first thing the
    dashboard says names the key (and the command) that installs their agents."""
    mac = NodeSpec(name="studio-1", host="127.0.0.251", address="127.0.0.251", control_port=PORT)
    app = StudioApp(tmp_path / "home", Inventory(name="desk", nodes=(mac,)))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "not answering" in log_text(app), 20, "the summary")
        text = " ".join(log_text(app).split())
        assert "cluster desk: 0/1 nodes up; not answering: studio-1" in text, text
        assert "P on a node provisions it" in text and "studiotui provision" in text, text


async def test_help_scrolls_to_its_last_line_on_a_small_terminal(tmp_path: Path) -> None:
    # At 80x24 the key list is longer than the dialog: its scroll must be the part that
    # shrinks (it was cut by the dialog instead, hiding the last keys and the memory note).
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        dialog = app.screen.query_one("#help-dialog")
        scroll = app.screen.query_one("#help-dialog VerticalScroll")
        assert scroll.region.bottom <= dialog.content_region.bottom, (scroll.region, dialog)
        assert scroll.max_scroll_y > 0
        await pilot.press("end")
        await pilot.pause()
        assert scroll.scroll_y == scroll.max_scroll_y


def _footer_keys(app: StudioApp) -> dict[str, bool]:
    """Each key of the footer's, and whether all of it is on screen."""
    from textual.widgets._footer import FooterKey

    width = app.size.width
    return {
        key.description: key.region.width > 0 and key.region.right <= width
        for key in app.screen.query(FooterKey)
    }


async def test_at_80_by_24_the_footer_keeps_the_first_keys_whole(tmp_path: Path) -> None:
    """At 80 columns the footer ended at "m Measu": Place, Unload and Chat were past the
    edge. The footer shows the newcomer's keys; the rest are under `?` and the palette.
    The chat screen's footer too (it ended at "^o Co")."""
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())

    async def footer(needed: str) -> dict[str, bool]:
        # Drawn once the screen's footer lists its keys (slow on a loaded machine).
        for _ in range(100):
            await pilot.pause(0.1)
            if needed in (shown := _footer_keys(app)):
                await pilot.pause(0.2)
                return _footer_keys(app)
        return shown

    async with app.run_test(size=(80, 24)) as pilot:
        shown = await footer("Place")
        for needed in ("Place", "Unload", "Chat", "Help", "Quit"):
            assert shown.get(needed), shown
        assert all(shown.values()), shown  # nothing cut at the edge
        # The Nodes pane's first hint too (it ended "drag a model he").
        chip = app.query_one("#chip-marked")
        hint = str(chip.render())
        strip = app.query_one("#groups-strip")
        assert "drag a model here" in hint, hint
        assert chip.region.right <= strip.region.right, (hint, chip.region, strip.region)
        # What the footer leaves out is still a key `?` lists, and in the palette.
        listed = {meaning for _, meaning in app.key_rows()}
        palette = " ".join(title for title, _, _ in app.palette_actions())
        for hidden in ("Restart", "links", "Provision", "logs", "Refresh", "theme"):
            assert any(hidden.lower() in m.lower() for m in listed), (hidden, listed)
            assert hidden.lower() in palette.lower(), hidden
        await pilot.press("c")
        chat = await footer("Regenerate")
        for needed in ("Stop / back", "Regenerate", "Conversations", "New", "Attach"):
            assert chat.get(needed), chat
        assert all(chat.values()), chat
        # The keys it leaves out are named by /help.
        assert "ctrl+y" in help_text() and "ctrl+b" in help_text()


def test_dashboard_snapshot_80x24(snap_compare, tmp_path: Path, utc: None) -> None:
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    assert snap_compare(app, terminal_size=(80, 24))
