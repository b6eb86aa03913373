"""How a shard runs layers [start, end) of any mlx-lm decoder: through the model's own forward.

What differs between families lives in mlx-lm's model classes: DeepSeek's latent
attention wants an array mask, gpt-oss alternates sliding and full attention
(picked by `layer_types`), gemma3 scales its embedding and picks windows by
`i % sliding_window_pattern`, Qwen3-Next and Qwen3.5 build an SSM mask for their
linear-attention layers and a causal one for the rest (from `cache[fa_idx]` and
`cache[ssm_idx]`), Kimi nests the decoder under `language_model`. Rather than
rebuild each of those, a shard calls the model's own `Model.__call__` with the
model's own layer list in which every layer it does not run is replaced by a
stand-in (`Elsewhere`):

- the stand-ins before the shard pass the hidden state on, and the one just before
  it hands over the activation that came over the wire instead;
- the stand-in just after the shard stops the forward (`SliceDone`) with its input,
  the shard's output; on the last shard the forward runs to the end, so the
  norm, head, tied embeddings and any soft-capping are the model's own;
- the cache list the forward sees is full length: the shard's own caches (the
  entries of mlx-lm's `make_cache()` for its layers) at their absolute indices,
  and at every other index a cache of the same kind the shard owns, so a mask
  the model builds from `cache[fa_idx]` sees the right offset even when layer
  `fa_idx` runs elsewhere.

So every per-layer index (layer_types, fa_idx, the sliding pattern) keeps meaning
the absolute layer, and a family whose forward follows this shape needs no entry
here. Stand-ins copy a layer's plain attributes (`is_linear`, `use_sliding`, …)
so loops and `make_cache()` that read them see what the real layer says.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from worker.shared.model_support import unsupported_reason


class UnsupportedFamily(ValueError):
    pass


def check_family(config: dict[str, Any]) -> str:
    reason = unsupported_reason(config)
    if reason:
        raise UnsupportedFamily(reason)
    return str(config.get("model_type", ""))


class SliceDone(Exception):
    """Raised by the stand-in after a shard's last layer: the forward ends there."""

    def __init__(self, h: mx.array) -> None:
        super().__init__()
        self.h = h


class Relay:
    """What the stand-ins of one shard share: where the shard starts and ends, and
    the activation handed in for the current step."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.incoming: mx.array | None = None
        self._ids: dict[tuple[int, ...], mx.array] = {}

    def placeholder_ids(self, shape: tuple[int, ...]) -> mx.array:
        """Token ids for the model to embed on a shard that is not the first: it never
        evaluates them (the stand-in before the shard hands over the activation), so
        one array per shape serves every step."""
        ids = self._ids.get(shape)
        if ids is None:
            if len(self._ids) > 64:  # prefill chunks of many lengths: start over
                self._ids.clear()
            ids = self._ids[shape] = mx.zeros(shape, dtype=mx.int32)
        return ids

    def at(self, index: int, h: mx.array) -> mx.array:
        if index == self.start - 1:
            assert self.incoming is not None
            return self.incoming
        if index == self.end:
            raise SliceDone(h)
        return h


_PLAIN = (bool, int, float, str, type(None))


class Elsewhere(nn.Module):
    """Holds the place, in the model's own layer list, of a layer another shard runs."""

    def __init__(self, layer: nn.Module, index: int, relay: Relay) -> None:
        super().__init__()
        for key, value in vars(layer).items():
            if not key.startswith("_") and isinstance(value, _PLAIN):
                object.__setattr__(self, key, value)
        self._index = index
        self._relay = relay

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return self._relay.at(self._index, h)


def decoder(model: nn.Module) -> tuple[str, nn.Module]:
    """The module holding the decoder layers (`model.model`, or nested as in Kimi's
    `language_model.model`), with its dotted path in the model."""
    for path, module in model.named_modules():
        if isinstance(module.get("layers"), list) and "embed_tokens" in module:
            return path, module
    raise UnsupportedFamily(f"{type(model).__module__}: no decoder with embed_tokens and layers")


def outer_modules(model: nn.Module, inner_path: str) -> Iterator[tuple[str, nn.Module]]:
    """Modules outside the decoder layers: the siblings of each module on the path from
    the model down to the decoder, and the decoder's own children but its layers."""
    node, prefix = model, ""
    steps = inner_path.split(".") if inner_path else []
    for step in [*steps, None]:
        for key, child in node.items():
            if key == step or (step is None and key == "layers"):
                continue
            if isinstance(child, nn.Module):
                yield prefix + key, child
        if step is None:
            return
        node, prefix = node[step], f"{prefix}{step}."


def place_stand_ins(inner: nn.Module, start: int, end: int) -> tuple[list[nn.Module], Relay]:
    """Replace every layer outside [start, end) by a stand-in; return the shard's own."""
    relay = Relay(start, end)
    layers = list(inner.layers)
    own = layers[start:end]
    inner.layers = [
        layer if start <= i < end else Elsewhere(layer, i, relay) for i, layer in enumerate(layers)
    ]
    return own, relay


class LayerCaches(list):
    """A shard's caches (mlx-lm's own, one per layer it runs), the full-length list the
    model's forward sees, and how many tokens they hold: linear-attention state
    (`ArraysCache`) has no offset of its own. `kin` maps each index of a layer run
    elsewhere to the index (in this list) of the cache it reads instead."""

    offset: int
    full: list[Any]
    start: int
    kin: dict[int, int]


def make_caches(
    model: nn.Module, start: int, end: int, n: int, kv_bits: int = 0, kv_group_size: int = 64
) -> LayerCaches:
    """The caches of layers [start, end) of an `n`-layer model, as `make_cache()` makes them.
    With `kv_bits`, every plain `KVCache` is mlx-lm's `QuantizedKVCache` instead, from the
    first token (the caller checked the family's attention reads it: shared.kv_quant);
    sliding-window and linear-attention caches have no quantized form and stay."""
    if hasattr(model, "make_cache"):
        full = list(model.make_cache())
    else:  # mlx-lm's default (make_prompt_cache) for a model without its own
        full = [KVCache() for _ in range(n)]
    if kv_bits:
        full = [
            QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) if type(c) is KVCache else c
            for c in full
        ]
    own = LayerCaches(full[start:end])
    own.offset = 0
    # Where the model reads a layer that runs elsewhere, it gets a cache of the same kind
    # that this shard holds (same type, same window): the mask it builds from it is the
    # one this shard's layers of that kind need. A kind this shard lacks keeps its
    # fresh entry: no layer here uses the mask made from it.
    own.start, own.kin = start, {}
    for j in range(n):
        if start <= j < end:
            continue
        k = next((k for k, c in enumerate(own) if _kind(c) == _kind(full[j])), None)
        if k is not None:
            own.kin[j] = k
            full[j] = own[k]
    own.full = full
    return own


# ---- batched decode: mlx-lm's batched caches -------------------------------------------


def batch_reason(caches: list[Any]) -> str:
    """Why mlx-lm cannot decode requests holding these caches as one batch ("" if it
    can). `KVCache`, `RotatingKVCache`, `ArraysCache` and `CacheList`s of them have
    batched forms (`merge` into `BatchKVCache`, `BatchRotatingKVCache`, a batched
    `ArraysCache`, with `extend`, `filter` and `extract`); quantized, chunked and
    concatenating caches have none in mlx-lm 0.32."""
    for cache in caches:
        inner = getattr(cache, "caches", None)
        if isinstance(inner, tuple | list):
            if reason := batch_reason(list(inner)):
                return reason
        elif not hasattr(cache, "merge"):
            return f"mlx-lm has no batched form of {type(cache).__name__}"
    return ""


def _with_full(own: LayerCaches, like: LayerCaches) -> LayerCaches:
    """Give `own` the full-length list of `like`, pointed at `own`'s entries."""
    own.start, own.kin, own.offset = like.start, like.kin, 0
    full = list(like.full)
    for k, cache in enumerate(own):
        full[like.start + k] = cache
    for j, k in like.kin.items():
        full[j] = own[k]
    own.full = full
    return own


def merge_caches(solos: list[LayerCaches]) -> LayerCaches:
    """One batch (a row per request, in order) of requests' own caches, by mlx-lm's
    `merge`. The full-length list is rebuilt so a mask the model makes from a layer run
    elsewhere reads the batched cache of its kind."""
    merged = LayerCaches(type(col[0]).merge(list(col)) for col in zip(*solos, strict=True))
    return _with_full(merged, solos[0])


def extend_caches(batch: LayerCaches, more: LayerCaches) -> None:
    """Append `more`'s rows to `batch`, in place (the full list keeps pointing at them)."""
    for cache, other in zip(batch, more, strict=True):
        cache.extend(other)


def filter_caches(batch: LayerCaches, keep: list[int]) -> None:
    """Keep only rows `keep` of `batch`, in that order, in place."""
    for cache in batch:
        cache.filter(keep)


def extract_caches(batch: LayerCaches, row: int, offset: int) -> LayerCaches:
    """Row `row` of a batch as one request's own caches again (holding `offset` tokens)."""
    solo = _with_full(LayerCaches(cache.extract(row) for cache in batch), batch)
    solo.offset = offset
    return solo


def _kind(cache: Any) -> tuple[type, Any]:
    return type(cache), getattr(cache, "max_size", None)


def run(model: nn.Module, relay: Relay, first: bool, h: mx.array, caches: LayerCaches) -> mx.array:
    """The model's own forward over the shard's layers. `h` is token ids on the first
    shard, else the activation from the previous one; returns the activation for the
    next shard, or the logits on the last."""
    steps = h.shape[1]
    if first:
        inputs = h
    else:
        inputs = relay.placeholder_ids(tuple(h.shape[:2]))
        relay.incoming = h
    try:
        out = model(inputs, cache=caches.full)
    except SliceDone as done:
        out = done.h
    finally:
        relay.incoming = None
    caches.offset += steps
    return out
