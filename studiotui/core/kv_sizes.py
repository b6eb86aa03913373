"""How many bytes each layer's cache holds for N tokens, per model family, from config.json.

Pure (no MLX): the planner sizes a 671B model's cache on a machine that has never
loaded it. The formulas follow what mlx-lm's own caches (`model.make_cache()`)
store, family by family, and tests/test_kv_sizes.py checks each against the
`nbytes` of those caches after running tokens through a tiny model of the family:

* standard attention (llama, mistral, qwen2/3, qwen3_moe, mixtral, glm4_moe,
  minimax): a `KVCache` of K and V, `2 × kv_heads × head_dim` values per token;
* MLA (deepseek_v3, Kimi K2, deepseek_v32): one compressed latent per token,
  `kv_lora_rank + qk_rope_head_dim` values, not per head; deepseek_v32 adds its
  indexer's keys (`CacheList` of two caches, the second stores K twice);
* sliding windows (gpt_oss's alternating layers, gemma3's local layers, llama's
  `layer_types`): a `RotatingKVCache` stops growing at the window;
* linear attention (qwen3_next, qwen3_5): an `ArraysCache` of a convolution state
  and a float32 recurrent state whose size does not depend on the context at all.

A family that follows the common shape needs no entry: the default is the
standard K/V formula, from the fields every config.json has.

Quantized KV (`place --kv-bits`, worker.shared.kv_quant): a plain K/V layer keeps, per
value, `bits` bits packed in uint32 words plus a scale and a bias (activation dtype) per
`group_size` values, as mlx-lm's `QuantizedKVCache` stores them; windows, linear states,
MLA latents and gpt-oss's sinks stay at full precision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.shared.kv_quant import family_reason as kv_quant_reason

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache: `per_token` bytes for each token it keeps, up to `window`
    tokens (None: every token), plus `fixed` bytes whatever the context."""

    per_token: int
    window: int | None = None
    fixed: int = 0

    def __post_init__(self) -> None:
        if self.per_token < 0 or self.fixed < 0 or (self.window is not None and self.window < 1):
            raise ValueError(f"bad layer cache size {self}")

    def bytes_for(self, tokens: int) -> int:
        kept = tokens if self.window is None else min(tokens, self.window)
        return self.fixed + self.per_token * kept


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Multimodal configs (gemma3, qwen3_5, qwen-vl…) keep the decoder's numbers in
    text_config; the outer model_type and quantization still apply."""
    nested = config.get("text_config")
    if isinstance(nested, Mapping) and "num_hidden_layers" not in config:
        return {**config, **nested}
    return dict(config)


def activation_bytes(config: Mapping[str, Any], default: str = "float32") -> int:
    """Bytes of one cached value: caches are kept in the activation dtype, not the
    weights' quantized one. Unknown counts as float32: overestimating KV is the safe side."""
    cfg = text_config(config)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or default)
    return DTYPE_BYTES.get(dtype, 4)


def _head_dim(cfg: Mapping[str, Any]) -> int:
    heads = int(cfg["num_attention_heads"])
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)


def standard_per_token(cfg: Mapping[str, Any], act: int) -> int:
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * kv_heads * _head_dim(cfg) * act


def quantized_per_token(cfg: Mapping[str, Any], act: int, bits: int, group_size: int) -> int:
    """K and V of one token as a `QuantizedKVCache` keeps them: per head, `head_dim`
    values of `bits` bits, and a scale and bias of `act` bytes per `group_size` values."""
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    dim = _head_dim(cfg)
    return 2 * kv_heads * (dim * bits // 8 + 2 * (dim // group_size) * act)


def _mla(cfg: Mapping[str, Any], n: int, act: int) -> tuple[LayerKV, ...]:
    per = (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])) * act
    if cfg.get("index_head_dim"):  # deepseek_v32's indexer: one key head, stored as K and V
        per += 2 * int(cfg["index_head_dim"]) * act
    return (LayerKV(per),) * n


def _linear_state(cfg: Mapping[str, Any], act: int) -> int:
    hk, hv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    conv_dim = 2 * hk * dk + hv * dv
    conv = (int(cfg.get("linear_conv_kernel_dim", 4)) - 1) * conv_dim * act
    recurrent = hv * dv * dk * 4  # gated delta keeps its state in float32
    return conv + recurrent


def _hybrid_linear(cfg: Mapping[str, Any], n: int, act: int, per: int) -> tuple[LayerKV, ...]:
    every = int(cfg.get("full_attention_interval", 4))
    full = LayerKV(per)
    linear = LayerKV(0, fixed=_linear_state(cfg, act))
    return tuple(full if (i + 1) % every == 0 else linear for i in range(n))


def _sliding_kinds(cfg: Mapping[str, Any], family: str, n: int) -> list[bool] | None:
    """Which layers keep only a window, as the family's make_cache decides; None: none do."""
    types = cfg.get("layer_types")
    if family in ("gemma3", "gemma3_text"):  # mlx-lm follows the pattern, not layer_types
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return [i % pattern != pattern - 1 for i in range(n)]
    if family == "gpt_oss" and not types:
        types = ["sliding_attention", "full_attention"] * (n // 2)
    if (
        family in ("gpt_oss", "llama", "mistral")
        and isinstance(types, list)
        and cfg.get("sliding_window")
    ):
        return [t == "sliding_attention" for t in types[:n]]
    return None


def layer_caches(
    config: Mapping[str, Any], kv_bits: int = 0, kv_group_size: int = 64
) -> tuple[LayerKV, ...]:
    """Every layer's cache size as a function of the context, for one stream; with
    `kv_bits`, the plain K/V layers quantized (the caller checked the group size
    divides the head width: worker.shared.kv_quant.kv_quant_refusal)."""
    cfg = text_config(config)
    n = int(cfg["num_hidden_layers"])
    family = str(config.get("model_type") or cfg.get("model_type") or "")
    act = activation_bytes(config)
    if cfg.get("kv_lora_rank") and cfg.get("qk_rope_head_dim") is not None:
        return _mla(cfg, n, act)
    full = standard_per_token(cfg, act)
    quantized = kv_bits and not kv_quant_reason(config)
    per = quantized_per_token(cfg, act, kv_bits, kv_group_size) if quantized else full
    if cfg.get("linear_num_value_heads") and cfg.get("full_attention_interval"):
        return _hybrid_linear(cfg, n, act, per)
    sliding = _sliding_kinds(cfg, family, n)
    if sliding is None:
        return (LayerKV(per),) * n
    # gemma3's ModelArgs default the window to 512 when config.json leaves it out.
    window = int(cfg.get("sliding_window") or (512 if family.startswith("gemma3") else 0)) or None
    # A window is a RotatingKVCache: mlx-lm has no quantized form of it.
    return tuple(LayerKV(full, window) if s else LayerKV(per) for s in sliding)


def full_precision_note(config: Mapping[str, Any], kv_bits: int) -> str:
    """What `--kv-bits` leaves at full precision, for the preview ("" when every layer is
    quantized, or none was asked to be)."""
    if not kv_bits:
        return ""
    if why := kv_quant_reason(config):
        return f"KV stays at full precision: {why}"
    caches = layer_caches(config)
    windows = sum(1 for kv in caches if kv.window is not None)
    linear = sum(1 for kv in caches if kv.per_token == 0 and kv.fixed)
    kept = [
        f"{count} of {len(caches)} layers {what}"
        for count, what in (
            (windows, "with a sliding window (RotatingKVCache)"),
            (linear, "with linear attention (ArraysCache)"),
        )
        if count
    ]
    if not kept:
        return ""
    return f"{' and '.join(kept)} keep full precision: mlx-lm has no quantized form of them"
