"""The controller's ZeroMQ side: request/reply with agents, streams with head shards.

One DEALER per peer; every request carries an id and replies carry it back as
`re`, so several requests to one agent can be in flight and a request may get
several replies (load progress, then ready). Replies arrive as their typed structs
(worker.shared.protocol.control), decoded once; an error reply is raised as an
`AgentError` carrying its code.

Each DEALER has a routing identity that stays the same for the controller's
session, so after a network blip the reconnected socket is the same client to the
agent or head shard (their ROUTERs hand the identity over), and replies sent
meanwhile reach it. A socket monitor tells when the connection is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from studiotui.core.errors import StudioError
from worker.shared.protocol import control
from worker.shared.protocol.control import Error, Message, encode
from worker.shared.protocol.curve import CurveKeys, make_client
from worker.shared.protocol.messages import ErrorCode, MessageError

T = TypeVar("T", bound=Message)

# Replies that say "still working" (progress, steps, a followed job's events): a request
# ends at its first reply of any other type.
INTERIM: frozenset[type[Message]] = frozenset(
    {
        control.LoadProgress,
        control.FileProgress,
        control.BenchStep,
        control.JobEvent,
        control.JobBeat,
        control.Accepted,
        control.Delta,
    }
)


class AgentUnreachable(StudioError, ConnectionError):
    pass


class AgentError(StudioError, RuntimeError):
    """A peer's error reply (or a reply that could not be read): `code` is the peer's
    stable reason (messages.ErrorCode), for programs; the words are for people."""

    def __init__(self, message: str, code: ErrorCode = "failed") -> None:
        super().__init__(message)
        self.code: ErrorCode = code


class Peer:
    """A CURVE DEALER to one agent or head shard, with replies routed by id."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        keys: CurveKeys,
        server_key: bytes,
        name: str,
        identity: bytes | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 200)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # A dead connection (sleep, cable) is noticed in seconds, then re-made.
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 4000)
        if identity is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
        make_client(self.sock, keys, server_key)
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        self.sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._queues: dict[Any, asyncio.Queue[Message]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.dropped = 0
        self.connected = False
        self.down_since: float | None = None  # monotonic time the connection dropped
        self.reconnects = 0

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read())
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """Follow the connection: up after each CURVE handshake, down on a disconnect."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self.down_since is not None:
                    self.reconnects += 1
                self.connected, self.down_since = True, None
            elif event["event"] == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected, self.down_since = False, time.monotonic()

    def down_for(self) -> float:
        """Seconds the connection has been down after having been up (0 if it is up)."""
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    async def _read(self) -> None:
        while True:
            data = await self.sock.recv()
            try:
                msg: Message = control.decode(data)
            except MessageError as exc:
                self.dropped += 1
                waiting = self._queues.get(exc.re)
                if waiting is not None:  # the request it answers fails now, not at its timeout
                    why = f"sent a malformed reply: {exc}"
                    waiting.put_nowait(Error(re=exc.re, code="bad_request", message=why))
                continue
            key = msg.re if msg.re is not None else getattr(msg, "rid", None)
            queue = self._queues.get(key)
            if queue is None:
                self.dropped += 1
                continue
            queue.put_nowait(msg)

    def open(self, key: Any) -> asyncio.Queue[Message]:
        self._ensure_reader()
        queue: asyncio.Queue[Message] = asyncio.Queue()
        self._queues[key] = queue
        return queue

    def close_queue(self, key: Any) -> None:
        self._queues.pop(key, None)

    async def send(self, kind: str, **fields: Any) -> None:
        """Send the message of type `kind` with these fields (control.build)."""
        await self.sock.send(encode(control.build(kind, **fields)))

    async def request(self, kind: str, timeout: float = 5.0, **fields: Any) -> Message:
        """Send and wait for the final reply; raise on an error reply or silence."""
        async for msg in self.stream(kind, timeout=timeout, **fields):
            if type(msg) not in INTERIM:
                return msg
        raise AgentUnreachable(f"{self.name} ({self.endpoint}) closed the request")

    async def ask(self, kind: str, reply: type[T], timeout: float = 5.0, **fields: Any) -> T:
        """`request`, its final reply checked to be a `reply` (control.py); a reply of
        another type is the agent's error, as an error reply is."""
        return self.read(await self.request(kind, timeout=timeout, **fields), reply)

    def read(self, msg: Message, reply: type[T]) -> T:
        """One reply as the `reply` it must be, or AgentError naming this peer."""
        if not isinstance(msg, reply):
            want = reply.__struct_config__.tag or reply.__name__
            raise AgentError(f"{self.name} answered {msg.kind} where {want} was due", "internal")
        return msg

    async def stream(
        self, kind: str, timeout: float = 5.0, **fields: Any
    ) -> AsyncIterator[Message]:
        """Yield every reply to one request until a final one; `timeout` is per reply."""
        rid = next(self._ids)
        queue = self.open(rid)
        try:
            await self.send(kind, id=rid, **fields)
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        msg = await queue.get()
                except TimeoutError:
                    raise AgentUnreachable(
                        f"{self.name} ({self.endpoint}) did not answer {kind} within {timeout:g} s"
                    ) from None
                if isinstance(msg, Error):
                    raise AgentError(f"{self.name}: {msg.message}", msg.code)
                yield msg
                if type(msg) not in INTERIM:
                    return
        finally:
            self.close_queue(rid)

    def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._close_sockets()

    async def aclose(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._close_sockets()

    def _close_sockets(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
