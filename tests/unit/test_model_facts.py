"""Reading a model directory for the planner: headers, index, activation dtype."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from studiotui.core.catalog import scan
from studiotui.core.model_facts import (
    _DTYPE_BITS,
    SAFETENSORS_DTYPES,
    ModelDirError,
    read_model,
    safetensors_tensors,
)
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


# ---- damaged model directories ------------------------------------------------------------
# Each is refused when the directory is listed or previewed, naming the file and what is
# wrong: before, most read as a model (and failed on the node after the copy) or raised a
# bare TypeError / AttributeError.


def _header(file: Path) -> tuple[int, dict[str, Any], bytes]:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _rewrite(file: Path, header: Any, data: bytes) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _weights(model: Path) -> Path:
    return next(iter(sorted(model.glob("*.safetensors"))))


def _first_tensor(model: Path, change: Callable[[dict[str, Any]], None]) -> None:
    file = _weights(model)
    _, header, data = _header(file)
    change(header[next(k for k in header if k != "__metadata__")])
    _rewrite(file, header, data)


def _config(model: Path, **changes: Any) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | changes))


DAMAGE: dict[str, tuple[Callable[[Path], Any], str]] = {
    "config missing": (lambda m: (m / "config.json").unlink(), r"no config\.json"),
    "config not JSON": (
        lambda m: (m / "config.json").write_text('{"model_type": "llama",'),
        r"config\.json is not valid JSON",
    ),
    "config a list": (
        lambda m: (m / "config.json").write_text("[1]"),
        r"config\.json is not a JSON object",
    ),
    "layers a string": (
        lambda m: _config(m, num_hidden_layers="four"),
        r"config\.json: num_hidden_layers is 'four', not a whole number",
    ),
    "layers missing": (
        lambda m: _config(m, num_hidden_layers=None),
        r"config\.json has no num_hidden_layers",
    ),
    "heads a list": (
        lambda m: _config(m, num_attention_heads=[4]),
        r"config\.json has a value mlx-lm cannot use",
    ),
    "quantization a string": (
        lambda m: _config(m, quantization={"group_size": "sixty", "bits": 4}),
        r"config\.json: quantization\.group_size is 'sixty', not a whole number",
    ),
    "weights cut short": (
        lambda m: os.truncate(_weights(m), _weights(m).stat().st_size - 100),
        r"safetensors has \d+ bytes but its tensors need \d+: it is cut short",
    ),
    "header past the end": (
        lambda m: _weights(m).write_bytes(struct.pack("<Q", 4096) + b'{"a":'),
        r"says its header has 4096 bytes but the file ends after \d+",
    ),
    "eight bytes": (lambda m: _weights(m).write_bytes(b"\1\2\3"), r"too short to be safetensors"),
    "header not JSON": (
        lambda m: _weights(m).write_bytes(struct.pack("<Q", 6) + b"{nope}"),
        r"safetensors: its header is not JSON",
    ),
    "header a list": (
        lambda m: _rewrite(_weights(m), [1, 2], b""),
        r"safetensors: its header is not a JSON object",
    ),
    "dtype unknown": (
        lambda m: _first_tensor(m, lambda t: t.update(dtype="Q4")),
        r"has dtype 'Q4', which MLX cannot load",
    ),
    "dtype F64": (
        lambda m: _first_tensor(m, lambda t: t.update(dtype="F64")),
        r"has dtype 'F64', which MLX cannot load",
    ),
    "shape a string": (
        lambda m: _first_tensor(m, lambda t: t.update(shape="64x64")),
        r"has shape '64x64': not a list of sizes",
    ),
    "offsets backwards": (
        lambda m: _first_tensor(m, lambda t: t.update(data_offsets=t["data_offsets"][::-1])),
        r"has data_offsets .*: not \[begin, end\]",
    ),
    "bytes not the shape's": (
        lambda m: _first_tensor(m, lambda t: t.update(shape=[t["shape"][0] * 2, *t["shape"][1:]])),
        r"has \d+ bytes for a \w+ .*: the file is damaged",
    ),
    "index names a missing shard": (
        lambda m: (m / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"x": "model-00009-of-00009.safetensors"}})
        ),
        r"lacks 1 of the 1 weight files .*finish the download",
    ),
    "index map a list": (
        lambda m: (m / "model.safetensors.index.json").write_text('{"weight_map": [1]}'),
        r"index\.json is not a safetensors index",
    ),
    "index not JSON": (
        lambda m: (m / "model.safetensors.index.json").write_text("{"),
        r"index\.json is not a safetensors index",
    ),
    "tokenizer missing": (
        lambda m: (m / "tokenizer.json").unlink(),
        r"has no tokenizer \(tokenizer\.json, .*copy the tokenizer files",
    ),
    "tokenizer not JSON": (
        lambda m: (m / "tokenizer.json").write_text('{"model": {"vocab": '),
        r"tokenizer\.json is not valid JSON",
    ),
    "tokenizer config a string": (
        lambda m: (m / "tokenizer_config.json").write_text('"x"'),
        r"tokenizer_config\.json is not a JSON object",
    ),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(
        tmp_path_factory.mktemp("pristine") / "m",
        DemoSpec(layers=2, hidden=32, heads=2, kv_heads=1),
    )


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_model_directory_is_refused_naming_the_file_and_the_fault(
    tmp_path: Path, pristine: Path, damage: str
) -> None:
    model = tmp_path / "m"
    shutil.copytree(pristine, model)
    read_model(model)  # whole, it reads
    breaks, says = DAMAGE[damage]
    breaks(model)
    with pytest.raises(ModelDirError, match=says):
        read_model(model)
    # The catalog (the TUI's Models pane, `studiotui models`) lists it as skipped with
    # the same words, not with an exception's class name.
    listed = scan([tmp_path], hf_cache=None)
    assert not listed.models
    (skipped,) = listed.skipped
    assert re.search(says, skipped.reason) and "Error:" not in skipped.reason, skipped.reason


def test_the_dtypes_read_are_those_mlx_loads(tmp_path: Path) -> None:
    """The list of loadable dtypes is MLX's own: each one loads, the rest do not."""
    bits = {"BOOL": 8, "F64": 64, "F8_E5M2": 8, "F4": 4, "U4": 4}
    for dtype in sorted(SAFETENSORS_DTYPES | set(bits)):
        file = tmp_path / f"{dtype}.safetensors"
        size = 4 * (_DTYPE_BITS.get(dtype) or bits[dtype]) // 8
        _rewrite(
            file, {"t": {"dtype": dtype, "shape": [4], "data_offsets": [0, size]}}, b"\0" * size
        )
        try:
            mx.load(str(file))
            loads = True
        except (RuntimeError, ValueError):
            loads = False
        assert loads == (dtype in SAFETENSORS_DTYPES), dtype
