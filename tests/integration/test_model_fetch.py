"""`studiotui fetch`: each node downloads only its share from the hub, with the real client.

The hub is out of reach here, so the real `huggingface_hub` on the operator and on
every agent talks to a stand-in that speaks the same HTTP (tests/support/hub_standin.py),
through HF_ENDPOINT. The stand-in counts what it serves per file.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants

from studiotui.cli.main import main
from studiotui.cluster.model_fetch import is_repo_id, share_names
from studiotui.cluster.model_files import even_shares, needed_names
from studiotui.core.inventory import dump_inventory
from tests.support.cluster_fixture import LocalCluster, cluster_fixture, start_cluster, stop_cluster
from tests.support.hub_standin import HubStandIn
from worker.shared.demo_model import DemoSpec, write_demo_model

COMMIT = "0123456789abcdef" * 2 + "01234567"


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[LocalCluster]:
    """Two agents of their own (127.0.0.76-77:57800), stopped by pid afterwards."""
    yield from cluster_fixture(tmp_path / "home", 2, 76, 57800, memory_gb=2.0)


@pytest.fixture()
def hub(tmp_path: Path) -> Iterator[HubStandIn]:
    model = write_demo_model(
        tmp_path / "published", DemoSpec(layers=4, hidden=64, heads=4, kv_heads=2, files=4)
    )
    server = HubStandIn("org/demo", model, COMMIT, "127.0.0.80", 58080)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_shares_split_the_layers_evenly_and_name_their_files(tmp_path: Path) -> None:
    assert even_shares(10, ["a", "b", "c"]) == {"a": (0, 4), "b": (4, 7), "c": (7, 10)}
    assert even_shares(2, ["a"]) == {"a": (0, 2)}
    model = write_demo_model(
        tmp_path / "m", DemoSpec(layers=4, hidden=64, heads=4, kv_heads=2, files=4)
    )
    # Only the small files and the index are needed to work the shares out.
    for f in model.glob("*.safetensors"):
        f.unlink()
    shares = share_names(model, ["a", "b"])
    assert [n for n in shares["a"] if n.endswith(".safetensors")] == [
        "model-00001-of-00004.safetensors",
        "model-00002-of-00004.safetensors",
    ]
    assert set(shares["b"]) == needed_names(model, 2, 4, 4)
    assert "config.json" in shares["a"] and "config.json" in shares["b"]
    assert is_repo_id("mlx-community/Qwen3-8B-4bit")
    assert not is_repo_id("../etc") and not is_repo_id("a/b/c") and not is_repo_id("x")


def test_each_node_downloads_only_its_share_from_the_hub(
    pair: LocalCluster,
    hub: HubStandIn,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(pair.inventory))
    monkeypatch.setenv("STUDIOTUI_HOME", str(pair.home))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "operator-hf"))
    nodes = list(pair.inventory.names)

    code = main(["-i", str(inventory), "fetch", "org/demo", "--nodes", ",".join(nodes),
                 "--cache-dir", "hf"])  # fmt: skip
    out = capsys.readouterr().out
    print(out)
    assert code == 0
    weights = {n: s for n, s in hub.served.items() if n.endswith(".safetensors")}
    published = {p.name: p.stat().st_size for p in hub.folder.glob("*.safetensors")}
    # Every weight file went out once, to the one node whose layers live in it.
    assert weights == published
    held = {}
    for node in pair.inventory.nodes:
        snapshot = Path(node.workdir) / "hf" / "models--org--demo" / "snapshots" / COMMIT
        held[node.name] = sorted(p.name for p in snapshot.glob("*.safetensors"))
        assert (snapshot / "config.json").is_file() and (snapshot / "tokenizer.json").is_file()
        for name in held[node.name]:
            assert (snapshot / name).read_bytes() == (hub.folder / name).read_bytes()
        assert f"{node.name} downloaded its share of org/demo@{COMMIT[:12]}" in out
    assert held[nodes[0]] == [
        "model-00001-of-00004.safetensors",
        "model-00002-of-00004.safetensors",
    ]
    assert held[nodes[1]] == [
        "model-00003-of-00004.safetensors",
        "model-00004-of-00004.safetensors",
    ]
    # The operator itself downloaded only the small files, to work the shares out.
    operator = tmp_path / "operator-hf" / "models--org--demo" / "snapshots" / COMMIT
    assert (operator / "config.json").is_file() and not list(operator.glob("*.safetensors"))

    # Bad input is a sentence, not a traceback, and nothing is downloaded for it.
    served = sum(hub.served.values())
    assert main(["-i", str(inventory), "fetch", "not a repo"]) == 2
    assert main(["-i", str(inventory), "fetch", "org/missing", "--nodes", nodes[0]]) == 2
    err = capsys.readouterr().err
    assert "'not a repo' is not a Hugging Face repo id (org/name), and model directory" in err
    assert "cannot read org/missing@main from the hub" in err
    assert sum(hub.served.values()) == served
    # A model's name in the catalog, as `place` takes it: its folder, sent as placing does.
    write_demo_model(pair.home / "models" / "named", DemoSpec(layers=2, hidden=64, heads=4))
    assert main(["-i", str(inventory), "fetch", "named", "--nodes", nodes[0]]) == 0
    out = "".join(capsys.readouterr().out.split())  # rich folds the path anywhere
    assert f"{nodes[0]}:{pair.home / 'models' / 'named'}" in out, out
    assert sum(hub.served.values()) == served

    # A node whose disk cannot hold its share refuses before downloading any of it.
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("mounting a small disk needs root")
    try:
        code = main(["-i", str(inventory), "fetch", "org/demo", "--nodes", nodes[0],
                     "--cache-dir", str(tiny)])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2
        assert f"{nodes[0]} has " in err and f"free at {tiny}" in err, err
        assert "its share needs " in err and " KB" in err, err
        assert list(tiny.iterdir()) == [] and sum(hub.served.values()) == served
    finally:
        subprocess.run(["umount", str(tiny)], check=False)


async def test_the_models_pane_fetches_the_selected_hub_model_to_the_nodes(
    hub: HubStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import snapshot_download

    from studiotui.app.app import StudioApp
    from studiotui.app.panes.models import ModelsPane

    # The agents' hub cache (their environment at start), the operator's own (with the
    # whole model: the catalog lists it) and the operator client's metadata cache.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "nodes-hf"))
    # start_cluster runs its own event loop: in a thread, beside this test's.
    cluster = await asyncio.to_thread(start_cluster, tmp_path / "home", 2, 78, 57900, 2.0)
    try:
        operator_cache = tmp_path / "operator-hf"
        await asyncio.to_thread(
            snapshot_download, "org/demo", cache_dir=operator_cache, endpoint=hub.endpoint
        )
        monkeypatch.setenv("HF_HUB_CACHE", str(operator_cache))
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "operator-meta"))
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        before = dict(hub.served)
        app = StudioApp(cluster.home, cluster.inventory)
        async with app.run_test(size=(160, 48)) as pilot:
            models = app.query_one(ModelsPane)
            for _ in range(200):
                if "2/2 nodes up" in app.sub_title and models.rows_shown:
                    break
                await pilot.pause(0.1)
            assert models.selected_row is not None and models.selected_row.name == "org/demo"
            await pilot.press("F")
            log: list[str] = []
            for _ in range(300):
                log = [e.text for e in app.cluster.log]
                if sum("downloaded its share" in t for t in log) == 2:
                    break
                await pilot.pause(0.1)
        assert sum("downloaded its share" in t for t in log) == 2, log
        served = {n: s - before.get(n, 0) for n, s in hub.served.items()}
        weights = {n: s for n, s in served.items() if n.endswith(".safetensors") and s}
        published = {p.name: p.stat().st_size for p in hub.folder.glob("*.safetensors")}
        assert weights == published  # each weight file went to one node, once
    finally:
        stop_cluster(cluster)


async def test_the_models_pane_fetches_a_hub_model_by_its_name_with_progress(
    hub: HubStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30 item 9: H on the Models pane asks for org/name and the nodes download
    their shares as `studiotui fetch` does, the progress shown per node; a name that is
    not a repo id is refused in the dialog before anything is asked of the hub."""
    from textual.widgets import Input, Static

    from studiotui.app.app import StudioApp
    from studiotui.app.panes.models import ModelsPane
    from studiotui.app.panes.placements import PlacementsPane
    from studiotui.app.screens.model_folders import HubFetchScreen

    # The agents and the operator share one hub cache, as on one machine: the shares
    # make a whole model there, which the Models pane then lists.
    cache = tmp_path / "shared-hf"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    cluster = await asyncio.to_thread(start_cluster, tmp_path / "home", 2, 82, 57960, 2.0)
    try:
        app = StudioApp(cluster.home, cluster.inventory)
        async with app.run_test(size=(160, 48)) as pilot:
            for _ in range(200):
                if "2/2 nodes up" in app.sub_title:
                    break
                await pilot.pause(0.1)
            seen: list[tuple[str, int, int]] = []
            pane = app.query_one(PlacementsPane)
            real = pane.progress

            def spy(node: str, done: int, total: int, key: str = "") -> None:
                seen.append((node, done, total))
                real(node, done, total, key)

            pane.progress = spy  # type: ignore[method-assign]
            served = sum(hub.served.values())
            await pilot.press("4", "H")
            await pilot.pause(0.2)
            assert isinstance(app.screen, HubFetchScreen)
            await pilot.press(*"not a repo", "enter")
            error = str(app.screen.query_one("#hub-error", Static).render())
            assert "'not a repo' is not a Hugging Face repo id: type org/name" in error
            assert sum(hub.served.values()) == served
            app.screen.query_one("#hub-repo", Input).value = "org/demo"
            await pilot.press("enter")
            log: list[str] = []
            for _ in range(300):
                log = [e.text for e in app.cluster.log]
                names = [r.name for r in app.query_one(ModelsPane).rows_shown]
                if sum("downloaded its share" in t for t in log) == 2 and "org/demo" in names:
                    break
                await pilot.pause(0.1)
            assert sum("downloaded its share" in t for t in log) == 2, log
            assert "org/demo" in [r.name for r in app.query_one(ModelsPane).rows_shown]
        nodes = {n for n, _, _ in seen}
        assert nodes == set(cluster.inventory.names), seen
        # Each node's gauge ends full, at its share's size.
        for node in nodes:
            done, total = [(d, t) for n, d, t in seen if n == node][-1]
            assert total > 0 and done == total, seen
        weights = {n: s for n, s in hub.served.items() if n.endswith(".safetensors")}
        published = {p.name: p.stat().st_size for p in hub.folder.glob("*.safetensors")}
        assert weights == published  # each weight file went to one node, once
    finally:
        stop_cluster(cluster)
