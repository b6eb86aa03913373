"""The words for a placement that cannot answer and what to do about it: pure, on the
state the controller holds (the log, a refused request and the dashboard say them)."""

from __future__ import annotations

import time

from studiotui.core.state import NodeState, PlacementState, ShardState

# How a node's message says the operator stopped it (NodeState.stopped_at says it to
# programs).
STOPPED_BY_DOWN = "stopped by `studiotui down`"


def clock(when: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when))


def stage_words(shard: ShardState) -> str:
    return f"stage {shard.index + 1} of {shard.count}, layers {shard.start}-{shard.end - 1}"


def stopped_by_down(placement: PlacementState, nodes: tuple[NodeState, ...]) -> bool:
    """Every node of `placement` that is missing was stopped by `studiotui down`."""
    gone = [n for n in nodes if n.name in placement.missing]
    return bool(gone) and all(n.stopped_at is not None for n in gone)


def reload_hint(node: str) -> str:
    """What loads a lost or failed shard again: a restart of its node (`restart_nodes`
    reloads it from what its agent or the controller recorded)."""
    return (
        f"restart {node} (studiotui restart {node}, r on the dashboard) to load it again "
        "on the same layers"
    )


def not_ready_hint(placement: PlacementState, nodes: tuple[NodeState, ...] = ()) -> str:
    """What an operator can do about a placement that cannot answer yet."""
    if placement.state in ("loading", "prepared"):
        return f"wait until {placement.name!r} is ready"
    silent = [s for s in placement.shards if s.state == "silent"]
    if silent:
        # Nothing is lost yet: the shard is loaded and only silent; say so, not "reload".
        s = silent[0]
        return (
            f"its shard on {s.node} ({stage_words(s)}) is {s.message or 'silent'}; "
            f"{placement.name!r} is used again by itself as soon as it answers; if it "
            f"stays silent, restart {s.node} (studiotui restart {s.node}, which reloads "
            "its shards)"
        )
    failed = [s for s in placement.shards if s.state == "failed"]
    if failed:
        s = failed[0]
        why = f": {s.message}" if s.message else ""
        return f"its shard on {s.node} ({stage_words(s)}) failed{why}; {reload_hint(s.node)}"
    # A node that fell silent may come back with its shards (a stopped agent, a blip):
    # say what is known first, and reloading only as what to do if it stays away.
    away = [n for n in nodes if n.name in placement.missing and n.state == "down"]
    if away:
        n = away[0]
        stages = placement.stages
        where = next(
            (
                f" (stage {i + 1} of {len(stages)}, layers {start}-{end - 1})"
                for i, (names, start, end) in enumerate(stages)
                if n.name in names
            ),
            "",
        )
        if n.stopped_at is not None:
            return (
                f"node {n.name}{where} was {n.message}; `studiotui up` or `studiotui restart "
                f"{n.name}` (r on the dashboard) starts it and loads its shard again"
            )
        return (
            f"node {n.name}{where}: {n.message or 'down'}; {placement.name!r} is used again by "
            f"itself if {n.name} comes back with its shard; if it stays silent, restart it "
            f"(studiotui restart {n.name}) or place {placement.name!r} again (R on the "
            "dashboard)"
        )
    return (
        f"unload it and place the model again (studiotui unload {placement.name}, then "
        "studiotui place; R on the dashboard does both)"
    )
