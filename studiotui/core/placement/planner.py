"""The planner: `plan` places a model on a group as a pipeline (or as stages of
tensor groups, see `tensor`), and `longest_context` searches it for the longest
context that fits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from studiotui.core.placement.accounting import _fixed, _usable
from studiotui.core.placement.facts import Link, ModelFacts, NodeBudget
from studiotui.core.placement.plans import Plan, Refusal, ShardPlan
from studiotui.core.placement.refusals import (
    _cut_refusal,
    _group_refusal,
    _small_node_refusal,
    _total_refusal,
)
from studiotui.core.placement.ring import _best_links, _ring_order, _slowest_link
from studiotui.core.placement.split import _best_fit
from studiotui.core.placement.tensor import _plan_tensor, tensor_refusal
from studiotui.core.placement.words import _joined, gb


def _check_args(context_tokens: int, streams: int, reserve_fraction: float) -> None:
    if context_tokens < 1 or streams < 1:
        raise ValueError("context_tokens and streams must be at least 1")
    if not 0.0 <= reserve_fraction < 1.0:
        raise ValueError("reserve_fraction must be in [0, 1)")


def _shard(
    node: NodeBudget, index: int, cuts: Sequence[int], model: ModelFacts, kv_layers: Sequence[int]
) -> ShardPlan:
    start, end = cuts[index], cuts[index + 1]
    weights = sum(model.layer_bytes[start:end]) + _fixed(index, len(cuts) - 1, model)
    kv = sum(kv_layers[start:end])
    adapter = sum(model.layer_adapter[start:end])
    after = node.free_bytes - weights - adapter - kv
    return ShardPlan(
        node.name, start, end, weights, kv, node.free_bytes, after, adapter_bytes=adapter
    )


def _adapter_refusal(
    model: ModelFacts,
    nodes: Sequence[NodeBudget],
    links: Sequence[Link],
    usable: Mapping[str, int],
    context_tokens: int,
    streams: int,
    reserve_fraction: float,
) -> Refusal | None:
    """Why the model fits these nodes but not with its adapter (None: no adapter, or it
    does not fit without one either): the plan without the adapter, and the node(s) of
    it whose layers' adapter share does not fit there, by how much."""
    if not model.layer_adapter:
        return None
    without = plan(
        replace(model, layer_adapter=()),
        nodes,
        links,
        context_tokens=context_tokens,
        streams=streams,
        reserve_fraction=reserve_fraction,
    )
    if not isinstance(without, Plan):
        return None
    short = []
    for s in without.shards:
        share = sum(model.layer_adapter[s.start : s.end])
        room = usable[s.node] - s.weight_bytes - s.kv_bytes
        if share > room:
            span = f"{s.start}–{s.end - 1}" if s.end - s.start > 1 else f"{s.start}"
            short.append((s.node, span, share, share - room))
    if not short:
        return None
    parts = [
        f"{node} would hold layers {span} and {gb(share)} of adapter tensors, "
        f"{gb(lack)} more than it has free"
        for node, span, share, lack in short
    ]
    return Refusal(
        f"{model.name} fits these nodes without its adapter but not with it "
        f"({gb(model.adapter_bytes)} of adapter tensors, each held by the shard of its "
        f"layer): "
        f"{_joined(parts, 'and')} after the reserve; free that much there, add a node, "
        "or shorten the context"
    )


def plan(
    model: ModelFacts,
    nodes: Sequence[NodeBudget],
    links: Sequence[Link] = (),
    *,
    context_tokens: int = 4096,
    streams: int = 1,
    reserve_fraction: float = 0.05,
    tensor: int = 1,
) -> Plan | Refusal:
    """Place `model` on `nodes` as a ring of contiguous layer ranges, or say why not.

    `tensor` > 1 makes every stage a tensor group of that many nodes (see
    `_plan_tensor`); 1, the default, is a pipeline of one-node stages.

    The ring follows the fastest links; layers go in proportion to each node's usable
    memory (free minus `reserve_fraction` of its total) after the head pays the
    embedding, the tail the head, and every node the KV cache of its layers for
    `context_tokens` × `streams`. Which node heads the ring (and so pays the embedding)
    and which way round it runs is chosen for the most even split, since that changes
    no link. The same input always gives the same plan, whatever order the nodes and
    links are listed in.
    """
    _check_args(context_tokens, streams, reserve_fraction)
    refusal = _group_refusal(model, nodes)
    if refusal:
        return refusal
    if tensor != 1:
        why = tensor_refusal(model, tensor, len(nodes))
        if why:
            return Refusal(why, "shape")
        if model.layer_adapter:
            # mlx-lm's LoRA layers wrap whole projections; a tensor rank holds slices.
            return Refusal(
                f"an adapter is applied by pipeline stages, not by tensor groups of {tensor}",
                "shape",
            )
        return _plan_tensor(model, nodes, links, tensor, context_tokens, streams, reserve_fraction)
    by_name = {node.name: node for node in nodes}
    usable = {name: _usable(node, reserve_fraction) for name, node in by_name.items()}
    # Each layer costs its own weights (experts included) plus its own cache, so the
    # split follows bytes: DeepSeek's 3 dense layers weigh a fraction of its MoE ones.
    kv_layers = model.kv_bytes(context_tokens, streams)
    costs = [size + kv for size, kv in zip(model.layer_bytes, kv_layers, strict=True)]
    if model.layer_adapter:
        # An adapter's tensors sit beside their layer's weights, on that layer's shard.
        costs = [c + a for c, a in zip(costs, model.layer_adapter, strict=True)]
    refusal = _total_refusal(
        model,
        list(usable.values()),
        sum(kv_layers),
        context_tokens,
        streams,
        reserve_fraction,
    ) or _small_node_refusal(usable, costs)
    if refusal:
        return (
            _adapter_refusal(model, nodes, links, usable, context_tokens, streams, reserve_fraction)
            or refusal
        )
    best_links = _best_links(links, frozenset(by_name))
    found = _best_fit(_ring_order(sorted(by_name), best_links), usable, costs, model)
    if found is None:
        return _adapter_refusal(
            model, nodes, links, usable, context_tokens, streams, reserve_fraction
        ) or _cut_refusal(model, list(usable.values()), costs)
    order, cuts = found
    shards = tuple(_shard(by_name[name], i, cuts, model, kv_layers) for i, name in enumerate(order))
    return Plan(
        model=model.name,
        shards=shards,
        context_tokens=context_tokens,
        slowest_link=_slowest_link(order, best_links),
        total_bytes=sum(s.weight_bytes + s.adapter_bytes + s.kv_bytes for s in shards),
        streams=streams,
    )


def longest_context(
    model: ModelFacts,
    nodes: Sequence[NodeBudget],
    links: Sequence[Link] = (),
    *,
    streams: int = 1,
    tensor: int = 1,
    reserve_fraction: float = 0.05,
    most: int = 1 << 24,
) -> int:
    """The longest context (at most `most`) `plan` places on these nodes for `streams`
    requests at once; 0 when not even one token fits. Caches grow with the context but
    not linearly (windows, linear states), so it searches the plan itself."""

    def fits(tokens: int) -> bool:
        verdict = plan(
            model,
            nodes,
            links,
            context_tokens=tokens,
            streams=streams,
            tensor=tensor,
            reserve_fraction=reserve_fraction,
        )
        return isinstance(verdict, Plan)

    if not fits(1):
        return 0
    if fits(most):
        return most
    low, high = 1, most
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
