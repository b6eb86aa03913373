"""What the planner answers: a `Plan` of `ShardPlan`s, or a `Refusal` a person can
read; and the JSON view of either.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from studiotui.core.placement.facts import Link
from studiotui.core.state import shape_label


@dataclass(frozen=True)
class ShardPlan:
    node: str
    start: int  # layers [start, end)
    end: int
    weight_bytes: int
    kv_bytes: int
    free_before: int
    free_after: int
    # A stage run by a tensor-parallel group: every node in it (rank order, `node` first)
    # holds a 1/N slice of layers [start, end) and they talk over `mx.distributed` with
    # `backend` ("ring" or "jaccl"), chosen for `backend_reason`. () for a one-node stage;
    # the byte figures above are then per node of the group.
    group: tuple[str, ...] = ()
    backend: str | None = None
    backend_reason: str = ""
    # Free memory of each node of the group before loading (rank order), so every
    # member's "after" can be shown; () for a one-node stage (`free_before` says it).
    group_free: tuple[int, ...] = ()
    # An adapter's share of these layers, held beside `weight_bytes` (counted in
    # free_after); 0 without an adapter.
    adapter_bytes: int = 0
    # The prompt cache's budget on this shard (per node of a group), in memory (counted
    # in free_after) and on the node's disk.
    prompt_cache_bytes: int = 0
    prompt_cache_disk_bytes: int = 0
    # A speculative decoding draft model, loaded whole beside the head's layers (counted
    # in free_after; studiotui/cluster/draft.py); 0 elsewhere and without one.
    draft_bytes: int = 0

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node of the stage: the group, or the one node."""
        return self.group or (self.node,)


@dataclass(frozen=True)
class Plan:
    model: str
    shards: tuple[ShardPlan, ...]  # in ring order: the first holds the embedding
    context_tokens: int
    slowest_link: Link | None  # None only for a single node
    total_bytes: int
    # Requests served at once, each with the whole context: the KV cache is reserved for
    # all of them, and the head shard queues or refuses ("busy") any beyond.
    streams: int = 1
    # Quantized KV (`--kv-bits`; 0: full precision), in groups of kv_group_size values.
    kv_bits: int = 0
    kv_group_size: int = 64
    # Lines the preview says under the table (what stays at full precision, why
    # requests decode one by one).
    notes: tuple[str, ...] = ()

    @property
    def tensor(self) -> int:
        """Nodes per stage (every stage of a plan has the same)."""
        return len(self.shards[0].nodes) if self.shards else 1

    @property
    def shape(self) -> str:
        """ "4 stages", "2 stages × 2 (ring)", "1 stage × 4 (jaccl)", "1 node"."""
        backends = {s.backend for s in self.shards if s.backend}
        return shape_label(len(self.shards), self.tensor, "/".join(sorted(backends)) or None)


@dataclass(frozen=True)
class Refusal:
    reason: str
    # What kind of refusal (REFUSAL_KINDS): what the CLI's exit status says.
    kind: str = "memory"


# Every kind of refusal: the model and its KV cache do not fit the memory; the group
# cannot take that shape (layers, tensor size, adapter); the model cannot run on a
# shard; a node of the group is unknown or not up.
REFUSAL_KINDS = ("memory", "shape", "model", "node")


def plan_to_dict(p: Plan | Refusal) -> dict[str, Any]:
    """A JSON-able view for `studiotui place --json` and the controller's events."""
    if isinstance(p, Refusal):
        return {"ok": False, "reason": p.reason}
    return {
        "ok": True,
        "model": p.model,
        "context_tokens": p.context_tokens,
        "streams": p.streams,
        "kv_bits": p.kv_bits,
        "kv_group_size": p.kv_group_size,
        "notes": list(p.notes),
        "total_bytes": p.total_bytes,
        "ring": [s.node for s in p.shards],
        "slowest_link": asdict(p.slowest_link) if p.slowest_link else None,
        "shape": p.shape,
        "shards": [
            {**asdict(s), "group": list(s.group), "group_free": list(s.group_free)}
            for s in p.shards
        ],
    }
