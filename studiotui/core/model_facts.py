"""What the planner needs to know about a model directory, read without loading it.

Sizes come from the safetensors headers alone (the JSON at the start of each file
gives every tensor's byte range), so reading a 700 GB download takes milliseconds
and a header-only copy of one reads the same. Names are mapped to layers the way
mlx-lm names them: `…layers.N.…` belongs to layer N — experts (`switch_mlp`,
`experts.M`), quantized `.scales`/`.biases` and all — the embedding to the first
shard, the final norm and `lm_head` to the last. Caches are sized per layer and
per family by `kv_sizes`.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from studiotui.core.errors import StudioError
from studiotui.core.kv_sizes import full_precision_note, layer_caches, text_config
from studiotui.core.placement import ModelFacts, TensorFacts, facts_from_config
from worker.shared.kv_quant import DEFAULT_KV_GROUP_SIZE, group_size_for, kv_quant_refusal
from worker.shared.kv_quant import family_reason as kv_quant_reason
from worker.shared.manifest import in_hub_cache
from worker.shared.model_support import unsupported_reason

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# What mlx-lm's `shard()` methods cut N ways (`shard_linear` / `shard_inplace` / sliced
# heads), by the tensor's name inside a layer: the attention and MLP projections, MLA's
# per-head `embed_q`/`unembed_out` (and `kv_b_proj` they are made of), every expert,
# linear attention's projections and per-head parameters, gpt-oss's sinks. The rest of
# a layer (norms, the router `mlp.gate`, DeepSeek's `q_a_proj`/`kv_a_proj_with_mqa`)
# stays whole on every node of a group.
_SPLIT = re.compile(
    r"\.(?:q_proj|k_proj|v_proj|o_proj|q_b_proj|kv_b_proj|embed_q|unembed_out|gate_proj|"
    r"up_proj|down_proj|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|in_proj_qkvz|in_proj_ba|"
    r"out_proj|conv1d|sinks|dt_bias|A_log)(?:\.|$)|\.experts\.|\.switch_mlp\.|\.shared_experts?\."
)


def cut_by_shard(key: str) -> bool:
    """Whether mlx-lm's `shard()` cuts this tensor (a layer's weight, by name) N ways."""
    return bool(_SPLIT.search(key))


# Routed experts: a token reads only the few its router picks (shared experts it always reads).
_ROUTED = re.compile(r"\.switch_mlp\.|(?<!shared_)experts\.")
# mlx-lm 0.32 model classes with a `shard()` method (tests/unit/test_shapes.py checks this
# against mlx-lm itself), and of those the ones whose cache is an MLA latent, not per head.
TENSOR_FAMILIES = frozenset(
    {
        "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2",
        "kimi_k25", "deepseek_v32", "glm4_moe", "gpt_oss", "minimax", "minimax_m2",
        "qwen3_5", "qwen3_5_moe", "glm4_moe_lite",
    }
)  # fmt: skip
_MLA_FAMILIES = frozenset({"deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v32", "glm4_moe_lite"})
_HEADER_LIMIT = 100 * 1024 * 1024  # a safetensors header is JSON; larger is corrupt
_INDEX = "model.safetensors.index.json"
# safetensors dtype names → the names config.json and the planner use
_FLOAT_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
# Bits an element of each safetensors dtype takes, for those mx.load reads (MLX's
# safetensors loader; tests/unit/test_model_facts.py checks the list against it).
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "U16": 16, "I16": 16, "F16": 16, "BF16": 16, "U32": 32,
    "I32": 32, "F32": 32, "U64": 64, "I64": 64, "C64": 64, "F8_E4M3": 8,
}  # fmt: skip
SAFETENSORS_DTYPES = frozenset(_DTYPE_BITS)


class ModelDirError(StudioError, ValueError):
    pass


def allowed_root(model_dir: Path) -> Path:
    """Where a model's files may really live: the directory itself, or for a hub
    snapshot (whose files link to `../../blobs/<hash>`) its repository folder."""
    if in_hub_cache(model_dir):
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
    # Why a shard could not run this model (family, quantization), from the table the
    # worker itself checks; None: it can. Known before any byte is copied.
    unsupported: str | None = None
    # What the operator should know before chatting with it ("" nothing): a demo
    # model written with random output (`demo-model --noise`) says it writes noise.
    note: str = ""


NOISE_NOTE = (
    "a demo model with random weights: it writes noise, not text "
    "(`studiotui demo-model DIR` writes one that recites a passage)"
)


def model_note(config: Mapping[str, Any]) -> str:
    """What a placement of this model should say of it: a demo model that does not
    recite writes noise."""
    demo = config.get("studiotui_demo")
    if isinstance(demo, Mapping) and not demo.get("recite"):
        return NOISE_NOTE
    return ""


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def count(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def safetensors_tensors(file: Path) -> dict[str, Tensor]:
    """Tensor name → dtype, shape and bytes, from the file's JSON header alone.

    Everything MLX would trip over when loading (after the file was copied to a node)
    is a ValueError here, saying what is wrong: a header that is cut, not JSON or not
    the format's shape, a dtype no loader knows, or a file shorter than its tensors."""
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file} is too short to be safetensors ({len(raw)} bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > _HEADER_LIMIT:
            raise ValueError(f"{file} has an implausible header of {length} bytes")
        text = f.read(length)
        size = os.fstat(f.fileno()).st_size
    if len(text) < length:
        raise ValueError(
            f"{file} says its header has {length} bytes but the file ends after {size}: "
            "it is cut short (an unfinished download?); fetch it again"
        )
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{file}: its header is not JSON ({exc}): the file is damaged") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: its header is not a JSON object: the file is damaged")
    out: dict[str, Tensor] = {}
    data_end = 0
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        tensor, end = _tensor(file, key, meta)
        out[key] = tensor
        data_end = max(data_end, end)
    if 8 + length + data_end > size:
        raise ValueError(
            f"{file} has {size} bytes but its tensors need {8 + length + data_end}: it is "
            "cut short (an unfinished download or copy?); fetch it again"
        )
    return out


def _tensor(file: Path, key: str, meta: Any) -> tuple[Tensor, int]:
    """One header entry as a Tensor and the end of its bytes; a ValueError naming the
    tensor and what is wrong with it."""
    where = f"{file}: tensor {key!r}"
    if not isinstance(meta, dict):
        raise ValueError(f"{where} is not described by an object: the file is damaged")
    dtype = meta.get("dtype")
    if dtype not in SAFETENSORS_DTYPES:
        known = ", ".join(sorted(SAFETENSORS_DTYPES))
        raise ValueError(f"{where} has dtype {dtype!r}, which MLX cannot load ({known})")
    shape = meta.get("shape")
    if not isinstance(shape, list) or not all(_natural(d) for d in shape):
        raise ValueError(f"{where} has shape {shape!r}: not a list of sizes")
    offsets = meta.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_natural(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise ValueError(f"{where} has data_offsets {offsets!r}: not [begin, end] in bytes")
    begin, end = offsets
    tensor = Tensor(dtype, tuple(shape), end - begin)
    bits = tensor.count * _DTYPE_BITS[dtype]
    if (bits + 7) // 8 != tensor.nbytes:
        raise ValueError(
            f"{where} has {tensor.nbytes} bytes for a {dtype} {list(shape)}: the file is damaged"
        )
    return tensor, end


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model; an index naming files that are not there is an
    unfinished download, said so rather than planned as a smaller model."""
    files = sorted(path.glob("*.safetensors"))
    index = path / _INDEX
    if index.is_file():
        try:
            listed = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise ModelDirError(f"{index} is not a safetensors index: {exc!r}") from None
        missing = sorted(f for f in listed if not (path / f).is_file())
        if missing:
            raise ModelDirError(
                f"{path} lacks {len(missing)} of the {len(listed)} weight files its index "
                f"lists ({missing[0]}…): finish the download"
            )
    if not files:
        raise ModelDirError(f"{path} has no *.safetensors weight files")
    # Nothing outside the model's folder is read on its behalf, not even a header.
    outside = outside_links(path, {f.name for f in files})
    if outside:
        raise ModelDirError(
            f"{path / outside[0]} links to {(path / outside[0]).resolve()}, outside the model "
            "directory; copy the file into the model folder instead of linking it"
        )
    return files


def _activation_dtype(tensors: dict[str, Tensor]) -> str | None:
    """The dtype activations (and caches) take: the embedding's, or its scales' when it
    is quantized, else the most common float among the tensors."""
    for key, t in tensors.items():
        if (
            "embed_tokens" in key
            and key.endswith((".scales", ".weight"))
            and t.dtype in (_FLOAT_NAMES)
        ):
            return _FLOAT_NAMES[t.dtype]
    floats: dict[str, int] = {}
    for t in tensors.values():
        if t.dtype in _FLOAT_NAMES:
            floats[t.dtype] = floats.get(t.dtype, 0) + t.nbytes
    return _FLOAT_NAMES[max(floats, key=lambda k: floats[k])] if floats else None


def count_params(tensors: dict[str, Tensor], config: dict[str, Any]) -> int:
    """Parameters, a quantized weight's unpacked: MLX packs bits-wide values into
    uint32 (bits per module where the config overrides them, as mlx-lm's mixed recipes
    and a MoE's 8-bit router do), and its scales and biases are not parameters."""
    q = config.get("quantization") or config.get("quantization_config") or {}
    q = q if isinstance(q, dict) else {}
    mode = str(q.get("mode") or q.get("quant_method") or "affine")
    default = {"mxfp4": 4, "nvfp4": 4, "mxfp8": 8}.get(mode) or q.get("bits") or 4

    def bits(stem: str) -> int:
        own = q.get(stem)
        value = own.get("bits", default) if isinstance(own, dict) else default
        return int(value) if isinstance(value, int) and 0 < value <= 32 else 4

    packed = {
        key[: -len(".weight")]
        for key, t in tensors.items()
        if key.endswith(".weight") and t.dtype == "U32" and f"{key[:-7]}.scales" in tensors
    }
    total = 0
    for key, t in tensors.items():
        stem, _, leaf = key.rpartition(".")
        if stem in packed:
            total += t.count * 32 // bits(stem) if leaf == "weight" else 0
        else:
            total += t.count
    return total


def read_model(path: Path) -> ModelInfo:
    """The model's facts, or a ModelDirError naming the file and what is wrong with it:
    everything a load would fail on after the copy is found here, before it."""
    path = path.expanduser()
    config = _config(path)
    try:
        return _read_model(path, config)
    except (TypeError, AttributeError, KeyError, ValueError, ZeroDivisionError) as exc:
        if isinstance(exc, ModelDirError):
            raise
        # A value of the wrong type somewhere in config.json (the headers and the
        # index say their own errors above).
        raise ModelDirError(
            f"{path}/config.json has a value mlx-lm cannot use ({type(exc).__name__}: {exc})",
            "compare it with the config.json of the model's original download",
        ) from None


def _read_model(path: Path, config: dict[str, Any]) -> ModelInfo:
    cfg = text_config(config)
    files = weight_files(path)
    unsupported = unsupported_reason(config)
    if not unsupported:  # else why it cannot run at all is the news, not its tokenizer
        check_tokenizer(path)
    raw_layers = cfg.get("num_hidden_layers") or 0
    if not isinstance(raw_layers, int) or isinstance(raw_layers, bool):
        raise ModelDirError(
            f"{path}/config.json: num_hidden_layers is {raw_layers!r}, not a whole number"
        )
    n_layers = raw_layers
    _check_quantization(path, config)
    if n_layers < 1:
        if not unsupported:
            raise ModelDirError(f"{path}/config.json has no num_hidden_layers")
        n_layers = 1  # listed only to say why it cannot run: its sizes do not matter
    tensors: dict[str, Tensor] = {}
    for file in files:
        try:
            tensors.update(safetensors_tensors(file))
        except (OSError, ValueError) as exc:
            raise ModelDirError(f"cannot read {file}: {exc}") from None
    per_layer = [0] * n_layers
    split = [0] * n_layers
    routed = [0] * n_layers
    embed = head = 0
    dtypes: dict[str, int] = {}
    params = count_params(tensors, config)
    for key, t in tensors.items():
        dtypes[t.dtype] = dtypes.get(t.dtype, 0) + t.nbytes
        if m := _LAYER.search(key):
            layer = int(m.group(1))
            # Layers past num_hidden_layers (DeepSeek's multi-token-prediction layer)
            # are dropped by mlx-lm's sanitize: no shard holds them.
            if layer < n_layers:
                per_layer[layer] += t.nbytes
                split[layer] += t.nbytes if _SPLIT.search(key) else 0
                routed[layer] += t.nbytes if _ROUTED.search(key) else 0
        elif "embed_tokens" in key:
            embed += t.nbytes
        else:
            head += t.nbytes
    if bool(cfg.get("tie_word_embeddings", False)):
        head += embed
    dtype = max(dtypes, key=lambda k: dtypes[k]) if dtypes else "?"
    try:
        facts = facts_from_config(
            config, per_layer, embed, head, path.name, _activation_dtype(tensors)
        )
        facts = with_shape_facts(facts, config, split, routed)
    except (ValueError, TypeError) as exc:
        if not unsupported:
            raise ModelDirError(
                f"{path}/config.json has a value mlx-lm cannot use ({exc})",
                "compare it with the config.json of the model's original download",
            ) from None
        # A family without attention fields (Mamba…): the reason it cannot run is
        # what the operator needs, not that its cache cannot be sized.
        family = str(config.get("model_type") or "unknown")
        facts = ModelFacts(path.name, family, n_layers, tuple(per_layer), embed, head, 0)
    return ModelInfo(
        path=path,
        name=path.name,
        family=facts.family,
        n_layers=n_layers,
        params=params,
        disk_bytes=sum(f.stat().st_size for f in files),
        dtype=dtype,
        quantization=facts.quantization,
        facts=facts,
        unsupported=unsupported,
        note=model_note(config),
    )


def with_kv_quant(
    info: ModelInfo, bits: int, group_size: int | None
) -> tuple[ModelInfo, tuple[str, ...], int]:
    """The model as placed with `--kv-bits bits --kv-group-size group_size`: each layer's
    cache at its quantized size, and what the preview says of it (what stays at full
    precision, that requests decode one by one); a ModelDirError when those settings
    cannot serve it (before any node is asked). `group_size` None: the default if it
    divides the heads, else one that does; the group size used comes back third."""
    if not bits:
        return info, (), group_size or DEFAULT_KV_GROUP_SIZE
    config = _config(info.path)
    group_size = group_size or group_size_for(config)
    if why := kv_quant_refusal(config, bits, group_size):
        raise ModelDirError(f"{info.name}: {why}")
    dtype = info.facts.dtype
    caches = layer_caches({**config, "torch_dtype": dtype, "dtype": dtype}, bits, group_size)
    facts = replace(
        info.facts, layer_kv=caches, kv_bytes_per_token=max(kv.per_token for kv in caches)
    )
    notes = [note] if (note := full_precision_note(config, bits)) else []
    if not kv_quant_reason(config):
        # mlx-lm 0.32 has no batched QuantizedKVCache (worker.families.batch_reason).
        notes.append(
            "requests decode one at a time, not as a batch: mlx-lm has no batched form "
            "of QuantizedKVCache"
        )
    return replace(info, facts=facts), tuple(notes), group_size


def _check_quantization(path: Path, config: dict[str, Any]) -> None:
    """mlx-lm builds a quantized model's layers from these numbers before it reads a
    weight: a wrong type there fails on every node, after the copy."""
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if q is None:
            continue
        if not isinstance(q, dict):
            raise ModelDirError(f"{path}/config.json: {key} is {q!r}, not an object")
        for field in ("bits", "group_size"):
            value = q.get(field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ModelDirError(
                    f"{path}/config.json: {key}.{field} is {value!r}, not a whole number"
                )


# The files a tokenizer comes in: Hugging Face's fast tokenizer, sentencepiece, GPT-2's
# vocab and merges, BERT's vocab, tiktoken's ranks (Kimi).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")
# Those that are JSON: a cut or damaged one fails mlx-lm's load_tokenizer on the node.
_JSON_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def check_tokenizer(path: Path) -> None:
    """A ModelDirError unless the directory has a tokenizer whose JSON files parse:
    without one every shard would load and the head would fail after the copy."""
    names = {p.name for p in path.iterdir()}
    if not names.intersection(TOKENIZER_FILES) and not any(n.endswith(".tiktoken") for n in names):
        raise ModelDirError(
            f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)} or *.tiktoken)",
            "copy the tokenizer files from the model's original download into the folder",
        )
    for name in _JSON_TOKENIZER_FILES:
        if name not in names:
            continue
        try:
            data = json.loads((path / name).read_bytes())
        except (OSError, ValueError, RecursionError) as exc:
            raise ModelDirError(
                f"{path / name} is not valid JSON ({exc})",
                "copy it again from the model's original download",
            ) from None
        if not isinstance(data, dict):
            raise ModelDirError(f"{path / name} is not a JSON object: the file is damaged")


def _config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ModelDirError(f"{path} has no config.json: not an mlx-lm model directory")
    try:
        data = json.loads(cfg.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise ModelDirError(f"{cfg} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise ModelDirError(f"cannot read {cfg}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{cfg} is not a JSON object")
    return data


# --------------------------------------------------------------------------- tensor groups


def _int(cfg: dict[str, Any], *keys: str) -> int:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _group_size(config: dict[str, Any]) -> int:
    """The quantization group: `shard()` cuts a quantized weight's scales too, so a
    width must divide into whole groups per node. 1 for float weights."""
    q = config.get("quantization") or config.get("quantization_config") or {}
    if not isinstance(q, dict):
        return 1
    mode = str(q.get("mode") or q.get("quant_method") or "affine")
    if mode in ("mxfp4", "mxfp8"):
        return 32
    if mode == "nvfp4":
        return 16
    return int(q.get("group_size") or (64 if "bits" in q else 1))


def tensor_dims(config: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """The sizes a tensor group's node count must divide for this model's `shard()`:
    attention heads (and KV heads, unless MLA keeps one latent or qwen3.5 repeats
    them), linear-attention heads, and each MLP / expert width in quantization groups
    (the `sharded-to-all` cut of a quantized `down_proj` splits its scales)."""
    cfg = text_config(config)
    family = str(config.get("model_type") or cfg.get("model_type") or "")
    group = _group_size(config)
    dims: list[tuple[str, int]] = [("attention heads", _int(cfg, "num_attention_heads"))]
    if family not in _MLA_FAMILIES and not family.startswith("qwen3_5"):
        dims.append(("KV heads", _int(cfg, "num_key_value_heads", "num_attention_heads")))
    dims += [
        ("linear-attention key heads", _int(cfg, "linear_num_key_heads")),
        ("linear-attention value heads", _int(cfg, "linear_num_value_heads")),
    ]
    shared = _int(cfg, "shared_expert_intermediate_size") or (
        _int(cfg, "moe_intermediate_size") * _int(cfg, "n_shared_experts")
    )
    unit = f" ({group}-wide quantization groups)" if group > 1 else ""
    for label, width in (
        ("MLP width", _int(cfg, "intermediate_size") if _runs_dense_mlp(cfg) else 0),
        ("expert width", _int(cfg, "moe_intermediate_size")),
        ("shared expert width", shared),
    ):
        if width:
            dims.append((f"{label}{unit}", width // group if width % group == 0 else width))
    return tuple((label, size) for label, size in dims if size)


def _runs_dense_mlp(cfg: dict[str, Any]) -> bool:
    """Whether some layer runs the dense MLP `intermediate_size` is the width of. In a
    MoE whose experts have their own `moe_intermediate_size`, only the layers the
    config keeps dense do: DeepSeek's / GLM's first `first_k_dense_replace`, Qwen
    MoE's `mlp_only_layers` and those off its `decoder_sparse_step` (mlx-lm's rule).
    Elsewhere (dense models; Mixtral or gpt-oss, whose experts are that wide) it is."""
    if not _int(cfg, "moe_intermediate_size"):
        return True
    if "first_k_dense_replace" in cfg:
        return _int(cfg, "first_k_dense_replace") > 0 or _int(cfg, "moe_layer_freq") > 1
    if "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:
        experts = _int(cfg, "num_experts", "n_routed_experts")
        step = _int(cfg, "decoder_sparse_step") or 1
        return not experts or step > 1 or bool(cfg.get("mlp_only_layers"))
    return True


def _bits_per_weight(config: dict[str, Any], dtype: str) -> float:
    """Bits a weight takes on disk, scales and biases included (affine: two 16-bit
    values per group; mx/nv formats: one 8-bit scale per group)."""
    q = config.get("quantization") or config.get("quantization_config")
    if isinstance(q, dict) and ("bits" in q or q.get("mode") or q.get("quant_method")):
        mode = str(q.get("mode") or q.get("quant_method") or "affine")
        group = _group_size(config)
        if mode in ("mxfp4", "nvfp4"):
            return 4 + 8 / group
        if mode == "mxfp8":
            return 8 + 8 / group
        return float(q.get("bits", 4)) + 32 / group
    return {"float32": 32.0, "float64": 64.0}.get(dtype, 16.0)


def with_shape_facts(
    facts: ModelFacts, config: dict[str, Any], split: list[int], routed: list[int]
) -> ModelFacts:
    """`facts` with what tensor groups and the speed forecast need: what `shard()`
    cuts (None for a family without one), the routed experts' bytes and the share of
    them a token reads, the widths, and bits per weight."""
    cfg = text_config(config)
    family = facts.family
    tensor = None
    if family in TENSOR_FAMILIES:
        tensor = TensorFacts(tensor_dims(config), tuple(split), family not in _MLA_FAMILIES)
    experts = _int(cfg, "n_routed_experts", "num_experts", "num_local_experts")
    active = _int(cfg, "num_experts_per_tok", "experts_per_token")
    heads = _int(cfg, "num_attention_heads")
    head_dim = (_int(cfg, "qk_nope_head_dim") + _int(cfg, "qk_rope_head_dim")) or _int(
        cfg, "head_dim"
    )
    hidden = _int(cfg, "hidden_size")
    return replace(
        facts,
        tensor=tensor,
        layer_experts=tuple(routed),
        experts_active=min(1.0, active / experts) if experts and active else 1.0,
        hidden_size=hidden,
        attn_width=heads * (head_dim or (hidden // heads if heads else 0)),
        bits_per_weight=_bits_per_weight(config, facts.dtype),
    )
