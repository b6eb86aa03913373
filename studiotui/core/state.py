"""The cluster as the controller knows it: frozen values, replaced, never mutated.

Views read these; only the controller makes new ones. Nothing here imports
from elsewhere in the project but the wire's types (`worker.shared.protocol`):
the statuses, and the shard reports the states are made from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from worker.shared.protocol.control import ShardReport
from worker.shared.protocol.status import (
    LogLevel,
    NodeStatus,
    PlacementStatus,
    ShardStatus,
)

HISTORY = 120  # samples of memory history kept per node (2 minutes at 1 Hz)


@dataclass(frozen=True)
class ShardState:
    placement: str
    node: str
    index: int
    count: int
    start: int
    end: int
    state: ShardStatus
    model_dir: str = ""
    progress: tuple[int, int] = (0, 0)
    param_bytes: int = 0
    client_port: int = 0
    data_port: int = 0
    tokens: int = 0
    in_flight: int = 0
    message: str = ""
    context_tokens: int = 0
    kv_bytes: int = 0  # KV cache the plan reserved for this shard
    streams: int = 1  # requests the head runs at once (the plan reserved KV for them)
    adapter: str = ""  # the placement's adapter, by name ("" none)
    adapter_dir: str = ""  # where this node holds it ("" when its layers are not adapted)
    adapter_bytes: int = 0  # the plan's share of the adapter on this shard's layers
    weight_bytes: int = 0  # the plan's weights for them (0: an agent that does not say)
    kv_bits: int = 0  # quantized KV (`place --kv-bits`; 0: full precision)
    kv_group_size: int = 64
    # The prompt cache's budget on this shard: memory (promised like its KV, see
    # core.memory.promised_bytes) and the node's disk.
    prompt_cache_bytes: int = 0
    prompt_cache_disk_bytes: int = 0
    # A member of a tensor-parallel stage: its rank and the group's nodes (rank order);
    # 0 and () for a one-node stage.
    rank: int = 0
    group: tuple[str, ...] = ()
    # Its prefix cache (the runner's stats): entries, bytes in memory and on disk; on
    # the head, requests that reused an entry (hits) or found none (misses).
    cache_entries: int = 0
    cache_bytes: int = 0
    cache_disk_bytes: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    # Speculative decoding on the head: its guesser, and its guesses sent and kept.
    draft: str = ""
    drafted: int = 0
    kept: int = 0
    verified_ahead: int = 0  # verify steps computed while the one before was out, sent


@dataclass(frozen=True)
class NodeState:
    name: str
    address: str
    control_port: int
    transport: str
    state: NodeStatus = "unknown"
    version: str = ""
    memory_total: int = 0
    memory_used: int = 0
    cpu_pct: float = 0.0
    gpu_pct: float | None = None
    power_w: float | None = None
    chip: str = ""
    os: str = ""
    last_seen: float = 0.0
    memory_history: tuple[float, ...] = ()
    shards: tuple[ShardState, ...] = ()
    facts: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    # When the operator's `studiotui down` stopped the node (stops.json), if that is
    # why it is down: decisions read this, never `message`'s words.
    stopped_at: float | None = None
    # The agent's last power and memory-pressure reports as sent (source, watts
    # by part, or the reason there is no figure), and their histories at 1 Hz.
    power: dict[str, Any] = field(default_factory=dict)
    power_history: tuple[float, ...] = ()
    pressure: dict[str, Any] = field(default_factory=dict)
    pressure_history: tuple[float, ...] = ()
    # Bytes free on the disk of its agent's home (None: not said), for the prompt
    # cache's disk budget (core.placement.disk).
    disk_free: int | None = None

    @property
    def pressure_pct(self) -> float | None:
        pct = self.pressure.get("pct")
        return float(pct) if isinstance(pct, int | float) else None

    @property
    def memory_free(self) -> int:
        return max(0, self.memory_total - self.memory_used)

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.control_port}"

    def with_sample(self, used: int, total: int, now: float) -> NodeState:
        frac = used / total if total else 0.0
        history = (*self.memory_history[-(HISTORY - 1) :], frac)
        return replace(
            self, memory_used=used, memory_total=total, last_seen=now, memory_history=history
        )


def pushed(history: tuple[float, ...], value: Any) -> tuple[float, ...]:
    """`history` with `value` appended (kept to HISTORY); a missing value adds nothing."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return history
    return (*history[-(HISTORY - 1) :], float(value))


@dataclass(frozen=True)
class PlannedShard:
    """Where the operator put a shard: kept until the placement is unloaded, so a
    placement whose node died still knows its whole ring."""

    node: str
    start: int
    end: int
    # The `mx.distributed` backend of the stage's tensor group ("ring", "jaccl");
    # "" for a one-node stage. Nodes of one group share start and end.
    backend: str = ""


@dataclass(frozen=True)
class PlacementState:
    name: str
    model: str
    model_dir: str
    shards: tuple[ShardState, ...]
    planned: tuple[PlannedShard, ...] = ()  # () when this operator did not place it
    placing: bool = False  # this operator is loading it right now
    adapter: str = ""  # the LoRA/DoRA adapter its shards apply, by name ("" none)
    adapter_dir: str = ""  # where the operator holds it ("" unknown: not planned here)
    placed_at: int = 0  # when it was placed (Unix seconds; 0 unknown: not planned here)

    @property
    def label(self) -> str:
        """The model as people read it: `model + adapter` when adapted."""
        return f"{self.model} + {self.adapter}" if self.adapter else self.model

    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes holding a shard now (what unload and the health check ask)."""
        return tuple(s.node for s in self.shards)

    @property
    def ring(self) -> tuple[PlannedShard, ...]:
        """The whole ring in order: as planned where known, else as reported."""
        return self.planned or tuple(PlannedShard(s.node, s.start, s.end) for s in self.shards)

    @property
    def stages(self) -> tuple[tuple[tuple[str, ...], int, int], ...]:
        """The ring as stages: each stage's nodes (a tensor group's, in rank order) and
        its layers. The nodes of a group share their layers and follow one another."""
        out: list[tuple[tuple[str, ...], int, int]] = []
        for p in self.ring:
            if out and (out[-1][1], out[-1][2]) == (p.start, p.end):
                out[-1] = ((*out[-1][0], p.node), p.start, p.end)
            else:
                out.append(((p.node,), p.start, p.end))
        return tuple(out)

    @property
    def shape(self) -> str:
        """ "4 stages", "2 stages × 2 (ring)": the nodes sharing a layer range are one
        stage's tensor group."""
        stages: dict[tuple[int, int], int] = {}
        for p in self.ring:
            stages[(p.start, p.end)] = stages.get((p.start, p.end), 0) + 1
        backends = sorted({p.backend for p in self.ring if p.backend})
        return shape_label(len(stages), max(stages.values(), default=1), "/".join(backends) or None)

    @property
    def missing(self) -> tuple[str, ...]:
        """Planned nodes that report no shard of this placement."""
        return tuple(p.node for p in self.planned if p.node not in self.nodes)

    @property
    def expected(self) -> int:
        """How many shard processes the placement has: planned, else what the loaded
        shards report (a tensor group's stage counts each of its nodes)."""
        if self.planned:
            return len(self.planned)
        stages = max((s.count for s in self.shards), default=0)
        groups = {s.index: len(s.group) for s in self.shards if s.group}
        return stages + sum(n - 1 for n in groups.values())

    @property
    def state(self) -> PlacementStatus:
        """failed once a shard failed; loading while any shard loads (the others may
        not have reported yet); broken when a shard is missing; else ready."""
        states = {s.state for s in self.shards}
        if "failed" in states:
            return "failed"
        if self.placing:  # shards appear one node at a time, or not yet at all
            return "loading"
        if "loading" in states:
            return "loading"
        if "prepared" in states:
            return "prepared"
        if not self.shards or len(self.shards) != self.expected:
            return "broken"
        return "ready" if states == {"ready"} else "broken"

    @property
    def context_tokens(self) -> int:
        return self.shards[0].context_tokens if self.shards else 0

    @property
    def streams(self) -> int:
        return self.shards[0].streams if self.shards else 1

    @property
    def layers(self) -> list[list[int]]:
        return [[s.start, s.end] for s in self.shards]


@dataclass(frozen=True)
class LinkState:
    """A measured link between two nodes (the same fields as placement.Link)."""

    a: str
    b: str
    latency_us: float | None
    gbps: float | None
    kind: str  # thunderbolt, ethernet, wifi, loopback, unknown
    measured_at: float = 0.0
    rdma: bool = False
    rdma_why: str = ""  # why not, when both nodes have RDMA (placement.Link.rdma_why)


# What a log entry reports, for a program that picks entries out (the words are for
# people): "files", a node received a model's files (a fetch's share, a copy); "" any
# other.
LogTopic = Literal["", "files"]


@dataclass(frozen=True)
class LogEntry:
    time: float
    level: LogLevel
    text: str
    topic: LogTopic = ""


@dataclass(frozen=True)
class ClusterState:
    name: str = "cluster"
    nodes: tuple[NodeState, ...] = ()
    placements: tuple[PlacementState, ...] = ()
    log: tuple[LogEntry, ...] = ()
    links: tuple[LinkState, ...] = ()

    def link(self, a: str, b: str) -> LinkState | None:
        return next((x for x in self.links if {x.a, x.b} == {a, b}), None)

    def node(self, name: str) -> NodeState | None:
        return next((n for n in self.nodes if n.name == name), None)

    def placement(self, name: str) -> PlacementState | None:
        return next((p for p in self.placements if p.name == name), None)


@dataclass(frozen=True)
class PlannedPlacement:
    model_dir: str
    shards: tuple[PlannedShard, ...]
    adapter_dir: str = ""  # the operator's adapter directory ("" none)
    adapter: str = ""  # its name, as the shards are told it
    placed_at: int = 0  # when it was placed (Unix seconds; 0: saved by an older build)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model_dir": self.model_dir,
            "shards": [
                [s.node, s.start, s.end, *([s.backend] if s.backend else [])] for s in self.shards
            ],
        }
        if self.placed_at:
            out["placed_at"] = self.placed_at
        if self.adapter_dir:
            out["adapter_dir"] = self.adapter_dir
            out["adapter"] = self.adapter
        return out

    @classmethod
    def from_json(cls, raw: Any) -> PlannedPlacement:
        """Raises ValueError (or TypeError) for anything but what to_json wrote."""
        rows = list(raw["shards"])
        if any(len(row) not in (3, 4) for row in rows):
            raise ValueError("a planned shard is [node, start, end] or [node, start, end, backend]")
        shards = tuple(
            PlannedShard(str(row[0]), int(row[1]), int(row[2]), str(row[3]) if len(row) > 3 else "")
            for row in rows
        )
        if not shards:
            raise ValueError("a planned placement without shards")
        return cls(
            model_dir=str(raw["model_dir"]),
            shards=shards,
            adapter_dir=str(raw.get("adapter_dir", "")),
            adapter=str(raw.get("adapter", "")),
            placed_at=int(raw.get("placed_at", 0)),
        )


def model_label(model_dir: str) -> str:
    """The model as people name it: a Hugging Face cache snapshot
    (`…/models--org--name/snapshots/<commit>`) is its repo id `org/name`, not the
    commit; any other directory its last part."""
    parts = model_dir.rstrip("/").split("/")
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        repo = parts[-3].split("--")[1:]
        if len(repo) >= 2 and all(repo):
            return "/".join(repo)
    return parts[-1]


def placements_from_shards(
    nodes: tuple[NodeState, ...],
    planned: Mapping[str, PlannedPlacement] | None = None,
    placing: frozenset[str] | set[str] = frozenset(),
) -> tuple[PlacementState, ...]:
    """Group the shards the agents report into placements, in ring order.

    A placement this operator planned is listed with its plan even when no node
    reports a shard of it any more (its nodes died): it is broken, not gone, until
    it is unloaded.
    """
    planned = planned or {}
    groups: dict[str, list[ShardState]] = {name: [] for name in planned}
    for node in nodes:
        for shard in node.shards:
            groups.setdefault(shard.placement, []).append(shard)
    out = []
    for name, shards in sorted(groups.items()):
        plan = planned.get(name)
        if plan is not None:
            # A shard still preparing reports no index yet: order by the plan's ring.
            ring = [p.node for p in plan.shards]
            shards.sort(key=lambda s: ring.index(s.node) if s.node in ring else len(ring))
        else:
            shards.sort(key=lambda s: (s.index, s.rank))
        model_dir = (plan.model_dir if plan else "") or next(
            (s.model_dir for s in shards if s.model_dir), ""
        )
        model = model_label(model_dir)
        adapter = (plan.adapter if plan else "") or next(
            (s.adapter for s in shards if s.adapter), ""
        )
        out.append(
            PlacementState(
                name=name,
                model=model,
                model_dir=model_dir,
                shards=tuple(shards),
                planned=plan.shards if plan else (),
                placing=name in placing,
                adapter=adapter,
                adapter_dir=plan.adapter_dir if plan else "",
                placed_at=plan.placed_at if plan else 0,
            )
        )
    return tuple(out)


def newly_broken(
    before: tuple[PlacementState, ...], after: tuple[PlacementState, ...]
) -> list[tuple[PlacementState, str]]:
    """Placements that were ready and are broken or failed now, each with why, in words."""
    was = {p.name: p for p in before if p.state == "ready"}
    out = []
    for p in after:
        if p.name not in was or p.state not in ("broken", "failed"):
            continue
        bad = [s for s in p.shards if s.state != "ready"]
        gone = [s.node for s in was[p.name].ring if s.node not in p.nodes]
        if bad:
            why = f"its shard on {bad[0].node} is {bad[0].state}"
            why += f" ({bad[0].message})" if bad[0].message else ""
        else:
            why = f"its shard on {', '.join(gone) or 'a node'} is gone"
        out.append((p, why))
    return out


def shard_from_report(node: str, report: ShardReport) -> ShardState:
    return ShardState(
        placement=report.placement,
        node=node,
        index=report.index,
        count=report.count,
        start=report.start,
        end=report.end,
        state=report.state,
        model_dir=report.model_dir,
        progress=report.progress,
        param_bytes=report.param_bytes,
        client_port=report.client_port,
        data_port=report.data_port,
        tokens=report.stats.tokens,
        in_flight=report.stats.in_flight,
        message=report.message,
        context_tokens=report.context_tokens,
        kv_bytes=report.kv_bytes,
        streams=report.streams,
        adapter=report.adapter,
        adapter_dir=report.adapter_dir,
        adapter_bytes=report.adapter_bytes,
        weight_bytes=report.weight_bytes,
        kv_bits=report.kv_bits,
        kv_group_size=report.kv_group_size,
        prompt_cache_bytes=report.prompt_cache_bytes,
        prompt_cache_disk_bytes=report.prompt_cache_disk_bytes,
        rank=report.rank,
        group=tuple(report.group),
        cache_entries=report.stats.prompt_cache_entries,
        cache_bytes=report.stats.prompt_cache_bytes,
        cache_disk_bytes=report.stats.prompt_cache_disk_bytes,
        cache_hits=report.stats.prompt_cache_hits,
        cache_misses=report.stats.prompt_cache_misses,
        draft=report.draft,
        drafted=report.stats.drafted,
        kept=report.stats.kept,
        verified_ahead=report.stats.verified_ahead,
    )


def node_start_hint(node: str) -> str:
    """How to bring one node that is not up back, local or SSH alike: `restart` starts
    its agent (over SSH for an SSH node) and loads again the shards `down` took off it;
    `studiotui up` starts local nodes only."""
    return f"start it: studiotui restart {node} (r on the dashboard)"


def shape_label(stages: int, tensor: int, backend: str | None = None) -> str:
    """A placement's shape in words: "4 stages", "2 stages × 2 (ring)", "1 node".

    `tensor` is the nodes per stage (1: a pipeline of one-node stages); `backend` the
    `mx.distributed` backend its tensor groups run, when known."""
    if tensor <= 1:
        return "1 node" if stages == 1 else f"{stages} stages"
    words = f"{stages} stage{'s' if stages != 1 else ''} × {tensor}"
    return f"{words} ({backend})" if backend else words
