"""Requests to a placement's head: which placement answers, the stream of its answer
(and why it stopped, in words), cancelling, and emptying its prefix cache."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from studiotui.cluster.errors import GenerationError, PlacementError
from studiotui.cluster.hints import not_ready_hint, reload_hint, stage_words
from studiotui.cluster.hub import CHECK_EVERY_S, HEALTH_CHECK_S, Hub
from studiotui.cluster.peers import AgentError, AgentUnreachable, Peer
from studiotui.core.state import PlacementState
from worker.shared.protocol import control

# How long a tensor group's leader's "a member is gone" waits for the agents to say which.
GROUP_LOST_WAIT_S = 2.0
# A head connection down for longer than this fails its streams (it usually comes
# back within a second or two, and the head keeps the replies for it meanwhile).
RECONNECT_GRACE_S = 5.0


class Generation:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def pick_placement(self, name: str | None) -> PlacementState:
        state = self.hub.state
        placements = state.placements
        if name is None:
            ready = [p for p in placements if p.state == "ready"]
            if len(ready) == 1:
                return ready[0]
            if not ready:
                if placements:
                    raise GenerationError(
                        "no placement is ready: "
                        + "; ".join(f"{p.name!r} is {p.state}" for p in placements)
                        + f"; {not_ready_hint(placements[0], state.nodes)}"
                    )
                raise GenerationError(
                    "no placement is ready: place a model first (studiotui place)"
                )
            names = ", ".join(p.name for p in ready)
            raise GenerationError(
                f"several placements are ready ({names}): pick one with --placement"
            )
        placement = state.placement(name)
        if placement is None:
            known = ", ".join(p.name for p in placements) or "none"
            raise GenerationError(f"no placement named {name!r} (known: {known})")
        if placement.state != "ready":
            raise GenerationError(
                f"placement {name!r} is {placement.state}, not ready: "
                f"{not_ready_hint(placement, state.nodes)}"
            )
        return placement

    async def generate(
        self,
        placement: str | None,
        request: dict[str, Any],
        params: dict[str, Any],
        first_timeout: float = 900.0,
        step_timeout: float = 60.0,
    ) -> AsyncGenerator[control.Answer, None]:
        """Yield accepted, delta… and done messages; raise GenerationError on failure.

        `request` holds one of messages / prompt / tokens.
        """
        chosen = self.pick_placement(placement)
        peer = self.hub.head_peer(chosen)
        rid = uuid.uuid4().hex
        queue = peer.open(rid)
        finished = False
        expect = 0  # the head numbers its messages for one request: a gap is a loss
        try:
            await peer.send("generate", rid=rid, params=params, **request)
            sent = time.monotonic()
            # A long prompt's prefill may take minutes: until the first token the limit
            # is long, and the health check, not the clock, catches a dead node.
            limit, waited = first_timeout, 0.0
            while True:
                try:
                    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
                    # cancel that lands as a message arrives, and Esc must stop at once.
                    async with asyncio.timeout(CHECK_EVERY_S):
                        msg = await queue.get()
                except TimeoutError:
                    waited += CHECK_EVERY_S
                    # Down for the grace *while this request waited*: a head that came
                    # back after a restart is reached on ZeroMQ's next reconnect (up to
                    # 2 s later), and a request sent meanwhile must not fail because the
                    # connection dropped long before it was sent.
                    if min(peer.down_for(), time.monotonic() - sent) > RECONNECT_GRACE_S:
                        raise GenerationError(self._lost_head(chosen, peer)) from None
                    if waited >= HEALTH_CHECK_S:
                        problem = await self.placement_problem(chosen)
                        if problem:
                            raise GenerationError(problem) from None
                    if waited >= limit:
                        raise GenerationError(self._silence_reason(chosen, limit)) from None
                    continue
                seq = msg.seq if isinstance(msg, control.Streamed) else None
                if seq is not None:
                    if seq != expect:
                        raise GenerationError(
                            f"{seq - expect} message(s) of the answer from {peer.name} were "
                            "lost while its connection was down; the answer is incomplete: "
                            "ask again"
                        )
                    expect += 1
                if isinstance(msg, control.Delta):
                    limit = step_timeout
                waited = 0.0
                if isinstance(msg, control.Failed | control.Error):
                    finished = True
                    param = msg.param if isinstance(msg, control.Failed) else None
                    raise GenerationError(await self._failure(chosen, msg), msg.code, param)
                match msg:
                    case control.Accepted() | control.Delta():
                        yield msg
                    case control.Done():
                        yield msg
                        finished = True
                        return
                    case _:
                        continue  # no other message answers a request
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    await peer.send("cancel", rid=rid)
            peer.close_queue(rid)

    async def _failure(self, placement: PlacementState, msg: control.Failed | control.Error) -> str:
        """Why a request failed. A tensor group whose `mx.distributed` link broke knows
        only that a member is gone; the members' agents say which, and why (they see its
        process end within moments of the leader's all-reduce failing)."""
        if not isinstance(msg, control.Failed) or not msg.group_lost:
            return msg.message
        deadline = time.monotonic() + GROUP_LOST_WAIT_S
        while True:
            problem = await self.placement_problem(placement)
            if problem or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        return f"{problem} ({msg.message})" if problem else msg.message

    async def placement_problem(self, placement: PlacementState) -> str | None:
        """Why a placement cannot answer, in words, or None if every shard is serving."""
        replies = await asyncio.gather(
            *(
                self.hub.peer(n).ask("list_shards", control.Shards, timeout=1.5)
                for n in placement.nodes
            ),
            return_exceptions=True,
        )
        for shard, reply in zip(placement.shards, replies, strict=True):
            node = shard.node
            again = reload_hint(node)
            if isinstance(reply, BaseException):
                return (
                    f"node {node} of placement {placement.name!r} stopped answering; "
                    f"{placement.name!r} is used again as soon as it answers; if it stays "
                    f"silent, restart it (studiotui restart {node}, or r on the dashboard)"
                )
            mine = [s for s in reply.shards if s.placement == placement.name]
            if not mine:
                return f"node {node} no longer holds its shard of {placement.name!r}: {again}"
            if mine[0].state == "silent":
                return (
                    f"the shard of {placement.name!r} on {node} ({stage_words(shard)}) is "
                    f"{mine[0].message or 'silent'}; this request is given up; "
                    f"{placement.name!r} is used again by itself if the shard answers again, "
                    f"else restart {node} (studiotui restart {node} reloads its shards)"
                )
            if mine[0].state != "ready":
                why = mine[0].message or mine[0].state
                return (
                    f"the shard of {placement.name!r} on {node} ({stage_words(shard)}) is "
                    f"down: {why}; {again}"
                )
        return None

    def _lost_head(self, placement: PlacementState, peer: Peer) -> str:
        head = placement.shards[0]
        return (
            f"the connection to the head of {placement.name!r} on {head.node} dropped "
            f"{peer.down_for():.0f} s ago and has not come back; this request is given up "
            "(check the network, then ask again)"
        )

    def _silence_reason(self, placement: PlacementState, timeout: float) -> str:
        state = self.hub.state
        down = [n for n in placement.nodes if (s := state.node(n)) and s.state != "up"]
        if down:
            return (
                f"node {', '.join(down)} of placement {placement.name!r} is down; "
                f"{placement.name!r} is used again as soon as it answers; if it stays "
                f"silent, restart it (studiotui restart {down[0]} reloads its shards)"
            )
        return f"placement {placement.name!r} sent nothing for {timeout:g} s"

    async def cancel(self, placement: str, rid: str) -> None:
        chosen = self.pick_placement(placement)
        await self.hub.head_peer(chosen).send("cancel", rid=rid)

    async def clear_cache(self, name: str) -> tuple[int, int]:
        """Empty placement `name`'s prefix cache on every stage (the head sends the word
        down its ring); the entries and bytes its head held."""
        placement = self.hub.state.placement(name)
        if placement is None:
            known = ", ".join(p.name for p in self.hub.state.placements) or "none"
            raise PlacementError(f"no placement named {name!r} (known: {known})")
        if placement.state != "ready":
            raise PlacementError(
                f"placement {name!r} is {placement.state}: its cache is cleared once it is "
                "ready (or unload it: that frees its memory cache too)"
            )
        try:
            head = self.hub.head_peer(placement)
            reply = await head.ask("cache_clear", control.CacheCleared)
        except (AgentError, AgentUnreachable) as exc:
            raise PlacementError(f"cannot clear the cache of {name!r}: {exc}") from None
        return reply.entries, reply.bytes
