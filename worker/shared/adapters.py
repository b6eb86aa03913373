"""A LoRA/DoRA adapter directory in mlx-lm's format, and the base model it belongs to.

mlx-lm's trainer saves an adapter as `adapter_config.json` (fine_tune_type, num_layers,
lora_parameters: rank, scale, dropout, optional keys) beside `adapters.safetensors`
(the `lora_a`/`lora_b` (and DoRA `m`) tensors, named like the model's own, e.g.
`model.layers.7.self_attn.q_proj.lora_a`). An adapter only means something on the
exact weights it was trained on, so studiotui stamps the base's identity into the
config under `studiotui_base`: the model directory's name (for people) and its digest
(for the check): `manifest.model_digest`, the SHA-256 of the folder's manifest (name,
size, SHA-256 of every file), so a renamed copy matches and a fine-tune with the same
file names does not. Hashes come from `worker.shared.manifest`, whose per-directory
cache makes a second look free.

A shard holds some layers only; `layers` says which decoder layers an adapter
touches and `layer_sizes` how many bytes of it each holds (read from the safetensors
header, no tensor is read), so a shard can tell whether it has anything to apply and
the planner counts each layer's share on the shard holding it.

Stdlib only: the operator refuses a mismatched or malformed adapter before copying
anything, with the same reading the node uses.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.shared.manifest import Hashing, in_hub_cache, model_digest

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapters.safetensors"
FILES = (CONFIG_NAME, WEIGHTS_NAME)
BASE_KEY = "studiotui_base"
# "full" fine-tunes save whole weights, not an adapter: those are fused models already.
FINE_TUNE_TYPES = ("lora", "dora")
# The leaves mlx-lm's load_adapters accepts from a lora/dora adapter.
ADAPTER_LEAVES = ("lora_a", "lora_b", "m")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own bound on a header


class AdapterError(ValueError):
    """An adapter directory that cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class BaseIdentity:
    model: str  # the base model directory's name, for people
    digest: str  # base_digest() of the base, for the check

    def as_dict(self) -> dict[str, str]:
        return {"model": self.model, "digest": self.digest}


@dataclass(frozen=True)
class Adapter:
    path: Path
    fine_tune_type: str
    num_layers: int
    rank: int
    scale: float
    tensors: tuple[str, ...]  # names in adapters.safetensors
    layers: tuple[int, ...]  # decoder layers the tensors adapt, ascending
    base: BaseIdentity | None
    weight_bytes: int
    # (layer, bytes of its tensors) for each adapted layer, ascending: what the shard
    # holding that layer holds more (mlx-lm loads the tensors as saved, dtype and all).
    layer_sizes: tuple[tuple[int, int], ...] = ()

    @property
    def name(self) -> str:
        return adapter_name(self.path)

    @property
    def outside(self) -> tuple[str, ...]:
        """Tensors of modules outside the decoder layers (an adapted lm_head, embedding)."""
        return tuple(t for t in self.tensors if layer_of(t) is None)

    def touches(self, start: int, end: int) -> bool:
        """Whether a shard running layers [start, end) has any adapted layer."""
        return any(start <= n < end for n in self.layers)

    def bytes_by_layer(self, n_layers: int) -> tuple[int, ...]:
        """Bytes of adapter tensors on each of a model's `n_layers` layers (the planner's
        input); layers beyond the model are the identity check's to refuse."""
        out = [0] * n_layers
        for layer, size in self.layer_sizes:
            if layer < n_layers:
                out[layer] += size
        return tuple(out)

    def tensors_in(self, start: int, end: int) -> list[str]:
        """The adapter's tensors a shard of layers [start, end) applies."""
        return [t for t in self.tensors if (n := layer_of(t)) is not None and start <= n < end]


def adapter_name(adapter_dir: Path) -> str:
    """What an adapter is called: its folder's name, or the folder above when that is
    `adapters` (mlx-lm's default output folder, and a fine-tuning job's), so
    `jobs/legal/adapters` is "legal", not one of many "adapters"."""
    path = Path(adapter_dir)
    if path.name == "adapters" and path.parent.name not in ("", "/"):
        return path.parent.name
    return path.name


def layer_of(tensor: str) -> int | None:
    """The decoder layer a tensor name belongs to (`model.layers.7.mlp...` -> 7)."""
    match = _LAYER.search(tensor)
    return int(match.group(1)) if match else None


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (names, dtypes, shapes); no tensor is read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise AdapterError(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise AdapterError(f"{path} is not a safetensors file (header of {size} bytes)")
            header = json.loads(f.read(size))
    except OSError as exc:
        raise AdapterError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise AdapterError(f"{path} is not a safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path} is not a safetensors file (its header is not a table)")
    return header


def _config(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / CONFIG_NAME
    if not adapter_dir.is_dir():
        raise AdapterError(f"adapter directory {adapter_dir} does not exist")
    if not path.is_file():
        raise AdapterError(
            f"{adapter_dir} has no {CONFIG_NAME}: an adapter is the folder mlx-lm's "
            f"trainer (or `studiotui finetune`) saved, with {CONFIG_NAME} and {WEIGHTS_NAME}"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path} does not hold a JSON object")
    return config


def read_adapter(adapter_dir: Path) -> Adapter:
    """Read and check an adapter directory as mlx-lm's `load_adapters` will use it."""
    adapter_dir = Path(adapter_dir)
    config = _config(adapter_dir)
    path = adapter_dir / CONFIG_NAME
    kind = config.get("fine_tune_type", "lora")  # mlx-lm's default
    if kind not in FINE_TUNE_TYPES:
        raise AdapterError(
            f"{path}: fine_tune_type {kind!r} is not an adapter (lora or dora); a 'full' "
            "fine-tune is a whole model: place its directory as a model"
        )
    num_layers = config.get("num_layers")
    if not isinstance(num_layers, int) or isinstance(num_layers, bool):
        raise AdapterError(f"{path}: num_layers must be an integer (how many last layers)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError(f"{path}: lora_parameters (rank, scale, dropout) is missing")
    for key in ("rank", "scale", "dropout"):
        value = params.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            hint = " (mlx-lm calls it scale, not alpha)" if key == "scale" else ""
            raise AdapterError(f"{path}: lora_parameters.{key} must be a number{hint}")
    if not isinstance(params["rank"], int) or params["rank"] < 1:
        raise AdapterError(f"{path}: lora_parameters.rank must be a positive integer")
    keys = params.get("keys")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise AdapterError(f"{path}: lora_parameters.keys must be a list of module names")
    weights = adapter_dir / WEIGHTS_NAME
    if not weights.is_file():
        raise AdapterError(f"{adapter_dir} has no {WEIGHTS_NAME}: the adapter was not saved")
    header = safetensors_header(weights)
    tensors = tuple(sorted(k for k in header if k != "__metadata__"))
    if not tensors:
        raise AdapterError(f"{weights} holds no tensors")
    foreign = [t for t in tensors if t.rsplit(".", 1)[-1] not in ADAPTER_LEAVES]
    if foreign:
        raise AdapterError(
            f"{weights} holds {foreign[0]!r}, which is not a {kind} adapter tensor "
            f"(their names end in {', '.join(ADAPTER_LEAVES)})"
        )
    layers = tuple(sorted({n for t in tensors if (n := layer_of(t)) is not None}))
    sizes = dict.fromkeys(layers, 0)
    for t in tensors:
        if (n := layer_of(t)) is not None:
            sizes[n] += _tensor_bytes(header[t], weights)
    return Adapter(
        path=adapter_dir,
        fine_tune_type=kind,
        num_layers=num_layers,
        rank=int(params["rank"]),
        scale=float(params["scale"]),
        tensors=tensors,
        layers=layers,
        base=_base(config.get(BASE_KEY)),
        weight_bytes=weights.stat().st_size,
        layer_sizes=tuple(sizes.items()),
    )


def _tensor_bytes(entry: Any, weights: Path) -> int:
    """A tensor's bytes from its header entry (`data_offsets`: [begin, end))."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise AdapterError(f"{weights} is not a safetensors file (a tensor has no data offsets)")
    return int(offsets[1] - offsets[0])


def outside_layers_reason(adapter: Adapter) -> str:
    """Why a placement cannot apply an adapter of modules outside the decoder layers."""
    return (
        f"adapter {adapter.name} adapts {adapter.outside[0]!r}, outside the decoder layers: "
        "shards apply adapters to their layers only; fuse it into a model instead "
        "(studiotui fuse MODEL --adapter DIR --out NEW_DIR) and place that"
    )


def _base(raw: Any) -> BaseIdentity | None:
    if not isinstance(raw, dict):
        return None
    model, digest = raw.get("model"), raw.get("digest")
    if not isinstance(model, str) or not isinstance(digest, str):
        return None
    return BaseIdentity(model, digest)


def base_digest(model_dir: Path, on_progress: Hashing | None = None) -> str:
    """The digest an adapter's base is known by: `manifest.model_digest` of the model
    folder (every file's name, size and SHA-256; the fine-tuning job stamps the same),
    with no cache written into a Hugging Face snapshot (the hub's folder). The hashes
    are cached beside the files by size and mtime, so only the first look reads them;
    `on_progress(done, total)` hears that reading in bytes."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise AdapterError(f"{model_dir} has no config.json: it is not a model directory")
    write = not in_hub_cache(model_dir)
    return model_digest(model_dir, write_cache=write, on_progress=on_progress)


def identity_of(model_dir: Path, on_progress: Hashing | None = None) -> BaseIdentity:
    model_dir = Path(model_dir)
    return BaseIdentity(model_dir.resolve().name, base_digest(model_dir, on_progress))


def stamp_identity(
    adapter_dir: Path, model_dir: Path, on_progress: Hashing | None = None
) -> BaseIdentity:
    """Write the base model's identity into the adapter's config (other keys kept)."""
    adapter_dir = Path(adapter_dir)
    config = _config(adapter_dir)
    identity = identity_of(model_dir, on_progress)
    config[BASE_KEY] = identity.as_dict()
    path = adapter_dir / CONFIG_NAME
    tmp = path.with_name(f".{CONFIG_NAME}.tmp")
    tmp.write_text(json.dumps(config, indent=4) + "\n")
    tmp.replace(path)
    return identity


def check_identity(adapter_dir: Path, model_dir: Path) -> str | None:
    """None when the adapter was stamped with this model's identity, else why not (a
    sentence naming both and what to do)."""
    try:
        adapter = read_adapter(Path(adapter_dir))
    except AdapterError as exc:
        return str(exc)
    return identity_mismatch(adapter, model_dir)


def identity_mismatch(
    adapter: Adapter, model_dir: Path, on_progress: Hashing | None = None
) -> str | None:
    """`check_identity` for an adapter already read (`on_progress`: see base_digest)."""
    model_dir = Path(model_dir)
    if adapter.base is None:
        return (
            f"adapter {adapter.name} does not say which model it was trained on (no "
            f"{BASE_KEY} in its {CONFIG_NAME}); if it was trained on {model_dir.name}, "
            f"stamp it: studiotui adapter stamp {adapter.path} --model {model_dir}"
        )
    try:
        digest = base_digest(model_dir, on_progress)
    except AdapterError as exc:
        return str(exc)
    if digest == adapter.base.digest:
        return None
    return (
        f"adapter {adapter.name} was trained on {adapter.base.model} (digest "
        f"{adapter.base.digest[:12]}), not on {model_dir.name} (digest {digest[:12]}): "
        f"use it with {adapter.base.model}, or train an adapter for {model_dir.name}"
    )
