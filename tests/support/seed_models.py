"""The seeds' models on paper: header-only safetensors of DeepSeek, Kimi, Qwen, GLM, gpt-oss.

The shapes come from the published config.json (tests/fixtures/models/, sources in
its README) given to mlx-lm's own model class, built lazily: MLX evaluates nothing,
so no memory is spent on a 1 TB model. `mlx_lm.utils.quantize_model` quantizes the
lazy model as `mlx_lm.convert` would (its own predicates, group sizes and modes),
and the result is written the way mlx-lm saves a model — 5 GB shards named
`model-0000N-of-0000M.safetensors` plus `model.safetensors.index.json` — except that
each file holds only its header: it is then extended (sparse) to its real length,
so the planner reads it exactly as it reads a download, on a few KB of disk.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import _get_classes, quantize_model

from worker.shared.demo_model import tokenizer_config, tokenizer_json

CONFIGS = Path(__file__).parents[1] / "fixtures" / "models"
SHARD_BYTES = 5 * 1024**3  # mlx-lm's own MAX_FILE_SIZE_GB
_SAFETENSORS_DTYPES = {
    mx.float32: "F32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.uint32: "U32",
    mx.uint8: "U8",
    mx.int8: "I8",
    mx.int32: "I32",
}

# How each is usually downloaded: (mode, bits, group size) as mlx-community publishes.
QUANTS: dict[str, tuple[str, int, int]] = {
    "8bit": ("affine", 8, 64),
    "4bit": ("affine", 4, 64),
    "mxfp4": ("mxfp4", 4, 32),
}


def published_config(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def lazy_tensors(config: dict[str, Any], quant: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Name → lazy array (never evaluated) of the model as mlx-lm would save it, and
    the config.json it would write beside it."""
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    # As mlx_lm.convert: floating weights to the published dtype, then quantize.
    dtype = getattr(mx, str(config.get("torch_dtype", "bfloat16")))
    cast = getattr(model, "cast_predicate", lambda _: True)
    model.update(
        tree_map_with_path(
            lambda k, v: v.astype(dtype) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    mode, bits, group = QUANTS[quant]
    model, saved_config = quantize_model(model, config, group, bits, mode=mode)
    return dict(tree_flatten(model.parameters())), saved_config


def write_header_only(path: Path, config: dict[str, Any], quant: str) -> Path:
    """A model directory whose safetensors hold headers only, sparse to their real size."""
    tensors, saved_config = lazy_tensors(config, quant)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, array in tensors.items():  # mlx-lm's make_shards: in the model's order
        if shards[-1] and size + array.nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, array))
        size += array.nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
        offset = 0
        for name, array in shard:
            end = offset + array.nbytes
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[array.dtype],
                "shape": list(array.shape),
                "data_offsets": [offset, end],
            }
            offset = end
            weight_map[name] = file
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
        with (path / file).open("wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
        os.truncate(path / file, 8 + len(raw) + offset)  # sparse: no data block is written
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(saved_config, indent=2))
    # A real (byte-level) tokenizer, as every model directory has one: the preview
    # refuses a directory without (studiotui/core/model_facts.py check_tokenizer).
    (path / "tokenizer.json").write_text(tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    return path


def seed_model(root: Path, name: str, quant: str) -> Path:
    """`root/name-quant`, written once (the caller caches `root` for the session)."""
    path = root / f"{name}-{quant}"
    if not (path / "config.json").is_file():
        write_header_only(path, published_config(name), quant)
    return path


def renamed(model: Path, name: str) -> Path:
    """The same weights under another name (DeepSeek-R1 has V3's shapes): each file's
    header copied and extended sparse to its size, as a download of its own (a link out
    of the folder is refused, as it should be)."""
    path = model.parent / name
    if not path.exists():
        path.mkdir()
        for file in model.iterdir():
            if file.suffix == ".safetensors":
                with file.open("rb") as f:
                    head = f.read(8)
                    head += f.read(int.from_bytes(head, "little"))
                (path / file.name).write_bytes(head)
                os.truncate(path / file.name, file.stat().st_size)
            else:
                shutil.copy(file, path / file.name)
    return path
