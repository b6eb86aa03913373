"""What the nodes say of themselves: the answer to `hello` (asked on `refresh`), the
telemetry each agent publishes, and a node's silence, which makes it down."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import zmq
import zmq.asyncio

from studiotui.cluster import keys, stops
from studiotui.cluster.hints import STOPPED_BY_DOWN, clock
from studiotui.cluster.hub import Hub
from studiotui.core.state import ClusterState, pushed, shard_from_report
from worker.shared.protocol import control, messages

DOWN_AFTER_S = 3.0


class Telemetry:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.dropped = 0  # malformed samples, each dropped alone
        self._tasks: list[asyncio.Task[Any]] = []
        self._subs: dict[str, zmq.asyncio.Socket] = {}

    def start(self) -> None:
        """Subscribe to every node's telemetry, and watch for silence."""
        from worker.shared.protocol.curve import make_client

        hub = self.hub
        for node in hub.inventory.nodes:
            # One SUB per node: a sample is that node's because of the connection it
            # came on, whatever name it carries.
            sub = hub.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"telemetry")
            sub.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES + 64)
            make_client(sub, hub.keys, keys.node_public_key(hub.home, node.name))
            sub.connect(node.telemetry_endpoint)
            self._subs[node.name] = sub
            self._tasks.append(asyncio.create_task(self._read(node.name, sub)))
        self._tasks.append(asyncio.create_task(self._watch_liveness()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sub in self._subs.values():
            sub.close(linger=0)

    async def _read(self, name: str, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            try:
                if len(frames) != 2:
                    raise messages.MessageError(f"{len(frames)} frames, not 2")
                msg = control.decode(frames[1])
                if not isinstance(msg, control.Telemetry):
                    raise messages.MessageError(f"a {msg.kind} message, not telemetry")
                if msg.name != name:
                    raise messages.MessageError(f"it names itself {msg.name!r}")
                self._apply(name, msg)
            except (messages.MessageError, KeyError, TypeError, ValueError, AttributeError) as exc:
                # One bad sample is dropped; the node's next one is read as usual.
                self.dropped += 1
                if self.dropped in (1, 10, 100, 1000):
                    self.hub.record(
                        f"dropped a malformed telemetry message from {name} ({exc}); "
                        f"{self.dropped} so far",
                        "warning",
                    )

    def _apply(self, name: str, msg: control.Telemetry) -> None:
        node = self.hub.state.node(name)
        if node is None:
            return
        was = node.state
        node = node.with_sample(msg.memory_used, msg.memory_total, time.time())
        facts = msg.facts
        shards = tuple(shard_from_report(name, s) for s in msg.shards)
        power, pressure = msg.power, msg.pressure
        self.hub.update_node(
            name,
            state="up",
            version=msg.version or node.version,
            power=power,
            power_history=pushed(node.power_history, power.get("total_w")),
            pressure=pressure,
            pressure_history=pushed(node.pressure_history, pressure.get("pct")),
            memory_used=node.memory_used,
            memory_total=node.memory_total,
            memory_history=node.memory_history,
            last_seen=node.last_seen,
            cpu_pct=msg.cpu_pct,
            gpu_pct=msg.gpu_pct,
            disk_free=msg.disk_free,
            power_w=power.get("total_w"),
            chip=str(facts.get("chip", node.chip)),
            os=str(facts.get("os", node.os)),
            facts=facts,
            shards=shards,
            message="",
            stopped_at=None,
        )
        if was != "up":
            self.hub.record(f"{name} is up ({msg.version or '?'})")

    async def _watch_liveness(self) -> None:
        hub = self.hub
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            silent = [
                n for n in hub.state.nodes if n.state == "up" and now - n.last_seen > DOWN_AFTER_S
            ]
            recorded = stops.read_stops(hub.home, hub.inventory.name) if silent else {}
            for node in silent:
                when = stops.stopped_at(recorded, node.name, node.last_seen)
                if when is not None:
                    # The operator's `down` (from another terminal): said as such, not
                    # as a fault to mend.
                    said = f"{STOPPED_BY_DOWN} at {clock(when)}"
                    hub.update_node(
                        node.name, state="down", shards=(), message=said, stopped_at=when
                    )
                    hub.record(
                        f"{node.name} is {said}; `studiotui up` or r starts it again, "
                        "with the shards it held"
                    )
                    continue
                since = clock(node.last_seen)
                quiet = f"silent since {since} (no telemetry for {DOWN_AFTER_S:g} s)"
                # Its shards may well be serving still (a stopped agent, a blip):
                # the planned ring keeps the placement, and the words say so.
                hub.update_node(node.name, state="down", shards=(), message=quiet, stopped_at=None)
                hub.record(
                    f"{node.name} is down: {quiet}; it is used again as soon as it "
                    f"answers; if it stays silent, restart it "
                    f"(r, or studiotui restart {node.name})",
                    "error",
                )

    async def refresh(self, timeout: float = 2.0) -> ClusterState:
        """Ask every agent who it is and what it runs."""
        hub = self.hub
        results = await asyncio.gather(
            *(self.hello(n.name, timeout) for n in hub.inventory.nodes), return_exceptions=True
        )
        for node, result in zip(hub.inventory.nodes, results, strict=True):
            if isinstance(result, BaseException):
                hub.update_node(
                    node.name, state="down", shards=(), message=str(result), stopped_at=None
                )
        return hub.state

    async def hello(self, name: str, timeout: float) -> None:
        """Ask one agent; its answer replaces what the state knew of the node."""
        hub = self.hub
        reply = await hub.peer(name).ask("hello", control.HelloReply, timeout=timeout)
        before = hub.state.node(name)
        if before is not None and before.state != "up":
            hub.record(f"{name} is up ({reply.version})")
        facts = reply.facts
        shards = tuple(shard_from_report(name, s) for s in reply.shards)
        hub.update_node(
            name,
            state="up",
            version=reply.version,
            memory_total=reply.memory_total or int(facts.get("memory_total", 0)),
            memory_used=reply.memory_used,
            disk_free=reply.disk_free,
            chip=str(facts.get("chip", "")),
            os=str(facts.get("os", "")),
            facts=facts,
            shards=shards,
            last_seen=time.time(),
            message="",
            stopped_at=None,
        )
