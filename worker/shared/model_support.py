"""Which models a shard can run: one table, read by the worker and the operator alike.

Pure (no MLX import), so the operator side can refuse a model at preview — before
any byte is copied — with the same verdict a shard would reach after loading.
`unsupported_reason(config)` is None for a model a shard can run, else a sentence
naming what is not supported and what is.

A shard runs a family through mlx-lm's own model class and forward (see
`worker/families.py`), so a family is listed here once a test has run it split
into shards token for token against `mlx_lm.generate`
(tests/integration/test_families.py).
"""

from __future__ import annotations

from typing import Any

# Families whose decoder a shard runs (model_type in config.json), with what each is.
FAMILY_NOTES: dict[str, str] = {
    "llama": "dense",
    "mistral": "dense (mlx-lm runs it as llama)",
    "qwen2": "dense",
    "qwen3": "dense",
    "qwen3_moe": "mixture of experts (Qwen3-30B-A3B, Qwen3-235B-A22B)",
    "deepseek_v3": "MLA attention + mixture of experts (DeepSeek V3, V3.1, R1)",
    "kimi_k2": "DeepSeek-V3 architecture under its own name (Kimi K2; mlx-lm maps it)",
    "kimi_k25": "DeepSeek-V3 decoder nested under text_config (Kimi K2.5)",
    "deepseek_v32": "MLA + sparse indexer attention (CacheList) + experts (DeepSeek V3.2)",
    "glm4_moe": "mixture of experts (GLM-4.5, GLM-4.6)",
    "gpt_oss": "alternating sliding/full attention (RotatingKVCache) + experts (gpt-oss)",
    "minimax": "mixture of experts (MiniMax M2)",
    "minimax_m2": "MiniMax M2 under the name it ships with (mlx-lm maps it to minimax)",
    "qwen3_next": "linear attention (ArraysCache) mixed with full + experts (Qwen3-Next)",
    "qwen3_5": "linear attention (ArraysCache) mixed with full attention (Qwen3.5)",
    "qwen3_5_moe": "linear attention mixed with full + experts (Qwen3.5 MoE)",
    "mixtral": "mixture of experts (Mixtral)",
    "gemma3_text": "sliding/global attention pattern, scaled embedding (Gemma 3 text)",
    "glm4_moe_lite": "MLA attention + mixture of experts (GLM-4.7-Flash)",
    "qwen2_moe": "mixture of experts with a shared expert (Qwen1.5/2 MoE)",
}
FAMILIES: tuple[str, ...] = tuple(FAMILY_NOTES)

# Quantization modes MLX can load (config.json "quantization"/"quantization_config").
QUANT_MODES: tuple[str, ...] = ("affine", "mxfp4", "mxfp8", "nvfp4")
AFFINE_BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
# The one (group size, bits) each float format has.
FLOAT_FORMATS: dict[str, tuple[int, int]] = {"mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}
# Hugging Face "quant_method"s that mlx-lm turns into one of the modes above on load.
QUANT_METHODS: tuple[str, ...] = ("mxfp4", "mxfp8")


def decoder_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's settings: a nested `text_config` (Kimi K2.5, Qwen3.5) over the
    top level, so `num_hidden_layers`, `vocab_size` and the rest are found either way."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return dict(config)
    merged = {**config, **text}
    merged["model_type"] = config.get("model_type", text.get("model_type"))
    return merged


def family_reason(config: dict[str, Any]) -> str | None:
    family = str(config.get("model_type", ""))
    if family in FAMILIES:
        return None
    return (
        f"model family {family!r} is not supported by the shard runner "
        f"(supported: {', '.join(FAMILIES)})"
    )


def quantization_reason(config: dict[str, Any]) -> str | None:
    quant = config.get("quantization")
    if quant is None:
        quant = config.get("quantization_config")
    if quant is None and isinstance(config.get("text_config"), dict):
        quant = config["text_config"].get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        return f"config.json's quantization is {quant!r}, not a table"
    if "quant_method" in quant and "bits" not in quant and "mode" not in quant:
        method = str(quant["quant_method"])
        if method in QUANT_METHODS:
            return None
        return (
            f"quantization method {method!r} is not supported "
            f"(supported: MLX conversions, {', '.join(QUANT_METHODS)})"
        )
    reason = _one_reason(quant, "")
    if reason:
        return reason
    # Mixed precision: per-module overrides, as mlx-lm's "mixed" conversions write them.
    for path, override in quant.items():
        if isinstance(override, dict):
            reason = _one_reason(override, f" for {path}")
            if reason:
                return reason
    return None


def _one_reason(quant: dict[str, Any], where: str) -> str | None:
    mode = str(quant.get("mode", "affine"))
    if mode not in QUANT_MODES:
        return (
            f"quantization mode {mode!r}{where} is not supported "
            f"(supported: {', '.join(QUANT_MODES)})"
        )
    bits, group = quant.get("bits"), quant.get("group_size")
    if mode == "affine":
        if bits not in AFFINE_BITS:
            return f"{bits}-bit affine quantization{where} is not supported"
        if group not in GROUP_SIZES:
            return f"quantization group size {group}{where} is not supported"
    elif (group, bits) != FLOAT_FORMATS[mode]:
        want_group, want_bits = FLOAT_FORMATS[mode]
        return (
            f"{mode}{where} has group size {group} and {bits} bits; "
            f"{mode} is group size {want_group}, {want_bits} bits"
        )
    return None


def unsupported_reason(config: dict[str, Any]) -> str | None:
    return family_reason(config) or quantization_reason(config)
