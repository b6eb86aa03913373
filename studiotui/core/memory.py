"""The memory accounting of placing: what a node holds for placements beyond what its
report shows used, and the words for it beside a refusal. Pure: on the state's nodes
and this controller's own pledges."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from studiotui.core.placement import format_bytes
from studiotui.core.state import NodeState, ShardState
from worker.shared.protocol import control

# What a shard process holds before any weight (Python, MLX, tokenizer): measured ~80 MB.
RUNNER_OVERHEAD_BYTES = 100 * 1024**2

Pledges = Mapping[str, Mapping[str, int]]  # placement -> node -> bytes


def promised_bytes(shard: ShardState) -> int:
    """Memory a shard not loaded yet has been promised and does not hold yet: from the
    moment its placement was decided (prepare_shard, through the copy of its files)
    the plan's weights, less those already read once it loads, and its share of the
    adapter (applied once the weights are in). Loaded, it is in the node's report."""
    if shard.state not in ("prepared", "loading"):
        return 0
    done, size = shard.progress
    # Before the runner's first progress the plan's figure stands for the file's.
    return max(0, (size or shard.weight_bytes) - done) + shard.adapter_bytes


def committed_bytes(node: NodeState) -> int:
    """Memory a node has promised but not yet used: the KV caches and prompt caches its
    placements may still grow to, and what its shards not loaded yet will hold
    (promised_bytes)."""
    return sum(
        shard.kv_bytes + shard.prompt_cache_bytes + promised_bytes(shard) for shard in node.shards
    )


def pledged_bytes(pledges: Pledges, node: NodeState) -> int:
    """Memory this controller has planned onto `node` for placements whose prepared
    shards the node has not reported yet (the round trip of prepare_shard): counted
    once, so a placement the node already reports is the report's, not the pledge's."""
    reported = {shard.placement for shard in node.shards}
    return sum(on.get(node.name, 0) for name, on in pledges.items() if name not in reported)


def room(node: NodeState, pledges: Pledges) -> int:
    """What a new shard may still take on `node`: its free memory less what is
    promised there (reported or only pledged by this controller) and a runner."""
    return (
        node.memory_free
        - committed_bytes(node)
        - pledged_bytes(pledges, node)
        - RUNNER_OVERHEAD_BYTES
    )


def promises_note(nodes: Sequence[NodeState], pledges: Pledges | None = None) -> str:
    """Who holds the memory of these nodes that their reports still show free: the
    placements not loaded yet, each with its promise per node, and what frees it; ""
    when there are none. Said beside a refusal, which otherwise reads as a mystery.
    `pledges`: this controller's placements not reported by their nodes yet."""
    held: dict[str, list[str]] = {}
    doing: dict[str, str] = {}
    for node in nodes:
        for name, on in (pledges or {}).items():
            mine = pledged_bytes({name: on}, node)
            if mine > 0:
                held.setdefault(name, []).append(f"{format_bytes(mine)} on {node.name}")
                doing.setdefault(name, "being prepared")
        for shard in node.shards:
            promised = shard.kv_bytes + shard.prompt_cache_bytes + promised_bytes(shard)
            if shard.state not in ("prepared", "loading") or promised <= 0:
                continue
            held.setdefault(shard.placement, []).append(f"{format_bytes(promised)} on {node.name}")
            if doing.get(shard.placement) != "copying its files":
                doing[shard.placement] = (
                    "copying its files" if shard.state == "prepared" else "loading"
                )
    parts = [
        f"placement {name!r} ({doing[name]}) is promised {', '.join(where)}"
        for name, where in held.items()
    ]
    if not parts:
        return ""
    # An operator killed while placing leaves its shards prepared until their lease
    # lapses (the agents drop them): say how to free them sooner.
    unload = f"studiotui unload {next(iter(held))}" if len(held) == 1 else "studiotui unload NAME"
    lease = f"{control.PREPARED_LEASE_S / 60:.0f} minutes"
    return (
        "; ".join(parts)
        + ": that memory is taken once it is loaded, or given back if it fails or is "
        + f"unloaded ({unload} if its placing was given up); a copy whose operator "
        + f"went away is given back after {lease}"
    )
