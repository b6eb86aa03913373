"""The shards this node runs: prepare (ports and the plan's promised memory), load (a
runner process per shard, followed until ready and watched after), renew, unload, list."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from worker import group
from worker.agent.host import Ask, Host, Route, route
from worker.shared.ports import port_free
from worker.shared.protocol import control, events
from worker.shared.protocol.messages import CodedError, ErrorCode
from worker.shared.protocol.status import ShardStatus

log = logging.getLogger("studiotui.agent")

SHARD_PORT_OFFSET = 10
# While a shard loads, the controller hears from this agent at least this often (the
# bytes loaded so far): a big layer on a slow disk gives no progress for minutes.
LOAD_HEARTBEAT_S = 2.0
# A runner beats twice a second (worker.runner.BEAT_EVERY_S); a ready one heard from
# for this long is "silent" (stopped or frozen) until it speaks again.
SILENT_AFTER_S = 3.0
# A step that runs this long is a hang (MLX stuck), not work: steps take milliseconds
# to a few seconds for a long prefill chunk.
STUCK_AFTER_S = 60.0
WATCH_EVERY_S = 0.5


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


def load_failure(code: int | None, oom: bool) -> ErrorCode:
    """The code of a load that ended without its shard ready: out of memory when the
    runner said so or was killed by SIGKILL (how memory running out ends a process)."""
    return "out_of_memory" if oom or code == -signal.SIGKILL else "load_failed"


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
    oom: bool = False  # the runner's last word said it ran out of memory
    stderr_tail: list[str] = field(default_factory=list)
    last_heard: float = field(default_factory=time.monotonic)
    step_s: float = 0.0
    silent_since: float = 0.0  # wall clock, for the words "silent since ..."
    bad_lines: int = 0
    # While prepared: how long a lease lasts, and when this one lapses (monotonic).
    lease_s: float = control.PREPARED_LEASE_S
    lease_until: float = float("inf")

    def describe(self) -> control.ShardReport:
        spec = self.spec
        return control.ShardReport(
            placement=self.placement,
            model_dir=spec.get("model_dir", ""),
            start=spec.get("start", 0),
            end=spec.get("end", 0),
            index=spec.get("index", 0),
            count=spec.get("count", 0),
            context_tokens=spec.get("context_tokens", 0),
            streams=spec.get("streams", 1),
            kv_bytes=spec.get("kv_bytes", 0),
            prefill_chunk=spec.get("prefill_chunk", 512),
            adapter=spec.get("adapter", ""),
            adapter_dir=spec.get("adapter_dir", ""),
            adapter_bytes=spec.get("adapter_bytes", 0),
            draft=spec.get("draft", ""),
            weight_bytes=spec.get("weight_bytes", 0),
            kv_bits=spec.get("kv_bits", 0),
            kv_group_size=spec.get("kv_group_size", 64),
            prompt_cache_bytes=spec.get("prompt_cache_bytes", 0),
            prompt_cache_disk_bytes=spec.get("prompt_cache_disk_bytes", 0),
            model_digest=spec.get("model_digest", ""),
            data_port=self.data_port,
            client_port=self.client_port,
            group_port=self.group_port,
            rank=spec.get("rank", 0),
            group=spec.get("group", []),
            backend=spec.get("backend", ""),
            state=self.state,
            progress=self.progress,
            param_bytes=self.param_bytes,
            # The runner's stats event, as the plain counters (no event tag).
            stats=control.ShardStats(**msgspec.structs.asdict(self.stats)),
            message=self.message,
            pid=self.proc.pid if self.proc else None,
            silent_since=self.silent_since or None,
        )

    def ports(self) -> tuple[int, int, int]:
        return self.data_port, self.client_port, self.group_port


class Shards:
    """The shards of this node, by placement."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.shards: dict[str, ShardProc] = {}

    def routes(self) -> Iterable[Route]:
        return (
            route(control.PrepareShard, self.prepare),
            route(control.RenewShards, self.renew),
            route(control.LoadShard, self.load),
            route(control.Unload, self.unload),
            route(control.ListShards, self.list),
        )

    def reports(self) -> list[control.ShardReport]:
        return [s.describe() for s in self.shards.values()]

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.shards.values() if s.proc and s.proc.returncode is None]

    def ports_held(self) -> set[int]:
        return {p for s in self.shards.values() for p in s.ports()}

    # ---- requests ----------------------------------------------------------------------

    async def prepare(self, ask: Ask, req: control.PrepareShard) -> None:
        name = req.placement
        if name in self.shards and self.shards[name].state in ("loading", "ready"):
            raise CodedError("conflict", f"placement {name!r} already has a shard here")
        if req.lease_s is not None and not req.lease_s > 0:
            raise CodedError("bad_request", f"lease_s must be positive seconds, not {req.lease_s}")
        await self.stop(name)
        # A shard reloaded after a restart asks for the ports it had, so its ring
        # neighbours and clients, which reconnect by themselves, find it again.
        wished = (req.data_port, req.client_port)
        if (
            req.data_port is not None
            and req.client_port is not None
            and all(self.port_usable(p) for p in (req.data_port, req.client_port))
            and len(set(wished)) == 2
        ):
            data_port, client_port = req.data_port, req.client_port
            # A tensor group member's new group port: any free one but those two.
            spare = self.host.free_ports(3) if req.tensor else []
            rest = [p for p in spare if p not in (data_port, client_port)][:1]
        else:
            # A member of a tensor-parallel stage also needs a port for mx.distributed.
            data_port, client_port, *rest = self.host.free_ports(3 if req.tensor else 2)
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
        await ask.answer(
            control.Prepared(
                placement=name,
                data_port=data_port,
                client_port=client_port,
                group_port=group_port,
            )
        )

    async def renew(self, ask: Ask, req: control.RenewShards) -> None:
        now, renewed = time.monotonic(), []
        for name in req.placements:
            shard = self.shards.get(name)
            if shard is not None and shard.state == "prepared":
                shard.lease_until = now + shard.lease_s
                renewed.append(name)
        await ask.answer(control.Renewed(placements=renewed))

    def expire_leases(self, now: float) -> None:
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

    async def load(self, ask: Ask, req: control.LoadShard) -> None:
        name = req.placement
        shard = self.shards.get(name)
        if shard is None or shard.state != "prepared":
            raise CodedError("not_prepared", f"placement {name!r} was not prepared here")
        config = self.host.config
        spec = {
            "home": str(config.home),
            "placement": name,
            "model_dir": req.model_dir,
            "start": req.start,
            "end": req.end,
            "index": req.index,
            "count": req.count,
            "address": config.address,
            "data_port": shard.data_port,
            "client_port": shard.client_port,
            "next_endpoint": req.next_endpoint,
            "next_key": req.next_key,
            "prefill_chunk": req.prefill_chunk,
            "context_tokens": req.context_tokens,
            "streams": max(1, req.streams),
            "kv_bytes": req.kv_bytes,
            "model_digest": req.model_digest,
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
        run_dir = config.home / "shards"
        run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if req.group:
            try:
                member, member_env = tensor_member(req, config.address, run_dir / _safe(name))
            except (group.GroupError, ValueError) as exc:
                raise CodedError("bad_request", f"tensor group: {exc}") from None
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
        self.host.spawn(self.read_stderr(shard))
        await self.follow(ask, shard)

    async def unload(self, ask: Ask, req: control.Unload) -> None:
        await self.stop(req.placement)
        self.shards.pop(req.placement, None)
        await ask.answer(control.Unloaded(placement=req.placement))

    async def list(self, ask: Ask, req: control.ListShards) -> None:
        await ask.answer(control.Shards(shards=self.reports()))

    # ---- a runner, followed ------------------------------------------------------------------

    async def heartbeat(self, ask: Ask, shard: ShardProc) -> None:
        """Say "still loading" with the bytes so far while the shard process lives."""
        while True:
            await asyncio.sleep(LOAD_HEARTBEAT_S)
            if shard.state != "loading" or shard.proc is None or shard.proc.returncode is not None:
                return
            done, total = shard.progress
            await ask.answer(
                control.LoadProgress(placement=shard.placement, done=done, total=total)
            )

    async def follow(self, ask: Ask, shard: ShardProc) -> None:
        """Relay the runner's progress until it is ready or gone, then keep reading stats."""
        assert shard.proc is not None and shard.proc.stdout is not None
        heartbeat = asyncio.create_task(self.heartbeat(ask, shard))
        try:
            await self.relay(ask, shard)
        finally:
            heartbeat.cancel()

    async def relay(self, ask: Ask, shard: ShardProc) -> None:
        assert shard.proc is not None and shard.proc.stdout is not None
        answered = False
        async for event in _events(shard.proc.stdout, shard):
            answered = await self.on_runner_event(ask, shard, event, answered)
        await self.runner_gone(ask, shard, answered)

    async def on_runner_event(
        self, ask: Ask, shard: ShardProc, event: events.RunnerEvent, answered: bool
    ) -> bool:
        """Act on one event of a runner's output; return whether the load was answered."""
        match event:
            case events.Beat():
                shard.step_s = event.step_s
            case events.Loading():
                shard.progress = (event.done, event.total)
                if not answered:
                    await ask.answer(
                        control.LoadProgress(
                            placement=shard.placement, done=event.done, total=event.total
                        )
                    )
            case events.Ready():
                shard.state, shard.param_bytes = "ready", event.param_bytes
                log.info("shard %s ready, %d bytes", shard.placement, shard.param_bytes)
                await ask.answer(
                    control.ShardReady(
                        placement=shard.placement,
                        start=event.start,
                        end=event.end,
                        param_bytes=shard.param_bytes,
                    )
                )
                answered = True
            case events.Stats():
                shard.stats = event
            case events.Fatal():
                shard.message, shard.oom = event.message, event.out_of_memory
        return answered

    async def runner_gone(self, ask: Ask, shard: ShardProc, answered: bool) -> None:
        assert shard.proc is not None
        code = await shard.proc.wait()
        if shard.state == "stopped":
            return
        tail = "\n".join(shard.stderr_tail[-8:])
        shard.message = exit_reason(code, loading=not answered, fatal=shard.message)
        if tail and not shard.message.endswith(tail):
            shard.message += f"\n{tail}"
        shard.state = "failed"
        log.error("shard %s failed: %s", shard.placement, shard.message)
        if not answered:
            failure = load_failure(code, shard.oom)
            await ask.answer(control.Error(code=failure, message=shard.message))

    async def read_stderr(self, shard: ShardProc) -> None:
        assert shard.proc is not None and shard.proc.stderr is not None
        async for line in _lines(shard.proc.stderr, shard):
            text = line.decode(errors="replace").rstrip()
            shard.stderr_tail = [*shard.stderr_tail[-49:], text]
            log.info("[%s] %s", shard.placement, text)

    async def watch(self) -> None:
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
                judge(shard, now)
            self.expire_leases(now)
            self.host.jobs.judge(now)

    # ---- ports and stopping --------------------------------------------------------------

    def port_usable(self, port: int) -> bool:
        taken = self.ports_held() | self.host.jobs.ports_held()
        return 0 < port <= 65535 and port not in taken and port_free(self.host.config.address, port)

    async def stop(self, name: str) -> None:
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

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(n) for n in list(self.shards)))


def judge(shard: ShardProc, now: float) -> None:
    """A ready shard whose runner went quiet (or hangs in one step) is silent; a silent
    one heard again is ready."""
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


async def _lines(stream: asyncio.StreamReader, shard: ShardProc) -> AsyncIterator[bytes]:
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


async def _events(
    stream: asyncio.StreamReader, shard: ShardProc
) -> AsyncIterator[events.RunnerEvent]:
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
