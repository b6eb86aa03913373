"""Placing from the dashboard on an SSH node, under Pilot: the model's first hashing
for the copy is shown in bytes (the operator's gauge, in the preview and in the
Placements pane), gone once the copy starts; placed again, the hashes are cached
beside the model and no hashing is shown.

The node is reached over the real loopback sshd (its agent runs here, on its address,
with its own home), so the model is copied to it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from textual.widgets import Static

from studiotui.app.app import StudioApp
from studiotui.app.panes.models import ModelsPane
from studiotui.app.panes.placements import HASHING_SAID, PlacementsPane
from studiotui.app.place.preview import PreviewScreen
from studiotui.cluster import local_cluster
from studiotui.core.inventory import Inventory
from studiotui.core.placement import format_bytes
from tests.support.pilot_helpers import until
from tests.support.sshd import SshdServer, ssh_node, sshd_server  # noqa: F401 - the fixture
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.manifest import CACHE_NAME

pytestmark = pytest.mark.integration
SPEC = DemoSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=6)
PORT = 59957


async def test_a_placement_on_an_ssh_node_shows_its_first_hashing(
    sshd_server: SshdServer,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))
    home = tmp_path / "home"
    model = write_demo_model(home / "models" / "tiny", SPEC)
    (model / CACHE_NAME).unlink(missing_ok=True)  # as just downloaded: nothing cached
    node = ssh_node(sshd_server, sshd_server.addresses[3], "mac-24", tmp_path / "nodes", PORT)
    inv = Inventory(name="desk", nodes=(node,))
    sshd_server.write_known_hosts(home / "known_hosts")
    size = sum(p.stat().st_size for p in model.iterdir() if not p.name.startswith("."))
    # What the Placements pane's progress block and the preview said at every redraw.
    pane_said: list[tuple[bool, str]] = []
    preview_said: list[str] = []
    pane_render, preview_draw = PlacementsPane._render_progress, PreviewScreen._draw

    def render(pane: PlacementsPane) -> None:
        pane_render(pane)
        block = pane.query_one("#place-progress", Static)
        pane_said.append((bool(block.display), str(block.content) if block.display else ""))

    def draw(screen: PreviewScreen) -> None:
        preview_draw(screen)
        if screen.is_mounted and screen.phase == "loading":
            preview_said.append(screen.text)

    monkeypatch.setattr(PlacementsPane, "_render_progress", render)
    monkeypatch.setattr(PreviewScreen, "_draw", draw)

    def hashing_shown(texts: list[str]) -> list[str]:
        return [t for t in texts if HASHING_SAID in t]

    def gauge_whole(text: str) -> bool:
        line = next(ln for ln in text.splitlines() if ln.startswith("operator "))
        return f"{format_bytes(size)} / {format_bytes(size)}" in line

    pid = local_cluster.start_agent(home, node, inv)
    try:
        app = StudioApp(home, inv)
        async with app.run_test(size=(160, 48)) as pilot:
            await until(
                pilot,
                lambda: app.controller is not None and app.cluster.nodes[0].state == "up",
                30,
                "the node up",
            )
            models = app.query_one(ModelsPane)
            await until(pilot, lambda: models.select_model("tiny"), 10, "the model listed")

            async def place() -> None:
                await pilot.press("p")  # the model under the cursor on all up nodes
                await until(pilot, lambda: isinstance(app.screen, PreviewScreen), 10, "preview")
                screen = app.screen
                assert isinstance(screen, PreviewScreen)
                await until(pilot, lambda: screen.phase == "plan", 30, "the plan")
                await pilot.press("enter")
                await until(
                    pilot,
                    lambda: (p := app.cluster.placement("tiny")) is not None and p.state == "ready",
                    60,
                    "tiny ready",
                )

            await place()
            panes = hashing_shown([t for shown, t in pane_said if shown])
            previews = hashing_shown(preview_said)
            assert panes and previews, (pane_said[-3:], preview_said[-3:])
            # The operator's gauge reached every byte of the model, in both places.
            assert any(gauge_whole(t) for t in panes), panes
            assert any(gauge_whole(t) for t in previews), previews
            # Then the copy: the node's gauge, the hashing gone.
            last = max(i for i, (_, t) in enumerate(pane_said) if HASHING_SAID in t)
            after = pane_said[last + 1 :]
            assert any(shown and "mac-24 " in t for shown, t in after), after
            assert pane_said[-1] == (False, ""), pane_said[-3:]  # gone once placed
            assert (model / CACHE_NAME).is_file()  # the hashes kept beside the model

            # Placed again: the hashes are cached, nothing is hashed, nothing shown.
            assert app.controller is not None
            await app.controller.unload("tiny")
            await until(pilot, lambda: app.cluster.placement("tiny") is None, 30, "unloaded")
            pane_said.clear()
            preview_said.clear()
            await place()
            assert any(shown for shown, _ in pane_said), "no progress shown placing again"
            assert not hashing_shown([t for _, t in pane_said]), pane_said
            assert preview_said and not hashing_shown(preview_said), preview_said
    finally:
        local_cluster.kill_pid(pid)
    await asyncio.sleep(0)
