"""Quantized KV (`place --kv-bits 8|4`): which caches of a model mlx-lm can keep quantized.

Pure (no MLX import), read by the shard (which caches it makes as `QuantizedKVCache`)
and by the planner (how many bytes they hold, what the preview says), so both reach
the same verdict from config.json alone.

mlx-lm quantizes a cache by `KVCache.to_quantized`, and its attention reads a
`QuantizedKVCache` through `quantized_scaled_dot_product_attention`. What it cannot do
(mlx-lm 0.32), each checked by tests/integration/test_kv_quant.py:

* a `RotatingKVCache` (sliding windows: gemma3's local layers, gpt-oss's) has no
  quantized form (`to_quantized` raises "NYI"), an `ArraysCache` (the linear-attention
  state of qwen3_next / qwen3_5) is not K/V at all: those layers keep full precision;
* MLA (deepseek_v3, Kimi, deepseek_v32, glm4_moe_lite) multiplies its cached latent and
  rotary keys itself, outside the quantized attention, so its caches stay full;
* gpt-oss's attention sinks: the quantized attention has none ("Quantized SDPA does not
  support attention sinks"), so its full-attention layers stay full too.

Every other layer's `KVCache` becomes a `QuantizedKVCache(group_size, bits)` from the
first token (see worker/families.make_caches).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KV_BITS: tuple[int, ...] = (4, 8)
KV_GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
DEFAULT_KV_GROUP_SIZE = 64


def _decoder(config: Mapping[str, Any]) -> dict[str, Any]:
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        return {**config, **nested, "model_type": config.get("model_type")}
    return dict(config)


def family_reason(config: Mapping[str, Any]) -> str:
    """Why none of this model's caches can be kept quantized ("" when its plain K/V
    layers can)."""
    cfg = _decoder(config)
    if cfg.get("kv_lora_rank"):
        return (
            "its MLA attention reads the cached latent and rotary keys itself, not through "
            "mlx-lm's quantized attention"
        )
    if str(config.get("model_type", "")) == "gpt_oss":
        return "its attention sinks are not supported by mlx-lm's quantized attention"
    return ""


def head_dims(config: Mapping[str, Any]) -> tuple[int, ...]:
    """The widths mlx-lm quantizes along: each K and V head's."""
    cfg = _decoder(config)
    heads = int(cfg.get("num_attention_heads") or 1)
    dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size") or 0) // max(heads, 1))
    return (dim,)


def group_size_for(config: Mapping[str, Any]) -> int:
    """The default group size if it divides the head width, else the largest that does
    (the dashboard's `k` asks for none): what `--kv-group-size` would be told to use."""
    fits = [g for g in KV_GROUP_SIZES if all(d % g == 0 for d in head_dims(config))]
    if DEFAULT_KV_GROUP_SIZE in fits or not fits:
        return DEFAULT_KV_GROUP_SIZE
    return max(fits)


def kv_quant_refusal(config: Mapping[str, Any], bits: int, group_size: int) -> str | None:
    """Why `--kv-bits bits --kv-group-size group_size` cannot serve this model, or None.
    bits 0 is full precision: always fine."""
    if bits == 0:
        return None
    if bits not in KV_BITS:
        return f"--kv-bits {bits} is not offered: use {' or '.join(map(str, KV_BITS))}"
    if group_size not in KV_GROUP_SIZES:
        sizes = ", ".join(map(str, KV_GROUP_SIZES))
        return f"--kv-group-size {group_size} is not offered: use one of {sizes}"
    if family_reason(config):
        return None  # nothing is quantized: the widths do not matter
    bad = [d for d in head_dims(config) if d % group_size]
    if bad:
        fits = [g for g in KV_GROUP_SIZES if all(d % g == 0 for d in head_dims(config))]
        hint = f"use --kv-group-size {' or '.join(map(str, fits))}" if fits else "use full KV"
        return (
            f"--kv-group-size {group_size} does not divide the model's attention head "
            f"width {bad[0]} (KV is quantized in groups along it): {hint}"
        )
    return None
