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


# A node whose agent process is gone has its connection closed by its kernel, so the
# controller's socket sees it drop at once; a busy agent (a loaded machine, a long
# file hash) keeps it up. Down this long is gone, not a reconnect.
NODE_DOWN_S = 2.0


def node_gone(
    node: str, down_for: float, silent_for: float, silence_s: float = LOAD_SILENCE_S
) -> str | None:
    """Why a node loading a shard counts as gone, or None while it may just be slow:
    its connection down for `down_for` seconds, or no answer to a health check for
    `silent_for`. One missed check is not enough: an agent held off the CPU for a few
    seconds answers late, and rolling back a placement for that loses the whole load."""
    if down_for >= NODE_DOWN_S:
        return f"node {node} stopped answering while loading: its connection closed"
    if silent_for >= silence_s:
        return f"node {node} stopped answering while loading: silent for {silent_for:.0f} s"
    return None
