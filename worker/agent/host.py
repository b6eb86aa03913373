"""What every capability of the agent works with: the node's configuration, the agent's
shared state (`Host`), one request being answered (`Ask`), and how a capability names
the messages it handles (`route`).

A capability (shards.py, links.py, ...) is a class built on a `Host` whose `routes()`
say which message type each of its handlers takes; the agent (core.py) dispatches a
decoded message by its type to that handler, which gets the typed struct. A handler
refuses with `CodedError(code, words)`: the agent answers it as an error reply.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec
import zmq.asyncio

from worker import files, jobs
from worker.shared.protocol import control, curve
from worker.shared.protocol.control import Message

M = TypeVar("M", bound=Message)
Handler = Callable[["Ask", Any], Awaitable[None]]
Route = tuple[type[Message], Handler]


@dataclass
class AgentConfig:
    name: str
    address: str
    control_port: int
    home: Path
    memory_gb: float | None = None

    @property
    def telemetry_port(self) -> int:
        return self.control_port + 1

    def keys(self) -> curve.CurveKeys:
        """This node's CURVE keypair."""
        return curve.load_keypair(curve.key_dir(self.home) / "self.key_secret")


class Ask:
    """One request being answered: every reply goes to its sender (`ident`, the control
    ROUTER's identity of it) carrying the request's id as `re`."""

    def __init__(
        self, send: Callable[[bytes, Message], Awaitable[None]], ident: bytes, re: Any
    ) -> None:
        self._send = send
        self.ident = ident
        self.re = re

    async def answer(self, msg: Message) -> None:
        await self._send(self.ident, msgspec.structs.replace(msg, re=self.re))


class Host(Protocol):
    """The agent as its capabilities see it (core.Agent is one)."""

    config: AgentConfig
    ctx: zmq.asyncio.Context
    jobs: jobs.Jobs
    facts: dict[str, Any]
    live: dict[str, Any]
    stopping: asyncio.Event

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None: ...

    def free_ports(self, count: int) -> list[int]: ...


def route(kind: type[M], handler: Callable[[Ask, M], Awaitable[None]]) -> Route:
    """`handler` takes the messages of type `kind` (mypy checks the pair)."""
    return kind, handler


class Capability(Protocol):
    def routes(self) -> Iterable[Route]: ...


def progress_to(host: Host, ask: Ask, stage: str, total: int) -> files.Progress:
    """A callback, safe from any thread, relaying byte progress as `file_progress`
    replies (also what keeps a long hash or copy from looking like a silent agent)."""
    loop = asyncio.get_running_loop()
    last = [0.0]

    def send(done: int, _total: int = total) -> None:
        now = time.monotonic()
        if now - last[0] < files.PROGRESS_EVERY_S and done < _total:
            return
        last[0] = now
        reply = ask.answer(control.FileProgress(stage=stage, done=done, total=_total))
        loop.call_soon_threadsafe(lambda: host.spawn(reply))

    return send
