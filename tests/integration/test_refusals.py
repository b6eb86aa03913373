"""A model no shard can run is refused before any byte moves: by `place --dry-run`,
by the preview in the TUI, and by the controller before copying to an SSH node.

The verdict comes from `worker.shared.model_support`, the table the shards check too.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from studiotui.app.app import StudioApp
from studiotui.app.panes.models import ModelsPane, rows_from_catalog
from studiotui.app.place.preview import PlaceRequest, PreviewScreen
from studiotui.cli import exits
from studiotui.cluster import local_cluster
from studiotui.cluster.controller import Controller, PlacementError
from studiotui.core.catalog import scan
from studiotui.core.inventory import Inventory, dump_inventory, local_inventory
from tests.support.app_fixtures import fixed_state
from tests.support.sshd import SshdServer, ssh_node, sshd_server  # noqa: F401
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.model_support import unsupported_reason


def _model(path: Path, **config_changes: object) -> Path:
    write_demo_model(path, DemoSpec(layers=4, hidden=64, heads=4, kv_heads=2, dtype="float32"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **config_changes}))
    return path


def _falcon_mamba(path: Path) -> Path:
    """A Mamba as published (no attention at all): fields of tiiuae/falcon-mamba-7b's
    config.json at a tiny size, tensors named as in its safetensors."""
    path.mkdir()
    config = {
        "architectures": ["FalconMambaForCausalLM"],
        "model_type": "falcon_mamba",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "state_size": 16,
        "conv_kernel": 4,
        "expand": 2,
        "time_step_rank": 4,
        "vocab_size": 256,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    tensors = {"backbone.embeddings.weight": np.zeros((256, 64), np.float16)}
    for i in range(2):
        tensors[f"backbone.layers.{i}.mixer.in_proj.weight"] = np.zeros((256, 64), np.float16)
        tensors[f"backbone.layers.{i}.mixer.A_log"] = np.zeros((128, 16), np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "ok": _model(root / "ok"),
        "mamba": _model(root / "mamba", model_type="falcon_mamba"),
        "oddquant": _model(root / "oddquant", quantization={"mode": "q4_k", "group_size": 64}),
        "falcon": _falcon_mamba(root / "falcon"),
    }


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STUDIOTUI_HOME": str(home), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "studiotui", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def test_dry_run_refuses_an_unsupported_family_and_quantization(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    # Nodes nobody answers on: the refusal must come before any node is asked.
    inv = local_inventory(2, base_octet=201, control_port=59990, home=tmp_path / "nodes")
    (tmp_path / "cluster.toml").write_text(dump_inventory(inv))
    home = tmp_path / "home"
    for key, words in (
        ("mamba", "model family 'falcon_mamba' is not supported"),
        ("falcon", "model family 'falcon_mamba' is not supported"),
        ("oddquant", "quantization mode 'q4_k' is not supported"),
    ):
        out = _cli(
            home, "-i", str(tmp_path / "cluster.toml"), "place", str(models[key]), "--dry-run"
        )
        said = " ".join(out.stdout.split())
        assert out.returncode == exits.REFUSED["model"], out.stderr
        assert f"cannot place: {key} cannot run on a shard: {words}" in said, said
        assert words in unsupported_reason(json.loads((models[key] / "config.json").read_text()))


async def test_models_pane_lists_the_reason_beside_the_model(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    listed = rows_from_catalog(scan([models["ok"].parent], hf_cache=None))
    rows = {r.name: r for r in listed}
    assert rows["ok"].unsupported == "" and rows["ok"].placeable
    assert "model family 'falcon_mamba' is not supported" in rows["mamba"].unsupported
    assert "quantization mode 'q4_k'" in rows["oddquant"].unsupported
    # A real Mamba has no attention fields: still listed, with the same reason.
    assert "model family 'falcon_mamba' is not supported" in rows["falcon"].unsupported
    # In the real pane: the last cell of the row says why, in place of where it came from.
    app = StudioApp(tmp_path, state=fixed_state(), models=listed)
    async with app.run_test(size=(200, 48)) as pilot:
        await pilot.pause(0.2)
        pane = app.query_one(ModelsPane)
        cells = {r.name: str(pane.get_row(r.path)[-1]) for r in listed}
    assert cells["mamba"].startswith("✗ model family 'falcon_mamba' is not supported")
    assert cells["oddquant"].startswith("✗ quantization mode 'q4_k' is not supported")
    assert not cells["ok"].startswith("✗")


async def test_preview_in_the_tui_refuses_an_unsupported_family(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    inv = local_inventory(2, base_octet=203, control_port=59980, home=tmp_path / "nodes")
    # The real controller's preview (its read of the model, its refusal) in the real app.
    controller = Controller(tmp_path / "home", inv)
    app = StudioApp(tmp_path / "home", state=controller.state, models=[])
    screens: dict[str, PreviewScreen] = {}
    try:
        async with app.run_test(size=(160, 40)) as pilot:
            for key in ("mamba", "ok"):
                request = PlaceRequest(models[key], key, inv.names, "all up nodes", key)
                screen = PreviewScreen(request, controller, lambda s: pytest.fail("deployed"))
                screens[key] = screen
                await app.push_screen(screen)
                for _ in range(50):
                    await pilot.pause(0.1)
                    if screen.phase != "planning":
                        break
                await pilot.press("enter")  # refused: nothing is deployed
                await pilot.pause(0.1)
                text = screen.text
                await pilot.press("escape")
                await pilot.pause(0.1)
                screens[key + "-text"] = text  # type: ignore[assignment]
    finally:
        await controller.close()
    mamba = screens["mamba"]
    assert mamba.phase == "refused" and mamba.plan is None
    assert "falcon_mamba" in (mamba.refusal or "")
    assert "✗ not supported" in str(screens["mamba-text"])
    assert "cannot place: mamba cannot run on a shard" in str(screens["mamba-text"])
    # A supported model is said to be so; this group is refused for being down instead.
    assert "✓ supported" in str(screens["ok-text"])
    assert "cannot run on a shard" not in str(screens["ok-text"])


@pytest.fixture
def ssh_cluster(
    sshd_server: SshdServer,  # noqa: F811
    tmp_path: Path,
) -> Iterator[tuple[Path, Inventory]]:
    """Two nodes reached over a real sshd, whose agents run here on the sshd's addresses."""
    addrs = sshd_server.addresses[2:4]
    nodes = tuple(
        ssh_node(sshd_server, a, f"mac-{a[-2:]}", tmp_path / "nodes", 59970) for a in addrs
    )
    inv = Inventory(name="desk", nodes=nodes)
    home = tmp_path / "home"
    home.mkdir()
    sshd_server.write_known_hosts(home / "known_hosts")
    pids = [local_cluster.start_agent(home, node, inv) for node in nodes]
    try:
        yield home, inv
    finally:
        for pid in pids:
            local_cluster.kill_pid(pid)


def test_controller_refuses_before_copying_to_anssh_node(
    ssh_cluster: tuple[Path, Inventory], tmp_path: Path, models: dict[str, Path]
) -> None:
    home, inv = ssh_cluster
    names = list(inv.names)

    async def run() -> tuple[str, str]:
        ctl = Controller(home, inv)
        try:
            for _ in range(100):
                await ctl.refresh(timeout=1.0)
                if all(n.state == "up" for n in ctl.state.nodes):
                    break
                await asyncio.sleep(0.2)
            # The same path copies a model it can run, so a refusal below is no accident.
            await ctl.place(models["ok"], names, "ok", prefill_chunk=16)
            await ctl.unload("ok")
            try:
                await ctl.place(models["mamba"], names, "mamba")
                refused = "placed?!"
            except PlacementError as exc:
                refused = str(exc)
            log = "\n".join(e.text for e in ctl.state.log)
            return refused, log
        finally:
            await ctl.close()

    refused, log = asyncio.run(run())
    assert "cannot run on a shard: model family 'falcon_mamba' is not supported" in refused
    for node in inv.nodes:
        held = sorted(p.name for p in (Path(node.workdir) / "models").iterdir())
        assert held == ["ok"], held  # the refused model's files never reached the node
    assert "copied" in log and "placing mamba" not in log
