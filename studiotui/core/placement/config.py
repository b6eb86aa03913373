"""`ModelFacts` from a model's config.json and the sizes of its tensors, and what the
config says of the positions the model was trained for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from studiotui.core.kv_sizes import (
    DTYPE_BYTES,
    activation_bytes,
    layer_caches,
    standard_per_token,
    text_config,
)
from studiotui.core.placement.facts import ModelFacts


def _quantization(config: Mapping[str, Any]) -> str | None:
    q = config.get("quantization") or config.get("quantization_config")
    if isinstance(q, Mapping):
        mode = q.get("mode", "affine")
        if mode != "affine":  # mxfp4, mxfp8, nvfp4: the name says the bits
            return str(mode)
        if "bits" in q:
            # Mixed conversions override bits per module ("model.layers.0.mlp": {...}).
            bits = {q["bits"]} | {
                v["bits"] for v in q.values() if isinstance(v, Mapping) and "bits" in v
            }
            if len(bits) > 1:
                return f"mixed {'/'.join(str(b) for b in sorted(bits))}-bit"
            return f"{q['bits']}-bit"
        method = q.get("quant_method")
        return str(method) if method else None
    return None


def kv_bytes_per_token(config: Mapping[str, Any], act_dtype: str | None = None) -> int:
    """K and V of one token in one standard-attention layer, from a config.json.

    The cache is kept in the activation dtype (`act_dtype`, else the config's), not the
    weights' quantized one; an unknown dtype counts as float32 because overestimating
    KV is the safe side."""
    cfg = text_config(config)
    act = DTYPE_BYTES.get(act_dtype, 4) if act_dtype else activation_bytes(config)
    return standard_per_token(cfg, act)


def facts_from_config(
    config: Mapping[str, Any],
    weight_bytes_by_layer: Sequence[int],
    embed_bytes: int,
    head_bytes: int,
    name: str,
    act_dtype: str | None = None,
    kv_bits: int = 0,
    kv_group_size: int = 64,
) -> ModelFacts:
    """ModelFacts from a config.json dict and the tensor sizes read from safetensors.

    `act_dtype` is the dtype activations (and so caches) will have, when the caller
    knows it from the weights better than config.json says; `kv_bits`: the caches
    quantized (`place --kv-bits`)."""
    cfg = text_config(config)
    dtype = act_dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    try:
        n_layers = int(cfg["num_hidden_layers"])
        caches = layer_caches(
            {**config, "torch_dtype": dtype, "dtype": dtype}, kv_bits, kv_group_size
        )
    except KeyError as missing:
        raise ValueError(f"{name}: config.json lacks {missing}") from None
    return ModelFacts(
        name=name,
        family=str(config.get("model_type") or cfg.get("model_type") or "unknown"),
        n_layers=n_layers,
        layer_bytes=tuple(int(b) for b in weight_bytes_by_layer),
        embed_bytes=int(embed_bytes),
        head_bytes=int(head_bytes),
        kv_bytes_per_token=max(kv.per_token for kv in caches),
        dtype=dtype,
        quantization=_quantization(config),
        layer_kv=caches,
        max_positions=trained_positions(cfg),
    )


def trained_positions(cfg: Mapping[str, Any]) -> int:
    """How many positions a (text) config says its model was trained for, its RoPE
    scaling's stretch included (YaRN: original × factor); 0 when it does not say."""
    most = cfg.get("max_position_embeddings")
    positions = most if isinstance(most, int) and not isinstance(most, bool) else 0
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, Mapping):
        original, factor = scaling.get("original_max_position_embeddings"), scaling.get("factor")
        if isinstance(original, int) and isinstance(factor, int | float) and factor > 1:
            positions = max(positions, int(original * factor))
    return max(0, positions)


def context_beyond(facts: ModelFacts, context_tokens: int) -> str:
    """A word for a context longer than the model was trained for ("" when it is not):
    the KV cache is reserved all the same, but what comes past those positions is
    unreliable, and the memory could serve more streams instead."""
    if not facts.max_positions or context_tokens <= facts.max_positions:
        return ""
    return (
        f"{context_tokens} tokens of context is beyond the {facts.max_positions} positions "
        f"{facts.name} was trained for (max_position_embeddings): answers past them are "
        f"unreliable; --context {facts.max_positions} or less keeps to them"
    )
