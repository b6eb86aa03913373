"""The model catalog against real model directories in temporary folders.

The Hugging Face cache is laid out the way huggingface_hub writes it (blobs named by
hash, snapshots holding symlinks to them, refs/main naming the revision), holding a
real generated demo model, so what is read here is what a real download looks like.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from studiotui.app.themes import ThemeFileError, theme_from_toml
from studiotui.core import catalog
from studiotui.core.adapter_catalog import adapter_folders
from studiotui.core.catalog import Catalog, scan, scan_home, scan_models, settings
from studiotui.core.model_facts import read_model
from worker.shared.demo_model import DemoSpec, write_demo_model

SPEC = DemoSpec(layers=6, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=3)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "demo", SPEC)


def hf_repo(cache: Path, repo_id: str, model: Path, revision: str = "abc123") -> Path:
    """Put `model` into `cache` as huggingface_hub would have downloaded it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    blobs = repo / "blobs"
    snapshot = repo / "snapshots" / revision
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in model.iterdir():
        data = file.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def names(found: Catalog) -> list[str]:
    return [m.name for m in found.models]


def test_folder_models_with_their_facts(tmp_path: Path, demo: Path) -> None:
    folder = tmp_path / "models"
    shutil.copytree(demo, folder / "demo")
    # One level of nesting, as `hf download org/name --local-dir models/org/name` leaves it.
    shutil.copytree(demo, folder / "mlx-community" / "tiny-llama")
    (folder / "notes").mkdir()
    (folder / "broken").mkdir()
    (folder / "broken" / "config.json").write_text("{not json")
    # Weights with no config: a model cut short, said; a folder of notes only counted.
    (folder / "cut").mkdir()
    shutil.copy(demo / "model.safetensors", folder / "cut" / "model.safetensors")
    (folder / ".hidden").mkdir()

    found = scan([folder], hf_cache=None)
    assert names(found) == ["demo", "mlx-community/tiny-llama"]
    info = found.models[0]
    direct = read_model(demo)
    assert (info.family, info.n_layers, info.params, info.disk_bytes) == (
        "llama",
        6,
        direct.params,
        direct.disk_bytes,
    )
    assert info.quantization is None and info.dtype == "F32"
    assert found.models[1].facts.name == "mlx-community/tiny-llama"  # the planner's title
    assert found.source(info) == str(folder)
    skipped = {s.name: s.reason for s in found.skipped}
    assert set(skipped) == {"cut", "broken"}
    assert "no config.json" in skipped["cut"]
    # Issue 30 item 9: every non-model folder beside the models was a red "skipped" row
    # and a log warning at every start; now it is counted, quietly.
    assert found.empty == (folder / "notes",)
    assert "config.json" in skipped["broken"]
    assert scan_models([folder], hf_cache=None) == list(found.models)


def test_hf_cache_layout(tmp_path: Path, demo: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = hf_repo(cache, "mlx-community/Tiny-Demo-f32", demo)
    # An older revision beside it: refs/main decides which one is offered.
    older = cache / "models--mlx-community--Tiny-Demo-f32" / "snapshots" / "old000"
    shutil.copytree(demo, older)
    older_config = {**json.loads((demo / "config.json").read_text()), "num_hidden_layers": 1}
    (older / "config.json").write_text(json.dumps(older_config))
    # Things a real cache holds that are not models for this tool.
    (cache / "datasets--someone--corpus" / "snapshots" / "r1").mkdir(parents=True)
    tok = cache / "models--org--tokenizer-only" / "snapshots" / "r1"
    tok.mkdir(parents=True)
    (tok / "tokenizer.json").write_text("{}")
    torch_only = cache / "models--org--torch-only" / "snapshots" / "r1"
    torch_only.mkdir(parents=True)
    (torch_only / "config.json").write_text("{}")
    (torch_only / "pytorch_model.bin").write_bytes(b"\0")
    # A half-finished download: the weights' symlink points at a blob not yet there.
    partial = hf_repo(cache, "org/partial", demo, revision="p1")
    weights = next(partial.glob("*.safetensors"))
    (partial / weights.name).unlink()
    (partial / weights.name).symlink_to("../../blobs/missing.incomplete")
    # An encoder with config.json and safetensors is not something to chat with.
    bert = hf_repo(cache, "org/bert-ish", demo, revision="b1")
    config = json.loads((bert / "config.json").read_text())
    (bert / "config.json").unlink()
    (bert / "config.json").write_text(json.dumps({**config, "architectures": ["BertModel"]}))

    found = scan([], hf_cache=cache)
    assert names(found) == ["mlx-community/Tiny-Demo-f32"]
    info = found.models[0]
    assert info.path == snapshot
    assert info.n_layers == 6 and info.family == "llama"
    assert info.disk_bytes == read_model(demo).disk_bytes  # symlinks followed to the blobs
    assert found.source(info) == catalog.HF_SOURCE
    reasons = {s.name: s.reason for s in found.skipped}
    assert set(reasons) == {"org/torch-only", "org/partial", "org/bert-ish"}
    assert "mlx_lm.convert" in reasons["org/torch-only"]
    assert "not a text-generation model (BertModel)" in reasons["org/bert-ish"]
    assert reasons["org/partial"]  # whatever the OS says about the missing blob

    # With no refs/main the most recently written snapshot is taken.
    (cache / "models--mlx-community--Tiny-Demo-f32" / "refs" / "main").unlink()
    os.utime(snapshot, (1_000_000, 1_000_000))
    newest = scan([], hf_cache=cache)
    assert newest.models[0].path == older and newest.models[0].n_layers == 1


def test_quantised_models_count_unpacked_parameters(tmp_path: Path, demo: Path) -> None:
    from mlx_lm import convert

    folder = tmp_path / "models"
    folder.mkdir()
    convert(str(demo), mlx_path=str(folder / "demo-4bit"), quantize=True, q_bits=4, q_group_size=32)
    found = scan([folder], hf_cache=None)
    (info,) = found.models
    assert info.quantization == "4-bit"
    # model_facts counts packed uint32 elements; the catalog shows what the model has.
    assert info.params == read_model(demo).params
    assert info.disk_bytes < read_model(demo).disk_bytes


def test_settings_from_config_toml(
    tmp_path: Path, demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    user = tmp_path / "user"
    monkeypatch.setenv("HOME", str(user))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    shutil.copytree(demo, home / "models" / "demo")
    shutil.copytree(demo, user / "llms" / "user-model")
    shutil.copytree(demo, home / "extra" / "in-home")
    (home / "config.toml").write_text('models_dirs = ["~/llms", "extra", "~/missing"]\n')
    hf_repo(tmp_path / "hf" / "hub", "org/cached", demo)

    found = settings(home)
    assert found.folders == (home / "models", user / "llms", home / "extra", user / "missing")
    assert found.hf_cache == tmp_path / "hf" / "hub"
    listed = scan_home(home)
    assert names(listed) == ["demo", "in-home", "org/cached", "user-model"]
    assert {listed.source(m) for m in listed.models} >= {"~/llms", catalog.HF_SOURCE}
    assert "~/missing" in listed.searched and not listed.skipped

    (home / "config.toml").write_text('models_dirs = "not a list"\nhf_cache = false\n')
    broken = scan_home(home)
    assert names(broken) == ["demo"]
    assert "models_dirs must be a list" in broken.skipped[0].reason

    (home / "config.toml").write_text("models_dirs = [\n")
    bad = scan_home(home)
    assert names(bad)[0] == "demo"  # the default folder still works
    assert bad.skipped[0].name == "config.toml" and "cannot read" in bad.skipped[0].reason


def test_default_cache_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", "/x/hub")
    assert catalog.default_hf_cache() == Path("/x/hub")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", "/y")
    assert catalog.default_hf_cache() == Path("/y/hub")
    monkeypatch.delenv("HF_HOME")
    assert catalog.default_hf_cache() == Path.home() / ".cache" / "huggingface" / "hub"


def test_unreadable_folder_and_model_given_directly(tmp_path: Path, demo: Path) -> None:
    # models_dirs may name a model directory itself.
    found = scan([demo, demo], hf_cache=None)  # and a folder listed twice counts once
    assert names(found) == ["demo"]
    # A configured "folder" that is a file (a typo in config.toml) says so.
    not_a_folder = tmp_path / "models.txt"
    not_a_folder.write_text("oops")
    result = scan([not_a_folder], hf_cache=None)
    assert not result.models
    assert "cannot list" in result.skipped[0].reason


def test_a_config_toml_nested_past_the_parser_is_reported_not_raised(tmp_path: Path) -> None:
    """tomllib recurses per '[': before, 5000 of them raised RecursionError out of the
    Models pane's scan, the adapters' folders and a theme file's reading."""
    home = tmp_path / "home"
    home.mkdir()
    deep = "models_dirs = " + "[" * 5000 + "]" * 5000 + "\n"
    (home / "config.toml").write_text(deep)
    found = settings(home)
    assert found.folders == (home / "models",)
    assert "cannot read" in found.problems[0].reason
    assert adapter_folders(home) == (home / "adapters",)
    with pytest.raises(ThemeFileError, match=r"mine\.toml: invalid TOML: arrays nest too deep"):
        theme_from_toml(deep, "mine.toml")


def test_the_stamp_changes_when_a_model_comes_or_goes_and_only_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    home = tmp_path / "home"
    (home / "models" / "org").mkdir(parents=True)
    first = catalog.models_stamp(home)
    assert catalog.models_stamp(home) == first  # nothing changed, nothing read
    # One level down, as `models/mlx-community/Qwen3-8B-4bit`.
    nested = home / "models" / "org" / "m"
    nested.mkdir()
    second = catalog.models_stamp(home)
    assert second != first
    (cache / "models--org--x" / "snapshots" / "abc").mkdir(parents=True)
    third = catalog.models_stamp(home)
    assert third != second
    shutil.rmtree(nested)
    assert catalog.models_stamp(home) != third


def test_the_stamp_changes_when_a_weight_file_is_written_over_in_place(tmp_path: Path) -> None:
    """A weight file replaced under the same name changes no directory entry: the
    Models pane saw it only on f5. A model's own files are stamped too."""
    home = tmp_path / "home"
    model = home / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"old")
    before = catalog.models_stamp(home)
    folder_time = model.stat().st_mtime_ns
    with weights.open("r+b") as f:  # in place: the same inode, the same entry
        f.write(b"new weights")
    assert model.stat().st_mtime_ns == folder_time  # no directory changed
    assert catalog.models_stamp(home) != before
    # A folder that holds no model is not read file by file.
    (home / "models" / "notes").mkdir()
    (home / "models" / "notes" / "a.json").write_text("{}")
    assert not any("a.json" in path for path, _ in catalog.models_stamp(home))


def test_a_directory_is_settling_while_it_or_a_file_in_it_is_fresh(tmp_path: Path) -> None:
    folder = tmp_path / "half"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(b"x")
    now = os.stat(weights).st_mtime
    assert catalog.settling(folder, 20.0, now + 5)
    assert not catalog.settling(folder, 20.0, now + 30)
    os.utime(folder, (now - 100, now - 100))
    assert catalog.settling(folder, 20.0, now + 5)  # the file is still fresh
    os.utime(weights, (now - 100, now - 100))
    assert not catalog.settling(folder, 20.0, now + 5)


def test_a_hub_snapshot_is_named_by_its_repo_not_its_commit() -> None:
    """A model the hub fetched lives in `models--org--name/snapshots/<commit>`: the
    Placements pane, the chat and `status` named it by the commit's 40 hex digits."""
    from studiotui.core.state import PlannedPlacement, PlannedShard, model_label
    from studiotui.core.state import placements_from_shards as placements

    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = (
        f"/home/me/.cache/huggingface/hub/models--mlx-community--Qwen3-8B-4bit/snapshots/{commit}"
    )
    assert model_label(snapshot) == "mlx-community/Qwen3-8B-4bit"
    assert model_label(snapshot + "/") == "mlx-community/Qwen3-8B-4bit"
    assert model_label("/models/qwen3-8b") == "qwen3-8b"
    assert model_label("/x/snapshots/abc") == "abc"  # not a hub cache's layout
    planned = {"qwen": PlannedPlacement(snapshot, (PlannedShard("a", 0, 2),))}
    [placement] = placements((), planned)
    assert placement.model == "mlx-community/Qwen3-8B-4bit"
