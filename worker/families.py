"""What differs per model family when a shard runs a slice of the decoder itself.

mlx-lm's `Model.__call__` runs the whole stack; a shard runs only
`model.model.layers[start:end]`, so it has to rebuild the parts of the forward
pass around the layers: the embedding, the attention masks and the head. For the
families below those parts are the same (no embedding scale, no logit
soft-capping, RMSNorm then lm_head or tied embeddings); a family that differs gets
its own entry here rather than a branch elsewhere.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from worker.shared.model_support import unsupported_reason


class UnsupportedFamily(ValueError):
    pass


def check_family(config: dict[str, Any]) -> str:
    reason = unsupported_reason(config)
    if reason:
        raise UnsupportedFamily(reason)
    return str(config.get("model_type", ""))


def layer_masks(inner: Any, layers: list[Any], caches: list[Any], h: mx.array) -> list[Any]:
    """One mask per layer: full causal, or windowed for sliding-window layers."""
    full = create_attention_mask(h, caches[0] if caches else None)
    window = getattr(inner, "sliding_window", None)
    masks = []
    for layer, cache in zip(layers, caches, strict=True):
        if getattr(layer, "use_sliding", False) and window:
            masks.append(create_attention_mask(h, cache, window_size=window))
        else:
            masks.append(full)
    return masks


def tied_embeddings(model: Any) -> bool:
    return bool(getattr(model.args, "tie_word_embeddings", False)) or not hasattr(model, "lm_head")
