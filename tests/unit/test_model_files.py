"""Which files a shard needs, and loading a shard from a directory holding only those."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from studiotui.cluster.model_files import copy_name, hub_snapshot_path, needed_files
from worker.shard import ShardLoadError, load_shard
from worker.shared.demo_model import DemoSpec, write_demo_model


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
