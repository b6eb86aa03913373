"""The Models pane follows the model folders by itself: a model written while the
dashboard runs shows without f5, a directory still being written does not flash as
broken, and one that stays broken is shown once it has settled."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from studiotui.app import app as app_module
from studiotui.app.app import StudioApp
from studiotui.app.panes.models import ModelsPane
from studiotui.core.inventory import Inventory, NodeSpec
from tests.app.test_app_dashboard import SIZE, log_text, until
from worker.shared.demo_model import DemoSpec, write_demo_model

SPEC = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32")


def names(app: StudioApp) -> dict[str, str]:
    """Shown rows: name → its problem ("" for a placeable model)."""
    return {r.name: r.problem for r in app.query_one(ModelsPane).rows_shown}


async def test_a_model_written_while_the_dashboard_runs_shows_by_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))
    home = tmp_path / "home"
    models = home / "models"
    models.mkdir(parents=True)
    source = write_demo_model(tmp_path / "source", SPEC)
    # Nothing answers at this address: the pane does not need a cluster.
    node = NodeSpec(name="n1", host="127.0.0.250", address="127.0.0.250", control_port=57390)
    app = StudioApp(home, Inventory(name="desk", nodes=(node,)))
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(ModelsPane)
        await until(pilot, lambda: pane.row_count == 1 and not pane.rows_shown, 20, "empty pane")
        # A copy under way: weights arriving, no config.json yet.
        half = models / "half"
        half.mkdir()
        weights = (source / "model.safetensors").read_bytes()
        (half / "model.safetensors").write_bytes(weights[: len(weights) // 2])
        # Another terminal's `studiotui demo-model models/x`.
        await asyncio.to_thread(write_demo_model, models / "x", SPEC)
        await until(pilot, lambda: names(app).get("x") == "", 30, "x listed without f5")
        assert "half" not in names(app), names(app)
        assert "half" not in log_text(app)
        # The copy completes: the model shows, never having been shown broken.
        for f in source.iterdir():
            shutil.copy(f, half / f.name)
        await until(pilot, lambda: names(app).get("half") == "", 30, "half listed once whole")
        assert "model half skipped" not in log_text(app)

        # A directory that stays broken is shown once it has settled, by itself.
        monkeypatch.setattr(app_module, "MODELS_SETTLE_S", 1.0)
        broken = models / "broken"
        shutil.copytree(source, broken)
        (broken / "config.json").write_text("{")
        await until(pilot, lambda: "broken" in names(app), 30, "broken listed as skipped")
        assert "not valid JSON" in names(app)["broken"]
        # A model removed goes away too.
        shutil.rmtree(models / "x")
        await until(pilot, lambda: "x" not in names(app), 30, "x gone")
