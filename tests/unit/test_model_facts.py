"""Reading a model directory for the planner: headers, index, activation dtype."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from studiotui.core.model_facts import ModelDirError, read_model, safetensors_tensors
from worker.shared.demo_model import DemoSpec, write_demo_model


def test_sizes_are_the_headers_byte_ranges_and_an_unfinished_download_is_refused(
    tmp_path: Path,
) -> None:
    model = write_demo_model(tmp_path / "m", DemoSpec(layers=4, hidden=64, files=3))
    info = read_model(model)
    tensors: dict = {}
    for file in model.glob("*.safetensors"):
        tensors.update(safetensors_tensors(file))
    layer2 = sum(t.nbytes for k, t in tensors.items() if k.startswith("model.layers.2."))
    assert info.facts.layer_bytes[2] == layer2 > 0
    assert info.facts.weight_bytes == sum(t.nbytes for t in tensors.values())
    assert info.unsupported is None
    # The index names three files; one is not there yet.
    next(iter(sorted(model.glob("*.safetensors")))).unlink()
    with pytest.raises(ModelDirError, match=r"lacks 1 of the 3 weight files.*finish the download"):
        read_model(model)


def test_caches_take_the_activation_dtype_not_the_config_default(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "m", DemoSpec(layers=2, hidden=64, dtype="bfloat16"))
    config = json.loads((model / "config.json").read_text())
    config.pop("torch_dtype", None)
    (model / "config.json").write_text(json.dumps(config))
    facts = read_model(model).facts
    # bfloat16 embeddings: 2 bytes a cached value, whatever config.json leaves out.
    assert facts.dtype == "bfloat16"
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert facts.kv_bytes(1) == [2 * heads * head_dim * 2] * 2


@pytest.mark.parametrize("quantize", ["4", "mixed", "mxfp4"])
def test_a_quantized_model_counts_as_many_parameters_as_its_float_original(
    tmp_path: Path, quantize: str
) -> None:
    """MLX packs 32 // bits values into each uint32 of a quantized weight: counting
    the packed elements gave the place preview a 4-bit model an eighth of its
    parameters (1.3M where the Models pane said 8.0M). Per-module bits (mixed, and
    the 8-bit router mlx-lm keeps in a 4-bit MoE) count too."""
    spec = DemoSpec(arch="qwen3_moe", layers=2, hidden=128, heads=4, kv_heads=2)
    plain = read_model(write_demo_model(tmp_path / "f", spec))
    packed = read_model(write_demo_model(tmp_path / "q", replace(spec, quantize=quantize)))
    assert packed.params == plain.params
