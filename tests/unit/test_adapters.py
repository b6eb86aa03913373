"""worker/shared/adapters.py: reading an adapter as mlx-lm's load_adapters uses it, the
base model's identity, and which layers an adapter touches (real mlx-lm adapters)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest

from studiotui.cli.adapter_cmd import fuse_target
from studiotui.core.adapter_catalog import (
    AdapterRefused,
    adapter_folders,
    adapter_placement_name,
    check_adapter,
    converted_from,
    resolve_adapter,
    scan_adapters,
)
from studiotui.core.errors import UserError
from studiotui.core.model_facts import read_model
from tests.support.adapter_model import write_adapter
from worker.shard import load_shard
from worker.shared import manifest
from worker.shared.adapters import (
    BASE_KEY,
    AdapterError,
    base_digest,
    check_identity,
    layer_of,
    read_adapter,
    stamp_identity,
)
from worker.shared.demo_model import DemoSpec, write_demo_model

SPEC = DemoSpec(arch="llama", layers=4, hidden=32, heads=4, kv_heads=2, dtype="float32", seed=5)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    base = write_demo_model(root / "base", SPEC)
    other = write_demo_model(root / "other", DemoSpec(**{**SPEC.__dict__, "seed": 6}))
    return base, other


@pytest.fixture
def adapter(models: tuple[Path, Path], tmp_path: Path) -> Path:
    return write_adapter(models[0], tmp_path / "ad", num_layers=2)


def test_reads_a_real_adapter_and_the_layers_it_touches(adapter: Path) -> None:
    a = read_adapter(adapter)
    assert (a.fine_tune_type, a.num_layers, a.rank, a.scale) == ("lora", 2, 4, 4.0)
    assert a.layers == (2, 3)  # num_layers=2 adapts the last two of four
    assert a.touches(2, 4) and a.touches(3, 4) and not a.touches(0, 2)
    assert a.tensors_in(0, 2) == []
    assert a.tensors_in(3, 4) and all(".layers.3." in t for t in a.tensors_in(3, 4))
    assert a.base is not None and a.base.model == "base"
    assert a.weight_bytes == (adapter / "adapters.safetensors").stat().st_size
    # Each layer's bytes, as the tensors MLX itself loads from the file weigh.
    loaded = mx.load(str(adapter / "adapters.safetensors"))
    for layer in (2, 3):
        mine = sum(v.nbytes for k, v in loaded.items() if f".layers.{layer}." in k)
        assert dict(a.layer_sizes)[layer] == mine > 0
    assert a.bytes_by_layer(4) == (0, 0, dict(a.layer_sizes)[2], dict(a.layer_sizes)[3])


def test_layer_of_reads_decoder_layer_indices() -> None:
    assert layer_of("model.layers.12.self_attn.q_proj.lora_a") == 12
    assert layer_of("language_model.model.layers.0.mlp.lora_b") == 0
    assert layer_of("lm_head.lora_a") is None


def test_identity_matches_its_base_and_a_renamed_copy(
    adapter: Path, models: tuple[Path, Path], tmp_path: Path
) -> None:
    base, _ = models
    assert check_identity(adapter, base) is None
    copy = tmp_path / "renamed"
    shutil.copytree(base, copy)
    assert base_digest(copy) == base_digest(base)
    assert check_identity(adapter, copy) is None


def test_identity_refuses_another_model_naming_both_digests(
    adapter: Path, models: tuple[Path, Path]
) -> None:
    base, other = models
    reason = check_identity(adapter, other)
    assert reason is not None
    assert base_digest(base)[:12] in reason and base_digest(other)[:12] in reason
    assert "trained on base" in reason and "not on other" in reason


def test_unstamped_adapter_is_refused_with_how_to_stamp(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    base, _ = models
    ad = write_adapter(base, tmp_path / "plain", stamp=False)
    reason = check_identity(ad, base)
    assert reason is not None and "studiotui adapter stamp" in reason
    stamped = stamp_identity(ad, base)
    config = json.loads((ad / "adapter_config.json").read_text())
    assert config[BASE_KEY] == {"model": "base", "digest": stamped.digest}
    assert config["lora_parameters"]["rank"] == 4  # other keys kept
    assert check_identity(ad, base) is None


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda c: c.update(fine_tune_type="full"), "not an adapter"),
        (lambda c: c.pop("num_layers"), "num_layers"),
        (lambda c: c.pop("lora_parameters"), "lora_parameters"),
        (lambda c: c["lora_parameters"].pop("scale"), "scale, not alpha"),
        (lambda c: c["lora_parameters"].update(rank=0), "rank"),
        (lambda c: c["lora_parameters"].update(keys="q_proj"), "keys"),
    ],
)
def test_malformed_configs_are_named(
    adapter: Path, edit: Callable[[dict[str, Any]], object], words: str
) -> None:
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=words):
        read_adapter(adapter)


def test_missing_or_broken_files_are_named(adapter: Path, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="does not exist"):
        read_adapter(tmp_path / "nowhere")
    (adapter / "adapters.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(AdapterError, match="not a safetensors file"):
        read_adapter(adapter)
    (adapter / "adapters.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"no adapters\.safetensors"):
        read_adapter(adapter)
    (adapter / "adapter_config.json").write_text("{")
    with pytest.raises(AdapterError, match="not valid JSON"):
        read_adapter(adapter)
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"has no adapter_config\.json"):
        read_adapter(adapter)


def test_a_model_tensor_in_the_adapter_is_refused(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    ad = write_adapter(models[0], tmp_path / "ad")
    mx.save_safetensors(
        str(ad / "adapters.safetensors"), {"model.layers.0.mlp.up_proj.weight": mx.zeros((2, 2))}
    )
    with pytest.raises(AdapterError, match="not a lora adapter tensor"):
        read_adapter(ad)


def test_adapters_are_found_in_home_and_configured_folders_by_base_name(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    base, _ = models
    home = tmp_path / "home"
    write_adapter(base, home / "adapters" / "style")
    write_adapter(base, tmp_path / "elsewhere" / "tiny-runs" / "run1")  # one level nested
    (home / "adapters" / "broken").mkdir(parents=True)
    (home / "adapters" / "broken" / "adapter_config.json").write_text("{")
    (home / "config.toml").write_text(f'adapters_dirs = ["{tmp_path / "elsewhere"}", "rel"]\n')
    folders = adapter_folders(home)
    assert folders == (home / "adapters", tmp_path / "elsewhere", home / "rel")
    catalog = scan_adapters(folders)
    assert sorted(a.name for a in catalog.for_model("base")) == ["run1", "style"]
    assert catalog.for_model("other") == []
    [(path, why)] = catalog.skipped
    assert path.name == "broken" and "not valid JSON" in why
    assert resolve_adapter("run1", home) == (tmp_path / "elsewhere" / "tiny-runs" / "run1")
    with pytest.raises(AdapterRefused, match="adapters found: run1, style"):
        resolve_adapter("nope", home)


def test_a_hub_snapshot_is_hashed_without_writing_into_the_hub_cache(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    base, _ = models
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(base, snapshot, ignore=shutil.ignore_patterns(".studiotui-manifest.json"))
    assert base_digest(snapshot) == base_digest(base)
    assert not (snapshot / ".studiotui-manifest.json").exists()


@pytest.mark.parametrize("split", [(0, 1, 4), (0, 3, 4), (0, 2, 3, 4)])
def test_shards_apply_only_their_layers_part_and_compose_to_mlx_lm(
    models: tuple[Path, Path], tmp_path: Path, split: tuple[int, ...]
) -> None:
    """In-process: each shard's forward, chained, gives mlx-lm's logits for the model
    loaded with the adapter; a shard with no adapted layer applies nothing."""
    base, _ = models
    ad = write_adapter(base, tmp_path / "ad", num_layers=3)  # layers 1-3
    full, tok = mlx_lm.load(str(base), adapter_path=str(ad))
    ids = mx.array([tok.encode("A shard holds some layers only.")])
    want = full(ids)[0, -1]
    shards = [load_shard(base, a, b, adapter_dir=ad) for a, b in itertools.pairwise(split)]
    h = ids
    for shard in shards:
        h = shard.forward(h, shard.make_cache())
    got = shards[-1].logits(h)
    assert mx.allclose(got, want, atol=1e-5).item()
    assert int(mx.argmax(got).item()) == int(mx.argmax(want).item())
    adapted = [s.adapted for s in shards]
    # Seven projections a layer, two tensors each.
    assert adapted == [
        14 * len([n for n in (1, 2, 3) if a <= n < b]) for a, b in itertools.pairwise(split)
    ]
    assert all(s.adapter == "ad" for s in shards)


def test_an_adapter_saved_as_adapters_is_named_after_its_folder(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """mlx-lm (and a fine-tuning job) save into a folder called `adapters`."""
    base, _ = models
    ad = write_adapter(base, tmp_path / "jobs" / "legal" / "adapters")
    assert read_adapter(ad).name == "legal"
    assert adapter_placement_name(base, ad) == "base+legal"
    assert read_adapter(write_adapter(base, tmp_path / "style")).name == "style"


def test_fuse_writes_into_the_models_folder_and_never_over_a_model(tmp_path: Path) -> None:
    home, model, ad = tmp_path / "home", tmp_path / "tiny", tmp_path / "style"
    assert fuse_target(None, home, model, ad) == home / "models" / "tiny+style-fused"
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="exists and is not empty"):
        fuse_target(tmp_path / "taken", home, model, ad)
    (tmp_path / "empty").mkdir()
    assert fuse_target(tmp_path / "empty", home, model, ad) == tmp_path / "empty"


def test_an_adapter_whose_num_layers_does_not_cover_its_tensors_is_refused(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    base, _ = models
    info = read_model(base)
    ad = write_adapter(base, tmp_path / "ad", num_layers=3)  # layers 1-3
    assert check_adapter(ad, base, info).layers == (1, 2, 3)
    config = json.loads((ad / "adapter_config.json").read_text())
    config["num_layers"] = 2
    (ad / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterRefused, match=r"tensors of layer 1, but its num_layers \(2\)"):
        check_adapter(ad, base, info)
    assert [converted_from(n, 4) for n in (-1, 0, 2, 4, 9)] == [0, 0, 2, 0, 0]


def test_the_first_check_of_a_base_reports_hashing_in_bytes_and_the_second_reads_nothing(
    models: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, _ = models
    fresh = tmp_path / "fresh"  # a copy with no hashes cached yet, as a new download
    shutil.copytree(base, fresh, ignore=shutil.ignore_patterns(".studiotui-manifest.json"))
    ad = write_adapter(base, tmp_path / "ad", num_layers=2)  # stamped by content: fits fresh
    read: list[str] = []
    real = manifest.sha256_file
    monkeypatch.setattr(
        manifest, "sha256_file", lambda p, on=None: read.append(Path(p).name) or real(p, on)
    )
    heard: list[tuple[int, int]] = []
    info = read_model(fresh)
    check_adapter(ad, fresh, info, lambda done, total: heard.append((done, total)))
    files = [p for p in fresh.iterdir() if not p.name.startswith(".")]
    size = sum(p.stat().st_size for p in files)
    assert sorted(read) == sorted(p.name for p in files)  # every byte, once
    assert heard[0] == (0, size) and heard[-1] == (size, size)
    assert [d for d, _ in heard] == sorted(d for d, _ in heard)  # only forward
    assert len(heard) >= len(files) + 1
    # The second check: the cache (size and mtime of every file) answers; nothing read.
    read.clear()
    heard.clear()
    check_adapter(ad, fresh, info, lambda done, total: heard.append((done, total)))
    assert read == [] and heard == []
    # A file changed since (same size, new mtime) is read again, alone.
    weights = next(p for p in files if p.suffix == ".safetensors")
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    check_adapter(ad, fresh, info, lambda done, total: heard.append((done, total)))
    assert read == [weights.name] and heard[-1] == (weights.stat().st_size,) * 2
