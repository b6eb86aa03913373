"""Memory accounting: what a node keeps free for the OS, what a shard holds besides
its layers, and the prompt cache's budget counted in the same memory.
"""

from __future__ import annotations

import math
from dataclasses import replace

from studiotui.core.placement.facts import ModelFacts, NodeBudget
from studiotui.core.placement.plans import Plan, Refusal, ShardPlan
from studiotui.core.placement.words import _GB, gb


def reserve_bytes(node: NodeBudget, reserve_fraction: float) -> int:
    """Memory kept free on a node for the OS and the runner itself."""
    return math.ceil(node.total_bytes * reserve_fraction)


def _usable(node: NodeBudget, reserve_fraction: float) -> int:
    return node.free_bytes - reserve_bytes(node, reserve_fraction)


def _fixed(index: int, count: int, model: ModelFacts) -> int:
    """Bytes a shard holds besides its layers, by its place in the ring."""
    first = model.embed_bytes if index == 0 else 0
    last = model.head_bytes if index == count - 1 else 0
    return first + last


# The default prompt-cache budget of a shard: at most this share of what the plan leaves
# free on its node (the rest stays for other placements and jobs), and at most this many
# whole contexts' KV of one stream (that many conversations' entries kept).
CACHE_SHARE_OF_FREE = 0.5


CACHE_KV_MULTIPLE = 4


CACHE_DISK_MULTIPLE = 4  # default disk budget: this many times the memory one


def with_prompt_cache(p: Plan, memory: int | None, disk: int | None) -> Plan | Refusal:
    """`p` with a prompt-cache budget on every shard, counted in its node's memory.

    `memory` is the whole placement's, split between the nodes as the KV is (an entry
    holds each layer's cache, on that layer's shard); None: each shard gets what its
    node can spare, at most CACHE_SHARE_OF_FREE of what the plan leaves free there and
    CACHE_KV_MULTIPLE whole contexts of one stream's KV. `disk` likewise (None:
    CACHE_DISK_MULTIPLE times memory). A `memory` some node cannot hold is refused with
    the most that fits."""
    nodes_kv = sum(s.kv_bytes * len(s.nodes) for s in p.shards)
    count = sum(len(s.nodes) for s in p.shards)

    def share(total: int, s: ShardPlan) -> int:
        return total * s.kv_bytes // nodes_kv if nodes_kv else total // count

    if memory is None:
        mem = [
            max(
                0,
                min(
                    int(s.free_after * CACHE_SHARE_OF_FREE),
                    CACHE_KV_MULTIPLE * s.kv_bytes // p.streams,
                ),
            )
            for s in p.shards
        ]
    else:
        mem = [share(memory, s) for s in p.shards]
        short = [(s, m) for s, m in zip(p.shards, mem, strict=True) if m > s.free_after]
        if short:
            most = min(
                max(s.free_after, 0) * nodes_kv // s.kv_bytes if nodes_kv and s.kv_bytes else 0
                for s in p.shards
            )
            where = ", ".join(
                f"{'+'.join(s.nodes)} would hold {gb(m)} of it with {gb(max(s.free_after, 0))} "
                "free after weights and KV"
                for s, m in short
            )
            return Refusal(
                f"a prompt cache of {gb(memory)} does not fit: {where}; "
                f"--prompt-cache {math.floor(most / _GB * 10) / 10:.1f} or less fits these nodes"
            )
    if disk is None:
        on_disk = [CACHE_DISK_MULTIPLE * m for m in mem]
    else:
        on_disk = [share(disk, s) for s in p.shards]
    shards = tuple(
        replace(
            s,
            prompt_cache_bytes=m,
            prompt_cache_disk_bytes=d,
            free_after=s.free_after - m,
        )
        for s, m, d in zip(p.shards, mem, on_disk, strict=True)
    )
    added = sum(m * len(s.nodes) for s, m in zip(p.shards, mem, strict=True))
    return replace(p, shards=shards, total_bytes=p.total_bytes + added)
