"""Which models a shard can run: one table, read by the worker and the operator alike.

Pure (no MLX import), so the operator side can refuse a model at preview — before
any byte is copied — with the same verdict a shard would reach after loading.
`unsupported_reason(config)` is None for a model a shard can run, else a sentence
naming what is not supported and what is.
"""

from __future__ import annotations

from typing import Any

# Families whose decoder a shard runs (model_type in config.json).
FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")

# Quantization modes MLX can load (config.json "quantization"/"quantization_config").
QUANT_MODES: tuple[str, ...] = ("affine", "mxfp4", "mxfp8", "nvfp4")
AFFINE_BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
GROUP_SIZES: tuple[int, ...] = (32, 64, 128)


def family_reason(config: dict[str, Any]) -> str | None:
    family = str(config.get("model_type", ""))
    if family in FAMILIES:
        return None
    return (
        f"model family {family!r} is not supported by the shard runner "
        f"(supported: {', '.join(FAMILIES)})"
    )


def quantization_reason(config: dict[str, Any]) -> str | None:
    quant = config.get("quantization") or config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        return f"config.json's quantization is {quant!r}, not a table"
    mode = str(quant.get("mode", "affine"))
    if mode not in QUANT_MODES:
        return f"quantization mode {mode!r} is not supported (supported: {', '.join(QUANT_MODES)})"
    if mode == "affine":
        bits, group = quant.get("bits"), quant.get("group_size")
        if bits not in AFFINE_BITS:
            return f"{bits}-bit affine quantization is not supported"
        if group not in GROUP_SIZES:
            return f"quantization group size {group} is not supported"
    return None


def unsupported_reason(config: dict[str, Any]) -> str | None:
    return family_reason(config) or quantization_reason(config)
