"""Placing models from the dashboard, driven by Textual's Pilot on a real local cluster.

Four real agents on 127.0.0.201-204:59300 advertise 0.3 GB each, so a node that
already runs a shard has too little left for the "big" model (mostly KV cache for
its 4096 tokens of context) while two idle nodes hold it. Every agent is stopped by
its pid when the module ends, failed or not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from textual.widgets import DataTable

from studiotui.app.app import StudioApp
from studiotui.app.dialogs import ConfirmScreen
from studiotui.app.panes.models import ModelsPane
from studiotui.app.panes.nodes import NodesPane
from studiotui.app.panes.placements import PlacementsPane
from studiotui.app.place.preview import PreviewScreen
from studiotui.cluster import local_cluster
from studiotui.cluster.controller import Controller
from studiotui.core.inventory import Inventory
from tests.support.cluster_fixture import LocalCluster, start_cluster, stop_cluster
from tests.support.pilot_helpers import run_from_palette, until
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control

BASE, PORT = 201, 59300
SIZE = (160, 48)
GROUPS = {"left": ("local-1", "local-2"), "right": ("local-3", "local-4")}


@dataclass(frozen=True)
class Setup:
    home: Path
    inventory: Inventory
    cluster: LocalCluster


# Every test here places models on a real local cluster.
pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def no_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The Models pane lists the Hugging Face cache too; this machine's must not count.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    home = tmp_path_factory.mktemp("place-home")
    models = home / "models"
    small = {"alpha": 1, "beta": 2, "gamma": 3}
    for name, seed in small.items():
        spec = DemoSpec(layers=6, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=seed)
        write_demo_model(models / name, spec)
    # 64 layers × 4 MB of KV at 4096 tokens (and little weight): 0.27 GB, which two
    # idle nodes hold and two nodes already running a shard do not.
    big = DemoSpec(
        layers=64, hidden=128, heads=4, kv_heads=4, intermediate=32, dtype="float32", seed=5
    )
    write_demo_model(models / "big", big)
    # 0.33 GB each (0.3 fell short by 1-10 MB once the agents imported more): after the
    # agent itself and the ~100 MB a shard process costs, an
    # idle node has ~0.16 GB for the big model, a node already running beta ~0.07 GB.
    cluster = start_cluster(home, 4, BASE, PORT, memory_gb=0.33)
    try:
        inventory = replace(cluster.inventory, groups=GROUPS)
        yield Setup(home, inventory, cluster)
    finally:
        stop_cluster(cluster)


# --------------------------------------------------------------------------- helpers


async def ready_app(pilot, app: StudioApp) -> None:
    await until(pilot, lambda: "4/4 nodes up" in app.sub_title, 20, "cluster up")
    models = app.query_one(ModelsPane)
    await until(pilot, lambda: len(models.rows_shown) == 4, 10, "models listed")


def placement_state(app: StudioApp, name: str) -> str | None:
    found = app.cluster.placement(name)
    return found.state if found else None


OVERLAP_TOKENS = 400


async def chat(app: StudioApp, placement: str, n: int = 24) -> tuple[list[int], float, float]:
    """Tokens from the placement, and when the first and the last arrived."""
    assert app.controller is not None
    out: list[int] = []
    first = last = 0.0
    request = {"messages": [{"role": "user", "content": "Say something."}]}
    async for msg in app.controller.generate(
        placement, request, {"max_tokens": n, "ignore_eos": True}
    ):
        if isinstance(msg, control.Delta):
            out += msg.tokens
            last = time.monotonic()
            first = first or last
    return out, first, last


async def drag(pilot, app: StudioApp, model: str, onto, offset=(8, 0)) -> None:
    """Press on the model's row, move over `onto`, release there: a real drag."""
    pane = app.query_one(ModelsPane)
    row = [r.name for r in pane.rows_shown].index(model)
    await pilot.mouse_down(pane, offset=(2, 1 + row))  # below the header line
    await pilot.hover(onto, offset=offset)
    await pilot.mouse_up(onto, offset=offset)


async def preview(pilot, app: StudioApp) -> PreviewScreen:
    await until(pilot, lambda: isinstance(app.screen, PreviewScreen), 5, "preview open")
    screen = app.screen
    assert isinstance(screen, PreviewScreen)
    await until(pilot, lambda: screen.phase not in ("measuring", "planning"), 20, "preview planned")
    return screen


async def deploy(pilot, app: StudioApp, screen: PreviewScreen, name: str) -> None:
    assert screen.phase == "plan", screen.text
    await pilot.press("enter")
    await until(pilot, lambda: placement_state(app, name) == "ready", 60, f"{name} ready")
    await until(pilot, lambda: app.screen is not screen, 5, "preview closed when ready")


async def unload_all(app: StudioApp, keep: tuple[str, ...] = ()) -> None:
    ctl = app.controller
    if ctl is None:
        return
    await ctl.refresh()
    for placement in ctl.state.placements:
        if placement.name not in keep or placement.state != "ready":
            await ctl.unload(placement.name)


def table_rows(app: StudioApp) -> dict[str, list[str]]:
    table = app.query_one("#placements-table", DataTable)
    return {
        str(table.get_row_at(i)[0]): [str(c) for c in table.get_row_at(i)]
        for i in range(table.row_count)
    }


# --------------------------------------------------------------------------- mouse


async def test_drag_onto_a_node_onto_marked_nodes_and_onto_a_group(setup: Setup) -> None:
    app = StudioApp(setup.home, setup.inventory)
    async with app.run_test(size=SIZE) as pilot:
        try:
            await ready_app(pilot, app)
            await pilot.press("4")
            nodes = app.query_one(NodesPane)
            pane = app.query_one(ModelsPane)
            card4 = nodes.cards["local-4"]

            # Onto one node: the card lights up while the pointer is over it.
            await pilot.mouse_down(pane, offset=(2, 1))  # alpha, the first row
            await pilot.hover(card4, offset=(8, 1))
            assert card4.has_class("-drop-target")
            assert not nodes.cards["local-3"].has_class("-drop-target")
            ghost = str(app.screen.query_one("DragGhost").render())
            assert "alpha" in ghost and "node local-4" in ghost
            await pilot.mouse_up(card4, offset=(8, 1))
            assert not card4.has_class("-drop-target")
            assert not app.screen.query("DragGhost")
            screen = await preview(pilot, app)
            assert screen.request.nodes == ("local-4",)
            text = screen.text
            assert "alpha" in text and "llama" in text and "6 layers" in text
            assert "local-4" in text and "0–5 (6) +embed+head" in text
            assert "✓ fits" in text and "ring: local-4 alone" in text
            await deploy(pilot, app, screen, "alpha")
            tokens, _, _ = await chat(app, "alpha")
            assert len(tokens) == 24

            # Onto the marked nodes: mark two with space, drop on either of them.
            nodes.focus()
            nodes.select("local-1")
            await pilot.press("space", "j", "space")
            assert nodes.marked_in_order() == ("local-1", "local-2")
            assert "✓" in nodes.cards["local-1"].render().plain
            placements = app.query_one(PlacementsPane)
            seen: list[tuple[str, str]] = []
            original = placements.progress

            def spy(node: str, done: int, total: int, key: str = "") -> None:
                seen.append((key, node))
                original(node, done, total, key)

            placements.progress = spy  # type: ignore[method-assign]
            await pilot.press("4")  # the Placements tab came up when alpha was ready
            beta_row = [r.name for r in pane.rows_shown].index("beta")
            await pilot.mouse_down(pane, offset=(2, 1 + beta_row))
            await pilot.hover(nodes.cards["local-2"], offset=(8, 2))
            lit = {n for n, c in nodes.cards.items() if c.has_class("-drop-target")}
            assert lit == {"local-1", "local-2"}
            assert nodes.strip.chip("marked").has_class("-drop-target")
            await pilot.mouse_up(nodes.cards["local-2"], offset=(8, 2))
            screen = await preview(pilot, app)
            assert screen.request.target == "marked nodes"
            assert screen.request.nodes == ("local-1", "local-2")
            # Never measured before: the preview measured first, so the link is known.
            assert "slowest link" in screen.text and "unknown" not in screen.text, screen.text
            await deploy(pilot, app, screen, "beta")
            assert {node for key, node in seen if key == "beta"} == {"local-1", "local-2"}
            assert set(screen.loads) == {"local-1", "local-2"}
            assert all(done == total > 0 for done, total in screen.loads.values())
            assert nodes.marked == set()  # the marks were spent on beta
            await until(pilot, lambda: set(table_rows(app)) == {"alpha", "beta"}, 5, "rows")
            rows = table_rows(app)
            assert rows["beta"][3] == "left" and rows["alpha"][3] == "1 node"
            # Which node heads the ring depends on free memory to the byte; both do.
            assert rows["beta"][7] in ("l1[0:3]→l2[3:6]", "l2[0:3]→l1[3:6]")

            # Onto a group chip: its nodes light up; the preview names what they hold.
            await pilot.press("4")
            chip = nodes.strip.chip("right")
            gamma_row = [r.name for r in pane.rows_shown].index("gamma")
            await pilot.mouse_down(pane, offset=(2, 1 + gamma_row))
            await pilot.hover(chip, offset=(1, 0))
            lit = {n for n, c in nodes.cards.items() if c.has_class("-drop-target")}
            assert lit == {"local-3", "local-4"} and chip.has_class("-drop-target")
            await pilot.mouse_up(chip, offset=(1, 0))
            screen = await preview(pilot, app)
            assert screen.request.target == "group right"
            assert "holds" in screen.text and "alpha" in screen.text
            await pilot.press("escape")  # cancelled: nothing loads
            assert not isinstance(app.screen, PreviewScreen)

            # A drop on nothing places nothing.
            await drag(pilot, app, "gamma", app.query_one("#log"))
            assert not isinstance(app.screen, PreviewScreen)
            assert placement_state(app, "gamma") is None

            # `u` unloads the selected placement, after asking; its memory is freed.
            placements.select("alpha")
            used = app.cluster.node("local-4").memory_used  # type: ignore[union-attr]
            await pilot.press("u")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await until(pilot, lambda: placement_state(app, "alpha") is None, 15, "unloaded")

            def freed() -> bool:
                node = app.cluster.node("local-4")
                return node is not None and node.memory_used < used - 20 * 1024**2

            await until(pilot, freed, 10, "local-4's memory freed")
            assert placement_state(app, "beta") == "ready"
        finally:
            # beta may serve the next test (it places it itself when run alone).
            await unload_all(app, keep=("beta",))


# --------------------------------------------------------------------------- keys


async def test_keys_two_placements_at_once_and_an_overcommit_refused(setup: Setup) -> None:
    app = StudioApp(setup.home, setup.inventory)
    async with app.run_test(size=SIZE) as pilot:
        try:
            await ready_app(pilot, app)
            assert app.controller is not None
            if app.cluster.placement("beta") is None:  # run alone: the left group's model
                await app.controller.place(setup.home / "models" / "beta", list(GROUPS["left"]))
            nodes = app.query_one(NodesPane)
            models = app.query_one(ModelsPane)

            async def pick_model(name: str) -> None:
                await pilot.press("4")
                models.focus()
                await pilot.pause()
                assert app.focused is models
                await pilot.press("ctrl+home")  # the first row; "home" scrolls sideways
                await pilot.press(*["down"] * [r.name for r in models.rows_shown].index(name))
                assert models.selected_row is not None and models.selected_row.name == name

            async def mark(*names: str) -> None:
                nodes.focus()
                await pilot.press("escape")  # clear marks
                for name in names:
                    nodes.select(name)
                    await pilot.press("space")
                assert nodes.marked_in_order() == names

            # While local-3 and local-4 are idle, the big model fits on them (palette).
            await pick_model("big")
            await run_from_palette(pilot, app, "group right", "group right")
            screen = await preview(pilot, app)
            assert screen.request.nodes == GROUPS["right"], screen.text
            assert screen.phase == "plan", screen.text
            await pilot.press("escape")

            # Keys: model, marks, p, preview, enter.
            await pick_model("gamma")
            await mark("local-3", "local-4")
            await pilot.press("p")
            screen = await preview(pilot, app)
            assert screen.request.target == "marked nodes"
            # Past the 4096 positions the demo was trained for, the preview says so.
            assert "positions" not in screen.text
            await pilot.press("plus")
            await until(pilot, lambda: screen.context_tokens == 8192, 5, "context doubled")
            await until(pilot, lambda: "positions" in screen.text, 10, "the note")
            assert "8192 tokens of context is beyond the 4096 positions gamma" in " ".join(
                screen.text.split()
            ), screen.text
            await pilot.press("minus")
            await until(pilot, lambda: "positions" not in screen.text, 10, "the note gone")
            await until(pilot, lambda: screen.phase == "plan", 10, "planned again")
            await deploy(pilot, app, screen, "gamma")

            # Two placements on disjoint groups answer at the same time.
            # Long enough that one cannot end before the other starts on a fast engine
            # (48 tokens took ~0.1 s each and sometimes ran one after the other).
            (a, a0, a1), (b, b0, b1) = await asyncio.gather(
                chat(app, "gamma", OVERLAP_TOKENS), chat(app, "beta", OVERLAP_TOKENS)
            )
            assert len(a) == len(b) == OVERLAP_TOKENS
            assert a0 < b1 and b0 < a1, "the two streams did not overlap"
            await until(
                pilot,
                lambda: table_rows(app).get("gamma", [""] * 8)[6] == str(OVERLAP_TOKENS),
                5,
                "gamma's token count in the Placements pane",
            )
            rate = table_rows(app)["gamma"][5]
            assert rate != "–" and float(rate) > 0, rate

            # local-1 and local-2 hold beta: the big model would overcommit them.
            await pick_model("big")
            await mark("local-1", "local-2")
            await pilot.press("p")
            screen = await preview(pilot, app)
            assert screen.phase == "refused", screen.text
            reason = screen.refusal or ""
            assert "needs 0.27 GB" in reason and "GB free" in reason, reason
            assert "cannot place" in screen.text and "beta" in screen.text  # what they hold
            await pilot.press("enter")  # refused: enter deploys nothing
            assert placement_state(app, "big") is None
            # A shorter context is what the planner suggests; the preview re-plans for it.
            await pilot.press("minus", "minus", "minus", "minus")
            await until(pilot, lambda: screen.phase == "plan", 10, "fits with less context")
            assert screen.context_tokens == 256
            await pilot.press("escape")

            # `u` from the keyboard, confirmed with enter.
            app.query_one(PlacementsPane).select("gamma")
            await pilot.press("u", "enter")
            await until(pilot, lambda: placement_state(app, "gamma") is None, 15, "unloaded")
        finally:
            await unload_all(app)


async def test_k_quantizes_the_kv_in_the_preview_and_the_plan_follows(setup: Setup) -> None:
    """`k` cycles full → 8-bit → 4-bit KV: the plan's KV shrinks with it, the preview
    says how it is kept and why requests decode one by one; a model whose heads no
    group size divides is refused in those words."""
    app = StudioApp(setup.home, setup.inventory)
    async with app.run_test(size=SIZE) as pilot:
        try:
            await ready_app(pilot, app)
            models = app.query_one(ModelsPane)

            async def open_preview(name: str) -> PreviewScreen:
                await pilot.press("4")
                models.focus()
                await pilot.pause()
                await pilot.press("ctrl+home")
                await pilot.press(*["down"] * [r.name for r in models.rows_shown].index(name))
                await run_from_palette(pilot, app, "group right", "group right")
                return await preview(pilot, app)

            def kv(screen: PreviewScreen) -> float:
                """KV reserved per stream (more fit once it is quantized)."""
                assert screen.plan is not None, screen.text
                return sum(s.kv_bytes for s in screen.plan.shards) / screen.plan.streams

            screen = await open_preview("big")
            assert screen.phase == "plan", screen.text
            full = kv(screen)
            assert "prompt cache" in screen.text  # the budget, counted per node
            await pilot.press("k")
            await until(pilot, lambda: screen.kv_bits == 8 and screen.phase == "plan", 10, "8-bit")
            said = " ".join(screen.text.split())
            assert "KV 8-bit" in said and "decode one at a time" in said, said
            assert screen.plan is not None and screen.plan.kv_group_size == 32  # heads of 32
            # float32 heads 32 wide: 128 bytes each, 8-bit keeps 32 + a scale and bias (8).
            assert kv(screen) < full * 0.35
            await pilot.press("k")
            await until(pilot, lambda: screen.kv_bits == 4 and screen.phase == "plan", 10, "4-bit")
            assert kv(screen) < full * 0.2
            await pilot.press("k")
            await until(pilot, lambda: screen.kv_bits == 0 and screen.phase == "plan", 10, "full")
            assert kv(screen) == full
            await pilot.press("escape")

            screen = await open_preview("alpha")  # heads 16 wide: no group of 32-128 fits
            await pilot.press("k")
            await until(pilot, lambda: screen.phase == "refused", 10, "refused")
            said = " ".join(screen.text.split())
            assert "does not divide the model's attention head width 16" in said, said
            await pilot.press("escape")
        finally:
            await unload_all(app)


async def test_a_failed_load_shows_the_controllers_message(setup: Setup) -> None:
    """The controller rolls back; the preview keeps its message on screen."""
    app = StudioApp(setup.home, setup.inventory)
    async with app.run_test(size=SIZE) as pilot:
        await ready_app(pilot, app)
        assert app.controller is not None
        from studiotui.cluster.controller import PlacementError

        async def failing_place(*args: object, **kwargs: object) -> None:
            progress = kwargs.get("progress")
            if callable(progress):
                progress("local-3", 10, 100)
            raise PlacementError("placement 'alpha' failed and was rolled back: runner died")

        app.controller.place = failing_place  # type: ignore[method-assign]
        await pilot.press("4")
        await drag(pilot, app, "alpha", app.query_one(NodesPane).cards["local-3"])
        screen = await preview(pilot, app)
        await pilot.press("enter")
        await until(pilot, lambda: screen.phase == "failed", 5, "failure shown")
        assert "rolled back: runner died" in screen.text
        assert isinstance(app.screen, PreviewScreen)  # stays open to be read
        assert any("rolled back" in n.message for n in app._notifications)
        assert not app.query_one(PlacementsPane).query_one("#place-progress").display


async def test_a_broken_placement_is_placed_again_on_its_own_nodes(setup: Setup) -> None:
    """A shard process dies; R (here from the palette) unloads the rest, previews the
    same model on the same nodes under the same name, and it answers again."""
    app = StudioApp(setup.home, setup.inventory)
    async with app.run_test(size=SIZE) as pilot:
        try:
            await ready_app(pilot, app)
            ctl = app.controller
            assert ctl is not None
            await unload_all(app)
            await ctl.place(setup.home / "models" / "alpha", ["local-3", "local-4"], "mine")
            await until(pilot, lambda: placement_state(app, "mine") == "ready", 10, "ready")
            pane = app.query_one(PlacementsPane)
            await until(pilot, lambda: "mine" in table_rows(app), 5, "mine listed")
            pane.select("mine")
            await pilot.press("R")  # a ready placement is not placed again
            await until(
                pilot,
                lambda: any("only a broken or failed" in n.message for n in app._notifications),
                5,
                "R on a ready placement explained",
            )
            assert not isinstance(app.screen, ConfirmScreen)

            # local-4's agent stops (its shard with it): the placement is broken, and
            # still knows its whole ring, also to a controller started afresh.
            node = setup.inventory.node("local-4")
            await asyncio.to_thread(local_cluster.stop_agent, node)
            await until(pilot, lambda: placement_state(app, "mine") == "broken", 15, "broken")
            broken = app.cluster.placement("mine")
            assert broken is not None and broken.missing == ("local-4",)
            assert sorted(p.node for p in broken.ring) == ["local-3", "local-4"]
            assert "✗l4[" in table_rows(app)["mine"][7], "the ring shows the missing hop"
            # The log says so once, with the node and what to do.
            await until(
                pilot,
                lambda: any(
                    "placement 'mine' is" in e.text and "local-4" in e.text and "R on" in e.text
                    for e in app.cluster.log
                ),
                5,
                "the breakage logged",
            )
            fresh = Controller(setup.home, setup.inventory)
            try:
                await fresh.refresh()
                again = fresh.state.placement("mine")
                assert again is not None and again.state == "broken"
                assert [(p.node, p.start, p.end) for p in again.ring] == [
                    (p.node, p.start, p.end) for p in broken.ring
                ]
            finally:
                await fresh.close()
            # Back up, with no shard: R proposes the placement's own two nodes, not all four.
            await asyncio.to_thread(local_cluster.start_agent, setup.home, node, setup.inventory)
            await until(pilot, lambda: "4/4 nodes up" in app.sub_title, 20, "local-4 back")
            pane.select("mine")
            await run_from_palette(pilot, app, "placement again", "Place selected placement again")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 5, "confirm shown")
            await pilot.press("enter")
            screen = await preview(pilot, app)
            assert screen.request.name == "mine"
            assert screen.request.nodes == tuple(p.node for p in broken.ring)  # in ring order
            assert screen.request.model_name == "alpha"
            await deploy(pilot, app, screen, "mine")
            tokens, _, _ = await chat(app, "mine", 8)
            assert len(tokens) == 8
        finally:
            await unload_all(app)
