"""The model folders of config.toml, changed from the dashboard, and when a model may
be deleted (issue 30 item 9): pure decisions, then the file and the real deletion."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from studiotui.app.panes.filter import matches
from studiotui.cluster.model_delete import DeleteError, delete_model
from studiotui.core.catalog import scan_home
from studiotui.core.model_folders import (
    FolderError,
    add_folder,
    delete_refusal,
    empty_note,
    folder_counts,
    model_folders,
    outside_note,
    remove_folder,
    with_folder,
    without_folder,
)
from studiotui.core.state import PlacementState, ShardState
from worker.shared.demo_model import DemoSpec, write_demo_model

SPEC = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2)

CONFIG = """\
# my settings: kept by the dashboard
hf_cache = false  # no cache listing here

models_dirs = [
    "~/old-models",  # the first disk
]
"""


def test_adding_and_removing_keeps_the_operators_comments(tmp_path: Path) -> None:
    home, where = tmp_path / "home", tmp_path / "home" / "config.toml"
    added = with_folder(CONFIG, Path("/data/models"), home, where)
    assert "# my settings: kept by the dashboard" in added
    assert "# no cache listing here" in added and "# the first disk" in added
    assert tomllib.loads(added)["models_dirs"] == ["~/old-models", "/data/models"]
    # Under the user's home it is written as they would type it.
    again = with_folder(added, Path.home() / "more", home, where)
    assert tomllib.loads(again)["models_dirs"][-1] == "~/more"
    removed = without_folder(again, Path.home() / "old-models", home, where)
    assert tomllib.loads(removed)["models_dirs"] == ["/data/models", "~/more"]
    assert "# my settings: kept by the dashboard" in removed and "hf_cache = false" in removed
    # A file with no models_dirs yet gets one.
    assert tomllib.loads(with_folder("", Path("/x"), home, where))["models_dirs"] == ["/x"]


def test_refusals_name_the_folder_and_what_to_do(tmp_path: Path) -> None:
    home, where = tmp_path / "home", tmp_path / "home" / "config.toml"
    with pytest.raises(FolderError, match="a model folder already"):
        with_folder(CONFIG, Path.home() / "old-models", home, where)
    with pytest.raises(FolderError, match="always looked in"):
        with_folder(CONFIG, home / "models", home, where)
    with pytest.raises(FolderError, match="always looked in"):
        without_folder(CONFIG, home / "models", home, where)
    with pytest.raises(FolderError, match="not in models_dirs"):
        without_folder(CONFIG, Path("/elsewhere"), home, where)
    with pytest.raises(FolderError, match="not valid TOML"):
        with_folder("models_dirs = [", Path("/x"), home, where)
    with pytest.raises(FolderError, match="must be a list of paths"):
        with_folder('models_dirs = "/x"', Path("/y"), home, where)
    # A folder that does not exist is refused before the file is touched.
    with pytest.raises(FolderError, match="is not a directory"):
        add_folder(home, tmp_path / "typo")
    assert not where.exists()


def test_the_file_is_written_and_scanned(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text("# keep me\n")
    extra = tmp_path / "disk"
    write_demo_model(extra / "tiny", SPEC)
    (extra / "notes").mkdir()
    (extra / "datasets").mkdir()
    assert add_folder(home, extra) == extra.resolve()
    assert (home / "config.toml").read_text().startswith("# keep me\n")
    assert model_folders(home) == (home / "models", extra.resolve())
    catalog = scan_home(home)
    assert [m.name for m in catalog.models] == ["tiny"] and not catalog.skipped
    counts = folder_counts(home, model_folders(home), catalog)
    assert [(c.entry, c.models, c.empty, c.exists) for c in counts] == [
        ("", 0, 0, False),
        (str(extra.resolve()), 1, 2, True),
    ]
    assert empty_note(catalog.empty) == "2 folders there hold no model (datasets, notes)"
    remove_folder(home, extra)
    assert model_folders(home) == (home / "models",)
    assert (extra / "tiny" / "config.json").is_file()  # removing a folder deletes nothing


def _placement(name: str, model_dir: str) -> PlacementState:
    shard = ShardState(name, "n1", 0, 1, 0, 2, "ready", model_dir=model_dir)
    return PlacementState(name, Path(model_dir).name, model_dir, (shard,))


def test_a_model_a_placement_uses_is_not_deleted(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "models" / "tiny", SPEC)
    used = [_placement("chat", str(model))]
    said = delete_refusal(model, used, [tmp_path / "models"])
    assert said is not None and "placement 'chat' uses tiny: unload it first" in said
    assert delete_refusal(model, [_placement("other", "/m/else")], [tmp_path / "models"]) is None
    # A hub snapshot's folder is its commit: the refusal names the model as listed.
    said = delete_refusal(model, used, [], name="org/tiny")
    assert said is not None and "uses org/tiny: unload it first" in said
    said = delete_refusal(model, [], [model])
    assert said is not None and "is a model folder itself" in said


def test_deleting_removes_the_files_and_says_what_it_freed(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "models" / "tiny", SPEC)
    size = sum(f.stat().st_size for f in model.iterdir())
    done = delete_model(model)
    assert done.freed == size and not model.exists()
    (tmp_path / "models" / "notes").mkdir()
    with pytest.raises(DeleteError, match="holds no model"):
        delete_model(tmp_path / "models" / "notes")
    assert (tmp_path / "models" / "notes").is_dir()


def test_the_filter_keeps_rows_holding_every_word() -> None:
    row = ("qwen3-32b", "broken", "studio-3[0:40]")
    assert matches("", row) and matches("QWEN", row) and matches("32b brok", row)
    assert not matches("qwen ready", row) and not matches("deepseek", row)


def test_a_hub_cache_model_is_deleted_with_huggingface_hubs_own_tools(tmp_path: Path) -> None:
    from studiotui.core.catalog import scan
    from tests.unit.test_catalog import hf_repo

    demo = write_demo_model(tmp_path / "demo", SPEC)
    cache = tmp_path / "hub"
    snapshot = hf_repo(cache, "org/tiny", demo)
    assert [m.name for m in scan([], cache).models] == ["org/tiny"]
    done = delete_model(snapshot)
    blobs = sum(f.stat().st_size for f in demo.iterdir())
    assert done.freed == blobs and not snapshot.exists()
    # Its only revision: the repo goes whole, blobs and refs with it.
    assert not (cache / "models--org--tiny").exists()
    assert scan([], cache).models == ()


def test_a_model_outside_the_folders_is_said_to_be(tmp_path: Path) -> None:
    folders = [tmp_path / "home" / "models", tmp_path / "disk"]
    assert outside_note(tmp_path / "home" / "models" / "demo", folders) is None
    assert outside_note(tmp_path / "home" / "models" / "org" / "demo", folders) is None
    assert outside_note(tmp_path / "disk", folders) is None  # a folder that is the model
    said = outside_note(tmp_path / "elsewhere" / "demo", folders)
    assert said is not None and said.startswith(f"{tmp_path / 'elsewhere'} is not a model folder")
    assert str(folders[0]) in said and "`a` on the Models pane" in said
