"""What the planner needs to know about a model directory, read without loading it.

Sizes come from the safetensors headers (the `safetensors` library reads them
without touching the tensor data), names are mapped to layers the way mlx-lm
names them: `model.layers.N.…` belongs to layer N, the embedding to the first
shard, the final norm and `lm_head` to the last.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from studiotui.placement import ModelFacts

_DTYPE_BYTES = {
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "U8": 1,
    "I8": 1,
    "F64": 8,
    "I64": 8,
    "U16": 2,
    "I16": 2,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ModelDirError(ValueError):
    pass


_SNAPSHOT = re.compile(r"(?:^|/)models--[^/]+/snapshots/[^/]+$")


def allowed_root(model_dir: Path) -> Path:
    """Where a model's files may really live: the directory itself, or for a hub
    snapshot (whose files link to `../../blobs/<hash>`) its repository folder."""
    if _SNAPSHOT.search(model_dir.as_posix().rstrip("/")):
        return model_dir.parent.parent
    return model_dir


def outside_links(model_dir: Path, names: list[str] | set[str]) -> list[str]:
    """The named files whose real path (symlinks followed) is outside `allowed_root`."""
    root = allowed_root(model_dir).resolve()
    return sorted(n for n in names if not (model_dir / n).resolve().is_relative_to(root))


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    name: str
    family: str
    n_layers: int
    params: int
    disk_bytes: int
    dtype: str
    quantization: str | None
    facts: ModelFacts


def read_model(path: Path) -> ModelInfo:
    path = path.expanduser()
    config = _config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelDirError(f"{path} has no *.safetensors weight files")
    # Nothing outside the model's folder is read on its behalf, not even a header.
    outside = outside_links(path, {f.name for f in files})
    if outside:
        raise ModelDirError(
            f"{path / outside[0]} links to {(path / outside[0]).resolve()}, outside the model "
            "directory; copy the file into the model folder instead of linking it"
        )
    n_layers = int(config.get("num_hidden_layers", 0))
    if n_layers < 1:
        raise ModelDirError(f"{path}/config.json has no num_hidden_layers")
    per_layer = [0] * n_layers
    embed = head = params = 0
    tied = bool(config.get("tie_word_embeddings", False))
    dtypes: dict[str, int] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensor = f.get_slice(key)
                    shape, dtype = tensor.get_shape(), tensor.get_dtype()
                    count = 1
                    for d in shape:
                        count *= d
                    size = count * _DTYPE_BYTES.get(dtype, 2)
                    params += count
                    dtypes[dtype] = dtypes.get(dtype, 0) + size
                    if m := _LAYER.search(key):
                        layer = int(m.group(1))
                        if layer < n_layers:
                            per_layer[layer] += size
                    elif "embed_tokens" in key:
                        embed += size
                    else:
                        head += size
        except Exception as exc:
            raise ModelDirError(f"cannot read {file}: {exc}") from None
    if tied:
        head += embed
    quant = config.get("quantization") or config.get("quantization_config")
    qtext = f"{quant.get('bits')}-bit" if isinstance(quant, dict) and quant.get("bits") else None
    dtype = max(dtypes, key=lambda k: dtypes[k]) if dtypes else "?"
    kv_heads = int(config.get("num_key_value_heads") or config.get("num_attention_heads", 1))
    head_dim = int(
        config.get("head_dim")
        or int(config.get("hidden_size", 0)) // max(1, int(config.get("num_attention_heads", 1)))
    )
    act_bytes = 2 if dtype in ("BF16", "F16") or qtext else 4
    facts = ModelFacts(
        name=path.name,
        family=str(config.get("model_type", "?")),
        n_layers=n_layers,
        layer_bytes=tuple(per_layer),
        embed_bytes=embed,
        head_bytes=head,
        kv_bytes_per_token=2 * kv_heads * head_dim * act_bytes,
        dtype=dtype.lower(),
        quantization=qtext,
    )
    return ModelInfo(
        path=path,
        name=path.name,
        family=facts.family,
        n_layers=n_layers,
        params=params,
        disk_bytes=sum(f.stat().st_size for f in files),
        dtype=dtype,
        quantization=qtext,
        facts=facts,
    )


def _config(path: Path) -> dict:
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ModelDirError(f"{path} has no config.json: not an mlx-lm model directory")
    try:
        data = json.loads(cfg.read_text())
    except ValueError as exc:
        raise ModelDirError(f"{cfg} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{cfg} is not a JSON object")
    return data
