"""The Jobs screen starting a fine-tuning job on an SSH node, under Pilot: the base's
first hashing and its copies to the node are shown as they go, in bytes.

The node is reached over the real loopback sshd (its agent runs here, on its address,
with its own home), so the base and the job's data share are copied to it. The base is
fresh (no hashes cached beside it): it is hashed once, from a worker thread, shown with
the operator's gauge; then the node's gauge shows the model's copy and its data
share's; the block is gone once the job started. Two iterations keep the job short.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from textual.widgets import Static

from studiotui.app.app import StudioApp
from studiotui.app.screens.jobs import JobsScreen
from studiotui.cluster import local_cluster
from studiotui.cluster.model_files import needed_files
from studiotui.core.inventory import Inventory
from studiotui.core.model_facts import read_model
from studiotui.core.placement import format_bytes
from studiotui.tune import finetune as ft
from tests.support.adapter_model import write_training_text
from tests.support.pilot_helpers import until
from tests.support.sshd import SshdServer, ssh_node, sshd_server  # noqa: F401 - the fixture
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.manifest import CACHE_NAME

pytestmark = pytest.mark.integration
SPEC = DemoSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=4)
PORT = 59955


async def test_a_job_started_on_an_ssh_node_shows_its_hashing_and_copies(
    sshd_server: SshdServer,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = write_demo_model(tmp_path / "models" / "tiny", SPEC)
    (model / CACHE_NAME).unlink(missing_ok=True)  # as just downloaded: nothing cached
    node = ssh_node(sshd_server, sshd_server.addresses[2], "mac-23", tmp_path / "nodes", PORT)
    inv = Inventory(name="desk", nodes=(node,))
    home = tmp_path / "home"
    home.mkdir()
    sshd_server.write_known_hosts(home / "known_hosts")
    data = write_training_text(tmp_path / "data.jsonl", 16)
    base_size = sum(p.stat().st_size for p in model.iterdir() if not p.name.startswith("."))
    layers = read_model(model).n_layers
    copied = sum(f.size for f in needed_files(model, 0, layers, layers, False))
    # What the start block said at every redraw, and whether it was shown.
    said: list[tuple[bool, str]] = []
    real = JobsScreen._show_start

    def show(screen: JobsScreen) -> None:
        real(screen)
        block = screen.query_one("#jobs-hashing", Static)
        said.append((bool(block.display), str(block.content)))

    monkeypatch.setattr(JobsScreen, "_show_start", show)
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
            await pilot.press("J")
            screen = app.screen
            assert isinstance(screen, JobsScreen)
            req = ft.FinetuneRequest(
                str(model), str(data), ("mac-23",), "remote", iters=2, batch_size=4
            )
            screen.start(req)
            await until(
                pilot,
                lambda: (
                    "remote" in screen.watches and screen.watches["remote"].progress.state == "done"
                ),
                60,
                "the job done",
            )
            assert said and said[-1] == (False, ""), said[-3:]  # gone once it started
            shown = [text for visible, text in said if visible]
            hashing = [t for t in shown if "hashing tiny to stamp the adapter" in t]
            assert hashing, shown
            # The operator's gauge reached every byte of the base.
            whole = f"{format_bytes(base_size)} / {format_bytes(base_size)}"
            assert any("operator" in t and whole in t for t in hashing), hashing
            copies = [t for t in shown if "copying tiny and the data to the nodes" in t]
            assert copies, shown
            # The node's gauge: the model's bytes, then its data share's.
            model_done = f"{format_bytes(copied)} / {format_bytes(copied)}"
            gauges = [[ln for ln in t.splitlines() if ln.startswith("mac-23 ")] for t in copies]
            assert all(len(g) == 1 for g in gauges), copies
            assert any(model_done in g[0] for g in gauges), gauges
            share = sum(p.stat().st_size for p in ft.data_folder(home, "remote").glob("rank0.*"))
            data_done = f"{format_bytes(share)} / {format_bytes(share)}"
            assert data_done in gauges[-1][0], gauges
            await until(
                pilot, (home / "adapters" / "remote").is_dir, 30, "the job's adapter fetched"
            )
    finally:
        local_cluster.kill_pid(pid)
    await asyncio.sleep(0)
