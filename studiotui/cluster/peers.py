"""The controller's ZeroMQ side: request/reply with agents, streams with head shards.

One DEALER per peer; every request carries an id and replies carry it back as
`re`, so several requests to one agent can be in flight and a request may get
several replies (load progress, then ready).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from studiotui.core.errors import StudioError
from worker.shared.protocol import messages
from worker.shared.protocol.curve import CurveKeys, make_client

FINAL = {
    "hello_reply",
    "prepared",
    "shard_ready",
    "unloaded",
    "shards",
    "log",
    "ok",
    "error",
    "links",
    "stats_reply",
}


class AgentUnreachable(StudioError, ConnectionError):
    pass


class AgentError(StudioError, RuntimeError):
    pass


class Peer:
    """A CURVE DEALER to one agent or head shard, with replies routed by id."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        keys: CurveKeys,
        server_key: bytes,
        name: str,
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 200)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        make_client(self.sock, keys, server_key)
        self.sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._queues: dict[Any, asyncio.Queue[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.dropped = 0

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            data = await self.sock.recv()
            try:
                msg = messages.decode(data)
            except messages.MessageError:
                self.dropped += 1
                continue
            key = msg.get("re", msg.get("rid"))
            queue = self._queues.get(key)
            if queue is None:
                self.dropped += 1
                continue
            queue.put_nowait(msg)

    def open(self, key: Any) -> asyncio.Queue[dict[str, Any]]:
        self._ensure_reader()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[key] = queue
        return queue

    def close_queue(self, key: Any) -> None:
        self._queues.pop(key, None)

    async def send(self, kind: str, **fields: Any) -> None:
        await self.sock.send(messages.encode(kind, **fields))

    async def request(self, kind: str, timeout: float = 5.0, **fields: Any) -> dict[str, Any]:
        """Send and wait for the final reply; raise on an error reply or silence."""
        async for msg in self.stream(kind, timeout=timeout, **fields):
            if msg["type"] in FINAL:
                return msg
        raise AgentUnreachable(f"{self.name} ({self.endpoint}) closed the request")

    async def stream(
        self, kind: str, timeout: float = 5.0, **fields: Any
    ) -> AsyncIterator[dict[str, Any]]:
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
                if msg["type"] == "error":
                    raise AgentError(f"{self.name}: {msg['message']}")
                yield msg
                if msg["type"] in FINAL:
                    return
        finally:
            self.close_queue(rid)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close(linger=0)

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self.sock.close(linger=0)
