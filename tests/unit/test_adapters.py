"""worker/shared/adapters.py: reading an adapter as mlx-lm's load_adapters uses it, the
base model's identity, and which layers an adapter touches (real mlx-lm adapters)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from tests.adapter_model import write_adapter
from worker.shared.adapters import (
    BASE_KEY,
    AdapterError,
    check_identity,
    layer_of,
    model_digest,
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
    assert model_digest(copy) == model_digest(base)
    assert check_identity(adapter, copy) is None


def test_identity_refuses_another_model_naming_both_digests(
    adapter: Path, models: tuple[Path, Path]
) -> None:
    base, other = models
    reason = check_identity(adapter, other)
    assert reason is not None
    assert model_digest(base)[:12] in reason and model_digest(other)[:12] in reason
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
