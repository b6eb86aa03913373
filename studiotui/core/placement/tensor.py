"""Tensor groups: which sizes `shard()` can cut a model into, the `mx.distributed`
backend a group runs, and stages of tensor groups planned as a pipeline's nodes are.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from studiotui.core.placement.accounting import _fixed, _usable
from studiotui.core.placement.facts import Link, ModelFacts, NodeBudget
from studiotui.core.placement.plans import Plan, Refusal, ShardPlan
from studiotui.core.placement.refusals import _cut_refusal, _small_node_refusal
from studiotui.core.placement.ring import (
    _best_links,
    _hop_us,
    _Pair,
    _pair,
    _ring_order,
    _slowest_link,
)
from studiotui.core.placement.split import _best_fit
from studiotui.core.placement.words import _count, _joined, gb
from studiotui.core.state import shape_label


def tensor_refusal(model: ModelFacts, n: int, node_count: int) -> str | None:
    """Why `node_count` nodes cannot run `model` as stages of `n`-node tensor groups."""
    if n < 1:
        return f"a tensor group needs at least 1 node, not {n}"
    if n == 1:
        return None
    if model.tensor is None:
        why = (
            f"{model.name} ({model.family}) has no tensor-parallel shard() in mlx-lm, "
            "so it runs only as a pipeline (tensor 1)"
        )
    elif node_count % n:
        why = f"a tensor group of {n} does not split {_count(node_count, 'node')} into equal stages"
    elif node_count // n > model.n_layers:
        why = f"{node_count // n} stages need at least {node_count // n} layers"
    else:
        cut = model.tensor.refusal(n)
        why = f"{model.name} cannot be cut {n} ways: {cut}" if cut else ""
    if not why:
        return None
    fits = [str(k) for k in tensor_sizes(model, node_count)]
    return f"{why}; tensor sizes that divide here: {', '.join(fits)}"


def tensor_sizes(model: ModelFacts, node_count: int) -> tuple[int, ...]:
    """Tensor-group sizes `shard()` can cut this model into on `node_count` nodes (the
    stages equal), 1 — a pipeline of one-node stages — first."""
    if model.tensor is None:
        return (1,)
    return tuple(
        n
        for n in range(1, node_count + 1)
        if node_count % n == 0
        and node_count // n <= model.n_layers
        and model.tensor.refusal(n) is None
    )


def _partitions(names: Sequence[str], n: int) -> list[tuple[tuple[str, ...], ...]]:
    """Every way to cut the sorted names into groups of n (each group sorted; the group
    holding the first name first), without repeating one in another order."""
    if not names:
        return [()]
    first, rest = names[0], names[1:]
    out = []
    for mates in itertools.combinations(rest, n - 1):
        left = [x for x in rest if x not in mates]
        out += [((first, *mates), *more) for more in _partitions(left, n)]
    return out


def _all_rdma(group: Sequence[str], links: Mapping[_Pair, Link]) -> bool:
    return all(
        (link := links.get(_pair(a, b))) is not None and link.rdma
        for a, b in itertools.combinations(group, 2)
    )


def _group_key(
    groups: Sequence[Sequence[str]], links: Mapping[_Pair, Link]
) -> tuple[int, float, float]:
    """Smaller is better: groups without RDMA everywhere, then the slowest link inside a
    group (every all-reduce waits for it), then the total."""
    pairs = [p for g in groups for p in itertools.combinations(g, 2)]
    times = [_hop_us(links.get(_pair(a, b))) for a, b in pairs]
    finite = [t for t in times if math.isfinite(t)]
    no_rdma = sum(not _all_rdma(g, links) for g in groups)
    return (no_rdma, max(times, default=0.0), math.fsum(finite))


def backend_for(
    group: Sequence[str], links: Sequence[Link] | Mapping[_Pair, Link]
) -> tuple[str, str]:
    """The `mx.distributed` backend a tensor group runs and why: JACCL when every pair
    of its nodes has RDMA over Thunderbolt enabled at both ends, else the ring backend
    over TCP on the Thunderbolt bridge addresses."""
    best = links if isinstance(links, Mapping) else _best_links(links, frozenset(group))
    missing, named = [], []
    for a, b in itertools.combinations(group, 2):
        link = best.get(_pair(a, b))
        if link is not None and link.rdma:
            continue
        if link is not None and link.rdma_why:
            named.append(link.rdma_why)
        else:
            missing.append(f"{a} ↔ {b}")
    if not missing and not named:
        return "jaccl", f"every pair of {', '.join(group)} has RDMA enabled: JACCL over RDMA"
    words = list(dict.fromkeys(named))
    if missing:
        verb = "has" if len(missing) == 1 else "have"
        words.append(f"{_joined(missing, 'and')} {verb} no RDMA at both ends")
    return "ring", f"{'; '.join(words)}: ring backend over TCP on the bridge addresses"


def _plan_tensor(
    model: ModelFacts,
    nodes: Sequence[NodeBudget],
    links: Sequence[Link],
    n: int,
    context_tokens: int,
    streams: int,
    reserve_fraction: float,
) -> Plan | Refusal:
    """Stages of `n`-node tensor groups: every node of a group holds 1/n of what
    `shard()` splits in the stage's layers (and of their cache, unless it is an MLA
    latent), and the rest whole; the first group's nodes each hold the embedding, the
    last group's the head. Groups are the partition whose links are best (RDMA
    everywhere first), then the stages are cut and ordered as a pipeline's nodes are,
    each group counted as its smallest node."""
    assert model.tensor is not None  # tensor_refusal said so
    by_name = {node.name: node for node in nodes}
    usable = {name: _usable(node, reserve_fraction) for name, node in by_name.items()}
    kv_layers = model.kv_bytes(context_tokens, streams)
    split = model.tensor.layer_split
    node_layer = [b - s + math.ceil(s / n) for b, s in zip(model.layer_bytes, split, strict=True)]
    node_kv = [math.ceil(kv / n) if model.tensor.kv_split else kv for kv in kv_layers]
    costs = [w + kv for w, kv in zip(node_layer, node_kv, strict=True)]
    stages = len(nodes) // n
    label = shape_label(stages, n)
    need = n * (sum(costs) + model.embed_bytes + model.head_bytes)
    # Held whole on each node of a group: what shard() does not cut, and an MLA cache.
    whole = sum(b - s for b, s in zip(model.layer_bytes, split, strict=True))
    whole += model.embed_bytes + model.head_bytes
    whole += 0 if model.tensor.kv_split else sum(kv_layers)
    available = sum(max(u, 0) for u in usable.values())
    if need > available:
        return Refusal(
            f"{model.name} as {label} needs {gb(need)} ({gb((n - 1) * whole)} more than a "
            f"pipeline: what shard() leaves whole — norms, routers, embedding, head, an MLA "
            f"cache — is held by each of the {n} nodes of a group), the group has "
            f"{gb(available)} free after a {reserve_fraction:.0%} "
            f"reserve per node; use fewer nodes per tensor group or add a node"
        )
    refusal = _small_node_refusal(usable, costs)
    if refusal:
        return refusal
    best = _best_links(links, frozenset(by_name))
    partitions = sorted(_partitions(sorted(by_name), n), key=lambda g: (_group_key(g, best), g))
    for groups in partitions:
        leaders = {g[0]: g for g in groups}
        room = {lead: min(usable[m] for m in g) for lead, g in leaders.items()}
        found = _best_fit(_ring_order(sorted(leaders), best), room, costs, model)
        if found is None:
            continue
        order, cuts = found
        shards = []
        for i, lead in enumerate(order):
            group = leaders[lead]
            start, end = cuts[i], cuts[i + 1]
            weights = sum(node_layer[start:end]) + _fixed(i, len(order), model)
            kv = sum(node_kv[start:end])
            backend, why = backend_for(group, best)
            free = by_name[lead].free_bytes
            shards.append(
                ShardPlan(
                    lead,
                    start,
                    end,
                    weights,
                    kv,
                    free,
                    free - weights - kv,
                    group=group,
                    backend=backend,
                    backend_reason=why,
                    group_free=tuple(by_name[m].free_bytes for m in group),
                )
            )
        return Plan(
            model=model.name,
            shards=tuple(shards),
            context_tokens=context_tokens,
            slowest_link=_slowest_link(order, best),
            total_bytes=sum((s.weight_bytes + s.kv_bytes) * n for s in shards),
            streams=streams,
        )
    return _cut_refusal(model, list(usable.values()), costs)
