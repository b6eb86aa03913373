"""A shard: layers [start, end) of an mlx-lm model, and only those in memory.

`mlx_lm.utils.load_model(lazy=True)` builds the family's own model class and
maps the safetensors files without reading them; MLX reads a tensor only when it
is evaluated. The shard replaces the layers it does not run by stand-ins (see
`families`), keeps its own (plus the embedding on the first shard and the norm
and head on the last) and evaluates just those, so the bytes a node reads and
holds are its share of the model. It computes through the model's own forward,
so masks, caches and embedding scales are the family's own.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from worker import families
from worker.cpu_fusion import fuse_for_cpu
from worker.shared.adapters import (
    ADAPTER_LEAVES,
    WEIGHTS_NAME,
    AdapterError,
    adapter_name,
    outside_layers_reason,
    read_adapter,
)
from worker.shared.kv_quant import DEFAULT_KV_GROUP_SIZE, kv_quant_refusal
from worker.shared.kv_quant import family_reason as kv_quant_reason
from worker.shared.model_support import decoder_config
from worker.shared.tensors import named_arrays

Progress = Callable[[int, int], None]


class ShardLoadError(RuntimeError):
    pass


@dataclass
class Shard:
    start: int
    end: int
    n_layers: int
    family: str
    config: dict[str, Any]  # the decoder's settings (a nested text_config merged in)
    inner: Any
    model: Any
    layers: list[Any]
    param_bytes: int
    dtype: Any
    relay: families.Relay
    owned: list[str] = field(default_factory=list)
    adapter: str = ""  # the adapter applied to this shard's layers ("" none)
    adapted: int = 0  # adapter tensors this shard applied
    # Quantized KV (`place --kv-bits`): its caches are mlx-lm's QuantizedKVCache of
    # `kv_bits` (0: full precision, also when the family's attention cannot read them).
    kv_bits: int = 0
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.n_layers

    def make_cache(self) -> families.LayerCaches:
        """mlx-lm's own caches (`make_cache()`) for this shard's layers only."""
        return families.make_caches(
            self.model, self.start, self.end, self.n_layers, self.kv_bits, self.kv_group_size
        )

    @staticmethod
    def cache_offset(caches: families.LayerCaches) -> int:
        """Tokens the caches hold (linear-attention state has no offset of its own)."""
        return caches.offset

    def embed(self, tokens: mx.array) -> mx.array:
        """The head shard's input: token ids. The model's own forward embeds them (and
        scales the embedding where the family does)."""
        return tokens

    def forward(self, h: mx.array, caches: families.LayerCaches) -> mx.array:
        return families.run(self.model, self.relay, self.is_first, h, caches)

    def logits(self, out: mx.array) -> mx.array:
        """Logits of the last position, from the last shard's output (the model's own
        head ran in `forward`: norm, tied embeddings, soft-capping as the family has)."""
        return out[0, -1, :]


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ShardLoadError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise ShardLoadError(f"{model_dir} has no config.json: it is not an mlx-lm model directory")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShardLoadError(f"{path} is not valid JSON: {exc}") from None


def load_shard(
    model_dir: Path,
    start: int,
    end: int,
    progress: Progress | None = None,
    *,
    fuse: bool = True,
    group: mx.distributed.Group | None = None,
    adapter_dir: Path | None = None,
    kv_bits: int = 0,
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
) -> Shard:
    """With `group` (a tensor-parallel stage), this process holds its rank's 1/N slice
    of every layer in [start, end), cut by the model's own `shard(group)`. With
    `adapter_dir`, an mlx-lm LoRA/DoRA adapter is applied to the layers of [start, end)
    it adapts (see `apply_adapter`; pipeline stages only). With `kv_bits` (8 or 4), the
    caches it makes keep K/V quantized where the family's attention reads them so
    (shared.kv_quant)."""
    from mlx_lm.utils import load_model

    config = read_config(model_dir)
    try:
        family = families.check_family(config)
    except families.UnsupportedFamily as exc:
        raise ShardLoadError(str(exc)) from None
    declared = decoder_config(config).get("num_hidden_layers")
    if isinstance(declared, int):
        _check_range(start, end, declared)  # before building anything
    if why := kv_quant_refusal(config, kv_bits, kv_group_size):
        raise ShardLoadError(why)
    if kv_quant_reason(config):
        kv_bits = 0  # kept at full precision, as the preview said
    if group is not None and adapter_dir is not None:
        # mlx-lm's LoRA layers wrap whole projections; a rank holds 1/N slices of them.
        raise ShardLoadError(
            "an adapter is applied by pipeline stages only, not a tensor-parallel one: "
            "place the model with the adapter as a pipeline, or fuse it (studiotui fuse)"
        )
    partial = _missing_weight_files(model_dir)
    try:
        # A node may hold only the files of its own layers: then missing tensors are
        # expected, and _check_present below makes sure none of ours is among them.
        model, config = load_model(model_dir, lazy=True, strict=not partial)
    except Exception as exc:  # mlx-lm raises many types for a broken directory
        raise ShardLoadError(f"cannot load {model_dir}: {type(exc).__name__}: {exc}") from None
    if group is not None:
        _tensor_shard(model, group, str(config.get("model_type", "")))
    try:
        inner_path, inner = families.decoder(model)
    except families.UnsupportedFamily as exc:
        raise ShardLoadError(str(exc)) from None
    n_layers = len(inner.layers)
    _check_range(start, end, n_layers)
    # The layers other shards run become stand-ins, so nothing can evaluate (read) them.
    layers, relay = families.place_stand_ins(inner, start, end)
    owned = _owned_modules(model, inner_path, layers, start, end, n_layers)
    if partial:
        _check_present(model_dir, model, owned)
    _check_backend(owned)
    # After the check of the model's own tensor names (LoRA renames `q_proj.weight` to
    # `q_proj.linear.weight`), before anything is evaluated or fused for the CPU.
    adapted = apply_adapter(model, adapter_dir, start, end) if adapter_dir else 0
    param_bytes = _evaluate(owned, progress)
    if fuse:
        fuse_for_cpu([inner], compile_moe=group is None)  # a no-op on a GPU
    dtype = _first_dtype(layers)
    return Shard(
        start=start,
        end=end,
        n_layers=n_layers,
        family=family,
        config=decoder_config(config),
        inner=inner,
        model=model,
        layers=layers,
        param_bytes=param_bytes,
        dtype=dtype,
        relay=relay,
        owned=[name for name, _ in owned],
        adapter=adapter_name(adapter_dir) if adapter_dir else "",
        adapted=adapted,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
    )


def apply_adapter(model: Any, adapter_dir: Path, start: int, end: int) -> int:
    """Apply an mlx-lm adapter to the layers this shard runs; return how many of its
    tensors it applied.

    mlx-lm's own `load_adapters` does the work, as `mlx_lm.load(adapter_path=...)`
    does: `linear_to_lora_layers` over the model's layer list (the stand-ins of other
    shards' layers hold no modules, so only this shard's layers are converted), then
    the weights, checked by name and shape. It loads every tensor of the file and
    refuses those the model lacks, so it is given a copy of the adapter holding only
    this shard's layers' tensors (a temporary directory; LoRA tensors are small)."""
    from mlx_lm.tuner.utils import load_adapters

    try:
        adapter = read_adapter(adapter_dir)
    except AdapterError as exc:
        raise ShardLoadError(str(exc)) from None
    if adapter.outside:
        raise ShardLoadError(outside_layers_reason(adapter))
    mine = adapter.tensors_in(start, end)
    if not mine:
        return 0  # nothing of ours is adapted: the base layers are the adapted model's
    weights = mx.load(str(adapter_dir / WEIGHTS_NAME))  # lazy: read when saved below
    assert isinstance(weights, dict)
    with tempfile.TemporaryDirectory(prefix="studiotui-adapter-") as tmp:
        part = Path(tmp)
        (part / "adapter_config.json").write_bytes(
            (adapter_dir / "adapter_config.json").read_bytes()
        )
        mx.save_safetensors(str(part / WEIGHTS_NAME), {name: weights[name] for name in mine})
        try:
            load_adapters(model, str(part))
        except (ValueError, KeyError) as exc:
            raise ShardLoadError(f"adapter {adapter.name} does not fit the model: {exc}") from None
        # Read now, while the temporary file exists (MLX loads lazily); the adapter's
        # leaves only: evaluating the whole model would read other shards' bytes.
        mx.eval(
            [
                p
                for n, p in named_arrays(model.parameters())
                if n.rsplit(".", 1)[-1] in ADAPTER_LEAVES
            ]
        )
    model.eval()  # as mlx_lm.load does after load_adapters: no dropout when serving
    return len(mine)


def _tensor_shard(model: Any, group: mx.distributed.Group, family: str) -> None:
    """Cut every layer to this rank's slice with mlx-lm's own `Model.shard(group)`: the
    heads and MLP/expert widths split N ways, and the all-reduces (`all_sum`) that put
    the slices back together sit inside the sharded layers. Lazily: the weights are
    mapped, not read, so a rank reads only its slice when `_evaluate` runs. Before the
    stand-ins are placed, since `shard` walks the model's own layer list."""
    if not callable(getattr(model, "shard", None)):
        raise ShardLoadError(
            f"mlx-lm's {family} model has no shard() method, so it cannot run as a "
            "tensor-parallel stage: place it as a pipeline (one node per stage)"
        )
    try:
        model.shard(group)
    except (ValueError, ZeroDivisionError) as exc:
        # mx.split refuses a width (heads, MLP, a quantization group) N does not divide.
        raise ShardLoadError(
            f"{family} cannot be split {group.size()} ways: {exc}; use a tensor group "
            "whose size divides its heads and layer widths, or a pipeline"
        ) from None


def _check_range(start: int, end: int, n_layers: int) -> None:
    if not 0 <= start < end <= n_layers:
        raise ShardLoadError(
            f"layer range [{start}, {end}) is outside the model's {n_layers} layers"
        )


def _owned_modules(
    model: Any, inner_path: str, layers: list[Any], start: int, end: int, n_layers: int
) -> list[tuple[str, Any]]:
    """What this shard reads: its layers; the embedding on the first shard; the norm and
    head (and the embedding, when the head is tied to it) on the last."""
    prefix = f"{inner_path}." if inner_path else ""
    outer = list(families.outer_modules(model, inner_path))
    tied = not any(name.rsplit(".", 1)[-1] == "lm_head" for name, _ in outer)
    owned: list[tuple[str, Any]] = []
    for name, module in outer:
        embedding = name.rsplit(".", 1)[-1] == "embed_tokens"
        if embedding and (start == 0 or (end == n_layers and tied)):
            owned.append((name, module))
    owned += [(f"{prefix}layers.{start + i}", layer) for i, layer in enumerate(layers)]
    if end == n_layers:
        owned += [(n, m) for n, m in outer if n.rsplit(".", 1)[-1] != "embed_tokens"]
    return owned


def _check_backend(owned: list[tuple[str, Any]]) -> None:
    """Refuse, before reading a byte, experts MLX's CPU backend cannot multiply: its
    gather_mm takes float32 only, so unquantized float16/bfloat16 experts would fail at
    the first token. (Quantized experts use gather_qmm, which takes every dtype; on an
    Apple GPU all of them run.)"""
    from mlx_lm.models.switch_layers import SwitchLinear

    if mx.default_device() != mx.cpu:
        return
    for name, module in owned:
        for path, sub in module.named_modules():
            if type(sub) is SwitchLinear and sub.weight.dtype != mx.float32:
                dtype = _dtype_name(sub.weight.dtype)
                raise ShardLoadError(
                    f"{name}.{path} holds unquantized {dtype} experts, which "
                    "MLX's CPU backend multiplies only in float32: on this node use a "
                    "quantized (4-bit, 8-bit, mxfp4...) or float32 conversion of the model"
                )


def _missing_weight_files(model_dir: Path) -> list[str]:
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return []
    try:
        files = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError) as exc:
        raise ShardLoadError(f"{index} is not a safetensors index: {exc}") from None
    return sorted(f for f in files if not (model_dir / f).is_file())


def _check_present(model_dir: Path, model: Any, owned: list[tuple[str, Any]]) -> None:
    """Every tensor this shard owns is in the files the node holds. A download in the
    original Hugging Face layout names its tensors otherwise (experts one by one,
    gpt-oss's packed blocks...): the model's own `sanitize` renames them, lazily (no byte
    is read), as loading does, and both sets of names count."""
    present_arrays: dict[str, Any] = {}
    for file in model_dir.glob("*.safetensors"):
        loaded = mx.load(str(file))  # lazy: nothing is read
        assert isinstance(loaded, dict)  # a .safetensors file loads as named arrays
        present_arrays.update(loaded)
    present = set(present_arrays)
    if hasattr(model, "sanitize"):
        # A partial set sanitize cannot take leaves the names as they are.
        with contextlib.suppress(Exception):
            present |= set(model.sanitize(dict(present_arrays)))
    for prefix, module in owned:
        for name, _ in named_arrays(module.parameters()):
            if f"{prefix}.{name}" not in present:
                raise ShardLoadError(
                    f"{model_dir} lacks {prefix}.{name}: copy the model's files for this "
                    "shard to the node (placement does this for SSH nodes)"
                )


def _evaluate(owned: list[tuple[str, Any]], progress: Progress | None) -> int:
    sizes = [sum(p.nbytes for _, p in named_arrays(m.parameters())) for _, m in owned]
    total, done = sum(sizes), 0
    if progress:
        progress(0, total)
    for (name, module), size in zip(owned, sizes, strict=True):
        try:
            mx.eval(module.parameters())
        except Exception as exc:
            raise ShardLoadError(f"cannot read the weights of {name}: {exc}") from None
        done += size
        if progress:
            progress(done, total)
    return total


def _first_dtype(layers: list[Any]) -> Any:
    for _, p in named_arrays(layers[0].parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]
