"""The node daemon: its control socket, the dispatch of each request by its type to the
capability that handles it, and the lifecycle of everything it runs.

It outlives the operator's session (started detached) and keeps the truth about
its node: which shards it runs and how they are doing, so a restarted TUI
re-attaches by asking it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import logging.handlers
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from worker import __version__, jobs, telemetry
from worker.agent.bench import Bench
from worker.agent.files import Files
from worker.agent.host import AgentConfig, Ask, Capability, Handler
from worker.agent.hub import Hub
from worker.agent.jobs import Jobs
from worker.agent.links import Links
from worker.agent.node import Node
from worker.agent.shards import SHARD_PORT_OFFSET, Shards
from worker.shared.ports import bind_exit_status, port_free
from worker.shared.protocol import control, curve
from worker.shared.protocol.control import Error, Message, encode
from worker.shared.protocol.messages import CodedError, ErrorCode, MessageError

log = logging.getLogger("studiotui.agent")
# Control requests handled at once; past it a request is answered "busy" at once, so a
# flood of requests cannot grow the agent without bound.
MAX_CONTROL_TASKS = 256
# What a node's key may ask of another node's agent: what measure_links needs. All
# else (load_shard, shutdown, read_log, measure_links ...) is the controller's alone.
PEER_REQUESTS: frozenset[type[Message]] = frozenset(
    {control.PingPeer, control.OpenSink, control.CloseSink}
)
LOG_BYTES = 10 << 20
LOG_BACKUPS = 3


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.stopping = asyncio.Event()
        self.facts = telemetry.machine_facts(config.memory_gb)
        # Power, memory pressure (and GPU use from macmon), refreshed by Node.meter.
        self.live: dict[str, Any] = {}
        self.control: zmq.asyncio.Socket | None = None
        self.pub: zmq.asyncio.Socket | None = None
        self.auth: AsyncioAuthenticator | None = None
        self.dropped = 0  # control messages it could not accept
        self.refused = 0  # requests from a key that may not ask them
        self._tasks: set[asyncio.Task[Any]] = set()
        self.controller_key: str | None = None
        self.allowed: frozenset[str] = frozenset()
        self._keys_seen: tuple[tuple[str, int, int], ...] = ()
        self.jobs = jobs.Jobs(config.home, config.address)
        # The capabilities, each handling the requests of its kind.
        self.shard_room = Shards(self)
        self.bench = Bench(self)
        self.files = Files(self)
        self.node = Node(
            self,
            shards=self.shard_room.reports,
            pids=self._pids,
            counts=lambda: (self.dropped, self.refused),
        )
        rooms: list[Capability] = [
            self.node,
            self.shard_room,
            Links(self),
            self.files,
            Hub(self),
            self.bench,
            Jobs(self),
        ]
        self.handlers: dict[type[Message], Handler] = {}
        for room in rooms:
            for kind, handler in room.routes():
                assert kind not in self.handlers, f"{kind.__name__} handled twice"
                self.handlers[kind] = handler

    @property
    def shards(self) -> dict[str, Any]:
        return self.shard_room.shards

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        # Keep a reference: the loop holds tasks only weakly.
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _pids(self) -> list[int]:
        return self.shard_room.pids() + self.jobs.pids()

    # ---- lifecycle ----------------------------------------------------------------------

    def bind(self) -> None:
        keys = self.config.keys()
        self.auth = AsyncioAuthenticator(self.ctx)
        self.auth.start()
        self.reload_keys()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        # The controller reconnects under its session's identity: the new connection
        # takes it over at once, so replies reach it (see studiotui.cluster.peers.Peer).
        self.control.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.control.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.control.setsockopt(zmq.HEARTBEAT_TIMEOUT, 4000)
        curve.make_server(self.control, keys)
        self.control.bind(f"tcp://{self.config.address}:{self.config.control_port}")
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        curve.make_server(self.pub, keys)
        self.pub.bind(f"tcp://{self.config.address}:{self.config.telemetry_port}")

    async def run(self) -> None:
        self.bind()
        assert self.pub is not None
        self.spawn(self.node.probe())
        self.spawn(self.node.meter())
        (self.config.home / "agent.pid").write_text(str(os.getpid()))
        log.info(
            "agent %s %s listening on %s:%d",
            self.config.name,
            __version__,
            self.config.address,
            self.config.control_port,
        )
        tasks = [
            asyncio.create_task(self._serve()),
            asyncio.create_task(self.node.publish(self.pub, self._reloaded)),
            asyncio.create_task(self.shard_room.watch()),
        ]
        await self.stopping.wait()
        for task in tasks:
            task.cancel()
        await self.shard_room.stop_all()
        await self.bench.stop_all()
        await self.jobs.stop_all()
        await self.files.close()
        self.close()

    def close(self) -> None:
        for sock in (self.control, self.pub):
            if sock is not None:
                sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        with contextlib.suppress(FileNotFoundError):
            (self.config.home / "agent.pid").unlink()

    def reload_keys(self) -> bool:
        """Take up the authorized keys as they are on disk now, if they changed: a key
        provision removed stops working, one it added starts, with no restart."""
        home = self.config.home
        seen = curve.keys_signature(home)
        if seen == self._keys_seen and self.controller_key is not None:
            return False
        assert self.auth is not None
        self.auth.configure_curve(domain="*", location=str(curve.authorized_dir(home)))
        self.controller_key = curve.controller_key(home)
        self.allowed = curve.authorized_z85(home)
        self._keys_seen = seen
        return True

    def _reloaded(self) -> int:
        """How many keys are authorized now, if they changed since last asked (else 0)."""
        return len(self._keys_seen) if self.reload_keys() else 0

    # ---- ports ---------------------------------------------------------------------------

    def free_ports(self, count: int) -> list[int]:
        taken = self.shard_room.ports_held() | self.jobs.ports_held()
        found: list[int] = []
        port = self.config.control_port + SHARD_PORT_OFFSET
        while len(found) < count:
            if port > 65535:
                raise RuntimeError("no free port for a shard")
            if port not in taken and port_free(self.config.address, port):
                found.append(port)
            port += 1
        return found

    # ---- control --------------------------------------------------------------------------

    async def _serve(self) -> None:
        assert self.control is not None
        while True:
            parts = await self.control.recv_multipart(copy=False)
            if len(parts) != 2:
                self.dropped += 1
                continue
            ident = parts[0].bytes
            try:
                msg = control.decode(parts[1].bytes)
            except MessageError as exc:
                self.dropped += 1
                log.warning("bad control message: %s", exc)
                await self._error(ident, exc.re, "bad_request", f"bad message: {exc}")
                continue
            who = curve.sender(parts[1])
            if who not in self.allowed or (
                type(msg) not in PEER_REQUESTS and who != self.controller_key
            ):
                # Another node's key may ping, never drive this node; a key revoked
                # since its connection was made gets nothing either.
                self.refused += 1
                why = (
                    "this key is no longer authorized here"
                    if who not in self.allowed
                    else f"{msg.kind} is for the controller's key only"
                )
                log.warning("refused %s: %s", msg.kind, why)
                await self._error(ident, msg.id, "not_authorized", why)
                continue
            if len(self._tasks) >= MAX_CONTROL_TASKS:
                self.dropped += 1
                await self._error(ident, msg.id, "busy", "agent busy: try again")
                continue
            self.spawn(self._handle(ident, msg))

    async def _send(self, ident: bytes, msg: Message) -> None:
        assert self.control is not None
        await self.control.send_multipart([ident, encode(msg)])

    async def _error(self, ident: bytes, re: Any, code: ErrorCode, message: str) -> None:
        await self._send(ident, Error(re=re, code=code, message=message))

    async def _handle(self, ident: bytes, msg: Message) -> None:
        ask = Ask(self._send, ident, msg.id)
        handler = self.handlers.get(type(msg))
        if handler is None:
            await self._error(ident, msg.id, "unknown_request", f"{msg.kind} is not for an agent")
            return
        try:
            await handler(ask, msg)
        except CodedError as exc:  # a refusal: its code and words
            await self._error(ident, msg.id, exc.code, str(exc))
        except MessageError as exc:  # a part of the message that cannot be used
            self.dropped += 1
            log.warning("bad control message: %s", exc)
            await self._error(ident, msg.id, "bad_request", f"bad message: {exc}")
        except Exception as exc:  # a handler bug must answer, not kill the agent
            log.exception("handling %s", msg.kind)
            await self._error(ident, msg.id, "internal", f"{type(exc).__name__}: {exc}")


def log_handlers(home: Path) -> list[logging.Handler]:
    """The agent's log: agent.log rotated at LOG_BYTES with LOG_BACKUPS kept, so a
    chatty shard cannot fill the disk; only warnings go to stderr (agent.out, which
    cannot be rotated under the process holding it)."""
    to_file = logging.handlers.RotatingFileHandler(
        home / "agent.log", maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS
    )
    to_stderr = logging.StreamHandler()
    to_stderr.setLevel(logging.WARNING)
    return [to_file, to_stderr]


def run_agent(config: AgentConfig) -> int:
    # Everything the agent and its shards write (logs, shard specs) is the operator's
    # alone: model paths and prompts in error messages are private.
    os.umask(0o077)
    config.home.mkdir(parents=True, exist_ok=True)
    # The node's own home is where it keeps what it may not write beside a model (the
    # hashes of a read-only model folder, worker.shared.manifest.spill_path), not the
    # operator's STUDIOTUI_HOME a local agent inherits, nor ~/.studiotui.
    os.environ["STUDIOTUI_HOME"] = str(config.home)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        handlers=log_handlers(config.home),
    )
    agent = Agent(config)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stopping.set)
        await agent.run()

    try:
        asyncio.run(main())
    except zmq.ZMQError as exc:
        log.error("cannot bind %s:%d: %s", config.address, config.control_port, exc)
        print(
            f"studiotui-worker: cannot bind {config.address}:{config.control_port}: {exc}",
            file=sys.stderr,
        )
        return bind_exit_status(exc.errno)
    return 0
