"""The Models pane's own work under Pilot (issue 30 items 9 and 10): model folders
added and removed with `a` (config.toml keeps its comments), folders that hold no
model counted quietly, a model deleted with `D` after a question (never one a
placement uses), and the `/` filter of the Nodes, Models and Placements tables."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
from textual.events import Key
from textual.widgets import DataTable, Input, Static

from studiotui.app.app import StudioApp
from studiotui.app.dialogs import ConfirmScreen, DeleteScreen
from studiotui.app.panes.filter import FilterBar
from studiotui.app.panes.models import ModelRow, ModelsPane
from studiotui.app.panes.nodes import NodesPane
from studiotui.app.panes.placements import PlacementsPane
from studiotui.app.screens.model_folders import ModelFoldersScreen
from studiotui.core.inventory import Inventory, NodeSpec
from tests.app.test_app_dashboard import SIZE, log_text, until
from tests.support.app_fixtures import fixed_models, fixed_state
from worker.shared.demo_model import DemoSpec, write_demo_model

SPEC = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2)


def names(app: StudioApp) -> list[str]:
    return [r.name for r in app.query_one(ModelsPane).rows_shown]


def note(app: StudioApp) -> str:
    return str(app.query_one("#models-note", Static).render())


def _live_app(home: Path) -> StudioApp:
    # Nothing answers at this address: the Models pane needs no cluster.
    node = NodeSpec(name="n1", host="127.0.0.250", address="127.0.0.250", control_port=57391)
    return StudioApp(home, Inventory(name="desk", nodes=(node,)))


async def test_folders_are_added_and_removed_from_the_pane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))
    home = tmp_path / "home"
    (home / "models" / "notes").mkdir(parents=True)  # not a model: counted, not a row
    (home / "config.toml").write_text("# the operator's own words\nhf_cache = false\n")
    disk = tmp_path / "disk"
    write_demo_model(disk / "outside", SPEC)  # written outside the model folders
    (disk / "datasets").mkdir()
    app = _live_app(home)
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(ModelsPane)
        await pilot.press("4")
        await until(pilot, lambda: "looks in" in note(app), 20, "the note under the table")
        # Where models are looked for is said, and the folder with no model quietly.
        assert f"looks in {home / 'models'}" in note(app) or "looks in ~/" in note(app)
        assert "1 folder there holds no model (notes)" in note(app)
        assert pane.row_count == 1 and not pane.rows_shown  # "no models in …"
        assert "skipped" not in log_text(app)

        await pilot.press("a")
        await until(pilot, lambda: isinstance(app.screen, ModelFoldersScreen), 10, "folders")
        await pilot.press(*"/nowhere/at/all", "enter")
        said = str(app.screen.query_one("#folders-said", Static).render())
        assert "/nowhere/at/all is not a directory" in said
        box = app.screen.query_one("#folders-input", Input)
        box.value = str(disk)
        await pilot.press("enter")
        config = (home / "config.toml").read_text()
        assert config.startswith("# the operator's own words\nhf_cache = false\n")
        assert tomllib.loads(config)["models_dirs"] == [str(disk)]
        table = app.screen.query_one("#folders-table", DataTable)
        rows = [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]
        assert rows[1] == [str(disk), "1 model · 1 other folder", "config.toml"], rows
        assert rows[0][2] == "home (always)"
        await pilot.press("escape")
        await until(pilot, lambda: names(app) == ["outside"], 20, "the new folder's model")
        assert "2 folders there hold no model (datasets, notes)" in note(app)

        # Removed again (from the list: tab to it, the second row, x).
        await pilot.press("a")
        await until(pilot, lambda: isinstance(app.screen, ModelFoldersScreen), 10, "folders")
        app.screen.query_one("#folders-table", DataTable).focus()
        await pilot.press("down", "x")
        assert "models_dirs" not in tomllib.loads((home / "config.toml").read_text()) or (
            tomllib.loads((home / "config.toml").read_text())["models_dirs"] == []
        )
        assert (disk / "outside" / "config.json").is_file()  # nothing deleted
        await pilot.press("escape")
        await until(pilot, lambda: names(app) == [], 20, "the folder's model gone")


async def test_a_marked_model_is_deleted_after_a_question(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))
    home = tmp_path / "home"
    keep = write_demo_model(home / "models" / "keep", SPEC)
    gone = write_demo_model(home / "models" / "gone", SPEC)
    app = _live_app(home)
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(ModelsPane)
        await pilot.press("4")
        await until(pilot, lambda: names(app) == ["gone", "keep"], 20, "both models")
        assert pane.select_model("gone")
        await pilot.press("D")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 10, "the question")
        question = str(app.screen.query_one("#confirm-body", Static).render())
        assert "Delete gone? Its files" in question and str(gone) in question
        await pilot.press("n")  # no: nothing happens
        assert gone.is_dir()
        await pilot.press("D")
        await until(pilot, lambda: isinstance(app.screen, DeleteScreen), 10, "the question")
        await pilot.press("enter")  # enter, pressed out of habit, keeps it too
        await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen), 10, "closed")
        await pilot.pause(0.5)
        assert gone.is_dir() and "deleting gone" not in log_text(app)
        await pilot.press("D")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 10, "the question")
        await pilot.press("y")
        await until(pilot, lambda: names(app) == ["keep"], 20, "gone deleted")
        assert not gone.exists() and keep.is_dir()
        # The table is read again before the worker's log line lands, later under load.
        await until(pilot, lambda: "deleted gone:" in log_text(app), 10, "the log line")
        assert "freed" in log_text(app)


async def test_a_model_a_placement_uses_is_refused_without_a_question(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "models" / "qwen3-32b", SPEC)
    state = fixed_state()
    # The fixed state's qwen3-32b placement, loaded from this very folder.
    placements = tuple(
        replace(p, model_dir=str(model)) if p.name == "qwen3-32b" else p for p in state.placements
    )
    rows = [ModelRow("qwen3-32b", str(model), "qwen3", 1, 2, 3, "f32")]
    app = StudioApp(tmp_path, state=replace(state, placements=placements), models=rows)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("4", "D")
        await pilot.pause(0.2)
        assert not isinstance(app.screen, ConfirmScreen)
        said = log_text(app)
        assert "qwen3-32b is not deleted: placement 'qwen3-32b' uses qwen3-32b" in said
        assert "unload it first" in said
        assert (model / "config.json").is_file()


async def test_slash_filters_nodes_models_and_placements(tmp_path: Path) -> None:
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    async with app.run_test(size=SIZE) as pilot:
        nodes = app.query_one(NodesPane)
        bar = app.query_one(FilterBar)
        assert not bar.display
        # Nodes (the keys start there): typing narrows, enter keeps, esc clears. Keys
        # queued right behind `/` go to the box ("l" opened a node's log, in tmux).
        # Two keys in one read of the terminal, as tmux's send-keys gives them.
        for key, char in (("slash", "/"), ("x", "x")):
            app.post_message(Key(key, char))
        await pilot.pause(0.2)
        assert bar.has_focus and bar.value == "x", (app.focused, bar.value)
        await pilot.press("slash")  # typed in the box, "/" is a character
        assert bar.value == "x/"
        await pilot.press("escape")
        await pilot.press("slash", *"studio-3")
        assert bar.display and bar.has_focus
        assert nodes.visible_order == ["studio-3"] and nodes.selected == "studio-3"
        assert "/studio-3 · 1 of 4 · esc clears" in str(nodes.border_title)
        await pilot.press("enter")
        assert not bar.display and nodes.has_focus and nodes.visible_order == ["studio-3"]
        await pilot.press("escape")
        assert len(nodes.visible_order) == 4 and "esc clears" not in str(nodes.border_title)
        # A filter on a group name or a placement: the cards holding its shards.
        await pilot.press("slash", *"deepseek", "enter")
        assert nodes.visible_order == ["studio-1", "studio-2"]
        await pilot.press("escape")

        # Models: every word anywhere in the row, any case.
        models = app.query_one(ModelsPane)
        await pilot.press("4", "slash", *"QWEN 8-bit")
        assert [r.name for r in models.rows_shown] == ["qwen3-32b"]
        await pilot.press("enter")
        assert models.has_focus and models.selected_row is not None
        assert "/QWEN 8-bit · 1 of 4 · esc clears" in note(app)
        await pilot.press("escape")
        assert len(models.rows_shown) == 4
        await pilot.press("slash", *"nothing-like-it")
        assert "no model matches 'nothing-like-it'" in str(models.get_row_at(0)[0])
        await pilot.press("escape")  # in the box: cleared and closed
        assert not bar.display and len(models.rows_shown) == 4 and models.has_focus

        # Placements: the state is a word too.
        placements = app.query_one(PlacementsPane)
        await pilot.press("3", "slash", *"broken")
        assert [p.name for p in placements.shown] == ["qwen3-32b"]
        await pilot.press("enter", "escape")
        assert [p.name for p in placements.shown] == ["deepseek-v3", "qwen3-32b"]


async def test_at_80_by_24_the_note_under_the_models_keeps_its_keys_in_view(
    tmp_path: Path,
) -> None:
    """The note under the Models table ended "D delete ·" at 80x24: "/ filter" was on a
    line the pane had no room for."""
    from textual.geometry import Region

    # Where models are looked for, as long as a real home's path: the test's own.
    app = _live_app(tmp_path / "home")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("4")
        await until(pilot, lambda: "looks in" in note(app), 20, "the note")
        await pilot.pause(0.3)
        shown = app.query_one("#models-note", Static)
        width, height = shown.size
        lines = shown.render_lines(Region(0, 0, width, height))
        seen = " ".join(" ".join(s.text for s in lines).split())
        for key in ("a folders", "H fetch from hub", "D delete", "/ filter"):
            assert key in seen, (key, seen)
