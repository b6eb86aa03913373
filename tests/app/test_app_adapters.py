"""Adapters in the dashboard, driven by Textual's Pilot on a real local cluster: the
Models pane lists them under their base model, `p` on one previews (refusing another
model's adapter with both digests) and places the base with it, and the Placements
pane and the chat's picker name it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from textual.widgets import DataTable

from studiotui.app.app import StudioApp
from studiotui.app.panes.models import ModelsPane
from studiotui.app.place.preview import PreviewScreen
from studiotui.app.screens.chat import ChatScreen
from studiotui.core.inventory import Inventory
from studiotui.core.placement import format_bytes
from tests.support.adapter_model import write_adapter
from tests.support.cluster_fixture import start_cluster, stop_cluster
from tests.support.pilot_helpers import until
from worker.shared.adapters import base_digest, read_adapter
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.manifest import CACHE_NAME

pytestmark = pytest.mark.integration
SIZE = (160, 48)


@dataclass(frozen=True)
class Setup:
    home: Path
    inventory: Inventory


@pytest.fixture(autouse=True)
def no_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    home = tmp_path_factory.mktemp("adapter-app-home")
    spec = DemoSpec(layers=4, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=7)
    base = write_demo_model(home / "models" / "tiny", spec)
    write_adapter(base, home / "adapters" / "style", num_layers=3)
    # Stamped for "tiny", but for weights tiny no longer has (retrained, replaced...).
    stale = write_adapter(base, home / "adapters" / "stale", num_layers=3)
    config = json.loads((stale / "adapter_config.json").read_text())
    config["studiotui_base"]["digest"] = "0" * 64
    (stale / "adapter_config.json").write_text(json.dumps(config))
    cluster = start_cluster(home, 2, 231, 59350)
    try:
        yield Setup(home, cluster.inventory)
    finally:
        stop_cluster(cluster)


async def open_preview(pilot, app: StudioApp, row_name: str) -> PreviewScreen:  # type: ignore[no-untyped-def]
    await pilot.press("4")
    pane = app.query_one(ModelsPane)
    pane.move_cursor(row=[r.name for r in pane.rows_shown].index(row_name), animate=False)
    await pilot.press("p")
    await until(pilot, lambda: isinstance(app.screen, PreviewScreen), 5, "preview open")
    screen = app.screen
    assert isinstance(screen, PreviewScreen)
    await until(pilot, lambda: screen.phase not in ("measuring", "planning"), 20, "planned")
    return screen


async def test_an_adapter_row_previews_places_and_is_named_everywhere(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The base as never checked before: its first preview hashes it (shown in bytes).
    (setup.home / "models" / "tiny" / CACHE_NAME).unlink(missing_ok=True)
    shown: list[tuple[int, int]] = []
    real = PreviewScreen._show_hashing

    def show(screen: PreviewScreen, done: int, total: int) -> None:
        shown.append((done, total))
        real(screen, done, total)
        assert "hashing tiny to check the adapter was trained on it" in screen.text
        assert "operator" in screen.text  # the gauge, as the nodes' loads are shown

    monkeypatch.setattr(PreviewScreen, "_show_hashing", show)
    app = StudioApp(setup.home, setup.inventory)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "2/2 nodes up" in app.sub_title, 20, "cluster up")
        pane = app.query_one(ModelsPane)
        await until(pilot, lambda: len(pane.rows_shown) == 3, 10, "models listed")
        assert [r.name for r in pane.rows_shown] == ["tiny", "tiny+stale", "tiny+style"]
        cells = [str(c) for c in pane.get_row(str(setup.home / "adapters" / "style"))]
        assert cells[:2] == ["tiny+style", "lora r4"] and cells[4] == "layers 1–3", cells
        assert cells[6].startswith("adapter · "), cells

        # Stamped for tiny but not for these weights: refused before any plan or copy.
        screen = await open_preview(pilot, app, "tiny+stale")
        assert screen.phase == "refused", screen.text
        said = " ".join(screen.text.split())
        assert "trained on tiny (digest 000000000000)" in said, said
        assert f"(digest {base_digest(setup.home / 'models' / 'tiny')[:12]})" in said
        tiny = setup.home / "models" / "tiny"
        size = sum(p.stat().st_size for p in tiny.iterdir() if not p.name.startswith("."))
        assert shown[0] == (0, size) and shown[-1] == (size, size), shown
        await pilot.press("escape")
        shown.clear()

        screen = await open_preview(pilot, app, "tiny+style")
        assert screen.phase == "plan", screen.text
        assert screen.request.name == "tiny+style"
        assert "adapter style  lora rank 4, layers 1–3  ✓ trained on this model" in screen.text
        assert shown == []  # the base's hashes were cached by the first look
        # Each shard's share of the adapter beside its weights, counted in "after".
        assert screen.plan is not None and "weights+adapter" in screen.text
        style = read_adapter(setup.home / "adapters" / "style")
        for shard in screen.plan.shards:
            share = sum(style.bytes_by_layer(4)[shard.start : shard.end])
            assert shard.adapter_bytes == share
            if share:
                assert f"+{format_bytes(share)}" in screen.text, screen.text
        assert sum(s.adapter_bytes for s in screen.plan.shards) == sum(style.bytes_by_layer(4))
        await pilot.press("enter")
        await until(
            pilot,
            lambda: (p := app.cluster.placement("tiny+style")) is not None and p.state == "ready",
            60,
            "tiny+style ready",
        )
        placed = app.cluster.placement("tiny+style")
        assert placed is not None and placed.adapter == "style"
        table = app.query_one("#placements-table", DataTable)
        await until(pilot, lambda: table.row_count == 1, 5, "placements row")
        assert str(table.get_row_at(0)[2]) == "tiny + style"

        await pilot.press("c")
        # The chat screen is pushed on the next turns of the event loop, later under load.
        await until(pilot, lambda: isinstance(app.screen, ChatScreen), 10, "the chat")
        chat = app.screen
        assert isinstance(chat, ChatScreen)
        await until(pilot, lambda: chat._options != [], 5, "picker filled")
        assert chat._options == [("tiny+style · adapter style", "tiny+style")]
        assert chat._chosen_name() == "tiny+style"
        assert app.controller is not None
        await app.controller.unload("tiny+style")
