"""The processes a plan runs: one per one-node stage, one per node of a tensor group;
and which RDMA device reaches which node, for MLX's JACCL backend.

Pure: the controller's load path asks this what to prepare and load where, and the
state keeps the members in this order (stage by stage, each group's leader first), so
the first member is always the head stage's leader, which serves the clients.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from studiotui.core.placement import Link, Plan, backend_for
from worker.shared.protocol.messages import MessageError
from worker.shared.protocol.rdma import RdmaFacts, RdmaPort, read_rdma


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


Matrix = list[list[str | None]]


@dataclass(frozen=True)
class Cable:
    """One Thunderbolt cable as one end sees it: this node's port and RDMA device, the
    node at the other end (None: a Mac that is not in the cluster, or none)."""

    node: str
    receptacle: int
    device: str | None
    state: str | None
    peer: str | None
    peer_uuid: str | None


def read_facts(raw: Mapping[str, Any]) -> dict[str, RdmaFacts | str]:
    """Each node's `facts["rdma"]` typed, or the words for why it cannot be used."""
    out: dict[str, RdmaFacts | str] = {}
    for node, value in raw.items():
        try:
            facts = read_rdma(value or None)
        except MessageError as exc:
            out[node] = f"{node} sent RDMA facts that cannot be read ({exc})"
            continue
        out[node] = facts if facts is not None else f"{node} has not reported its RDMA facts"
    return out


def cables(rdma: Mapping[str, Any]) -> list[Cable]:
    """Every port with a Mac at its other end, on every node, with that Mac named
    when it is one of `rdma`'s nodes: node A's port whose peer UUID is one of node B's
    own port UUIDs is a cable from A to B."""
    facts = {n: f for n, f in read_facts(rdma).items() if isinstance(f, RdmaFacts)}
    owner = {u: n for n, f in facts.items() for u in f.own_uuids}
    return [
        Cable(n, p.receptacle, p.device, p.state, owner.get(p.peer_uuid), p.peer_uuid)
        for n, f in facts.items()
        for p in f.ports
        if p.peer_uuid
    ]


def _wires(fa: RdmaFacts, fb: RdmaFacts) -> list[tuple[RdmaPort, RdmaPort]]:
    """Every cable between two Macs as (a's port, b's port at its other end), by a's
    port number: a's port whose peer UUID is b's port's own UUID."""
    theirs = {p.domain_uuid: p for p in fb.ports if p.domain_uuid}
    return [(p, theirs[p.peer_uuid]) for p in fa.ports if p.peer_uuid in theirs]


def _port_problem(node: str, p: RdmaPort) -> str:
    if not p.device:
        port = f"Thunderbolt {p.receptacle} ({p.interface or 'no interface'})"
        return f"{port} on {node} has no RDMA device"
    if not p.active:
        return f"{p.device} on {node} is {'down' if p.state else 'in an unknown state'}"
    if p.ipv4 == "":
        # MLX's JACCL takes the device's IPv4-mapped GID, which exists only while the
        # interface has an IPv4 address (MLX PR #4191): without one the join fails.
        return (
            f"{p.interface} on {node} has no IPv4 address (JACCL needs one on each cabled "
            "port; a link-local 169.254.x.y will do)"
        )
    return ""


def _usable(node: str, facts: RdmaFacts | str) -> str | RdmaFacts:
    if isinstance(facts, str):
        return facts
    if not facts.usable:
        return f"{node} has no usable RDMA device (rdma_ctl status, ibv_devices)"
    if not facts.ports:
        return f"{node} does not report its Thunderbolt ports (system_profiler, networksetup)"
    return facts


def rdma_pair(a: str, b: str, rdma: Mapping[str, Any]) -> tuple[str, str] | str:
    """The devices `a` and `b` reach each other through (a's, b's), both ends of one
    cable, or why they cannot talk over RDMA: one of them has none, no cable joins
    them, or a port of the cable is down (both ends must be PORT_ACTIVE).

    Where several cables join the two, the first by a's port number whose two ends are
    active, and b's device is that same cable's other end: JACCL pairs its queue pairs
    across ranks by the devices named, so the two ends must be one cable (exo found a
    load that hung when each side picked its own)."""
    facts = read_facts({a: rdma.get(a), b: rdma.get(b)})
    fa, fb = _usable(a, facts[a]), _usable(b, facts[b])
    if isinstance(fa, str) or isinstance(fb, str):
        return "; ".join(x for x in (fa, fb) if isinstance(x, str))
    wires = _wires(fa, fb)
    if not wires:
        return f"{a} has no cable to {b}"
    for mine, theirs in wires:
        if not _port_problem(a, mine) and not _port_problem(b, theirs):
            return str(mine.device), str(theirs.device)
    mine, theirs = wires[0]
    return "; ".join(w for w in (_port_problem(a, mine), _port_problem(b, theirs)) if w)


def rdma_link(a: str, b: str, rdma: Mapping[str, Any]) -> tuple[bool, str] | None:
    """Whether the link between `a` and `b` carries RDMA, and why not when both nodes
    have RDMA but no active cable joins them (the planner says that reason); None when
    an agent has not reported readable RDMA facts, so nothing can be judged."""
    facts = read_facts({a: rdma.get(a), b: rdma.get(b)})
    fa, fb = facts[a], facts[b]
    if not isinstance(fa, RdmaFacts) or not isinstance(fb, RdmaFacts):
        return None
    if not (fa.usable and fb.usable):
        return False, ""
    got = rdma_pair(a, b, rdma)
    return (False, got) if isinstance(got, str) else (True, "")


def jaccl_devices(group: Sequence[str], rdma: Mapping[str, Any]) -> Matrix | str:
    """JACCL's device matrix (row i: the `rdma_enX` device rank i reaches rank j
    through; None on the diagonal), from what each node's agent reports
    (`facts["rdma"]`), or every reason it cannot be made ("studio-2 has no cable to
    studio-4", "rdma_en3 on studio-1 is down").

    MLX's JACCL backend runs only on a fully connected mesh (a cable between every
    pair; MLX's distributed docs, "Defining a Mesh"), so every pair is checked. One
    device per pair: where two cables join a pair the first active one by port number."""
    n = len(group)
    rows: Matrix = [[None] * n for _ in range(n)]
    problems: list[str] = []
    for i, j in itertools.combinations(range(n), 2):
        got = rdma_pair(group[i], group[j], rdma)
        if isinstance(got, str):
            problems += [w for w in got.split("; ") if w not in problems]
        else:
            rows[i][j], rows[j][i] = got
    return "; ".join(problems) if problems else rows


@dataclass(frozen=True)
class GroupBackend:
    backend: str  # "ring" or "jaccl"
    reason: str
    devices: Matrix | None = None  # JACCL's device matrix, rank order
    # Every node has RDMA: the ring, if chosen, is for want of cables or active ports.
    rdma_everywhere: bool = False


def group_backend(
    group: Sequence[str], links: Sequence[Link], rdma: Mapping[str, Any]
) -> GroupBackend:
    """The `mx.distributed` backend of a group of processes the agents run (a tensor
    stage, a fine-tuning job, the benchmark's product), why, and JACCL's device matrix:
    JACCL when the planner's rule says every pair has RDMA and the cables make a full
    mesh, else the ring over TCP with the reason."""
    if len(group) < 2:
        return GroupBackend("ring", "one node: no group traffic")
    facts = read_facts({n: rdma.get(n) for n in group})
    everywhere = all(isinstance(f, RdmaFacts) and f.usable for f in facts.values())
    backend, why = backend_for(group, links)
    if backend != "jaccl":
        return GroupBackend("ring", why, rdma_everywhere=everywhere)
    devices = jaccl_devices(group, rdma)
    if isinstance(devices, str):
        why = f"{devices}: ring backend over TCP on the bridge addresses"
        return GroupBackend("ring", why, rdma_everywhere=everywhere)
    return GroupBackend("jaccl", why, devices, rdma_everywhere=everywhere)
