"""The processes a plan runs: one per one-node stage, one per node of a tensor group.

Pure: the controller's load path asks this what to prepare and load where, and the
state keeps the members in this order (stage by stage, each group's leader first), so
the first member is always the head stage's leader, which serves the clients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from studiotui.core.placement import Plan


@dataclass(frozen=True)
class Member:
    stage: int  # index in the pipeline
    rank: int  # 0 for the group's leader (and for a one-node stage)
    node: str
    start: int
    end: int
    group: tuple[str, ...]  # () for a one-node stage; else every node, rank order
    backend: str | None


def members(the_plan: Plan) -> list[Member]:
    out: list[Member] = []
    for i, s in enumerate(the_plan.shards):
        nodes = s.group or (s.node,)
        if s.group and s.group[0] != s.node:
            raise ValueError(f"stage {i}'s group {s.group} does not start with its node {s.node}")
        for rank, node in enumerate(nodes):
            out.append(Member(i, rank, node, s.start, s.end, tuple(s.group), s.backend))
    seen = [m.node for m in out]
    if len(set(seen)) != len(seen):
        raise ValueError(f"a node appears twice in the plan: {seen}")
    return out


def jaccl_devices(
    group: Sequence[str], rdma: Mapping[str, Mapping[str, Any]]
) -> list[list[str | None]] | str:
    """JACCL's device matrix (row i: the RDMA device rank i reaches rank j through), from
    what each node's agent reports (`facts["rdma"]`), or why it cannot be made.

    The agents report a node's active `rdma_enX` devices but not which peer each cable
    leads to, so this is certain only when each node has one active device (two Macs,
    one cable); otherwise it refuses rather than guess.
    """
    rows: list[list[str | None]] = []
    for i, node in enumerate(group):
        facts = rdma.get(node) or {}
        active = [str(d) for d in facts.get("active_devices") or []]
        if not facts.get("usable") or not active:
            return f"{node} has no usable RDMA device (rdma_ctl status, ibv_devices)"
        if len(group) > 2 or len(active) != 1:
            return (
                f"{node} has {len(active)} active RDMA devices and the agents do not report "
                "which peer each one reaches; use the ring backend for this group"
            )
        rows.append([None if j == i else active[0] for j in range(len(group))])
    return rows
