"""`studiotui finetune` (and `place`) on an SSH node: the base's first hashing and the
copies to the node are shown in bytes.

The node is reached over the real loopback sshd (its agent runs here, on its address,
with its own home), so the model and the job's data are copied to it, not read where
they are. The base is fresh (no hashes cached beside it): it is hashed once, shown as a
bar of every byte, and the copy (checked by those hashes) finds them cached instead of
reading the base again unseen; the model's copy and the data's are each a bar of their
own. Two iterations keep the job short; the training is covered by test_finetune.py.
`studiotui place` of another fresh base on that node shows its hashing for the copy
the same way, beside the node's bar.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from rich import filesize

from studiotui.cli.main import main
from studiotui.cluster import local_cluster
from studiotui.cluster.model_files import needed_files
from studiotui.core.inventory import Inventory, dump_inventory
from studiotui.core.model_facts import read_model
from studiotui.tune import finetune as ft
from tests.support.adapter_model import write_training_text
from tests.support.cluster_fixture import wait_up
from tests.support.sshd import SshdServer, ssh_node, sshd_server  # noqa: F401 - the fixture
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.manifest import CACHE_NAME

SPEC = DemoSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=3)
PORT = 59950


def _kb(n: int) -> str:
    """A finished bar's figures as rich's download column writes them (decimal units)."""
    unit, suffix = filesize.pick_unit_and_suffix(n, ["bytes", "kB", "MB", "GB"], 1000)
    places = 0 if unit == 1 else 1
    return f"{n / unit:,.{places}f}/{n / unit:,.{places}f} {suffix}"


def test_finetune_and_place_on_an_ssh_node_show_the_hashing_and_the_copies(
    sshd_server: SshdServer,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = write_demo_model(tmp_path / "models" / "tiny", SPEC)
    (model / CACHE_NAME).unlink(missing_ok=True)  # as just downloaded: nothing cached
    node = ssh_node(sshd_server, sshd_server.addresses[1], "mac-22", tmp_path / "nodes", PORT)
    inv = Inventory(name="desk", nodes=(node,))
    home = tmp_path / "home"
    home.mkdir()
    sshd_server.write_known_hosts(home / "known_hosts")
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(inv))
    monkeypatch.setenv("STUDIOTUI_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "200")
    data = write_training_text(tmp_path / "data.jsonl", 16)
    base_size = sum(p.stat().st_size for p in model.iterdir() if not p.name.startswith("."))
    layers = read_model(model).n_layers
    copied = sum(f.size for f in needed_files(model, 0, layers, layers, False))
    pid = local_cluster.start_agent(home, node, inv)

    try:
        asyncio.run(wait_up(home, inv, timeout=60))
        argv = ["finetune", str(model), "--data", str(data), "--nodes", "mac-22"]
        more = ["--iters", "2", "--batch-size", "4", "--name", "remote", "-i", str(inventory)]
        code = main([*argv, *more])
        out = capsys.readouterr()
        said = " ".join((out.out + out.err).split())
        assert code == 0, said
        assert "job remote done" in said, said
        # The base hashed once, every byte of it, shown as one bar.
        assert said.count("hashing tiny to stamp the adapter with its base (once: cached)") == 1
        assert _kb(base_size) in said, (base_size, said)
        # The model's copy to the node, then its share of the data, each a bar.
        assert said.count("copying to mac-22") == 2, said
        assert _kb(copied) in said, (copied, said)
        shares = ft.data_folder(home, "remote")
        sent = sum(p.stat().st_size for p in shares.glob("rank0.*.jsonl"))
        assert sent > 0 and _kb(sent) in said, (sent, said)
        # The node trained on a copy (not the operator's folder), by content; hashed
        # once for both: the cache beside the base names every file the copy needed.
        weights = (model / "model.safetensors").read_bytes()
        copies = [p for p in Path(node.workdir, "models").rglob("model.safetensors")]
        assert [p.read_bytes() == weights for p in copies] == [True], copies
        cached = json.loads((model / CACHE_NAME).read_text())
        assert {f.name for f in needed_files(model, 0, layers, layers, False)} <= set(cached)

        # `place` of another fresh base on the node: its hashing for the copy shown too.
        plain = write_demo_model(tmp_path / "models" / "plain", replace(SPEC, seed=6))
        (plain / CACHE_NAME).unlink(missing_ok=True)
        needed = sum(f.size for f in needed_files(plain, 0, layers, layers, False))
        where = ["--nodes", "mac-22", "--prefill-chunk", "16", "-i", str(inventory)]
        code = main(["place", str(plain), *where])
        out = capsys.readouterr()
        said = " ".join((out.out + out.err).split())
        assert code == 0 and "placement plain is ready" in said, said
        # Its bar reached every byte the copy needs (the node's own bar ends on its load).
        bar = rf"hashing plain for the copy \(once: cached\) [━╸╺ ]*{re.escape(_kb(needed))}"
        assert len(re.findall(bar, said)) == 1, (needed, said)
        assert main(["unload", "plain", "-i", str(inventory)]) == 0
    finally:
        local_cluster.kill_pid(pid)
        shutil.rmtree(home / "adapters", ignore_errors=True)
