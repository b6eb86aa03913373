"""The node daemon: control socket, telemetry, and the shard runners it supervises.

It outlives the operator's session (started detached) and keeps the truth about
its node: which shards it runs and how they are doing, so a restarted TUI
re-attaches by asking it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import logging.handlers
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from worker import __version__, files, group, jobs, node_probe, telemetry
from worker.shared.ports import port_free
from worker.shared.protocol import control, curve, events, messages
from worker.shared.protocol.limits import (
    LINK_MEASURE_BOUNDS,
    out_of_bounds,
    tail_lines,
)
from worker.shared.protocol.status import ShardStatus

log = logging.getLogger("studiotui.agent")
TELEMETRY_EVERY_S = 1.0
PROBE_EVERY_S = 60.0  # RDMA and link facts (cables come and go)
SHARD_PORT_OFFSET = 10
LINK_PINGS = 21
# Bandwidth the way the ring moves activations: CURVE PUSH -> PULL, several large
# messages in flight (the PUSH queues up to LINK_IN_FLIGHT while one is on the wire),
# for a short while, timed at the receiver from the first message to the last.
LINK_CHUNK_BYTES = 4 << 20
LINK_IN_FLIGHT = 4
LINK_BULK_SECONDS = 0.3
LINK_BULK_MAX_BYTES = 1 << 30
LINK_TIMEOUT_S = 5.0
# A device measurement (worker/device_bench.py) runs seconds; one running past this is
# stopped and its request fails.
BENCH_TIMEOUT_S = 300.0
BENCH_STDERR_LINES = 20
# While a shard loads, the controller hears from this agent at least this often (the
# bytes loaded so far): a big layer on a slow disk gives no progress for minutes.
LOAD_HEARTBEAT_S = 2.0


def exit_reason(code: int | None, *, loading: bool, fatal: str = "") -> str:
    """Why a shard process ended, in words the operator can act on.

    macOS (jetsam) and Linux (the OOM killer) end a process that exhausts memory with
    SIGKILL and no word of its own; a runner that could not allocate says so itself
    ("out of memory while loading", see worker.runner)."""
    if fatal:
        return fatal
    if code == -signal.SIGKILL and loading:
        # Loading is when memory fills up; a served shard's SIGKILL may as well be a hand.
        return (
            "out of memory while loading: the shard process was killed by SIGKILL, which is "
            "how macOS and Linux end a process when memory runs out; free memory on this "
            "node or give it fewer layers"
        )
    if code == -signal.SIGKILL:
        return f"shard process exited with code {code} (killed by SIGKILL: out of memory?)"
    return f"shard process exited with code {code}"


# A runner beats twice a second (worker.runner.BEAT_EVERY_S); a ready one heard from
# for this long is "silent" (stopped or frozen) until it speaks again.
SILENT_AFTER_S = 3.0
# A step that runs this long is a hang (MLX stuck), not work: steps take milliseconds
# to a few seconds for a long prefill chunk.
STUCK_AFTER_S = 60.0
WATCH_EVERY_S = 0.5
# Control requests handled at once; past it a request is answered "busy" at once, so a
# flood of requests cannot grow the agent without bound.
MAX_CONTROL_TASKS = 256
# What a node's key may ask of another node's agent: what measure_links needs. All
# else (load_shard, shutdown, read_log, measure_links ...) is the controller's alone.
PEER_REQUESTS = frozenset({"ping_peer", "open_sink", "close_sink"})
# Followers of one job at once (a dashboard, a CLI, ...); an older one gives way.
MAX_FOLLOWERS = 8
LOG_BYTES = 10 << 20
LOG_BACKUPS = 3


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


@dataclass
class ShardProc:
    placement: str
    data_port: int
    client_port: int
    group_port: int = 0  # a tensor group's member: where mx.distributed listens
    spec: dict[str, Any] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None
    state: ShardStatus = "prepared"
    progress: tuple[int, int] = (0, 0)
    stats: control.ShardStats = field(default_factory=control.ShardStats)
    param_bytes: int = 0
    message: str = ""
    stderr_tail: list[str] = field(default_factory=list)
    last_heard: float = field(default_factory=time.monotonic)
    step_s: float = 0.0
    silent_since: float = 0.0  # wall clock, for the words "silent since ..."
    bad_lines: int = 0
    # While prepared: how long a lease lasts, and when this one lapses (monotonic).
    lease_s: float = control.PREPARED_LEASE_S
    lease_until: float = float("inf")

    def describe(self) -> dict[str, Any]:
        return {
            "placement": self.placement,
            "model_dir": self.spec.get("model_dir", ""),
            "start": self.spec.get("start", 0),
            "end": self.spec.get("end", 0),
            "index": self.spec.get("index", 0),
            "count": self.spec.get("count", 0),
            "context_tokens": self.spec.get("context_tokens", 0),
            "streams": self.spec.get("streams", 1),
            "kv_bytes": self.spec.get("kv_bytes", 0),
            "prefill_chunk": self.spec.get("prefill_chunk", 512),
            "adapter": self.spec.get("adapter", ""),
            "adapter_dir": self.spec.get("adapter_dir", ""),
            "adapter_bytes": self.spec.get("adapter_bytes", 0),
            "draft": self.spec.get("draft", ""),
            "weight_bytes": self.spec.get("weight_bytes", 0),
            "kv_bits": self.spec.get("kv_bits", 0),
            "kv_group_size": self.spec.get("kv_group_size", 64),
            "prompt_cache_bytes": self.spec.get("prompt_cache_bytes", 0),
            "prompt_cache_disk_bytes": self.spec.get("prompt_cache_disk_bytes", 0),
            "data_port": self.data_port,
            "client_port": self.client_port,
            "group_port": self.group_port,
            "rank": self.spec.get("rank", 0),
            "group": self.spec.get("group", []),
            "backend": self.spec.get("backend", ""),
            "state": self.state,
            "progress": list(self.progress),
            "param_bytes": self.param_bytes,
            "stats": msgspec.structs.asdict(self.stats),
            "message": self.message,
            "pid": self.proc.pid if self.proc else None,
            "silent_since": self.silent_since or None,
        }


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.shards: dict[str, ShardProc] = {}
        self.stopping = asyncio.Event()
        self.started = time.time()
        self.facts = telemetry.machine_facts(config.memory_gb)
        self.control: zmq.asyncio.Socket | None = None
        self.pub: zmq.asyncio.Socket | None = None
        self.auth: AsyncioAuthenticator | None = None
        self.dropped = 0
        self.file_server: files.FileServer | None = None
        self.refused = 0  # requests from a key that may not ask them
        self._tasks: set[asyncio.Task[Any]] = set()
        self.controller_key: str | None = None
        self.allowed: frozenset[str] = frozenset()
        self._keys_seen: tuple[tuple[str, int, int], ...] = ()
        # Power, memory pressure (and GPU use from macmon), refreshed by _meter.
        self.live: dict[str, Any] = {}
        self._sinks: dict[str, asyncio.Task[dict[str, Any]]] = {}
        self._benches: set[asyncio.subprocess.Process] = set()
        self._stopped_benches: set[int] = set()  # pids ended by stop_bench
        self.jobs = jobs.Jobs(config.home, config.address)
        self._follows: dict[str, list[asyncio.Task[Any]]] = {}

    def _spawn(self, coro: Any) -> None:
        # Keep a reference: the loop holds tasks only weakly.
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- lifecycle ----------------------------------------------------------------------

    def bind(self) -> None:
        home = self.config.home
        keys = curve.load_keypair(curve.key_dir(home) / "self.key_secret")
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
        self._spawn(self._probe())
        self._spawn(self._meter())
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
            asyncio.create_task(self._publish()),
            asyncio.create_task(self._watch_runners()),
        ]
        await self.stopping.wait()
        for task in tasks:
            task.cancel()
        await self._stop_all_shards()
        await self._stop_benches()
        await self.jobs.stop_all()
        if self.file_server is not None:
            await self.file_server.close()
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

    # ---- control --------------------------------------------------------------------------

    async def _serve(self) -> None:
        assert self.control is not None
        while True:
            parts = await self.control.recv_multipart(copy=False)
            if len(parts) != 2:
                self.dropped += 1
                continue
            ident, data = parts[0].bytes, parts[1].bytes
            try:
                msg = messages.decode(data)
            except messages.MessageError as exc:
                self.dropped += 1
                log.warning("bad control message: %s", exc)
                await self._reply(ident, exc.re, "error", message=f"bad message: {exc}")
                continue
            who = curve.sender(parts[1])
            if who not in self.allowed or (
                msg["type"] not in PEER_REQUESTS and who != self.controller_key
            ):
                # Another node's key may ping, never drive this node; a key revoked
                # since its connection was made gets nothing either.
                self.refused += 1
                why = (
                    "this key is no longer authorized here"
                    if who not in self.allowed
                    else f"{msg['type']} is for the controller's key only"
                )
                log.warning("refused %s: %s", msg["type"], why)
                await self._reply(ident, msg.get("id"), "error", message=why)
                continue
            if len(self._tasks) >= MAX_CONTROL_TASKS:
                self.dropped += 1
                await self._reply(ident, msg.get("id"), "error", message="agent busy: try again")
                continue
            self._spawn(self._handle(ident, msg))

    async def _reply(self, ident: bytes, re: Any, kind: str, **fields: Any) -> None:
        assert self.control is not None
        if re is not None:
            fields["re"] = re
        await self.control.send_multipart([ident, messages.encode(kind, **fields)])

    async def _handle(self, ident: bytes, msg: dict[str, Any]) -> None:
        re = msg.get("id")
        handler = getattr(self, f"_on_{msg['type']}", None)
        if handler is None:
            await self._reply(ident, re, "error", message=f"{msg['type']} is not for an agent")
            return
        try:
            await handler(ident, re, msg)
        except messages.MessageError as exc:  # a field of the wrong type (control.parse)
            self.dropped += 1
            log.warning("bad control message: %s", exc)
            await self._reply(ident, re, "error", message=f"bad message: {exc}")
        except Exception as exc:  # a handler bug must answer, not kill the agent
            log.exception("handling %s", msg["type"])
            await self._reply(ident, re, "error", message=f"{type(exc).__name__}: {exc}")

    def _sample(self) -> dict[str, Any]:
        pids = [s.proc.pid for s in self.shards.values() if s.proc and s.proc.returncode is None]
        pids += self.jobs.pids()
        sample = telemetry.sample(self.config.memory_gb, pids)
        sample.pop("time", None)
        return {**sample, **self.live}

    async def _on_hello(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        await self._reply(
            ident,
            re,
            "hello_reply",
            name=self.config.name,
            version=__version__,
            pid=os.getpid(),
            address=self.config.address,
            control_port=self.config.control_port,
            started=self.started,
            facts=self.facts,
            shards=[s.describe() for s in self.shards.values()],
            jobs=[j.describe() for j in self.jobs.jobs.values()],
            **self._sample(),
        )

    async def _on_prepare_shard(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        req = control.parse(msg, control.PrepareShard)
        name = req.placement
        if name in self.shards and self.shards[name].state in ("loading", "ready"):
            await self._reply(
                ident, re, "error", message=f"placement {name!r} already has a shard here"
            )
            return
        if req.lease_s is not None and not req.lease_s > 0:
            await self._reply(
                ident, re, "error", message=f"lease_s must be positive seconds, not {req.lease_s}"
            )
            return
        await self._stop_shard(name)
        # A shard reloaded after a restart asks for the ports it had, so its ring
        # neighbours and clients, which reconnect by themselves, find it again.
        wished = (req.data_port, req.client_port)
        if (
            req.data_port is not None
            and req.client_port is not None
            and all(self._port_usable(p) for p in (req.data_port, req.client_port))
            and len(set(wished)) == 2
        ):
            data_port, client_port = req.data_port, req.client_port
            # A tensor group member's new group port: any free one but those two.
            spare = self._free_ports(3) if req.tensor else []
            rest = [p for p in spare if p not in (data_port, client_port)][:1]
        else:
            # A member of a tensor-parallel stage also needs a port for mx.distributed.
            data_port, client_port, *rest = self._free_ports(3 if req.tensor else 2)
        group_port = rest[0] if rest else 0
        # The plan's memory for the shard, reported with it from now (describe): its
        # files may take hours to copy here, and meanwhile that memory is promised.
        promise = {
            "weight_bytes": req.weight_bytes,
            "kv_bytes": req.kv_bytes,
            "adapter_bytes": req.adapter_bytes,
            "prompt_cache_bytes": req.prompt_cache_bytes,
        }
        lease = req.lease_s or control.PREPARED_LEASE_S
        self.shards[name] = ShardProc(
            placement=name,
            data_port=data_port,
            client_port=client_port,
            group_port=group_port,
            spec=promise,
            lease_s=lease,
            lease_until=time.monotonic() + lease,
        )
        await self._reply(
            ident,
            re,
            "prepared",
            placement=name,
            data_port=data_port,
            client_port=client_port,
            group_port=group_port,
        )

    async def _on_renew_shards(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        req = control.parse(msg, control.RenewShards)
        now, renewed = time.monotonic(), []
        for name in req.placements:
            shard = self.shards.get(name)
            if shard is not None and shard.state == "prepared":
                shard.lease_until = now + shard.lease_s
                renewed.append(name)
        await self._reply(ident, re, "renewed", placements=renewed)

    def _expire_leases(self, now: float) -> None:
        """Drop the prepared shards whose controller stopped renewing them: the next
        telemetry reports them gone, so every operator sees their memory free again.
        A shard loading or loaded is not leased."""
        for name, shard in list(self.shards.items()):
            if shard.state == "prepared" and now > shard.lease_until:
                del self.shards[name]
                log.warning(
                    "shard %s dropped: prepared but not renewed for %.0f s (its operator "
                    "went away mid-copy?); its promised memory is free again",
                    name,
                    shard.lease_s,
                )

    async def _on_load_shard(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        req = control.parse(msg, control.LoadShard)
        name = req.placement
        shard = self.shards.get(name)
        if shard is None or shard.state != "prepared":
            await self._reply(
                ident, re, "error", message=f"placement {name!r} was not prepared here"
            )
            return
        spec = {
            "home": str(self.config.home),
            "placement": name,
            "model_dir": req.model_dir,
            "start": req.start,
            "end": req.end,
            "index": req.index,
            "count": req.count,
            "address": self.config.address,
            "data_port": shard.data_port,
            "client_port": shard.client_port,
            "next_endpoint": req.next_endpoint,
            "next_key": req.next_key,
            "prefill_chunk": req.prefill_chunk,
            "context_tokens": req.context_tokens,
            "streams": max(1, req.streams),
            "kv_bytes": req.kv_bytes,
            # The placement's adapter by name (every shard reports it), and where this
            # node holds its files ("" on a shard whose layers it does not adapt).
            "adapter": req.adapter,
            "adapter_dir": req.adapter_dir,
            "adapter_bytes": req.adapter_bytes,
            "kv_bits": req.kv_bits,
            "kv_group_size": req.kv_group_size,
            "prompt_cache_bytes": req.prompt_cache_bytes,
            "prompt_cache_disk_bytes": req.prompt_cache_disk_bytes,
            "draft": req.draft,
            "draft_dir": req.draft_dir,
            "draft_tokens": req.draft_tokens,
            # Said at prepare_shard; weights not read yet stay promised while it loads.
            "weight_bytes": shard.spec.get("weight_bytes", 0),
        }
        run_dir = self.config.home / "shards"
        run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        asked = control.parse(msg, control.TensorMember)
        if asked.group:
            try:
                member, member_env = tensor_member(
                    asked, self.config.address, run_dir / _safe(name)
                )
            except (group.GroupError, ValueError) as exc:
                await self._reply(ident, re, "error", message=f"tensor group: {exc}")
                return
            spec |= member
            env |= member_env
        shard.spec = spec
        shard.state = "loading"
        spec_path = run_dir / f"{_safe(name)}.json"
        spec_path.write_text(json.dumps(spec))
        shard.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "worker.runner",
            str(spec_path),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        log.info(
            "shard %s [%d,%d) pid %d loading", name, spec["start"], spec["end"], shard.proc.pid
        )
        self._spawn(self._read_stderr(shard))
        await self._follow(ident, re, shard)

    async def _heartbeat(self, ident: bytes, re: Any, shard: ShardProc) -> None:
        """Say "still loading" with the bytes so far while the shard process lives."""
        while True:
            await asyncio.sleep(LOAD_HEARTBEAT_S)
            if shard.state != "loading" or shard.proc is None or shard.proc.returncode is not None:
                return
            done, total = shard.progress
            await self._reply(
                ident, re, "progress", placement=shard.placement, done=done, total=total
            )

    async def _follow(self, ident: bytes, re: Any, shard: ShardProc) -> None:
        """Relay the runner's progress until it is ready or gone, then keep reading stats."""
        assert shard.proc is not None and shard.proc.stdout is not None
        heartbeat = asyncio.create_task(self._heartbeat(ident, re, shard))
        try:
            await self._relay(ident, re, shard)
        finally:
            heartbeat.cancel()

    async def _relay(self, ident: bytes, re: Any, shard: ShardProc) -> None:
        assert shard.proc is not None and shard.proc.stdout is not None
        answered = False
        async for event in _events(shard.proc.stdout, shard):
            answered = await self._on_runner_event(ident, re, shard, event, answered)
        await self._runner_gone(ident, re, shard, answered)

    async def _on_runner_event(
        self, ident: bytes, re: Any, shard: ShardProc, event: events.RunnerEvent, answered: bool
    ) -> bool:
        """Act on one event of a runner's output; return whether the load was answered."""
        if isinstance(event, events.Beat):
            shard.step_s = event.step_s
        elif isinstance(event, events.Loading):
            shard.progress = (event.done, event.total)
            if not answered:
                await self._reply(
                    ident,
                    re,
                    "progress",
                    placement=shard.placement,
                    done=shard.progress[0],
                    total=shard.progress[1],
                )
        elif isinstance(event, events.Ready):
            shard.state, shard.param_bytes = "ready", event.param_bytes
            log.info("shard %s ready, %d bytes", shard.placement, shard.param_bytes)
            await self._reply(
                ident,
                re,
                "shard_ready",
                placement=shard.placement,
                start=event.start,
                end=event.end,
                param_bytes=shard.param_bytes,
            )
            answered = True
        elif isinstance(event, events.Stats):
            shard.stats = event
        elif isinstance(event, events.Fatal):
            shard.message = event.message
        return answered

    async def _runner_gone(self, ident: bytes, re: Any, shard: ShardProc, answered: bool) -> None:
        assert shard.proc is not None
        code = await shard.proc.wait()
        if shard.state != "stopped":
            tail = "\n".join(shard.stderr_tail[-8:])
            shard.message = exit_reason(code, loading=not answered, fatal=shard.message)
            if tail and not shard.message.endswith(tail):
                shard.message += f"\n{tail}"
            shard.state = "failed"
            log.error("shard %s failed: %s", shard.placement, shard.message)
            if not answered:
                await self._reply(ident, re, "error", message=shard.message)

    async def _read_stderr(self, shard: ShardProc) -> None:
        assert shard.proc is not None and shard.proc.stderr is not None
        async for line in _lines(shard.proc.stderr, shard):
            text = line.decode(errors="replace").rstrip()
            shard.stderr_tail = [*shard.stderr_tail[-49:], text]
            log.info("[%s] %s", shard.placement, text)

    async def _watch_runners(self) -> None:
        """Mark a ready runner "silent" when it stops beating or one step hangs, and
        ready again when it is back: a stopped process holds its port open, so only
        its silence tells."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            now = time.monotonic()
            if now - last > SILENT_AFTER_S:
                # This agent was itself stopped (or starved): its runners' lines wait
                # unread in their pipes. Judge them only after reading those.
                for shard in self.shards.values():
                    shard.last_heard = max(shard.last_heard, now)
            last = now
            for shard in self.shards.values():
                self._judge(shard, now)
            self._expire_leases(now)
            self.jobs.judge(now)

    def _judge(self, shard: ShardProc, now: float) -> None:
        quiet = now - shard.last_heard
        why = ""
        if quiet > SILENT_AFTER_S:
            pid = shard.proc.pid if shard.proc else "?"
            why = f"its runner (pid {pid}) has sent nothing for {quiet:.0f} s (stopped or frozen)"
        elif shard.step_s > STUCK_AFTER_S:
            why = f"its runner has been inside one step for {shard.step_s:.0f} s (hung)"
        if why and shard.state == "ready":
            shard.state, shard.silent_since = "silent", time.time()
            shard.message = f"silent since {_clock(shard.silent_since)}: {why}"
            log.warning("shard %s %s", shard.placement, shard.message)
        elif not why and shard.state == "silent":
            log.info(
                "shard %s answers again (silent since %s)",
                shard.placement,
                _clock(shard.silent_since),
            )
            shard.state, shard.silent_since, shard.message = "ready", 0.0, ""

    async def _on_unload(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        name = control.parse(msg, control.Unload).placement
        await self._stop_shard(name)
        self.shards.pop(name, None)
        await self._reply(ident, re, "unloaded", placement=name)

    async def _on_list_shards(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        await self._reply(ident, re, "shards", shards=[s.describe() for s in self.shards.values()])

    async def _on_read_log(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        # Off the loop and bounded: a slow disk or a huge log must not stall every
        # other request, nor grow the agent by the log's size.
        wanted = control.parse(msg, control.ReadLog).lines
        lines = await asyncio.to_thread(tail_lines, self.config.home / "agent.log", wanted)
        await self._reply(ident, re, "log", lines=lines)

    async def _probe(self) -> None:
        """Gather RDMA and link facts off the loop (probes may take seconds on a Mac),
        again every PROBE_EVERY_S: a cable plugged in or a port that went down changes
        which RDMA device reaches which node, and JACCL's device matrix with it. Each
        round runs the cheap probes; `system_profiler` (seconds) only on a change."""
        replay = self.config.home / node_probe.REPLAY_FOLDER
        # Between rounds: the slow Thunderbolt listing is read again only when the
        # cheap probes (ifconfig, the hardware ports, RDMA port states) changed.
        memo = node_probe.ProbeMemo()
        while True:
            try:
                rdma = await asyncio.to_thread(
                    node_probe.rdma_facts, replay if replay.is_dir() else None, memo
                )
                log.debug("probes ran: %s", ", ".join(memo.ran))
                end = await asyncio.to_thread(node_probe.link_end, self.config.address)
            except Exception:  # a probe must never stop the agent: the next round retries
                log.exception("probing RDMA and link facts failed")
            else:
                self.facts = {**self.facts, "rdma": rdma, "link_end": end, "link_kind": end["kind"]}
            await asyncio.sleep(PROBE_EVERY_S)

    async def _meter(self) -> None:
        meter = await asyncio.to_thread(telemetry.Meter.for_this_machine)
        await telemetry.keep_reading(meter, self.live)

    async def _on_ping_peer(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        # An activation-sized ping is sent back whole, so its round trip carries it both ways.
        echo = msg.get("pad", b"") if msg.get("echo") else b""
        await self._reply(ident, re, "ok", pad=echo)

    async def _on_measure_links(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        req = control.parse(msg, control.MeasureLinks)
        try:
            sizes = link_sizes(req.sizes)
        except ValueError as exc:
            await self._reply(ident, re, "error", message=str(exc))
            return
        results = []
        for peer in req.peers:
            results.append(await self._measure(peer, sizes))
        await self._reply(ident, re, "links", links=results)

    async def _measure(self, peer: control.LinkPeer, sizes: LinkSizes) -> dict[str, Any]:
        """Latency from small pings over the control socket; bandwidth from a
        stream of large messages over a CURVE PUSH to a PULL the peer opens."""
        keys = curve.load_keypair(curve.key_dir(self.config.home) / "self.key_secret")
        server_key = peer.key.encode()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        curve.make_client(sock, keys, server_key)
        sock.connect(peer.endpoint)
        out: dict[str, Any] = {"peer": peer.name, "kind": self.facts.get("link_kind", "unknown")}
        try:
            rtts = [await _ping(sock, i, b"") for i in range(sizes.pings)]
            # The first ping makes the connection (CURVE handshake): not a latency.
            out["latency_us"] = statistics.median(rtts[1:]) / 2 * 1e6
            out["latency_p90_us"] = _quantile(rtts[1:], 0.9) / 2 * 1e6
            if sizes.pad_bytes:
                pad = bytes(sizes.pad_bytes)
                padded = [await _ping(sock, i, pad) for i in range(sizes.pings)]
                out["latency_pad_us"] = statistics.median(padded[1:]) / 2 * 1e6
                out["pad_bytes"] = sizes.pad_bytes
            token = os.urandom(8).hex()
            opened = control.parse(
                await _ask(sock, "open_sink", token=token, in_flight=sizes.in_flight),
                control.SinkOpen,
            )
            host = peer.endpoint.rsplit(":", 1)[0]
            sent = await self._stream(keys, server_key, f"{host}:{opened.port}", sizes)
            got = control.parse(
                await _ask(sock, "close_sink", token=token, timeout=2 * LINK_TIMEOUT_S),
                control.SinkResult,
            )
            if got.seconds > 0 and got.bytes > 0:
                out["gbps"] = got.bytes * 8 / got.seconds / 1e9
            out.update(
                method="curve push-pull",
                chunk_bytes=sizes.chunk_bytes,
                in_flight=sizes.in_flight,
                sent_bytes=sent,
                received_bytes=got.bytes,
                seconds=got.seconds,
            )
        except TimeoutError:
            out["error"] = f"{peer.name} did not answer in time"
        except (AgentLinkError, zmq.ZMQError, messages.MessageError) as exc:
            out["error"] = f"{peer.name}: {exc}"
        finally:
            sock.close(linger=0)
        return out

    async def _stream(
        self, keys: curve.CurveKeys, server_key: bytes, endpoint: str, sizes: LinkSizes
    ) -> int:
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        curve.make_client(push, keys, server_key)
        # After make_client, which sets the usual high-water marks: set before it, this
        # one was overwritten and the whole 1 GiB cap was queued at once (the stream then
        # lasted ~3 s here, whatever bulk_seconds said).
        push.setsockopt(zmq.SNDHWM, sizes.in_flight)
        payload = bytes(sizes.chunk_bytes)
        sent = 0
        try:
            push.connect(endpoint)
            # A small message first: a large first message on a new CURVE pipe to an
            # asyncio PULL stalled here (4 MiB hung, 64 KiB did not; seen with pyzmq's
            # asyncio sockets), and the receiver starts its clock at the first data.
            await asyncio.wait_for(push.send_multipart([b"warm"]), LINK_TIMEOUT_S)
            began = time.perf_counter()
            while time.perf_counter() - began < sizes.bulk_seconds and sent < LINK_BULK_MAX_BYTES:
                # copy=False: zero-copy, as the runner sends large activations.
                await asyncio.wait_for(
                    push.send_multipart([b"data", payload], copy=False), LINK_TIMEOUT_S
                )
                sent += len(payload)
            await asyncio.wait_for(push.send_multipart([b"end"]), LINK_TIMEOUT_S)
        finally:
            push.close(linger=int(LINK_TIMEOUT_S * 1000))
        return sent

    async def _on_open_sink(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        req = control.parse(msg, control.OpenSink)
        token = req.token
        try:
            in_flight = link_sizes(control.LinkSizes(in_flight=req.in_flight)).in_flight
        except ValueError as exc:
            await self._reply(ident, re, "error", message=str(exc))
            return
        keys = curve.load_keypair(curve.key_dir(self.config.home) / "self.key_secret")
        sink = self.ctx.socket(zmq.PULL)
        sink.setsockopt(zmq.LINGER, 0)
        curve.make_server(sink, keys)
        sink.setsockopt(zmq.RCVHWM, in_flight)  # after make_server, which sets its own
        sink.bind(f"tcp://{self.config.address}:*")
        port = int(sink.get_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        task = self._sinks[token] = asyncio.create_task(_drain(sink))
        # A measurer that never comes back for its result must not leave it here.
        task.add_done_callback(
            lambda _: asyncio.get_running_loop().call_later(
                LINK_TIMEOUT_S * 4, self._sinks.pop, token, None
            )
        )
        await self._reply(ident, re, "sink_open", port=port)

    async def _on_close_sink(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        task = self._sinks.pop(control.parse(msg, control.Token).token, None)
        if task is None:
            await self._reply(ident, re, "error", message="no such link sink")
            return
        await self._reply(ident, re, "sink_result", **await task)

    # ---- the device benchmark (worker/device_bench.py) --------------------------------------

    async def _on_device_bench(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        """Matrix-multiply and memory figures of this node's device, measured in a process
        of its own; each step is said as it starts."""
        busy = self._bench_running()
        if busy:
            await self._reply(ident, re, "error", message=busy)
            return
        sizes = control.parse(msg, control.DeviceBench).sizes
        try:
            figures = await self._measurement(
                ident, re, ["-m", "worker.device_bench", json.dumps(sizes)]
            )
        except BenchError as exc:
            await self._reply(ident, re, "error", message=str(exc))
            return
        await self._reply(ident, re, "ok", figures=figures)

    async def _measurement(
        self,
        ident: bytes,
        re: Any,
        argv: list[str],
        env: dict[str, str] | None = None,
        timeout: float = BENCH_TIMEOUT_S,
    ) -> dict[str, Any]:
        """Run `python ARGV` (a worker.device_bench program), relay its steps as
        `bench_step` replies and return its figures; raise BenchError with its words, or
        how it ended, when it gives none."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )
        self._benches.add(proc)
        log.info("benchmark pid %d: %s", proc.pid, " ".join(argv[:2]))
        assert proc.stdout is not None and proc.stderr is not None
        tail: list[str] = []
        drain = asyncio.create_task(_tail(proc.stderr, tail, BENCH_STDERR_LINES))
        figures: dict[str, Any] | None = None
        fatal = ""
        try:
            async with asyncio.timeout(timeout):
                async for line in proc.stdout:
                    event = _json_object(line)
                    kind = event.get("event")
                    if kind == "step":
                        await self._reply(ident, re, "bench_step", step=str(event.get("step")))
                    elif kind == "figures" and isinstance(event.get("figures"), dict):
                        figures = event["figures"]
                    elif kind == "fatal":
                        fatal = str(event.get("message", ""))
                code = await proc.wait()
        except TimeoutError:
            raise BenchError(
                f"the benchmark on {self.config.name} ran over {timeout:g} s and was stopped"
            ) from None
        finally:
            if proc.returncode is None:  # timed out or the request was cancelled
                proc.kill()
                await proc.wait()
            await drain
            self._benches.discard(proc)
        if proc.pid in self._stopped_benches:
            self._stopped_benches.discard(proc.pid)
            raise BenchError(f"the benchmark on {self.config.name} was stopped on request")
        if figures is not None:
            return figures
        why = fatal or bench_exit_reason(code)
        words = "\n".join(tail[-8:])
        raise BenchError(
            f"the benchmark on {self.config.name} failed: {why}" + (f"\n{words}" if words else "")
        )

    def _bench_running(self) -> str:
        running = [p.pid for p in self._benches if p.returncode is None]
        if not running:
            return ""
        return f"a benchmark already runs on {self.config.name} (pid {running[0]}): wait for it"

    async def _stop_benches(self) -> int:
        """End every measuring process (the agent stopping, or stop_bench); how many."""
        ended = 0
        for proc in list(self._benches):
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
                ended += 1
        return ended

    async def _on_stop_bench(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        """The controller gave up a device measurement (Esc on the Benchmark screen,
        Ctrl-C): end its process now, so the node's device is free and another can
        start at once rather than after the rest of this one's seconds."""
        self._stopped_benches.update(p.pid for p in self._benches if p.returncode is None)
        ended = await self._stop_benches()
        if ended:
            log.info("stopped %d benchmark process(es) on request", ended)
        await self._reply(ident, re, "ok", stopped=ended)

    async def _on_shutdown(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        await self._reply(ident, re, "ok")
        self.stopping.set()

    # ---- model files (worker/files.py) ------------------------------------------------------

    def _progress_to(self, ident: bytes, re: Any, stage: str, total: int) -> files.Progress:
        """A callback, safe from any thread, relaying byte progress as `progress` replies
        (also what keeps a long hash or copy from looking like a silent agent)."""
        loop = asyncio.get_running_loop()
        last = [0.0]

        def send(done: int, _total: int = total) -> None:
            now = time.monotonic()
            if now - last[0] < files.PROGRESS_EVERY_S and done < _total:
                return
            last[0] = now
            reply = self._reply(ident, re, "file_progress", stage=stage, done=done, total=_total)
            loop.call_soon_threadsafe(lambda: self._spawn(reply))

        return send

    def _hashed_to(self, ident: bytes, re: Any, total: int) -> Callable[[int], None]:
        """A callback adding bytes hashed, relayed as progress towards `total`."""
        send = self._progress_to(ident, re, "hashing", total)
        seen = [0]

        def add(n: int) -> None:
            seen[0] += n
            send(seen[0], total)

        return add

    async def _on_files_status(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        req = control.parse(msg, control.FilesStatus)
        wanted = req.files
        on_bytes = self._hashed_to(ident, re, sum(f.size for f in wanted))
        found = []
        for name in req.dirs:
            directory = files.resolve_dir(self.config.home, name)
            found.append(
                {"dir": name, **await asyncio.to_thread(files.status, directory, wanted, on_bytes)}
            )
        await self._reply(ident, re, "ok", dirs=found)

    async def _on_files_commit(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        req = control.parse(msg, control.FilesCommit)
        directory = files.resolve_dir(self.config.home, req.dir)
        landed = req.files
        on_bytes = self._hashed_to(ident, re, sum(f.size for f in landed))
        for f in landed:
            await asyncio.to_thread(files.commit, directory, f, on_bytes)
            log.info("verified and placed %s in %s", f.name, directory)
        await self._reply(ident, re, "ok")

    async def _on_serve_files(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        req = control.parse(msg, control.ServeFiles)
        directory = files.resolve_dir(self.config.home, req.dir)
        wanted = {f.name: f.size for f in req.files}
        for name, size in wanted.items():
            path = directory / name
            if not files.plain_name(name) or not path.is_file() or path.stat().st_size != size:
                await self._reply(ident, re, "error", message=f"{path} is not here at {size} B")
                return
        if self.file_server is None:
            keys = curve.load_keypair(curve.key_dir(self.config.home) / "self.key_secret")
            port = self._free_ports(1)[0]
            self.file_server = files.FileServer(self.ctx, keys, self.config.address, port)
            self.file_server.start()
        token = self.file_server.grant(directory, wanted)
        log.info("serving %d files of %s on port %d", len(wanted), directory, self.file_server.port)
        await self._reply(ident, re, "ok", port=self.file_server.port, token=token)

    async def _on_unserve_files(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        sent = 0
        if self.file_server is not None:
            sent = self.file_server.revoke(control.parse(msg, control.Token).token)
            if not self.file_server.grants:
                await self.file_server.close()
                self.file_server = None
        await self._reply(ident, re, "ok", sent=sent)

    async def _on_fetch_files(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        req = control.parse(msg, control.FetchFiles)
        directory = files.resolve_dir(self.config.home, req.dir)
        wanted = req.files
        keys = curve.load_keypair(curve.key_dir(self.config.home) / "self.key_secret")
        total = sum(f.size for f in wanted)
        began = time.monotonic()
        result = await files.fetch(
            self.ctx,
            keys,
            req.endpoint,
            req.key.encode(),
            req.token,
            directory,
            wanted,
            self._progress_to(ident, re, "copying", total),
        )
        log.info(
            "fetched %d B into %s from %s in %.1f s (%d B resumed)",
            result["received"],
            directory,
            req.endpoint,
            time.monotonic() - began,
            result["resumed"],
        )
        await self._reply(ident, re, "ok", path=str(directory.resolve()), **result)

    async def _on_hub_download(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        from worker import hub

        req = control.parse(msg, control.HubDownload)
        names = req.files
        bad = [n for n in names if not files.plain_name(n)]
        if bad:
            await self._reply(ident, re, "error", message=f"{bad[0]!r} is not a plain file name")
            return
        cache = req.cache_dir
        where = files.resolve_dir(self.config.home, cache) if cache else hub.default_cache()
        need, free = req.total, files.free_bytes(where)
        if need > free:
            await self._reply(
                ident,
                re,
                "error",
                message=f"{self.config.name} has {files.human_bytes(free)} free at {where} but "
                f"its share needs {files.human_bytes(need)}: free disk space there or fetch to "
                "other nodes",
            )
            return
        result = await hub.download(
            req.repo,
            req.revision,
            names,
            files.resolve_dir(self.config.home, cache) if cache else None,
            req.endpoint or None,
            req.total,
            self._progress_to(ident, re, "downloading", req.total),
        )
        log.info("downloaded %s of %s into %s", len(names), req.repo, result["path"])
        await self._reply(ident, re, "ok", **result)

    # ---- shards ----------------------------------------------------------------------------

    async def _stop_shard(self, name: str) -> None:
        shard = self.shards.get(name)
        if shard is None or shard.proc is None or shard.proc.returncode is not None:
            return
        shard.state = "stopped"
        shard.proc.terminate()
        try:
            await asyncio.wait_for(shard.proc.wait(), 5)
        except TimeoutError:
            shard.proc.kill()
            await shard.proc.wait()

    async def _stop_all_shards(self) -> None:
        await asyncio.gather(*(self._stop_shard(n) for n in list(self.shards)))

    def _port_usable(self, port: int) -> bool:
        taken = {
            p for s in self.shards.values() for p in (s.data_port, s.client_port, s.group_port)
        }
        taken |= self.jobs.ports_held()
        return 0 < port <= 65535 and port not in taken and port_free(self.config.address, port)

    def _free_ports(self, count: int) -> list[int]:
        taken = {
            p for s in self.shards.values() for p in (s.data_port, s.client_port, s.group_port)
        }
        taken |= self.jobs.ports_held()
        found: list[int] = []
        port = self.config.control_port + SHARD_PORT_OFFSET
        while len(found) < count:
            if port > 65535:
                raise RuntimeError("no free port for a shard")
            if port not in taken and port_free(self.config.address, port):
                found.append(port)
            port += 1
        return found

    # ---- jobs (worker/jobs.py) --------------------------------------------------------------

    async def _on_job_ports(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        """Free ports on this node's address, for a rank of a group job to listen on."""
        count = control.parse(msg, control.JobPorts).count
        if not 1 <= count <= 16:
            await self._reply(ident, re, "error", message="job_ports wants a count of 1-16")
            return
        await self._reply(ident, re, "job_ports", ports=self._free_ports(count))

    async def _on_start_job(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        try:
            job = await self.jobs.start(control.parse(msg, control.StartJob))
        except jobs.JobError as exc:
            await self._reply(ident, re, "error", message=f"{self.config.name}: {exc}")
            return
        assert job.proc is not None
        log.info(
            "job %s rank %d/%d (%s) pid %d", job.job, job.rank, job.size, job.kind, job.proc.pid
        )
        await self._reply(ident, re, "job_started", **job.describe())

    async def _on_follow_job(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        """Every event of a job's rank after `since`, a beat each second, then its end."""
        req = control.parse(msg, control.FollowJob)
        # A follower that went away (a closed TUI) is not told; its relay ends when the
        # job does. Bounded: the oldest relays of a job give way to new followers.
        relays = self._follows.setdefault(req.job, [])
        relays[:] = [t for t in relays if not t.done()]
        if (me := asyncio.current_task()) is not None:
            relays.append(me)
        while len(relays) > MAX_FOLLOWERS:
            relays.pop(0).cancel()
        try:
            async for kind, body in self.jobs.follow(req.job, req.since):
                if kind == "event":
                    # The job's own fields stay in `data`: they cannot clash with ours.
                    await self._reply(
                        ident,
                        re,
                        "job_event",
                        node=self.config.name,
                        event=str(body["event"]),
                        seq=int(body["seq"]),
                        data=body,
                    )
                else:
                    reply = "job_beat" if kind == "beat" else "job_end"
                    await self._reply(ident, re, reply, node=self.config.name, **body)
        except jobs.JobError as exc:
            await self._reply(ident, re, "error", message=f"{self.config.name}: {exc}")

    async def _on_job_status(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        wanted = control.parse(msg, control.JobStatusAsk).job
        found = [j.describe() for j in self.jobs.jobs.values() if j.job == wanted or not wanted]
        await self._reply(ident, re, "jobs", node=self.config.name, jobs=found)

    async def _on_stop_job(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        try:
            job = await self.jobs.stop(control.parse(msg, control.JobRef).job)
        except jobs.JobError as exc:
            await self._reply(ident, re, "error", message=f"{self.config.name}: {exc}")
            return
        log.info("job %s stopped (%s)", job.job, job.state)
        await self._reply(ident, re, "job_stopped", **job.describe())

    async def _on_forget_job(self, ident: bytes, re: Any, msg: dict[str, Any]) -> None:
        name = control.parse(msg, control.JobRef).job
        await self._reply(ident, re, "ok", forgotten=self.jobs.forget(name))

    # ---- telemetry ----------------------------------------------------------------------------

    async def _publish(self) -> None:
        assert self.pub is not None
        while True:
            if self.reload_keys():
                log.info("authorized keys reloaded (%d)", len(self._keys_seen))
            pids = [
                s.proc.pid for s in self.shards.values() if s.proc and s.proc.returncode is None
            ]
            pids += self.jobs.pids()
            sample = {**telemetry.sample(self.config.memory_gb, pids), **self.live}
            sample.pop("time", None)
            msg = messages.encode(
                "telemetry",
                name=self.config.name,
                time=time.time(),
                version=__version__,
                facts=self.facts,
                shards=[s.describe() for s in self.shards.values()],
                dropped=self.dropped,
                refused=self.refused,
                **sample,
            )
            await self.pub.send_multipart([b"telemetry", msg])
            await asyncio.sleep(TELEMETRY_EVERY_S)


def tensor_member(
    asked: control.TensorMember, address: str, base: Path
) -> tuple[dict[str, Any], dict[str, str]]:
    """The runner fields and the environment of one rank of a tensor-parallel stage:
    the ring backend's hostfile (every rank's bridge address and group port, as
    `mlx.launch` writes it) or JACCL's device file and coordinator, via worker.group."""
    nodes, addresses, ports = asked.group, asked.group_addresses, asked.group_ports
    rank, size, backend = asked.rank, len(nodes), asked.backend
    if not 0 <= rank < size or len(ports) != size:
        raise ValueError(f"rank {rank} of a group of {size} with {len(ports)} ports")
    if len(addresses) != size or addresses[rank] != address:
        raise ValueError(f"rank {rank}'s address is not this node's ({address})")
    if backend == "ring":
        hosts = group.write_json(
            base.with_suffix(".hosts.json"), group.ring_hostfile(addresses, ports)
        )
        env = group.rank_env(rank, size, "ring", hostfile=hosts, nodes=nodes, join_s=asked.join_s)
    elif backend == "jaccl":
        devices = group.write_json(base.with_suffix(".devices.json"), asked.devices)
        coordinator = f"{addresses[0]}:{ports[0]}"
        env = group.rank_env(
            rank,
            size,
            "jaccl",
            coordinator=coordinator,
            devices=devices,
            nodes=nodes,
            join_s=asked.join_s,
        )
    else:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(group.BACKENDS)}")
    member = {
        "rank": rank,
        "group_size": size,
        "group": nodes,
        "backend": backend,
        "followers": [[e, k] for e, k in asked.followers],
        "leader_key": asked.leader_key,
    }
    return member, env


@dataclass(frozen=True)
class LinkSizes:
    """How `measure_links` measures: pings (and their padding), and the bulk stream."""

    pings: int = LINK_PINGS
    pad_bytes: int = 0
    bulk_seconds: float = LINK_BULK_SECONDS
    chunk_bytes: int = LINK_CHUNK_BYTES
    in_flight: int = LINK_IN_FLIGHT


def link_sizes(asked: control.LinkSizes) -> LinkSizes:
    """The sizes a `measure_links` request asks for, the defaults for the rest; a size
    out of its bounds (limits.LINK_MEASURE_BOUNDS) is refused, naming it (its type and
    an unknown one were checked by control.parse)."""
    given = {k: v for k, v in msgspec.structs.asdict(asked).items() if v is not None}
    problem = out_of_bounds(given, LINK_MEASURE_BOUNDS)
    if problem:
        raise ValueError(f"link measurement: {problem}")
    return dataclasses.replace(LinkSizes(), **given)


class BenchError(RuntimeError):
    """A device or group measurement that gave no figures, in words."""


def bench_exit_reason(code: int | None) -> str:
    if code == -signal.SIGKILL:
        return "its process was killed by SIGKILL (out of memory? ask for smaller sizes)"
    if code is not None and code < 0:
        return f"its process was ended by signal {-code}"
    return f"its process exited with code {code} without figures"


def _json_object(line: bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}


async def _tail(stream: asyncio.StreamReader, into: list[str], keep: int) -> None:
    """Keep the last `keep` lines of a pipe (read to its end, so the writer never blocks)."""
    while line := await stream.readline():
        into.append(line.decode(errors="replace").rstrip())
        del into[:-keep]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class AgentLinkError(RuntimeError):
    """A peer refused a link-measurement step."""


async def _ask(
    sock: zmq.asyncio.Socket, kind: str, timeout: float = LINK_TIMEOUT_S, **fields: Any
) -> dict[str, Any]:
    await sock.send(messages.encode(kind, **fields))
    reply = messages.decode(await asyncio.wait_for(sock.recv(), timeout))
    if reply["type"] == "error":
        raise AgentLinkError(str(reply.get("message")))
    return reply


async def _drain(sink: zmq.asyncio.Socket) -> dict[str, Any]:
    """Receive a measurement stream until its end marker (or silence); the bytes
    after the first message over the time from the first to the last."""
    first = last = 0.0
    count = received = 0
    try:
        # poll, not wait_for around recv: a cancelled recv can lose a message.
        while await sink.poll(int(LINK_TIMEOUT_S * 1000)):  # POLLIN, the default
            frames = await sink.recv_multipart(copy=False)
            if frames[0].bytes == b"warm":
                continue
            if frames[0].bytes != b"data":
                break
            now = time.perf_counter()
            if count:
                received += len(frames[1])
            else:
                first = now
            last, count = now, count + 1
    finally:
        sink.close(linger=0)
    return {"bytes": received, "seconds": last - first, "messages": count}


async def _ping(sock: zmq.asyncio.Socket, n: int, pad: bytes) -> float:
    began = time.perf_counter()
    await sock.send(messages.encode("ping_peer", id=n, pad=pad, echo=bool(pad)))
    await asyncio.wait_for(sock.recv(), LINK_TIMEOUT_S)
    return time.perf_counter() - began


async def _lines(stream: asyncio.StreamReader, shard: ShardProc) -> Any:
    """The lines of a runner's pipe; an over-long one is skipped, not fatal."""
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # longer than the reader's limit; the buffer is cleared
            shard.bad_lines += 1
            shard.last_heard = time.monotonic()
            continue
        if not line:
            return
        shard.last_heard = time.monotonic()
        yield line


async def _events(stream: asyncio.StreamReader, shard: ShardProc) -> Any:
    """The events a runner writes (protocol/events.py); anything else is counted and
    skipped: a line that is not JSON, not an object, or an event with a bad field."""
    async for line in _lines(stream, shard):
        try:
            yield events.decode(line)
        except events.EventError as exc:
            shard.bad_lines += 1
            log.warning("shard %s: bad line from its runner: %s", shard.placement, exc)


def _clock(when: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when))


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


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
        return 2
    return 0
