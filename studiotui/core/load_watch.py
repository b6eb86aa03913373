"""When a loading shard has been quiet too long: the deadline logic, pure.

A 100+ GB shard on a slow disk can spend minutes inside one layer (a DeepSeek MoE
layer at 8 bits is 11 GB) without a byte of progress to report, so no fixed wait
per step can tell "slow" from "dead". The node's agent says "still loading" every
couple of seconds (a heartbeat carrying the bytes loaded so far) for as long as
the shard process is alive; every word from the node moves the deadline. Only
silence — the node or its agent gone, or wedged — ends a load; a dead shard
process ends it at once, with its own reason, from the agent.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from studiotui.core.placement import format_bytes

# Heartbeats come every 2 s: 15 missed in a row is not a slow disk.
LOAD_SILENCE_S = 30.0


@dataclass(frozen=True)
class LoadWatch:
    node: str
    heard: float  # when the node last said anything (monotonic seconds)
    silence_s: float = LOAD_SILENCE_S
    done: int = 0
    total: int = 0

    def hear(self, now: float, done: int | None = None, total: int | None = None) -> LoadWatch:
        """Any word from the node (progress, heartbeat, ready) moves the deadline."""
        return replace(
            self,
            heard=max(self.heard, now),
            done=self.done if done is None else done,
            total=self.total if total is None else total,
        )

    @property
    def deadline(self) -> float:
        return self.heard + self.silence_s

    def overdue(self, now: float) -> str | None:
        """Why the load is given up at `now`, or None while the node is heard from."""
        if now < self.deadline:
            return None
        loaded = (
            f" with {format_bytes(self.done)} of {format_bytes(self.total)} loaded"
            if self.total
            else " before it started reading weights"
        )
        return (
            f"{self.node} said nothing for {now - self.heard:.0f} s while loading{loaded} "
            f"(its agent reports every few seconds while a shard loads): the node or its "
            "agent stopped; see `studiotui logs` for that node"
        )
