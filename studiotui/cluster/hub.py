"""What every room of the controller shares: the cluster's state (replaced whole on
every change, with its listeners and its log), the rings placements were planned on,
and the sockets to the nodes' agents and to placements' heads.

`Cluster` is what the modules beside the controller (file copies, jobs, adapters,
fine-tuning) need of it; the hub, and the `Controller` in front of it, are one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import zmq
import zmq.asyncio

from studiotui.cluster import keys
from studiotui.cluster.hints import not_ready_hint, stopped_by_down
from studiotui.cluster.peers import Peer
from studiotui.cluster.records import Records
from studiotui.core.inventory import Inventory, NodeSpec
from studiotui.core.state import (
    ClusterState,
    LogEntry,
    LogLevel,
    LogTopic,
    NodeState,
    PlacementState,
    PlannedPlacement,
    ShardState,
    newly_broken,
    placements_from_shards,
)

UNLOAD_QUIET_S = 10.0  # how long an unloaded placement's vanishing shards are expected
LOG_KEEP = 500
# How often a node (or a placement's shards) is asked whether it is still there.
HEALTH_CHECK_S = 2.0
# Once a stream is quiet (or a load is done) its placement is asked every second.
CHECK_EVERY_S = 1.0
Listener = Callable[[ClusterState], None]


class Cluster(Protocol):
    """What copies, jobs, adapters and fine-tuning need of the controller: its home,
    its state, a node's agent and address, and its log (the controller calls them, so
    they do not import it)."""

    home: Path

    @property
    def state(self) -> ClusterState: ...

    def peer(self, name: str) -> Peer: ...

    def spec(self, name: str) -> NodeSpec: ...

    def record(self, text: str, level: LogLevel = "info", topic: LogTopic = "") -> None: ...


class Hub:
    def __init__(self, home: Path, inventory: Inventory) -> None:
        self.home = home
        self.inventory = inventory
        self.records = Records(home, inventory.name)
        self.ctx = zmq.asyncio.Context()
        self.keys = keys.controller_keys(home)
        self.peers: dict[str, Peer] = {}
        self.state = ClusterState(
            name=inventory.name,
            nodes=tuple(
                NodeState(n.name, n.address, n.control_port, n.transport) for n in inventory.nodes
            ),
            links=self.records.load_links(inventory.names),
        )
        # The ring each placement was planned on, kept until it is unloaded (and saved,
        # so a restarted TUI still knows a broken placement's nodes).
        self.planned: dict[str, PlannedPlacement] = self.records.read_planned()
        self._planned_mtime = self.records.planned_stamp()  # the saved file `planned` follows
        self.placing: set[str] = set()  # being loaded by this controller: not broken yet
        self._answered: set[str] = set()  # placements seen ready in this session
        # Placements going away on purpose (unload, rollback), until when: their shards
        # vanish one node at a time, which must not read as "broken".
        self.unloading: dict[str, float] = {}
        self._listeners: list[Listener] = []
        # One routing identity per peer for this session: after a reconnect the agent
        # or head knows the socket as the same client (see peers.Peer).
        self.session = uuid.uuid4().hex[:16]

    # ---- state --------------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def set(self, state: ClusterState) -> None:
        self.state = state
        for listener in list(self._listeners):
            listener(state)

    def update_node(self, name: str, **changes: Any) -> None:
        nodes = tuple(replace(n, **changes) if n.name == name else n for n in self.state.nodes)
        self._follow_planned(nodes)
        placements = self._in_view(placements_from_shards(nodes, self.planned, self.placing))
        broken = newly_broken(self.state.placements, placements)
        was_down = {p.name for p in self.state.placements if p.state in ("broken", "failed")}
        self.set(replace(self.state, nodes=nodes, placements=placements))
        for placement, why in broken:
            if self.unloading.get(placement.name, 0.0) < time.monotonic():
                hint = not_ready_hint(placement, self.state.nodes)
                # The operator's own `down` stopped its nodes: said, not an error.
                level: LogLevel = "info" if stopped_by_down(placement, nodes) else "error"
                self.record(
                    f"placement {placement.name!r} is {placement.state}: {why}; {hint}", level
                )
        for placement in placements:
            if placement.state != "ready":
                continue
            # Only what this session saw answer before: a placement found ready as its
            # nodes report one by one (a dashboard just opened) never stopped answering.
            if placement.name in was_down and placement.name in self._answered:
                self.record(f"placement {placement.name!r} answers again")
            self._answered.add(placement.name)

    def mark_provisioning(self, names: list[str]) -> None:
        """Show `names` as being provisioned until the next refresh says otherwise."""
        for name in names:
            self.update_node(name, state="provisioning")

    def record(self, text: str, level: LogLevel = "info", topic: LogTopic = "") -> None:
        entry = LogEntry(time=time.time(), level=level, text=text, topic=topic)
        self.set(replace(self.state, log=(*self.state.log[-(LOG_KEEP - 1) :], entry)))

    # ---- planned rings ------------------------------------------------------------------

    def forget_placements_on(self, stopped: list[str]) -> list[str]:
        """After `down`: placements whose every node was stopped are gone, not broken."""
        gone = [
            name
            for name, plan in self.planned.items()
            if all(s.node in stopped for s in plan.shards)
        ]
        for name in gone:
            self.remember_plan(name, None)
        return gone

    def _follow_planned(self, nodes: tuple[NodeState, ...]) -> None:
        """Follow the rings other processes (the CLI, another dashboard) saved.

        One they placed joins once its shards report (its saved ring keeps a node of it
        that goes down in view); one they unloaded leaves, and its shards stopping are
        an unload, not a breakage. Their plan is forgotten before the shards stop (see
        `unload`), so the change is read before the first stopped shard is."""
        reported = {s.placement for n in nodes for s in n.shards}
        stamp = self.records.planned_stamp()
        if stamp == self._planned_mtime and reported <= self.planned.keys():
            return
        saved = self.records.read_planned()
        self._planned_mtime = stamp
        for name in self.planned.keys() - saved.keys() - self.placing:
            self.unloading[name] = time.monotonic() + UNLOAD_QUIET_S
        for name in saved.keys() - self.planned.keys():
            # Placed again (elsewhere) since its unload: in view at once, not after the
            # unload's quiet time (an API server said "no longer loaded" meanwhile).
            self.unloading.pop(name, None)
        # A ring saved before its shards report stays out: it would read as broken.
        known = self.planned.keys() | reported | self.placing
        self.planned = {k: v for k, v in saved.items() if k in known}

    def remember_plan(self, name: str, plan: PlannedPlacement | None) -> None:
        """Record (or forget) a placement's ring, merging with what other processes
        (the CLI, another dashboard) saved since, and show the result."""
        planned = self.records.read_planned()
        if plan is None:
            planned.pop(name, None)
            self.records.write_recorded(name, [])
        else:
            planned[name] = plan
        self.planned = planned
        if self.records.write_planned(planned):
            self._planned_mtime = self.records.planned_stamp()
        placements = placements_from_shards(self.state.nodes, planned, self.placing)
        self.set(replace(self.state, placements=self._in_view(placements)))

    def _in_view(self, placements: tuple[PlacementState, ...]) -> tuple[PlacementState, ...]:
        """A placement being unloaded leaves the view at once: its shards stop one by
        one, and in between it would read as broken ("2 of 4 nodes", in red)."""
        now = time.monotonic()
        return tuple(
            p for p in placements if p.name in self.placing or self.unloading.get(p.name, 0.0) < now
        )

    def planned_backend(self, shard: ShardState) -> str:
        """A tensor group member's backend as planned ("" for a one-node stage)."""
        if not shard.group:
            return ""
        planned = self.planned.get(shard.placement)
        ring = planned.shards if planned else ()
        return next((p.backend for p in ring if p.node == shard.node and p.backend), "ring")

    # ---- connections ---------------------------------------------------------------------

    def spec(self, name: str) -> NodeSpec:
        return self.inventory.node(name)

    def peer(self, name: str) -> Peer:
        if name not in self.peers:
            node = self.spec(name)
            self.peers[name] = Peer(
                self.ctx,
                node.control_endpoint,
                self.keys,
                keys.node_public_key(self.home, name),
                name,
                identity=self._identity(name),
            )
        return self.peers[name]

    def node_key(self, node: str) -> str:
        """A node's CURVE public key, as the load messages carry it."""
        return keys.node_public_key(self.home, node).decode()

    @staticmethod
    def head_key(placement: PlacementState) -> str:
        """Where `peers` keeps the socket to a placement's head shard."""
        head = placement.shards[0]
        return f"head:{placement.name}:{head.node}:{head.client_port}"

    def head_peer(self, placement: PlacementState) -> Peer:
        head = placement.shards[0]
        key = self.head_key(placement)
        if key not in self.peers:
            spec = self.spec(head.node)
            self.peers[key] = Peer(
                self.ctx,
                f"tcp://{spec.address}:{head.client_port}",
                self.keys,
                keys.node_public_key(self.home, head.node),
                f"{placement.name} head on {head.node}",
                identity=self._identity(key),
            )
        return self.peers[key]

    async def drop_heads(self, name: str) -> None:
        """Close the sockets to placement `name`'s head (it was unloaded)."""
        for key in [k for k in self.peers if k.startswith(f"head:{name}:")]:
            await self.peers.pop(key).aclose()

    def _identity(self, key: str) -> bytes:
        # Routing identities are at most 255 bytes and must not start with a zero byte.
        return f"studiotui:{self.session}:{key}".encode()[:255]

    async def aclose(self) -> None:
        """Close every socket to the nodes, then the context (after the rooms' own)."""
        for peer in self.peers.values():
            await peer.aclose()
        self.ctx.term()
