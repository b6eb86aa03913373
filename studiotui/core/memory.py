"""The memory accounting of placing, in one word: a *promise* is memory a node holds for
a placement beyond what its report shows used (the KV cache and prompt cache it may
grow to, and until it is loaded the weights and adapter it will read). The node reports
the promises of its shards; this controller's own, made between its plan and the
nodes' prepared replies, are *unreported* until then. Pure: on the state's nodes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from studiotui.core.placement import format_bytes
from studiotui.core.state import NodeState, ShardState
from worker.shared.protocol import control

# What a shard process holds before any weight (Python, MLX, tokenizer): measured ~80 MB.
RUNNER_OVERHEAD_BYTES = 100 * 1024**2

# The promises this controller made that the nodes do not report yet: placement ->
# node -> bytes.
Promises = Mapping[str, Mapping[str, int]]


def promised_bytes(shard: ShardState) -> int:
    """What `shard` is promised beyond what its node reports used: its KV cache and
    prompt-cache budget (allocated lazily), and, from the moment its placement was
    decided (prepare_shard, through the copy of its files) until it is loaded, the
    plan's weights less those already read and its share of the adapter (applied once
    the weights are in). Loaded, its weights are in the node's report."""
    promised = shard.kv_bytes + shard.prompt_cache_bytes
    if shard.state not in ("prepared", "loading"):
        return promised
    done, size = shard.progress
    # Before the runner's first progress the plan's figure stands for the file's.
    return promised + max(0, (size or shard.weight_bytes) - done) + shard.adapter_bytes


def node_promised_bytes(node: NodeState) -> int:
    """What the shards `node` reports are promised (promised_bytes), all together."""
    return sum(promised_bytes(shard) for shard in node.shards)


def unreported_promised_bytes(promises: Promises, node: NodeState) -> int:
    """What this controller has promised on `node` to placements whose prepared shards
    the node does not report yet (the round trip of prepare_shard): counted once, so a
    placement the node already reports is the report's."""
    reported = {shard.placement for shard in node.shards}
    return sum(on.get(node.name, 0) for name, on in promises.items() if name not in reported)


def room(node: NodeState, promises: Promises) -> int:
    """What a new shard may still take on `node`: its free memory less every promise
    there (reported, or unreported and this controller's) and a runner."""
    return (
        node.memory_free
        - node_promised_bytes(node)
        - unreported_promised_bytes(promises, node)
        - RUNNER_OVERHEAD_BYTES
    )


def disk_room(node: NodeState) -> int | None:
    """The disk a new placement's prompt cache may count on `node`: its free disk less
    what the prompt caches of the shards it runs may still write there (each one's disk
    budget less what it holds already), so two placements' defaults never promise the
    same free space twice. None when the node does not say its free disk."""
    if node.disk_free is None:
        return None
    pending = sum(max(0, s.prompt_cache_disk_bytes - s.cache_disk_bytes) for s in node.shards)
    return node.disk_free - pending


def promises_note(nodes: Sequence[NodeState], promises: Promises | None = None) -> str:
    """Who holds the memory of these nodes that their reports still show free: the
    placements not loaded yet, each with its promise per node, and what frees it; ""
    when there are none. Said beside a refusal, which otherwise reads as a mystery.
    `promises`: this controller's, not reported by their nodes yet."""
    held: dict[str, list[str]] = {}
    doing: dict[str, str] = {}
    for node in nodes:
        for name, on in (promises or {}).items():
            mine = unreported_promised_bytes({name: on}, node)
            if mine > 0:
                held.setdefault(name, []).append(f"{format_bytes(mine)} on {node.name}")
                doing.setdefault(name, "being prepared")
        for shard in node.shards:
            promised = promised_bytes(shard)
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
