"""Cluster jobs as facts and decisions: which node a failed job is to blame on, and
what a job's stream of events adds up to (per node state, rates, losses over
iterations, memory, time left); a group's backend is core/members.group_backend's.
No I/O: studiotui/cluster/jobs.py talks to the agents and feeds `JobWatch`; the CLI
and the Jobs screen show it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

# A node that ends a job with this in its words was only a bystander: MLX's ring
# backend fails every rank whose peer went away.
BYSTANDER_WORDS = ("connection to a peer was lost", "peer", "connection reset")
RATE_WINDOW = 5  # reports averaged for iterations/s and tokens/s
ENDED = ("done", "failed", "stopped")


def blame(ends: Mapping[str, tuple[str, str]], lost: Iterable[str]) -> list[str]:
    """The nodes a failed job is to be blamed on: those that stopped answering, else
    those whose rank failed for a reason of its own (not a lost peer), else every
    node whose rank failed. `ends`: node -> (state, message)."""
    gone = sorted(set(lost))
    if gone:
        return gone
    failed = {n: m.lower() for n, (s, m) in ends.items() if s == "failed"}
    own = [n for n, m in failed.items() if not any(w in m for w in BYSTANDER_WORDS)]
    return sorted(own or failed)


@dataclass(frozen=True)
class Point:
    iteration: int
    value: float


@dataclass(frozen=True)
class NodeRun:
    node: str
    rank: int
    state: str = "starting"
    message: str = ""
    memory: int | None = None  # bytes MLX holds now
    peak_memory_gb: float | None = None


@dataclass(frozen=True)
class JobProgress:
    """What a job's events add up to, for the CLI and the Jobs screen."""

    name: str
    kind: str = "finetune"
    state: str = "starting"  # starting, running, done, failed, stopped
    message: str = ""
    nodes: tuple[NodeRun, ...] = ()
    iteration: int = 0
    start_iteration: int = 0
    total: int = 0
    iterations_per_second: float | None = None
    tokens_per_second: float | None = None  # over the last RATE_WINDOW reports
    last_tokens_per_second: float | None = None  # the newest report's own
    trained_tokens: int = 0
    train_loss: tuple[Point, ...] = ()
    val_loss: tuple[Point, ...] = ()
    saved_iteration: int | None = None
    adapter_dir: str = ""

    @property
    def eta_s(self) -> float | None:
        if self.state not in ("running", "starting") or not self.iterations_per_second:
            return None
        return max(0, self.total - self.iteration) / self.iterations_per_second

    @property
    def ended(self) -> bool:
        return self.state in ENDED


@dataclass
class JobWatch:
    """Feed it each node's events (in any interleaving); read `progress`."""

    name: str
    kind: str = "finetune"
    nodes: list[str] = field(default_factory=list)
    progress: JobProgress = field(init=False)
    _rates: list[tuple[float, float]] = field(default_factory=list)
    _seen: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        runs = tuple(NodeRun(n, i) for i, n in enumerate(self.nodes))
        self.progress = JobProgress(self.name, self.kind, nodes=runs)

    def since(self, node: str) -> int:
        """The last event sequence number seen from `node` (to follow on from)."""
        return self._seen.get(node, 0)

    def _node(self, node: str, **changes: Any) -> None:
        runs = tuple(replace(r, **changes) if r.node == node else r for r in self.progress.nodes)
        self.progress = replace(self.progress, nodes=runs)

    def _rank(self, node: str) -> int:
        return next((r.rank for r in self.progress.nodes if r.node == node), -1)

    def feed(self, node: str, event: Mapping[str, Any]) -> None:
        seq = event.get("seq")
        if isinstance(seq, int):
            if seq <= self._seen.get(node, 0):
                return  # heard already (a follower re-attached from an older point)
            self._seen[node] = seq
        kind = str(event.get("event", ""))
        lead = self._rank(node) == 0  # global figures are the same on every rank
        if kind in ("started", "loading"):
            self._node(node, state="loading" if kind == "loading" else "starting")
        elif kind == "ready":
            self._node(node, state="running")
            if lead:
                start = int(event.get("start_iteration", 0))
                self.progress = replace(
                    self.progress,
                    state="running",
                    start_iteration=start,
                    iteration=max(self.progress.iteration, start),
                    total=int(event.get("total", self.progress.total)),
                )
        elif kind == "metrics":
            self._node(
                node,
                state="running",
                memory=_int(event.get("memory")),
                peak_memory_gb=_float(event.get("peak_memory")),
            )
            if lead:
                self._metrics(event)
        elif kind == "val" and lead:
            point = Point(int(event["iteration"]), float(event["val_loss"]))
            self.progress = replace(self.progress, val_loss=_added(self.progress.val_loss, point))
        elif kind == "saved" and lead:
            self.progress = replace(self.progress, saved_iteration=int(event["iteration"]))
        elif kind == "finished":
            self._node(node, state="done")
            if lead:
                self.progress = replace(
                    self.progress, adapter_dir=str(event.get("adapter_dir", ""))
                )
        elif kind == "fatal":
            self._node(node, state="failed", message=str(event.get("message", "")))
        elif kind == "ended":
            self._node(
                node, state=str(event.get("state", "")), message=str(event.get("message", ""))
            )

    def _metrics(self, event: Mapping[str, Any]) -> None:
        p = self.progress
        it = int(event["iteration"])
        rate = (float(event["iterations_per_second"]), float(event["tokens_per_second"]))
        self._rates = [*self._rates[-(RATE_WINDOW - 1) :], rate]
        point = Point(it, float(event["train_loss"]))
        self.progress = replace(
            p,
            state="running" if p.state == "starting" else p.state,
            iteration=max(p.iteration, it),
            total=int(event.get("total", p.total)),
            iterations_per_second=sum(r[0] for r in self._rates) / len(self._rates),
            tokens_per_second=sum(r[1] for r in self._rates) / len(self._rates),
            last_tokens_per_second=rate[1],
            trained_tokens=int(event.get("trained_tokens", p.trained_tokens)),
            train_loss=_added(p.train_loss, point),
        )

    def beat(self, node: str, state: str, message: str = "") -> None:
        """A rank's state from the agent's beat (silent, running ...)."""
        self._node(node, state=state, message=message)

    def finish(self, state: str, message: str = "") -> None:
        self.progress = replace(self.progress, state=state, message=message)


def _added(points: tuple[Point, ...], point: Point) -> tuple[Point, ...]:
    kept = tuple(x for x in points if x.iteration != point.iteration)
    return tuple(sorted((*kept, point), key=lambda x: x.iteration))


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None
