"""Which files a shard needs, and loading a shard from a directory holding only those."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from studiotui.cluster.model_files import (
    ModelFilesError,
    check_model_dir,
    copy_name,
    disk_refusal,
    escaping_names,
    hub_snapshot_path,
    needed_files,
    plan_copy,
)
from studiotui.core.model_facts import ModelDirError, read_model
from worker.shard import ShardLoadError, load_shard
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.manifest import CACHE_NAME, FileId, manifest, plain_name, spill_path
from worker.shared.protocol import control


@pytest.fixture(scope="module")
def split_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = DemoSpec(layers=8, hidden=64, heads=4, kv_heads=2, dtype="float32", files=4)
    return write_demo_model(tmp_path_factory.mktemp("split") / "m", spec)


def names(model: Path, start: int, end: int) -> set[str]:
    return {f.name for f in needed_files(model, start, end, 8)}


def test_a_shard_needs_only_the_files_of_its_layers(split_model: Path) -> None:
    small = {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "model.safetensors.index.json",
        "README.md",
    }
    assert names(split_model, 0, 2) == small | {"model-00001-of-00004.safetensors"}
    assert names(split_model, 2, 6) == small | {
        "model-00002-of-00004.safetensors",
        "model-00003-of-00004.safetensors",
    }
    # The last shard holds the norm and lm_head, which live in the last file.
    assert names(split_model, 6, 8) == small | {"model-00004-of-00004.safetensors"}
    assert len(names(split_model, 0, 8)) == len(small) + 4


def test_a_shard_loads_from_its_own_files_and_refuses_without_them(
    split_model: Path, tmp_path: Path
) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in needed_files(split_model, 2, 6, 8):
        shutil.copy(split_model / f.name, partial / f.name)
    shard = load_shard(partial, 2, 6)
    full = load_shard(split_model, 2, 6)
    assert shard.param_bytes == full.param_bytes > 0
    with pytest.raises(ShardLoadError, match=r"lacks model\.layers\.6"):
        load_shard(partial, 6, 8)


@pytest.mark.parametrize("recite", [False, True], ids=["noise", "reciting"])
def test_demo_model_files_are_byte_identical_for_the_same_spec(
    tmp_path: Path, recite: bool
) -> None:
    spec = DemoSpec(
        arch="qwen2", layers=3, hidden=32, heads=4, kv_heads=2, seed=5, files=2, recite=recite
    )
    a = write_demo_model(tmp_path / "a", spec)
    b = write_demo_model(tmp_path / "b", spec)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    other = write_demo_model(
        tmp_path / "c",
        DemoSpec(
            arch="qwen2", layers=3, hidden=32, heads=4, kv_heads=2, seed=6, files=2, recite=recite
        ),
    )
    assert (other / "model-00001-of-00002.safetensors").read_bytes() != (
        a / "model-00001-of-00002.safetensors"
    ).read_bytes()


def test_a_hub_snapshot_is_looked_for_at_the_same_place_in_the_nodes_home() -> None:
    home = Path("/Users/ana")
    snap = home / ".cache/huggingface/hub/models--mlx-community--Qwen3-8B-4bit/snapshots/ab12cd"
    assert hub_snapshot_path(snap, home) == (
        ".cache/huggingface/hub/models--mlx-community--Qwen3-8B-4bit/snapshots/ab12cd"
    )
    elsewhere = Path("/Volumes/models/hub/models--org--m/snapshots/0f0f")
    assert hub_snapshot_path(elsewhere, home) == "/Volumes/models/hub/models--org--m/snapshots/0f0f"
    # Not a snapshot: an ordinary folder's name says nothing about its content.
    assert hub_snapshot_path(home / "models/demo", home) is None
    assert hub_snapshot_path(home / "hub/models--org--m/snapshots", home) is None
    assert copy_name(snap) == "mlx-community--Qwen3-8B-4bit@ab12cd"
    assert copy_name(Path("/m/snapshots/x/models--a--b/snapshots/0123456789abcdef")) == (
        "a--b@0123456789ab"
    )
    assert copy_name(home / "models/demo") == "demo"


# ---- identity by content, copies, refusals (pure parts) ---------------------------------


def test_the_manifest_is_hashed_once_and_again_only_when_a_file_changes(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "m", DemoSpec(layers=2, hidden=32, heads=4, kv_heads=2))
    names = sorted(p.name for p in model.iterdir())
    hashed: list[int] = []
    first = manifest(model, names, on_bytes=hashed.append)
    assert sum(hashed) == sum((model / n).stat().st_size for n in names)
    assert (
        first["config.json"].sha256
        == hashlib.sha256((model / "config.json").read_bytes()).hexdigest()
    )
    assert (model / CACHE_NAME).is_file()
    hashed.clear()
    assert manifest(model, names, on_bytes=hashed.append) == first and hashed == []
    # Same name, same size, other bytes (and another mtime): hashed again, and it differs.
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    again = manifest(model, names, on_bytes=hashed.append)
    assert sum(hashed) == len(data)
    assert again["model.safetensors"].size == first["model.safetensors"].size
    assert again["model.safetensors"].sha256 != first["model.safetensors"].sha256
    # The needed files never include the cache itself.
    assert CACHE_NAME not in {f.name for f in needed_files(model, 0, 2, 2)}


# Two checks of a folder, each the bytes it hashed, in a process of its own: as root a
# chmod does not stop writes, so there the folder is made a read-only mount instead.
_CHECK_TWICE = """
import json, sys
from pathlib import Path
from worker.shared.manifest import manifest
model = Path(sys.argv[1])
names = sorted(p.name for p in model.iterdir())
hashed = [[], []]
for seen in hashed:
    manifest(model, names, on_bytes=seen.append)
print(json.dumps([sum(seen) for seen in hashed]))
"""
_READ_ONLY_MOUNT = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'


def test_a_read_only_folder_is_hashed_once_its_hashes_kept_under_the_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its cache cannot be written beside the files: it goes under STUDIOTUI_HOME,
    named by the folder's path, and the second check reads no file."""
    model = write_demo_model(tmp_path / "m", DemoSpec(layers=2, hidden=32, heads=4, kv_heads=2))
    home = tmp_path / "home"
    check = [sys.executable, "-c", _CHECK_TWICE, str(model)]
    if os.geteuid() == 0:
        if (
            shutil.which("unshare") is None
            or subprocess.run(
                ["unshare", "--mount", "sh", "-c", _READ_ONLY_MOUNT, "sh", str(model), "true"],
                capture_output=True,
            ).returncode
        ):
            pytest.skip("root here, and no mount namespace to make a read-only folder in")
        check = ["unshare", "--mount", "sh", "-c", _READ_ONLY_MOUNT, "sh", str(model), *check]
    model.chmod(0o555)
    try:
        done = subprocess.run(
            check,
            env={**os.environ, "STUDIOTUI_HOME": str(home)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        model.chmod(0o755)
    assert done.returncode == 0, done.stderr
    first, second = json.loads(done.stdout)
    files = [p for p in model.iterdir() if p.is_file()]
    assert first == sum(p.stat().st_size for p in files)
    assert second == 0
    assert not (model / CACHE_NAME).exists()
    monkeypatch.setenv("STUDIOTUI_HOME", str(home))
    kept = json.loads(spill_path(model).read_text())
    assert spill_path(model).parent == home / "hashes"
    assert kept["dir"] == str(model.resolve()) and set(kept["files"]) == {p.name for p in files}


def test_a_hub_blob_link_states_its_hash_and_its_snapshot_is_not_written_to(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    payload = b"weights" * 1000
    digest = hashlib.sha256(payload).hexdigest()
    (repo / "blobs" / digest).write_bytes(payload)
    (snap / "model.safetensors").symlink_to(Path("../../blobs") / digest)
    hashed: list[int] = []
    ids = manifest(snap, ["model.safetensors"], write_cache=False, on_bytes=hashed.append)
    assert ids["model.safetensors"] == FileId("model.safetensors", len(payload), digest)
    assert hashed == [] and not (snap / CACHE_NAME).exists()


def _ids(*spec: tuple[str, int, str]) -> list[FileId]:
    return [FileId(n, s, h * 64) for n, s, h in spec]


def test_a_copy_plan_keeps_the_same_replaces_what_differs_and_resumes_parts() -> None:
    wanted = _ids(("a", 10, "a"), ("b", 20, "b"), ("c", 30, "c"), ("d", 40, "d"))
    # An agent's files_status answer for one folder, as the controller reads it.
    raw = {
        "path": "/m",
        "files": [
            {"name": "a", "state": "same", "size": 10, "sha256": "a" * 64, "partial": 0},
            {"name": "b", "state": "differs", "size": 20, "sha256": "f" * 64, "partial": 0},
            {"name": "c", "state": "differs", "size": 31, "sha256": "c" * 64, "partial": 12},
            {"name": "d", "state": "missing", "size": None, "sha256": None, "partial": 99},
        ],
    }
    found = control.parse(raw, control.DirStatus)
    the_plan = plan_copy(wanted, found)
    assert the_plan.keep == ("a",)
    assert [n for n, _ in the_plan.replace] == ["b", "c"]
    assert "sha256 ffffffffffff is not the model's bbbbbbbbbbbb" in the_plan.replace[0][1]
    assert "31 bytes, the model's file 30" in the_plan.replace[1][1]
    # c resumes from its 12 bytes; d's part is longer than the file: start again.
    assert [(f.name, o) for f, o in the_plan.send] == [("b", 0), ("c", 12), ("d", 0)]
    assert the_plan.bytes_to_send == 20 + 18 + 40 and the_plan.resumed == 12
    assert plan_copy(wanted[:1], found).complete


def test_a_disk_too_small_is_a_sentence_with_the_node_and_the_numbers() -> None:
    assert disk_refusal("mac-2", "/Users/a/studiotui/models/m", 10**9, 10**9) is None
    text = disk_refusal("mac-2", "/Users/a/studiotui/models/m", 3 * 10**9, 10**9) or ""
    assert text.startswith("mac-2 has ") and "free at /Users/a/studiotui/models/m" in text
    assert "GB" in text and "free disk space on mac-2" in text


@pytest.mark.parametrize(
    ("name", "plain"),
    [
        ("model-00001-of-00002.safetensors", True),
        ("sub/model.safetensors", True),
        ("../model.safetensors", False),
        ("sub/../../x", False),
        ("/etc/passwd", False),
        ("~/x", False),
        ("a\\..\\b", False),
        ("", False),
        ("./x", False),
        ("C:x", False),
    ],
)
def test_only_plain_names_stay_inside_the_model_directory(name: str, plain: bool) -> None:
    assert plain_name(name) is plain
    assert escaping_names([name, "ok.json"]) == ([] if plain else [name])


def _index(model: Path, target: str) -> None:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = target
    (model / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("target", ["../secret.safetensors", "/etc/hostname"])
def test_an_index_naming_files_outside_is_refused_at_preview_with_the_name(
    tmp_path: Path, target: str
) -> None:
    from studiotui.cluster.controller import Controller
    from studiotui.core.inventory import local_inventory

    model = write_demo_model(
        tmp_path / "m", DemoSpec(layers=2, hidden=32, heads=4, kv_heads=2, files=2)
    )
    _index(model, target)
    with pytest.raises(ModelFilesError, match=re.escape(repr(target))):
        check_model_dir(model)
    with pytest.raises(ModelFilesError, match=re.escape(repr(target))):
        needed_files(model, 0, 2, 2)
    # The controller's preview refuses before reading any header (no agent is needed).
    ctl = Controller(tmp_path / "home", local_inventory(1, home=tmp_path / "home"))
    try:
        with pytest.raises(ModelFilesError, match="outside the model directory"):
            ctl.preview(model, ["local-1"])
    finally:
        ctl.ctx.term()


def test_a_link_leaving_the_model_directory_is_refused_but_hub_blob_links_are_not(
    tmp_path: Path,
) -> None:
    model = write_demo_model(tmp_path / "m", DemoSpec(layers=2, hidden=32, heads=4, kv_heads=2))
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(model / "model.safetensors", outside)
    (model / "model.safetensors").symlink_to(outside)
    with pytest.raises(ModelFilesError, match=r"model\.safetensors links to .*elsewhere"):
        check_model_dir(model)
    # Reading the model's facts (the catalog, the preview) refuses before any header.
    with pytest.raises(ModelDirError, match=r"links to .*elsewhere.*outside the model directory"):
        read_model(model)
    # A hub snapshot links its files to ../../blobs: inside its repository, accepted.
    repo = tmp_path / "hub" / "models--org--m"
    snap = repo / "snapshots" / "0123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    shutil.move(outside, repo / "blobs" / "w")
    (snap / "model.safetensors").symlink_to(Path("../../blobs/w"))
    for f in model.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, snap / f.name)
    check_model_dir(snap)
