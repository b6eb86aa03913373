"""Refusals: why a model does not fit a group, with the numbers (need, have,
shortfall) and what would let it fit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from studiotui.core.kv_sizes import (
    DTYPE_BYTES,
)
from studiotui.core.placement.facts import ModelFacts, NodeBudget
from studiotui.core.placement.plans import Refusal
from studiotui.core.placement.words import _joined, gb


def _group_refusal(model: ModelFacts, nodes: Sequence[NodeBudget]) -> Refusal | None:
    if not nodes:
        return Refusal("the group is empty; pick at least one node", "shape")
    names = [n.name for n in nodes]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        return Refusal(
            f"the group names {', '.join(repeated)} more than once; "
            "a node can hold only one shard of a model",
            "shape",
        )
    if len(nodes) > model.n_layers:
        return Refusal(
            f"{model.name} has {model.n_layers} layers but the group has {len(nodes)} nodes "
            f"and each node needs at least one layer; use at most {model.n_layers} nodes",
            "shape",
        )
    return None


def _bits(model: ModelFacts) -> int | None:
    if model.quantization:
        found = re.search(r"\d+", model.quantization)
        return int(found.group()) if found else None
    size = DTYPE_BYTES.get(model.dtype)
    return None if size is None else size * 8


def remedies(
    model: ModelFacts, weights: int, kv: int, available: int, context_fit: int | None
) -> list[str]:
    """What would let `weights` + `kv` bytes fit in `available`, each only if it helps:
    a node with the shortfall free always does; a 4-bit copy only when the model is
    wider than 4 bits and its weights at 4 bits beside the same KV cache would fit (a
    tiny model whose KV cache is what does not fit gains nothing from it); a shorter
    context when one fits (`context_fit`)."""
    parts = [f"add a node with at least {gb(weights + kv - available)} free"]
    bits = _bits(model)
    if (bits is None or bits > 4) and weights * 4 // (bits or 16) + kv <= available:
        parts.append("use a 4-bit copy")
    if context_fit:
        parts.append(f"shorten the context to {context_fit} tokens")
    return parts


def _context_that_fits(
    model: ModelFacts, available: int, weights: int, context_tokens: int, streams: int
) -> int | None:
    """The longest context below `context_tokens` whose caches fit beside the weights.

    Caches grow with the context but not linearly (windows stop, linear states do not
    grow at all), so this searches the real per-layer function rather than dividing."""

    def fits(tokens: int) -> bool:
        return weights + sum(model.kv_bytes(tokens, streams)) <= available

    if available <= weights or not fits(1):
        return None
    low, high = 1, context_tokens  # fits(low); not fits(high), or this is no refusal for KV
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low if low < context_tokens and sum(model.kv_bytes(low, streams)) > 0 else None


def _total_refusal(
    model: ModelFacts,
    usable: Sequence[int],
    kv_total: int,
    context_tokens: int,
    streams: int,
    reserve_fraction: float,
) -> Refusal | None:
    weights = model.weight_bytes
    need = weights + kv_total
    available = sum(max(u, 0) for u in usable)
    if need <= available:
        return None
    fit = _context_that_fits(model, available, weights, context_tokens, streams)
    return Refusal(
        f"{model.name} needs {gb(need)} ({gb(weights)} weights + {gb(kv_total)} KV cache "
        f"for {context_tokens} tokens × {streams} stream{'s' if streams > 1 else ''}), "
        f"the group has {gb(available)} free after a {reserve_fraction:.0%} reserve per node; "
        f"{_joined(remedies(model, weights, kv_total, available, fit), 'or')}"
    )


def _small_node_refusal(usable: Mapping[str, int], costs: Sequence[int]) -> Refusal | None:
    # Any shard holds at least one layer and its KV cache, wherever it sits in the ring.
    smallest = min(costs)
    tiny = sorted(name for name, room in usable.items() if room < smallest)
    if not tiny:
        return None
    rooms = ", ".join(f"{name} {gb(max(usable[name], 0))}" for name in tiny)
    return Refusal(
        f"one layer with its KV cache needs at least {gb(smallest)} but "
        f"{_joined(tiny, 'and')} {'has' if len(tiny) == 1 else 'have'} less free "
        f"after the reserve ({rooms}); "
        f"drop {'it' if len(tiny) == 1 else 'them'} from the group or free memory there"
    )


def _cut_refusal(model: ModelFacts, usable: Sequence[int], costs: Sequence[int]) -> Refusal:
    need = sum(costs) + model.embed_bytes + model.head_bytes
    bits = _bits(model)
    # A 4-bit copy helps where weights, not the KV cache, make the layers too large.
    smaller = (bits is None or bits > 4) and model.weight_bytes * 2 > need
    return Refusal(
        f"{model.name} needs {gb(need)} and the group has {gb(sum(max(u, 0) for u in usable))} "
        f"free, but its {model.n_layers} layers (the largest {gb(max(costs))} with KV cache) "
        "cannot be cut into contiguous ranges that fit every node; add a node"
        + (
            ", free memory on the smallest node or use a 4-bit copy"
            if smaller
            else " or free memory on the smallest node"
        )
    )
