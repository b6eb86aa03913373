"""The prompt cache's disk budget against each node's free disk (pure).

A placement's prefix cache spills entries to its nodes' disks (worker.prompt_cache).
Asked for (`place --prompt-cache-disk GB`), a budget a node's disk cannot hold is
refused before anything loads, naming the node, its free space and the flag. By
default each node keeps at most half of its free disk for it: a cache must never be
what fills a node's disk (its logs, copies of models and the system need the rest).
"Free" here is what the caller counts on: the node's free disk less what the prompt
caches already placed there may still write (core.memory.disk_room).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from studiotui.core.placement.plans import Plan, Refusal
from studiotui.core.placement.words import gb

_GB = 1024**3
# Of a node's free disk, the most the default budget takes.
DEFAULT_SHARE_OF_FREE_DISK = 0.5


def disk_by_node(p: Plan) -> dict[str, int]:
    """The prompt cache's disk bytes each node of `p` would keep (every member of a
    tensor group keeps its own slice of each entry)."""
    out: dict[str, int] = {}
    for s in p.shards:
        for node in s.nodes:
            out[node] = out.get(node, 0) + s.prompt_cache_disk_bytes
    return out


def fit_disk(p: Plan, asked: int | None, free: Mapping[str, int | None]) -> Plan | Refusal:
    """`p` with its prompt-cache disk budget checked against `free` (bytes free on each
    node's disk; None where the node did not say). `asked`: the budget the operator
    gave (`--prompt-cache-disk`, in bytes), refused where a node cannot hold its share;
    None: the plan's default, cut down on each node to DEFAULT_SHARE_OF_FREE_DISK of
    its free disk."""
    need = disk_by_node(p)
    if asked is not None:
        short = [
            (node, bytes_, room)
            for node, bytes_ in need.items()
            if (room := free.get(node)) is not None and bytes_ > room
        ]
        if not short:
            return p
        # Each node's share is a fixed part of the whole: the whole that fits them all.
        most = min(max(room, 0) * asked // bytes_ for _, bytes_, room in short)
        where = ", ".join(
            f"{node} would keep {gb(bytes_)} of it with {gb(max(room, 0))} free for it on its disk"
            for node, bytes_, room in short
        )
        return Refusal(
            f"a prompt cache of {gb(asked)} on disk does not fit: {where}; "
            f"--prompt-cache-disk {math.floor(most / _GB * 10) / 10:.1f} or less fits, "
            "or free some disk on those nodes"
        )
    scale: dict[str, float] = {}
    for node, bytes_ in need.items():
        room = free.get(node)
        if room is None or bytes_ <= 0:
            continue
        cap = int(max(room, 0) * DEFAULT_SHARE_OF_FREE_DISK)
        if bytes_ > cap:
            scale[node] = cap / bytes_
    if not scale:
        return p
    # A shard of a tensor group takes the smallest of its members' cuts: its members
    # hold slices of the same entries, so they keep the same budget.
    shards = tuple(
        replace(
            s,
            prompt_cache_disk_bytes=int(
                s.prompt_cache_disk_bytes * min(scale.get(n, 1.0) for n in s.nodes)
            ),
        )
        for s in p.shards
    )
    return replace(p, shards=shards)
