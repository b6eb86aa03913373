"""The one owner of cluster state and of all I/O with the nodes.

Command-line verbs and the TUI drive the same Controller. It keeps a frozen
`ClusterState`, replaces it on every change and tells its listeners. Commands are
methods named in the imperative (`place`, `unload`, `generate`); what happened
is recorded in the state's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from studiotui.cluster import keys, model_files, model_sync, stops
from studiotui.cluster.draft import DraftRefused, check_draft, draft_bytes, with_draft
from studiotui.cluster.peers import AgentError, AgentUnreachable, Peer
from studiotui.core import benchmark
from studiotui.core.adapter_catalog import (
    AdapterRefused,
    adapter_placement_name,
    adapter_tensor,
    check_adapter,
)
from studiotui.core.errors import StudioError
from studiotui.core.forecast import (
    Chip,
    LastMeasured,
    chips_from_state,
    choose,
    last_measured,
    links_from_state,
    measured_bandwidths,
    with_benchmark,
)
from studiotui.core.inventory import Inventory, NodeSpec
from studiotui.core.load_watch import LoadWatch, node_gone
from studiotui.core.members import Member, jaccl_devices, members, rdma_link
from studiotui.core.model_facts import ModelDirError, ModelInfo, read_model, with_kv_quant
from studiotui.core.placement import (
    NodeBudget,
    Plan,
    Refusal,
    format_bytes,
    longest_context,
    with_adapter,
    with_prompt_cache,
)
from studiotui.core.state import (
    ClusterState,
    LinkState,
    LogEntry,
    LogLevel,
    NodeState,
    PlacementState,
    PlannedPlacement,
    PlannedShard,
    ShardState,
    newly_broken,
    node_start_hint,
    placements_from_shards,
    pushed,
    shard_from_report,
)
from studiotui.ssh.client import SshError
from worker.shared import probes
from worker.shared.adapters import FILES as ADAPTER_FILES
from worker.shared.adapters import WEIGHTS_NAME, Adapter
from worker.shared.kv_quant import DEFAULT_KV_GROUP_SIZE
from worker.shared.manifest import Hashing, manifest
from worker.shared.protocol import control, messages
from worker.shared.protocol.control import Error
from worker.shared.protocol.limits import DEFAULT_STREAMS
from worker.shared.protocol.messages import ErrorCode

DOWN_AFTER_S = 3.0
UNLOAD_QUIET_S = 10.0  # how long an unloaded placement's vanishing shards are expected
# What a shard process holds before any weight (Python, MLX, tokenizer): measured ~80 MB.
RUNNER_OVERHEAD_BYTES = 100 * 1024**2
HEALTH_CHECK_S = 2.0
# A placing controller renews its prepared shards this often while their files are
# copied: an agent drops one unrenewed for 5 min (control.PREPARED_LEASE_S), so
# the memory promised to a placement whose operator died mid-copy is not held for ever.
LEASE_RENEW_EVERY_S = 30.0
# How long a tensor group's leader's "a member is gone" waits for the agents to say which.
GROUP_LOST_WAIT_S = 2.0
# Once a stream is quiet this long, its placement's health is asked every second.
CHECK_EVERY_S = 1.0
# A head connection down for longer than this fails its streams (it usually comes
# back within a second or two, and the head keeps the replies for it meanwhile).
RECONNECT_GRACE_S = 5.0
LINKS_FIRST_S = 30.0
LINKS_EVERY_S = 300.0
LOG_KEEP = 500
STOPPED_BY_DOWN = "stopped by `studiotui down`"
Listener = Callable[[ClusterState], None]
Progress = Callable[[str, int, int], None]


def promised_bytes(shard: ShardState) -> int:
    """Memory a shard not loaded yet has been promised and does not hold yet: from the
    moment its placement was decided (prepare_shard, through the copy of its files)
    the plan's weights, less those already read once it loads, and its share of the
    adapter (applied once the weights are in). Loaded, it is in the node's report."""
    if shard.state not in ("prepared", "loading"):
        return 0
    done, size = shard.progress
    # Before the runner's first progress the plan's figure stands for the file's.
    return max(0, (size or shard.weight_bytes) - done) + shard.adapter_bytes


def committed_bytes(node: NodeState) -> int:
    """Memory a node has promised but not yet used: the KV caches and prompt caches its
    placements may still grow to, and what its shards not loaded yet will hold
    (promised_bytes)."""
    return sum(
        shard.kv_bytes + shard.prompt_cache_bytes + promised_bytes(shard) for shard in node.shards
    )


Pledges = Mapping[str, Mapping[str, int]]  # placement -> node -> bytes


def pledged_bytes(pledges: Pledges, node: NodeState) -> int:
    """Memory this controller has planned onto `node` for placements whose prepared
    shards the node has not reported yet (the round trip of prepare_shard): counted
    once, so a placement the node already reports is the report's, not the pledge's."""
    reported = {shard.placement for shard in node.shards}
    return sum(on.get(node.name, 0) for name, on in pledges.items() if name not in reported)


def promises_note(nodes: Sequence[NodeState], pledges: Pledges | None = None) -> str:
    """Who holds the memory of these nodes that their reports still show free: the
    placements not loaded yet, each with its promise per node, and what frees it; ""
    when there are none. Said beside a refusal, which otherwise reads as a mystery.
    `pledges`: this controller's placements not reported by their nodes yet."""
    held: dict[str, list[str]] = {}
    doing: dict[str, str] = {}
    for node in nodes:
        for name, on in (pledges or {}).items():
            mine = pledged_bytes({name: on}, node)
            if mine > 0:
                held.setdefault(name, []).append(f"{format_bytes(mine)} on {node.name}")
                doing.setdefault(name, "being prepared")
        for shard in node.shards:
            promised = shard.kv_bytes + shard.prompt_cache_bytes + promised_bytes(shard)
            if shard.state not in ("prepared", "loading") or promised <= 0:
                continue
            held.setdefault(shard.placement, []).append(f"{format_bytes(promised)} on {node.name}")
            if doing.get(shard.placement) != "copying its files":
                doing[shard.placement] = (
                    "copying its files" if shard.state == "prepared" else "loading"
                )
    parts = [
        f"placement {name!r} ({doing[name]}) is promised {', '.join(where)}"
        for name, where in held.items()
    ]
    if not parts:
        return ""
    # An operator killed while placing leaves its shards prepared until their lease
    # lapses (the agents drop them): say how to free them sooner.
    unload = f"studiotui unload {next(iter(held))}" if len(held) == 1 else "studiotui unload NAME"
    lease = f"{control.PREPARED_LEASE_S / 60:.0f} minutes"
    return (
        "; ".join(parts)
        + ": that memory is taken once it is loaded, or given back if it fails or is "
        + f"unloaded ({unload} if its placing was given up); a copy whose operator "
        + f"went away is given back after {lease}"
    )


def _tied(model_dir: Path) -> bool:
    try:
        return bool(json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings"))
    except (OSError, ValueError):
        return False


class PlacementError(StudioError, RuntimeError):
    pass


class PlacementRefused(PlacementError):
    """The plan refused the placement (`refusal` says what kind) when it was placed: the
    cluster changed since the preview, or memory another placement holds a promise on."""

    def __init__(self, message: str, refusal: Refusal) -> None:
        super().__init__(message)
        self.refusal = refusal


class GenerationError(StudioError, RuntimeError):
    """A request that got no answer (or no whole one); `code` the head's reason
    (messages.ErrorCode: bad_request for a refused request, busy, ...)."""

    def __init__(self, message: str, code: ErrorCode = "failed") -> None:
        super().__init__(message)
        self.code: ErrorCode = code


@dataclass(frozen=True)
class PlaceResult:
    plan: Plan
    placement: PlacementState


@dataclass(frozen=True)
class SavedShard:
    """A shard as its agent reported it before a restart, and where its ring goes on,
    enough to load it again in the same place (node, layers, ports)."""

    node: str
    placement: str
    report: control.ShardReport
    next_endpoint: str
    next_key: str


def saved_row(k: SavedShard) -> dict[str, Any]:
    """A saved shard as the files that keep them write it (`kept_shards`, `recorded`)."""
    return {
        "node": k.node,
        "placement": k.placement,
        "report": control.to_wire(k.report),
        "next_endpoint": k.next_endpoint,
        "next_key": k.next_key,
    }


def saved_from_row(row: Any) -> SavedShard:
    """Raises ValueError, TypeError, KeyError or MessageError for anything else."""
    return SavedShard(
        node=str(row["node"]),
        placement=str(row["placement"]),
        report=control.parse(row["report"], control.ShardReport),
        next_endpoint=str(row["next_endpoint"]),
        next_key=str(row["next_key"]),
    )


@dataclass(frozen=True)
class ReloadResult:
    placement: str
    ok: bool
    text: str


class Controller:
    def __init__(self, home: Path, inventory: Inventory) -> None:
        self.home = home
        self.inventory = inventory
        self.ctx = zmq.asyncio.Context()
        self.keys = keys.controller_keys(home)
        self.peers: dict[str, Peer] = {}
        self.state = ClusterState(
            name=inventory.name,
            nodes=tuple(
                NodeState(n.name, n.address, n.control_port, n.transport) for n in inventory.nodes
            ),
        )
        self.state = replace(self.state, links=self._load_links())
        # The ring each placement was planned on, kept until it is unloaded (and saved,
        # so a restarted TUI still knows a broken placement's nodes).
        self._planned: dict[str, PlannedPlacement] = self._read_planned()
        self._planned_mtime = self._planned_stamp()  # the saved file this _planned follows
        self._placing: set[str] = set()  # being loaded by this controller: not broken yet
        self._answered: set[str] = set()  # placements seen ready in this session
        # What a placement being decided holds on each node until the node reports its
        # prepared shard: a preview in that round trip must not offer the same memory.
        self._pledges: dict[str, dict[str, int]] = {}
        # The lease its prepared shards ask for (None: the agent's, 5 min); renewed
        # every lease_renew_s while their files are copied (see keep_leases).
        self.lease_s: float | None = None
        self.lease_renew_s = LEASE_RENEW_EVERY_S
        # How long a tensor group's ranks wait for one another to start (each told it
        # with its load; meanwhile the agents' heartbeats keep the load alive).
        self.join_s = join_seconds(os.environ)
        self._listeners: list[Listener] = []
        # Placements going away on purpose (unload, rollback), until when: their shards
        # vanish one node at a time, which must not read as "broken".
        self._unloading: dict[str, float] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._subs: dict[str, zmq.asyncio.Socket] = {}
        self.telemetry_dropped = 0
        # While a benchmark runs (links_quiet) the periodic link measurement waits: it
        # shares the wire and the CPUs with the figures being taken. One under way
        # (holding _periodic) finishes before the benchmark starts.
        self._quiet = 0
        self._links_allowed = asyncio.Event()
        self._links_allowed.set()
        self._periodic = asyncio.Lock()
        # One routing identity per peer for this session: after a reconnect the agent
        # or head knows the socket as the same client (see peers.Peer).
        self.session = uuid.uuid4().hex[:16]

    # ---- state --------------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _set(self, state: ClusterState) -> None:
        self.state = state
        for listener in list(self._listeners):
            listener(state)

    def _update_node(self, name: str, **changes: Any) -> None:
        nodes = tuple(replace(n, **changes) if n.name == name else n for n in self.state.nodes)
        self._follow_planned(nodes)
        placements = self._in_view(placements_from_shards(nodes, self._planned, self._placing))
        broken = newly_broken(self.state.placements, placements)
        was_down = {p.name for p in self.state.placements if p.state in ("broken", "failed")}
        self._set(replace(self.state, nodes=nodes, placements=placements))
        for placement, why in broken:
            if self._unloading.get(placement.name, 0.0) < time.monotonic():
                hint = _not_ready_hint(placement, self.state.nodes)
                # The operator's own `down` stopped its nodes: said, not an error.
                level: LogLevel = "info" if _stopped_by_down(placement, nodes) else "error"
                self.record(
                    f"placement {placement.name!r} is {placement.state}: {why}; {hint}", level
                )
        for placement in placements:
            if placement.state != "ready":
                continue
            # Only what this session saw answer before: a placement found ready as its
            # nodes report one by one (a dashboard just opened) never stopped answering.
            if placement.name in was_down and placement.name in self._answered:
                self.record(f"placement {placement.name!r} answers again")
            self._answered.add(placement.name)

    def mark_provisioning(self, names: list[str]) -> None:
        """Show `names` as being provisioned until the next refresh says otherwise."""
        for name in names:
            self._update_node(name, state="provisioning")

    def record(self, text: str, level: LogLevel = "info") -> None:
        entry = LogEntry(time=time.time(), level=level, text=text)
        self._set(replace(self.state, log=(*self.state.log[-(LOG_KEEP - 1) :], entry)))

    # ---- connections ---------------------------------------------------------------------

    def spec(self, name: str) -> NodeSpec:
        return self.inventory.node(name)

    def peer(self, name: str) -> Peer:
        if name not in self.peers:
            node = self.spec(name)
            self.peers[name] = Peer(
                self.ctx,
                node.control_endpoint,
                self.keys,
                keys.node_public_key(self.home, name),
                name,
                identity=self._identity(name),
            )
        return self.peers[name]

    def _identity(self, key: str) -> bytes:
        # Routing identities are at most 255 bytes and must not start with a zero byte.
        return f"studiotui:{self.session}:{key}".encode()[:255]

    async def start(self, telemetry: bool = True) -> None:
        await self.refresh()
        if telemetry:
            self._start_telemetry()

    def _start_telemetry(self) -> None:
        from worker.shared.protocol.curve import make_client

        for node in self.inventory.nodes:
            # One SUB per node: a sample is that node's because of the connection it
            # came on, whatever name it carries.
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"telemetry")
            sub.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES + 64)
            make_client(sub, self.keys, keys.node_public_key(self.home, node.name))
            sub.connect(node.telemetry_endpoint)
            self._subs[node.name] = sub
            self._tasks.append(asyncio.create_task(self._read_telemetry(node.name, sub)))
        self._tasks.append(asyncio.create_task(self._watch_liveness()))
        self._tasks.append(asyncio.create_task(self._measure_periodically()))

    async def _measure_periodically(self) -> None:
        await asyncio.sleep(LINKS_FIRST_S)
        while True:
            # Due during a benchmark: measured once it ends.
            await self._links_allowed.wait()
            async with self._periodic:
                if not self._links_allowed.is_set():
                    continue  # a benchmark began while this waited for the lock
                try:
                    await self.measure_links()
                except Exception as exc:  # a failed measurement must not stop the loop
                    self.record(f"link measurement failed: {exc}", "warning")
            await asyncio.sleep(LINKS_EVERY_S)

    @contextlib.asynccontextmanager
    async def links_quiet(self) -> AsyncIterator[None]:
        """No periodic link measurement inside this block (a benchmark): one under way
        finishes first, and one that comes due meanwhile runs when the last such block
        ends."""
        self._quiet += 1
        self._links_allowed.clear()
        try:
            async with self._periodic:
                pass
            yield
        finally:
            self._quiet -= 1
            if not self._quiet:
                self._links_allowed.set()

    async def _read_telemetry(self, name: str, sub: zmq.asyncio.Socket) -> None:
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
                self._apply_telemetry(name, msg)
            except (messages.MessageError, KeyError, TypeError, ValueError, AttributeError) as exc:
                # One bad sample is dropped; the node's next one is read as usual.
                self.telemetry_dropped += 1
                if self.telemetry_dropped in (1, 10, 100, 1000):
                    self.record(
                        f"dropped a malformed telemetry message from {name} ({exc}); "
                        f"{self.telemetry_dropped} so far",
                        "warning",
                    )

    def _apply_telemetry(self, name: str, msg: control.Telemetry) -> None:
        node = self.state.node(name)
        if node is None:
            return
        was = node.state
        node = node.with_sample(msg.memory_used, msg.memory_total, time.time())
        facts = msg.facts
        shards = tuple(shard_from_report(name, s) for s in msg.shards)
        power, pressure = msg.power, msg.pressure
        self._update_node(
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
            power_w=power.get("total_w"),
            chip=str(facts.get("chip", node.chip)),
            os=str(facts.get("os", node.os)),
            facts=facts,
            shards=shards,
            message="",
        )
        if was != "up":
            self.record(f"{name} is up ({msg.version or '?'})")

    async def _watch_liveness(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            silent = [
                n for n in self.state.nodes if n.state == "up" and now - n.last_seen > DOWN_AFTER_S
            ]
            recorded = stops.read_stops(self.home, self.inventory.name) if silent else {}
            for node in silent:
                when = stops.stopped_at(recorded, node.name, node.last_seen)
                if when is not None:
                    # The operator's `down` (from another terminal): said as such, not
                    # as a fault to mend.
                    said = f"{STOPPED_BY_DOWN} at {_clock(when)}"
                    self._update_node(node.name, state="down", shards=(), message=said)
                    self.record(
                        f"{node.name} is {said}; `studiotui up` or r starts it again, "
                        "with the shards it held"
                    )
                    continue
                since = _clock(node.last_seen)
                quiet = f"silent since {since} (no telemetry for {DOWN_AFTER_S:g} s)"
                # Its shards may well be serving still (a stopped agent, a blip):
                # the planned ring keeps the placement, and the words say so.
                self._update_node(node.name, state="down", shards=(), message=quiet)
                self.record(
                    f"{node.name} is down: {quiet}; it is used again as soon as it "
                    f"answers; if it stays silent, restart it "
                    f"(r, or studiotui restart {node.name})",
                    "error",
                )

    async def refresh(self, timeout: float = 2.0) -> ClusterState:
        """Ask every agent who it is and what it runs."""
        results = await asyncio.gather(
            *(self._hello(n.name, timeout) for n in self.inventory.nodes), return_exceptions=True
        )
        for node, result in zip(self.inventory.nodes, results, strict=True):
            if isinstance(result, BaseException):
                self._update_node(node.name, state="down", shards=(), message=str(result))
        return self.state

    async def _hello(self, name: str, timeout: float) -> None:
        reply = await self.peer(name).ask("hello", control.HelloReply, timeout=timeout)
        before = self.state.node(name)
        if before is not None and before.state != "up":
            self.record(f"{name} is up ({reply.version})")
        facts = reply.facts
        shards = tuple(shard_from_report(name, s) for s in reply.shards)
        self._update_node(
            name,
            state="up",
            version=reply.version,
            memory_total=reply.memory_total or int(facts.get("memory_total", 0)),
            memory_used=reply.memory_used,
            chip=str(facts.get("chip", "")),
            os=str(facts.get("os", "")),
            facts=facts,
            shards=shards,
            last_seen=time.time(),
            message="",
        )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for peer in self.peers.values():
            await peer.aclose()
        for sub in self._subs.values():
            sub.close(linger=0)
        self.ctx.term()

    # ---- placement -----------------------------------------------------------------------

    def preview(
        self,
        model_dir: Path,
        nodes: list[str],
        context_tokens: int = 4096,
        streams: int | None = None,
        tensor: int | None = None,
        adapter: Adapter | None = None,
        kv_bits: int = 0,
        kv_group_size: int | None = DEFAULT_KV_GROUP_SIZE,
        prompt_cache: int | None = None,
        prompt_cache_disk: int | None = None,
        draft: str = "",
        draft_dir: Path | None = None,
        draft_tokens: int = 0,
    ) -> tuple[ModelInfo, Plan | Refusal]:
        """The plan for `streams` requests at once; None: as many as fit, up to
        DEFAULT_STREAMS (the preview shows how many that is), else the refusal for one.
        `tensor`: nodes per stage (forecast.choose); None: the fastest shape that fits.
        `adapter` (checked already): each layer's share of it counts on its shard.
        `kv_bits` (8 or 4): the KV sized, and later kept, quantized (shared.kv_quant);
        settings the model cannot take are a Refusal (None group size: one that
        divides its heads, kv_quant.group_size_for). `prompt_cache`,
        `prompt_cache_disk`: the placement's prompt-cache budget in bytes (None: what the
        plan can spare, placement.with_prompt_cache), counted in each node's memory.
        `draft` ("lookup", or "model" with `draft_dir`): speculative decoding, refused
        here in words when the draft's tokenizer or the model's caches do not allow it;
        a draft model's weights count on the head node."""
        model_files.check_model_dir(model_dir)  # before any header is read: nothing outside it is
        info = read_model(model_dir)
        try:
            info, kv_notes, kv_group_size = with_kv_quant(info, kv_bits, kv_group_size)
        except ModelDirError as exc:
            return info, Refusal(str(exc), "shape")
        if adapter is not None:
            adapted = with_adapter(info.facts, adapter.bytes_by_layer(info.n_layers))
            info = replace(info, facts=adapted)
        if info.unsupported:
            # Refused here, before the plan and so before any file is copied to a node.
            return info, Refusal(f"{info.name} cannot run on a shard: {info.unsupported}", "model")
        budgets = self._budgets(nodes)
        if isinstance(budgets, Refusal):
            return info, budgets
        links = links_from_state(self.state)
        chips = self.node_chips(nodes)
        tried = [streams] if streams is not None else range(DEFAULT_STREAMS, 0, -1)
        for n in tried:
            verdict = choose(
                info.facts,
                budgets,
                links,
                chips,
                tensor=tensor,
                context_tokens=context_tokens,
                streams=n,
            ).verdict
            if isinstance(verdict, Plan):
                verdict = with_prompt_cache(verdict, prompt_cache, prompt_cache_disk)
            if isinstance(verdict, Plan):
                break
        if draft:
            try:
                problem = check_draft(model_dir, draft, draft_dir, draft_tokens)
            except DraftRefused as exc:
                problem = str(exc)
            if problem:
                return info, Refusal(problem, "model")
            if draft == "model" and draft_dir is not None:
                verdict = with_draft(verdict, draft_bytes(draft_dir))
        if isinstance(verdict, Refusal):
            group = [s for name in nodes if (s := self.state.node(name)) is not None]
            if note := promises_note(group, self._pledges):
                verdict = Refusal(f"{verdict.reason} ({note})", verdict.kind)
        else:
            verdict = replace(
                verdict,
                kv_bits=kv_bits,
                kv_group_size=kv_group_size,
                notes=(*verdict.notes, *kv_notes),
            )
        return info, verdict

    def _budgets(self, nodes: Sequence[str]) -> list[NodeBudget] | Refusal:
        """What each node can take now (`_room`), or why one cannot take anything."""
        budgets = []
        for name in nodes:
            node = self.state.node(name)
            if node is None:
                return Refusal(f"unknown node {name!r}", "node")
            if node.state != "up":
                return Refusal(f"{name} is {node.state}: {node_start_hint(name)}", "node")
            free = max(0, self._room(node))
            budgets.append(NodeBudget(name, free, node.memory_total))
        return budgets

    def context_offer(
        self,
        model_dir: Path,
        nodes: list[str],
        streams: int = 1,
        tensor: int = 1,
        kv_bits: int = 0,
        kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    ) -> int:
        """The longest context these nodes hold for `streams` requests at once, as the
        planner places it now (the memory their reports and promises leave), with the KV
        at `kv_bits`; 0: none. A ModelDirError for a model or settings it cannot take."""
        info, _, _ = with_kv_quant(read_model(model_dir), kv_bits, kv_group_size)
        budgets = self._budgets(nodes)
        if isinstance(budgets, Refusal):
            return 0
        links = links_from_state(self.state)
        return longest_context(info.facts, budgets, links, streams=streams, tensor=tensor)

    @property
    def pledges(self) -> Pledges:
        """The placements this controller is deciding, by node, until their nodes
        report the prepared shards (a copy: for views and tests)."""
        return {name: dict(on) for name, on in self._pledges.items()}

    def _room(self, node: NodeState) -> int:
        """What a new shard may still take on `node`: its free memory less what is
        promised there (reported or only pledged by this controller) and a runner."""
        return (
            node.memory_free
            - committed_bytes(node)
            - pledged_bytes(self._pledges, node)
            - RUNNER_OVERHEAD_BYTES
        )

    def node_chips(self, nodes: Sequence[str]) -> dict[str, Chip]:
        """What the forecast knows of each node's speed: its chip, or a bandwidth its
        agent reports or the newest saved benchmark run of this cluster measured."""
        runs = benchmark.saved(self.home)
        measured = measured_bandwidths(runs, self.inventory.name)
        chips = chips_from_state(self.state, nodes, measured)
        return with_benchmark(chips, runs, self.inventory.name)

    def last_measured(self, model: str, shape: str) -> LastMeasured | None:
        """What the newest saved benchmark of this cluster measured for `model` on
        `shape` (one stream's decode tok/s), shown beside the forecast."""
        return last_measured(benchmark.saved(self.home), self.inventory.name, model, shape)

    async def place(
        self,
        model_dir: Path,
        nodes: list[str] | None = None,
        name: str | None = None,
        progress: Progress | None = None,
        prefill_chunk: int = 512,
        context_tokens: int = 4096,
        expected: Plan | None = None,
        streams: int | None = None,
        adapter_dir: Path | None = None,
        tensor: int | None = None,
        hashing: Hashing | None = None,
        kv_bits: int = 0,
        kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
        prompt_cache: int | None = None,
        prompt_cache_disk: int | None = None,
        draft_dir: str = "",
        draft: str = "",
        draft_tokens: int = 0,
    ) -> PlaceResult:
        """Plan and load; with `expected` (the plan a preview showed), load exactly that
        plan if it still fits, else refuse rather than load something else. With
        `adapter_dir`, the shards apply that mlx-lm adapter to the layers it adapts;
        an adapter of another model, or malformed, is refused before anything moves.
        `hashing(done, total)` hears, from a worker thread, the model's first hashing
        for a copy to a remote node (every byte once; cached beside the files after)."""
        model_dir = model_dir.expanduser().resolve()
        adapter = None
        if adapter_dir is not None:
            adapter_dir = adapter_dir.expanduser().resolve()
            adapter = await asyncio.to_thread(self.check_adapter, adapter_dir, model_dir)
            try:
                tensor = adapter_tensor(tensor)  # pipeline stages only
            except AdapterRefused as exc:
                raise PlacementError(str(exc)) from None
            self.record(
                f"adapter {adapter.name} matches {model_dir.name} (layers {_spans(adapter)})"
            )
        await self.refresh()
        nodes = nodes or [n.name for n in self.state.nodes if n.state == "up"]
        name = name or (
            adapter_placement_name(model_dir, adapter_dir) if adapter_dir else model_dir.name
        )
        if self.state.placement(name) is not None:
            raise PlacementError(f"a placement named {name!r} exists; unload it or pick --name")
        # --draft DIR is a draft model; "lookup" (or draft="lookup") prompt lookup.
        if draft_dir and not draft:
            draft = "lookup" if draft_dir == "lookup" else "model"
        guesser = Path(draft_dir).expanduser().resolve() if draft == "model" else None
        info, the_plan = self.preview(
            model_dir,
            nodes,
            context_tokens,
            streams,
            tensor,
            adapter,
            kv_bits,
            kv_group_size,
            prompt_cache,
            prompt_cache_disk,
            draft,
            guesser,
            draft_tokens,
        )
        if expected is not None:
            problem = self._no_longer_fits(expected)
            if problem:
                raise PlacementError(f"the cluster changed since the preview: {problem}")
            the_plan = expected
        if isinstance(the_plan, Refusal):
            raise PlacementRefused(f"cannot place {info.name}: {the_plan.reason}", the_plan)
        try:
            procs = members(the_plan)
        except ValueError as exc:
            raise PlacementError(f"cannot place {info.name}: {exc}") from None
        with_adapter = f" with adapter {adapter.name}" if adapter else ""
        self.record(
            f"placing {info.name}{with_adapter} as {name!r} on {', '.join(m.node for m in procs)}"
        )
        self._unloading.pop(name, None)  # placed again under a name just unloaded
        # Every node of a tensor-group stage is remembered with the stage's layers, so
        # the placement's shape ("2 stages × 2") is known from its ring alone.
        ring = tuple(
            PlannedShard(node, s.start, s.end, s.backend or "")
            for s in the_plan.shards
            for node in s.nodes
        )
        self._placing.add(name)
        pledge = self._pledges.setdefault(name, {})
        for shard in the_plan.shards:
            for node in shard.nodes:
                pledge[node] = (
                    shard.weight_bytes
                    + shard.kv_bytes
                    + shard.adapter_bytes
                    + shard.prompt_cache_bytes
                    + shard.draft_bytes
                )
        planned = PlannedPlacement(str(model_dir), ring, placed_at=int(time.time()))
        if adapter is not None:
            planned = replace(planned, adapter_dir=str(adapter.path), adapter=adapter.name)
        self._remember_plan(name, planned)
        try:
            speculation = (draft, guesser, draft_tokens)
            await self._deploy(
                the_plan, model_dir, name, progress, prefill_chunk, adapter, hashing, speculation
            )
            self._placing.discard(name)
            placed = await self._deployed(the_plan, name)
        except (AgentError, AgentUnreachable, PlacementError, SshError) as exc:
            # SshError: the operator's copy over SFTP could not reach the node; its
            # prepared shards (and the memory promised to them) are given back too.
            self.record(f"placement {name!r} failed, rolling back: {exc}", "error")
            await self._roll_back(name, [m.node for m in procs])
            raise PlacementError(f"placement {name!r} failed and was rolled back: {exc}") from None
        except asyncio.CancelledError:
            # Interrupted (Ctrl-C on `place`, the dashboard quitting): what was loaded so
            # far is unloaded, as after a failure, rather than left half made with nobody
            # watching it (a load under way would otherwise finish and stay).
            self.record(f"placement {name!r} interrupted, rolling back", "warning")
            await asyncio.shield(self._roll_back(name, [m.node for m in procs]))
            raise
        finally:
            self._placing.discard(name)
            self._pledges.pop(name, None)
        await self._record_shards(name)
        self.record(f"placement {name!r} is ready")
        return PlaceResult(plan=the_plan, placement=placed)

    async def _deployed(self, the_plan: Plan, name: str) -> PlacementState:
        """The placement as the nodes now report it, if every planned shard is there.

        A node can die after its shard said ready and before the others finished,
        faster than the load watchdog notices: ask them all once more. One that does
        not answer in time but keeps its connection is asked again, as the watchdog
        would (`node_gone`): a busy node is not a lost one."""
        started = time.monotonic()
        while True:
            await self.refresh()
            placed = self.state.placement(name)
            lost = [
                m.node for m in members(the_plan) if placed is None or m.node not in placed.nodes
            ]
            if placed is not None and not lost:
                return placed
            now = time.monotonic()
            # A node that answers without its shard has lost it; one that does not
            # answer is given the watchdog's time.
            answered = {n.name for n in self.state.nodes if n.state == "up"}
            if any(
                n in answered or node_gone(n, self.peer(n).down_for(), now - started) for n in lost
            ):
                break
            await asyncio.sleep(CHECK_EVERY_S)
        raise PlacementError(f"{', '.join(lost)} stopped answering while the shards loaded")

    def _no_longer_fits(self, expected: Plan) -> str | None:
        for shard, name in ((s, n) for s in expected.shards for n in s.nodes):
            # Every node of a tensor group holds the same share (its byte figures).
            node = self.state.node(name)
            if node is None or node.state != "up":
                return f"{name} is not up"
            adds = shard.free_before - shard.free_after
            room = self._room(node)
            if adds > room:
                note = promises_note([node], self._pledges)
                return (
                    f"{name} now has {format_bytes(max(room, 0))} free, the plan needs "
                    f"{format_bytes(adds)} there; preview again"
                ) + (f" ({note})" if note else "")
        return None

    async def _deploy(
        self,
        the_plan: Plan,
        model_dir: Path,
        name: str,
        progress: Progress | None,
        prefill_chunk: int,
        adapter: Adapter | None = None,
        hashing: Hashing | None = None,
        speculation: tuple[str, Path | None, int] = ("", None, 0),
    ) -> None:
        shards = the_plan.shards
        procs = members(the_plan)
        prepared = await asyncio.gather(
            *(
                self.peer(m.node).ask(
                    "prepare_shard",
                    control.Prepared,
                    placement=name,
                    tensor=bool(m.group),
                    # Promised from here, through the copy, until loaded (committed_bytes).
                    weight_bytes=shards[m.stage].weight_bytes,
                    kv_bytes=shards[m.stage].kv_bytes,
                    adapter_bytes=shards[m.stage].adapter_bytes,
                    prompt_cache_bytes=shards[m.stage].prompt_cache_bytes,
                    lease_s=self.lease_s,
                )
                for m in procs
            )
        )
        port = {m.node: p for m, p in zip(procs, prepared, strict=True)}
        # The prepared shards, with their promise, in this controller's state now rather
        # than at the next telemetry: a preview made during the copy counts them.
        await asyncio.gather(*(self._hello(n, 2.0) for n in dict.fromkeys(port)))
        self._pledges.pop(name, None)  # the nodes' reports hold the promise from here
        count = len(shards)
        # The copies may take hours: the shards' leases renewed until they load.
        keeper = asyncio.create_task(self.keep_leases(name, list(port), self.lease_renew_s))
        try:
            dirs = await self._model_dirs(procs, model_dir, progress, hashing)
            adapter_dirs = await self._adapter_dirs(procs, adapter, progress) if adapter else {}
            draft, guesser, draft_tokens = speculation
            head = next(m for m in procs if m.stage == 0 and m.rank == 0)
            draft_at = ""
            if guesser is not None:
                # The draft model goes whole to the head node, as a model's files do.
                whole = [Member(0, 0, head.node, 0, read_model(guesser).n_layers, (), None)]
                draft_at = (await self._model_dirs(whole, guesser, progress, hashing))[head.node]
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        leaders = [next(m for m in procs if m.stage == i and m.rank == 0) for i in range(count)]

        async def load(m: Member) -> None:
            nxt = leaders[(m.stage + 1) % count]
            endpoint = f"tcp://{self.spec(nxt.node).address}:{port[nxt.node].data_port}"
            # No fixed wait: the agent heartbeats while the shard loads, and only its
            # silence (see LoadWatch) ends a load, however slow the disk.
            quiet = LoadWatch(m.node, time.monotonic())
            stream = self.peer(m.node).stream(
                "load_shard",
                timeout=quiet.silence_s,
                placement=name,
                model_dir=dirs[m.node],
                start=m.start,
                end=m.end,
                index=m.stage,
                count=count,
                data_port=port[m.node].data_port,
                client_port=port[m.node].client_port,
                next_endpoint=endpoint,
                next_key=keys.node_public_key(self.home, nxt.node).decode(),
                prefill_chunk=prefill_chunk,
                context_tokens=the_plan.context_tokens,
                streams=the_plan.streams,
                kv_bytes=shards[m.stage].kv_bytes,
                **self._group_fields(m, port),
                adapter=adapter.name if adapter else "",
                adapter_dir=adapter_dirs.get(m.node, ""),
                adapter_bytes=shards[m.stage].adapter_bytes,
                kv_bits=the_plan.kv_bits,
                kv_group_size=the_plan.kv_group_size,
                prompt_cache_bytes=shards[m.stage].prompt_cache_bytes,
                prompt_cache_disk_bytes=shards[m.stage].prompt_cache_disk_bytes,
                **(
                    {"draft": draft, "draft_dir": draft_at, "draft_tokens": draft_tokens}
                    if m is head
                    else {}
                ),
            )
            try:
                async for msg in stream:
                    if isinstance(msg, control.LoadProgress):
                        quiet = quiet.hear(time.monotonic(), msg.done, msg.total)
                        if progress:
                            progress(m.node, msg.done, msg.total)
                    elif isinstance(msg, control.ShardReady):
                        quiet = quiet.hear(time.monotonic())
                        if progress:
                            progress(m.node, msg.param_bytes, msg.param_bytes)
                    else:
                        quiet = quiet.hear(time.monotonic())
            except AgentUnreachable:
                silent = quiet.overdue(time.monotonic())
                raise PlacementError(silent or f"{m.node} stopped answering") from None

        loads = [asyncio.ensure_future(load(m)) for m in procs]
        watch = asyncio.create_task(self._watch_nodes([m.node for m in procs]))
        waiting: set[asyncio.Future[Any]] = {*loads, watch}
        problem = ""
        while not problem and any(not t.done() for t in loads):
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if watch in done:
                problem = watch.result()
            elif errors := [t.exception() for t in done if t.exception() is not None]:
                # Give up at the first failure: a tensor group's other members would wait
                # for the failed one in mx.distributed's join for ever.
                problem = "; ".join(str(e) for e in errors)
        for task in (*loads, watch):
            task.cancel()
        await asyncio.gather(*loads, watch, return_exceptions=True)
        if problem:
            raise PlacementError(problem)

    def _group_fields(self, m: Member, port: dict[str, control.Prepared]) -> dict[str, Any]:
        """What a tensor group's member needs besides a shard's fields: the group (rank
        order), every member's bridge address and mx.distributed port (the agent writes
        the hostfile from them), the backend; the leader gets its followers' mirror
        endpoints, a follower its leader's key. Nothing for a one-node stage."""
        if not m.group:
            return {}
        fields: dict[str, Any] = {
            "group": list(m.group),
            "rank": m.rank,
            "backend": m.backend or "ring",
            "group_addresses": [self.spec(n).address for n in m.group],
            "group_ports": [port[n].group_port for n in m.group],
            "join_s": self.join_s,
        }
        if m.backend == "jaccl":
            rdma = {
                n: (node.facts.get("rdma") or {}) for n in m.group if (node := self.state.node(n))
            }
            devices = jaccl_devices(m.group, rdma)
            if isinstance(devices, str):
                raise PlacementError(f"JACCL for {', '.join(m.group)}: {devices}")
            fields["devices"] = devices
        if m.rank == 0:
            fields["followers"] = [
                [f"tcp://{self.spec(n).address}:{port[n].data_port}", self._key(n)]
                for n in m.group[1:]
            ]
        else:
            fields["leader_key"] = self._key(m.group[0])
        return fields

    def _key(self, node: str) -> str:
        return keys.node_public_key(self.home, node).decode()

    async def _model_dirs(
        self,
        shards: Any,
        model_dir: Path,
        progress: Progress | None,
        hashing: Hashing | None = None,
    ) -> dict[str, str]:
        """Where each node finds the model: the operator's path on this machine, else a
        folder holding (by content) the files its layers need, reused where it already
        is, copied from another node that has them, or from the operator
        (`model_sync`)."""
        where = {s.node: str(model_dir) for s in shards if self.spec(s.node).is_local}
        config = read_model(model_dir)
        tied = config.facts.head_bytes > 0 and _tied(model_dir)
        needs: dict[str, dict[str, model_files.NeededFile]] = {}
        for s in shards:
            if s.node not in where:
                found = model_files.needed_files(model_dir, s.start, s.end, config.n_layers, tied)
                needs.setdefault(s.node, {}).update({f.name: f for f in found})
        if needs:
            wanted = {node: list(files.values()) for node, files in needs.items()}
            try:
                where |= await model_sync.provide(
                    self, model_dir, wanted, progress, hashing=hashing
                )
            except (model_sync.SyncRefused, model_files.ModelFilesError) as exc:
                raise PlacementError(str(exc)) from None
        return where

    def check_adapter(
        self, adapter_dir: Path, model_dir: Path, on_progress: Hashing | None = None
    ) -> Adapter:
        """The adapter, if it can be placed with this model; else PlacementError naming
        what and what to do. Headers and (cached) hashes only: nothing copied or loaded;
        the first check of a base hashes all of it (`on_progress(done, total)` in bytes).
        Records nothing: it runs in a worker thread, and listeners expect the loop's."""
        model_files.check_model_dir(model_dir)
        info = read_model(model_dir)
        try:
            adapter = check_adapter(adapter_dir, model_dir, info, on_progress)
        except AdapterRefused as exc:
            raise PlacementError(f"cannot place {info.name} with {adapter_dir}: {exc}") from None
        return adapter

    async def _adapter_dirs(
        self, shards: Any, adapter: Adapter, progress: Progress | None
    ) -> dict[str, str]:
        """Where each node whose layers the adapter touches finds its files: the
        operator's path on this machine, else a copy (by content, as model files are)
        under the node's `models/<adapter>@<hash>`. A node whose layers it does not
        touch gets nothing: its layers are the base model's."""
        touched = [s for s in shards if adapter.touches(s.start, s.end)]
        where = {s.node: str(adapter.path) for s in touched if self.spec(s.node).is_local}
        remote = sorted({s.node for s in touched if s.node not in where})
        if remote:
            ids = await asyncio.to_thread(manifest, adapter.path, ADAPTER_FILES)
            weights = ids[WEIGHTS_NAME].sha256
            files = [model_files.NeededFile(f.name, f.size) for f in ids.values()]
            try:
                where |= await model_sync.provide(
                    self,
                    adapter.path,
                    {node: files for node in remote},
                    progress,
                    folder=f"{adapter.name}@{weights[:12]}",
                )
            except (model_sync.SyncRefused, model_files.ModelFilesError) as exc:
                raise PlacementError(str(exc)) from None
        return where

    async def renew_leases(self, name: str, nodes: Sequence[str]) -> list[str]:
        """Renew the leases of `name`'s prepared shards on `nodes`; the nodes that no
        longer hold one prepared (a node not answering is left to the load's watch)."""
        replies = await asyncio.gather(
            *(self.peer(n).ask("renew_shards", control.Renewed, placements=[name]) for n in nodes),
            return_exceptions=True,
        )
        return [
            node
            for node, reply in zip(nodes, replies, strict=True)
            if isinstance(reply, control.Renewed) and name not in reply.placements
        ]

    async def keep_leases(self, name: str, nodes: Sequence[str], every: float) -> None:
        """Renew `name`'s prepared shards on `nodes` every `every` seconds until
        cancelled: while this controller copies their files, they stay prepared."""
        kept = list(nodes)
        while kept:
            await asyncio.sleep(every)
            for node in await self.renew_leases(name, kept):
                self.record(
                    f"{node} no longer holds {name!r} prepared (its lease lapsed?)", "warning"
                )
                kept.remove(node)

    async def _watch_nodes(self, nodes: list[str]) -> str:
        """Return (only) when one of `nodes` is gone (see `node_gone`), saying which."""
        heard = dict.fromkeys(nodes, time.monotonic())
        while True:
            await asyncio.sleep(HEALTH_CHECK_S)
            replies = await asyncio.gather(
                *(self.peer(n).request("hello", timeout=HEALTH_CHECK_S) for n in nodes),
                return_exceptions=True,
            )
            now = time.monotonic()
            for node, reply in zip(nodes, replies, strict=True):
                if not isinstance(reply, BaseException):
                    heard[node] = now
                gone = node_gone(node, self.peer(node).down_for(), now - heard[node])
                if gone:
                    return gone

    async def unload(self, name: str) -> None:
        await self.refresh()
        placement = self.state.placement(name)
        if placement is None:
            known = ", ".join(p.name for p in self.state.placements) or "none"
            raise PlacementError(f"no placement named {name!r} (known: {known})")
        # Forgotten first: a dashboard watching reads that before a shard stops.
        self._unloading[name] = time.monotonic() + UNLOAD_QUIET_S
        self._remember_plan(name, None)
        await self._unload_everywhere(name, list(placement.nodes))
        await self.refresh()
        self.record(f"placement {name!r} unloaded")

    def forget_placements_on(self, stopped: list[str]) -> list[str]:
        """After `down`: placements whose every node was stopped are gone, not broken."""
        gone = [
            name
            for name, plan in self._planned.items()
            if all(s.node in stopped for s in plan.shards)
        ]
        for name in gone:
            self._remember_plan(name, None)
        return gone

    def _follow_planned(self, nodes: tuple[NodeState, ...]) -> None:
        """Follow the rings other processes (the CLI, another dashboard) saved.

        One they placed joins once its shards report (its saved ring keeps a node of it
        that goes down in view); one they unloaded leaves, and its shards stopping are
        an unload, not a breakage. Their plan is forgotten before the shards stop (see
        `unload`), so the change is read before the first stopped shard is."""
        reported = {s.placement for n in nodes for s in n.shards}
        stamp = self._planned_stamp()
        if stamp == self._planned_mtime and reported <= self._planned.keys():
            return
        saved = self._read_planned()
        self._planned_mtime = stamp
        for name in self._planned.keys() - saved.keys() - self._placing:
            self._unloading[name] = time.monotonic() + UNLOAD_QUIET_S
        for name in saved.keys() - self._planned.keys():
            # Placed again (elsewhere) since its unload: in view at once, not after the
            # unload's quiet time (an API server said "no longer loaded" meanwhile).
            self._unloading.pop(name, None)
        # A ring saved before its shards report stays out: it would read as broken.
        known = self._planned.keys() | reported | self._placing
        self._planned = {k: v for k, v in saved.items() if k in known}

    def _planned_file(self) -> Path:
        return self.home / f"placements-{self.inventory.name}.json"

    def _planned_stamp(self) -> int:
        try:
            return self._planned_file().stat().st_mtime_ns
        except OSError:
            return 0  # none saved yet

    def _read_planned(self) -> dict[str, PlannedPlacement]:
        try:
            raw = json.loads(self._planned_file().read_text())
            return {str(k): PlannedPlacement.from_json(v) for k, v in raw.items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}  # none saved yet, or damaged: placements show as reported

    def _remember_plan(self, name: str, plan: PlannedPlacement | None) -> None:
        """Record (or forget) a placement's ring, merging with what other processes
        (the CLI, another dashboard) saved since, and show the result."""
        planned = self._read_planned()
        if plan is None:
            planned.pop(name, None)
            self._write_recorded(name, [])
        else:
            planned[name] = plan
        self._planned = planned
        path = self._planned_file()
        with contextlib.suppress(OSError):
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
            tmp.write_text(json.dumps({k: v.to_json() for k, v in planned.items()}))
            tmp.replace(path)
            self._planned_mtime = self._planned_stamp()
        placements = placements_from_shards(self.state.nodes, planned, self._placing)
        self._set(replace(self.state, placements=self._in_view(placements)))

    def _in_view(self, placements: tuple[PlacementState, ...]) -> tuple[PlacementState, ...]:
        """A placement being unloaded leaves the view at once: its shards stop one by
        one, and in between it would read as broken ("2 of 4 nodes", in red)."""
        now = time.monotonic()
        return tuple(
            p
            for p in placements
            if p.name in self._placing or self._unloading.get(p.name, 0.0) < now
        )

    async def _roll_back(self, name: str, nodes: list[str]) -> None:
        await self._unload_everywhere(name, nodes)
        self._remember_plan(name, None)

    async def _unload_everywhere(self, name: str, nodes: list[str]) -> None:
        self._unloading[name] = time.monotonic() + UNLOAD_QUIET_S
        await asyncio.gather(
            *(self.peer(n).request("unload", timeout=10.0, placement=name) for n in nodes),
            return_exceptions=True,
        )
        # The head's socket goes with its runner: a placement of the same name placed
        # again on the same node and port must not inherit the old socket's "down
        # since the unload", which fails its first request after RECONNECT_GRACE_S.
        for key in [k for k in self.peers if k.startswith(f"head:{name}:")]:
            await self.peers.pop(key).aclose()

    # ---- generation ----------------------------------------------------------------------

    @staticmethod
    def head_key(placement: PlacementState) -> str:
        """Where `peers` keeps the socket to a placement's head shard."""
        head = placement.shards[0]
        return f"head:{placement.name}:{head.node}:{head.client_port}"

    def head_peer(self, placement: PlacementState) -> Peer:
        head = placement.shards[0]
        key = self.head_key(placement)
        if key not in self.peers:
            spec = self.spec(head.node)
            self.peers[key] = Peer(
                self.ctx,
                f"tcp://{spec.address}:{head.client_port}",
                self.keys,
                keys.node_public_key(self.home, head.node),
                f"{placement.name} head on {head.node}",
                identity=self._identity(key),
            )
        return self.peers[key]

    async def clear_cache(self, name: str) -> tuple[int, int]:
        """Empty placement `name`'s prefix cache on every stage (the head sends the word
        down its ring); the entries and bytes its head held."""
        placement = self.state.placement(name)
        if placement is None:
            known = ", ".join(p.name for p in self.state.placements) or "none"
            raise PlacementError(f"no placement named {name!r} (known: {known})")
        if placement.state != "ready":
            raise PlacementError(
                f"placement {name!r} is {placement.state}: its cache is cleared once it is "
                "ready (or unload it: that frees its memory cache too)"
            )
        try:
            reply = await self.head_peer(placement).ask("cache_clear", control.CacheCleared)
        except (AgentError, AgentUnreachable) as exc:
            raise PlacementError(f"cannot clear the cache of {name!r}: {exc}") from None
        return reply.entries, reply.bytes

    def not_ready_hint(self, placement: PlacementState) -> str:
        """Why `placement` cannot answer now and what to do, naming the node and stage
        (the words a request to it fails with)."""
        return _not_ready_hint(placement, self.state.nodes)

    def pick_placement(self, name: str | None) -> PlacementState:
        placements = self.state.placements
        if name is None:
            ready = [p for p in placements if p.state == "ready"]
            if len(ready) == 1:
                return ready[0]
            if not ready:
                if placements:
                    raise GenerationError(
                        "no placement is ready: "
                        + "; ".join(f"{p.name!r} is {p.state}" for p in placements)
                        + f"; {_not_ready_hint(placements[0], self.state.nodes)}"
                    )
                raise GenerationError(
                    "no placement is ready: place a model first (studiotui place)"
                )
            names = ", ".join(p.name for p in ready)
            raise GenerationError(
                f"several placements are ready ({names}): pick one with --placement"
            )
        placement = self.state.placement(name)
        if placement is None:
            known = ", ".join(p.name for p in placements) or "none"
            raise GenerationError(f"no placement named {name!r} (known: {known})")
        if placement.state != "ready":
            raise GenerationError(
                f"placement {name!r} is {placement.state}, not ready: "
                f"{_not_ready_hint(placement, self.state.nodes)}"
            )
        return placement

    async def generate(
        self,
        placement: str | None,
        request: dict[str, Any],
        params: dict[str, Any],
        first_timeout: float = 900.0,
        step_timeout: float = 60.0,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Yield accepted, delta… and done messages; raise GenerationError on failure.

        `request` holds one of messages / prompt / tokens.
        """
        chosen = self.pick_placement(placement)
        peer = self.head_peer(chosen)
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
                    raise GenerationError(await self._failure(chosen, msg), msg.code)
                if not isinstance(msg, control.Streamed):
                    continue  # no other message answers a request
                yield control.event(msg)
                if isinstance(msg, control.Done):
                    finished = True
                    return
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    await peer.send("cancel", rid=rid)
            peer.close_queue(rid)

    async def _failure(self, placement: PlacementState, msg: control.Failed | Error) -> str:
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
                self.peer(n).ask("list_shards", control.Shards, timeout=1.5)
                for n in placement.nodes
            ),
            return_exceptions=True,
        )
        for shard, reply in zip(placement.shards, replies, strict=True):
            node = shard.node
            again = _reload_hint(node)
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
                    f"the shard of {placement.name!r} on {node} ({_stage(shard)}) is "
                    f"{mine[0].message or 'silent'}; this request is given up; "
                    f"{placement.name!r} is used again by itself if the shard answers again, "
                    f"else restart {node} (studiotui restart {node} reloads its shards)"
                )
            if mine[0].state != "ready":
                why = mine[0].message or mine[0].state
                return (
                    f"the shard of {placement.name!r} on {node} ({_stage(shard)}) is down: "
                    f"{why}; {again}"
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
        down = [n for n in placement.nodes if (s := self.state.node(n)) and s.state != "up"]
        if down:
            return (
                f"node {', '.join(down)} of placement {placement.name!r} is down; "
                f"{placement.name!r} is used again as soon as it answers; if it stays "
                f"silent, restart it (studiotui restart {down[0]} reloads its shards)"
            )
        return f"placement {placement.name!r} sent nothing for {timeout:g} s"

    async def cancel(self, placement: str, rid: str) -> None:
        chosen = self.pick_placement(placement)
        await self.head_peer(chosen).send("cancel", rid=rid)

    # ---- links ---------------------------------------------------------------------------

    async def measure_links(self) -> tuple[LinkState, ...]:
        """Every up node measures every other, one node at a time so that
        measurements do not share the wire."""
        up = [n.name for n in self.state.nodes if n.state == "up"]
        found: dict[frozenset[str], list[control.LinkResult]] = {}
        for node in up:
            try:
                results = await self.link_results(node, [p for p in up if p != node])
            except (AgentError, AgentUnreachable) as exc:
                self.record(f"{node} could not measure its links: {exc}", "warning")
                continue
            for result in results:
                link = control.parse(result, control.LinkResult)  # checked by link_results
                found.setdefault(frozenset((node, link.peer)), []).append(link)
        links = tuple(
            self._link(pair, results)
            for pair, results in sorted(found.items(), key=lambda kv: sorted(kv[0]))
        )
        self._set(replace(self.state, links=links))
        self._save_links(links)
        self.record(f"measured {len(links)} links")
        return links

    async def link_results(
        self, node: str, peers: list[str], sizes: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """What `node` measures towards each of `peers` (latency, and bandwidth over a
        CURVE PUSH to a PULL the peer opens), each result marked with `from`; `sizes`
        changes how long and with what messages (limits.LINK_MEASURE_BOUNDS)."""
        if not peers:
            return []
        targets = [
            {
                "name": p,
                "endpoint": self.spec(p).control_endpoint,
                "key": keys.node_public_key(self.home, p).decode(),
            }
            for p in peers
        ]
        extra = {"sizes": sizes} if sizes else {}
        peer = self.peer(node)
        reply = await peer.ask("measure_links", control.Links, timeout=60.0, peers=targets, **extra)
        return [{**control.to_wire(r), "from": node} for r in reply.links]

    def _links_file(self) -> Path:
        return self.home / f"links-{self.inventory.name}.json"

    def _save_links(self, links: tuple[LinkState, ...]) -> None:
        """Keep the last measurement, so a restarted TUI or CLI plans with it."""
        with contextlib.suppress(OSError):
            self._links_file().write_text(json.dumps([asdict(x) for x in links]))

    def _load_links(self) -> tuple[LinkState, ...]:
        names = set(self.inventory.names)
        try:
            raw = json.loads(self._links_file().read_text())
            links = tuple(LinkState(**x) for x in raw)
        except (OSError, ValueError, TypeError):
            return ()
        return tuple(x for x in links if x.a in names and x.b in names)

    def _link(self, pair: frozenset[str], results: list[control.LinkResult]) -> LinkState:
        a, b = sorted(pair)
        good = [r.latency_us for r in results if r.latency_us is not None]
        # RDMA when an active cable joins the two (core/members.rdma_link), with the
        # reason when both have RDMA but no such cable.
        facts = {n: (self.state.node(n) or NodeState(n, "", 0, "")).facts for n in (a, b)}
        judged = rdma_link(a, b, {n: f.get("rdma") for n, f in facts.items()})
        rdma, rdma_why = judged if judged is not None else (False, "")
        # The kind from both ends' interfaces; an agent's own end is the fallback.
        ends = [
            probes.LinkEnd.from_facts(
                (self.state.node(n) or NodeState(n, "", 0, "")).facts.get("link_end")
            )
            for n in (a, b)
        ]
        kind = probes.pair_link_kind(*ends) if all(ends) else results[0].kind
        if not good:
            return LinkState(a, b, None, None, kind, time.time())
        return LinkState(
            a,
            b,
            latency_us=min(good),
            gbps=max((r.gbps for r in results if r.gbps is not None), default=None),
            kind=kind,
            measured_at=time.time(),
            rdma=rdma,
            rdma_why=rdma_why,
        )

    # ---- nodes ---------------------------------------------------------------------------

    async def shards_on(
        self, names: list[str], kept: Sequence[SavedShard] = ()
    ) -> tuple[list[SavedShard], list[str]]:
        """The shards held on `names`, saved to be loaded again after a restart, and
        the words for placements that cannot be (so restart can name what it drops).

        `kept` are shards `down` took off nodes that are still down: a placement they
        complete counts as whole, and they are reloaded with it. So are the shards
        recorded when it was placed (`recorded_shards`) on a node of `names` that
        reports none of it: its agent died with them (`kill -9`), or is down and cannot
        say what it held; the controller knows the ring. A tensor group is saved
        whole, its members on other nodes too: its ranks join one `mx.distributed` group
        together, so one rank cannot rejoin the others; the whole group is relaunched."""
        await self.refresh()
        recorded = self.recorded_shards()
        saved: list[SavedShard] = []
        dropped: list[str] = []
        for placement in self.state.placements:
            held = {s.node for s in placement.shards}
            away = [k for k in kept if k.placement == placement.name and k.node not in held]
            away += [
                r
                for r in recorded
                if r.placement == placement.name
                and r.node in names
                and r.node not in held | {k.node for k in away}
            ]
            mine = [s for s in placement.shards if s.node in names]
            if not mine and not away:
                continue
            want = placement.expected or (away[0].report.count if away else 0)
            # A shard that failed (its runner died, a tensor group's rank lost a member)
            # is loaded again like one that is gone: same layers, ports and streams.
            states = ("ready", "broken", "failed")
            if placement.state not in states or len(placement.shards) + len(away) != want:
                dropped.append(
                    f"placement {placement.name!r} is {placement.state} and incomplete: "
                    "it is not reloaded (unload it and place it again)"
                )
                continue
            # Where each stage's leader listens, the kept ones' too (their nodes report
            # nothing); a tensor group's members all send on to the next stage's leader.
            stages = {s.index: (s.node, s.data_port) for s in placement.shards if s.rank == 0}
            stages.update(
                {k.report.index: (k.node, k.report.data_port) for k in away if k.report.rank == 0}
            )
            # The stages a restarted (or kept) node is a member of a group of.
            relaunched = {s.index for s in mine if s.group} | {
                k.report.index for k in away if k.report.group
            }
            chosen = [
                s
                for s in placement.shards
                if s.node in names or (s.group and s.index in relaunched)
            ]
            for shard in chosen:
                report = await self._shard_report(shard)
                node, port = stages[(shard.index + 1) % shard.count]
                saved.append(
                    SavedShard(
                        node=shard.node,
                        placement=placement.name,
                        report=report,
                        next_endpoint=f"tcp://{self.spec(node).address}:{port}",
                        next_key=keys.node_public_key(self.home, node).decode(),
                    )
                )
            saved.extend(away)
        return saved, dropped

    def _kept_file(self) -> Path:
        return self.home / f"stopped-shards-{self.inventory.name}.json"

    def kept_shards(self) -> list[SavedShard]:
        """Shards `down` took off nodes, kept for `restart` to load again; only those of
        placements still planned (an unloaded or forgotten one is not brought back)."""
        try:
            kept = [saved_from_row(row) for row in json.loads(self._kept_file().read_text())]
        except (OSError, ValueError, TypeError, KeyError, messages.MessageError):
            return []  # none kept, or damaged: restart reloads what the agents report
        planned = self._read_planned()
        return [k for k in kept if k.placement in planned]

    def keep_shards(self, saved: Sequence[SavedShard], forget: Sequence[str] = ()) -> None:
        """Remember `saved` for `restart` (replacing what was kept for their nodes) and
        forget what was kept for the nodes `forget` (restarted with their shards)."""
        nodes = {s.node for s in saved} | set(forget)
        kept = [k for k in self.kept_shards() if k.node not in nodes] + list(saved)
        _write_json(self._kept_file(), [saved_row(k) for k in kept])

    def _recorded_file(self) -> Path:
        return self.home / f"loaded-shards-{self.inventory.name}.json"

    def recorded_shards(self) -> list[SavedShard]:
        """Every shard of each planned placement as it was when the placement became
        ready (`_record_shards`): what a restart loads again on a node whose agent died
        with its shards (`kill -9`, a crash), which can no longer say what it held."""
        try:
            raw = json.loads(self._recorded_file().read_text())
            recorded = [saved_from_row(row) for rows in raw.values() for row in rows]
        except (OSError, ValueError, TypeError, KeyError, AttributeError, messages.MessageError):
            return []  # none recorded (placed by an older build), or damaged
        planned = self._read_planned()
        return [r for r in recorded if r.placement in planned]

    async def _record_shards(self, name: str) -> None:
        """Record the ready placement `name`'s shards (layers, ports, streams, where its
        ring goes on), asked of their agents, for `recorded_shards`."""
        placement = self.state.placement(name)
        if placement is None:
            return
        saved, _ = await self.shards_on(list(placement.nodes))
        self._write_recorded(name, [s for s in saved if s.placement == name])

    def _write_recorded(self, name: str, saved: Sequence[SavedShard]) -> None:
        try:
            raw = json.loads(self._recorded_file().read_text())
            rows = {str(k): v for k, v in raw.items()} if isinstance(raw, dict) else {}
        except (OSError, ValueError):
            rows = {}
        rows.pop(name, None)
        if saved:
            rows[name] = [saved_row(s) for s in saved]
        _write_json(self._recorded_file(), rows)

    async def _shard_report(self, shard: ShardState) -> control.ShardReport:
        """What the shard's agent says about it; what the controller last knew when the
        agent does not answer (a dead agent's shards are reloaded all the same)."""
        with contextlib.suppress(AgentError, AgentUnreachable):
            reply = await self.peer(shard.node).ask("list_shards", control.Shards, timeout=5.0)
            for report in reply.shards:
                if report.placement == shard.placement:
                    return report
        return control.ShardReport(
            placement=shard.placement,
            model_dir=shard.model_dir,
            start=shard.start,
            end=shard.end,
            index=shard.index,
            count=shard.count,
            data_port=shard.data_port,
            client_port=shard.client_port,
            context_tokens=shard.context_tokens,
            kv_bytes=shard.kv_bytes,
            adapter=shard.adapter,
            adapter_dir=shard.adapter_dir,
            adapter_bytes=shard.adapter_bytes,
            weight_bytes=shard.weight_bytes,
            kv_bits=shard.kv_bits,
            kv_group_size=shard.kv_group_size,
            prompt_cache_bytes=shard.prompt_cache_bytes,
            prompt_cache_disk_bytes=shard.prompt_cache_disk_bytes,
            rank=shard.rank,
            group=list(shard.group),
            backend=self._planned_backend(shard),
        )

    def _planned_backend(self, shard: ShardState) -> str:
        """A tensor group member's backend as planned ("" for a one-node stage)."""
        if not shard.group:
            return ""
        planned = self._planned.get(shard.placement)
        ring = planned.shards if planned else ()
        return next((p.backend for p in ring if p.node == shard.node and p.backend), "ring")

    async def reload_shards(self, saved: list[SavedShard]) -> list[ReloadResult]:
        """Load again, on the same nodes, layers and ports, shards a restart stopped.

        The same ports let the ring's other stages and the controller's head socket
        reconnect by themselves: nothing else of the placement is reloaded. A tensor
        group is relaunched whole (`shards_on` saved every member): its members still
        running are unloaded, then every rank is prepared and loaded together, so the
        group is formed again (`mx.distributed` cannot take one rank back)."""
        by_placement: dict[str, list[SavedShard]] = {}
        for shard in saved:
            by_placement.setdefault(shard.placement, []).append(shard)
        results = []
        for name, shards in by_placement.items():
            where = ", ".join(
                f"{s.node} (layers {s.report.start}-{s.report.end - 1})" for s in shards
            )
            groups: dict[int, list[SavedShard]] = {}
            for s in shards:
                if s.report.group:
                    groups.setdefault(s.report.index, []).append(s)
            alone = [s for s in shards if not s.report.group]
            try:
                await asyncio.gather(
                    *(self._reload_one(s) for s in alone),
                    *(self._reload_group(g) for g in groups.values()),
                )
            except (AgentError, AgentUnreachable, PlacementError) as exc:
                text = (
                    f"placement {name!r} is broken: its shards on {where} could not be "
                    f"loaded again ({exc}); unload it and place it again"
                )
                self.record(text, "error")
                results.append(ReloadResult(name, False, text))
                continue
            text = f"placement {name!r}: reloaded its shards on {where}"
            if groups:
                text += f" (tensor group{'s' if len(groups) > 1 else ''} formed again)"
            self.record(text)
            results.append(ReloadResult(name, True, text))
        await self.refresh()
        return results

    async def _prepare_again(self, saved: SavedShard, tensor: bool = False) -> control.Prepared:
        """The shard prepared again on its node, with the ports it had."""
        r, peer = saved.report, self.peer(saved.node)
        ports = (r.data_port, r.client_port)
        prepared = await peer.ask(
            "prepare_shard",
            control.Prepared,
            placement=saved.placement,
            data_port=ports[0],
            client_port=ports[1],
            tensor=tensor,
            weight_bytes=r.weight_bytes,
            kv_bytes=r.kv_bytes,
            adapter_bytes=r.adapter_bytes,
            prompt_cache_bytes=r.prompt_cache_bytes,
        )
        if (prepared.data_port, prepared.client_port) != ports:
            await peer.request("unload", placement=saved.placement)
            raise PlacementError(f"{saved.node} could not take back its ports {ports}")
        return prepared

    async def _load_again(self, saved: SavedShard, group: dict[str, Any] | None = None) -> None:
        r = saved.report
        async for _msg in self.peer(saved.node).stream(
            "load_shard",
            timeout=120.0,
            placement=saved.placement,
            model_dir=r.model_dir,
            start=r.start,
            end=r.end,
            index=r.index,
            count=r.count,
            data_port=r.data_port,
            client_port=r.client_port,
            next_endpoint=saved.next_endpoint,
            next_key=saved.next_key,
            prefill_chunk=r.prefill_chunk,
            context_tokens=r.context_tokens,
            streams=r.streams,
            kv_bytes=r.kv_bytes,
            adapter=r.adapter,
            adapter_dir=r.adapter_dir,
            adapter_bytes=r.adapter_bytes,
            kv_bits=r.kv_bits,
            kv_group_size=r.kv_group_size,
            prompt_cache_bytes=r.prompt_cache_bytes,
            prompt_cache_disk_bytes=r.prompt_cache_disk_bytes,
            **(group or {}),
        ):
            pass

    async def _reload_one(self, saved: SavedShard) -> None:
        await self._prepare_again(saved)
        await self._load_again(saved)

    async def _reload_group(self, saved: list[SavedShard]) -> None:
        """Relaunch one tensor group: every member unloaded (a rank still running sits
        in a group that lost a member), prepared with its ports (and a new group port
        each), then all loaded at once, each told the others' group ports, so they
        join one new group. Any member failing unloads them all: the others would only
        wait in the join."""
        first = saved[0].report
        order = {node: rank for rank, node in enumerate(first.group)}
        members = sorted(saved, key=lambda s: order.get(s.node, len(order)))
        if [s.node for s in members] != list(first.group):
            raise PlacementError(
                f"the tensor group {', '.join(first.group)} of stage {first.index + 1} "
                f"is not whole (saved: {', '.join(s.node for s in members)})"
            )
        await asyncio.gather(
            *(self.peer(s.node).request("unload", placement=s.placement) for s in members)
        )
        try:
            prepared = await asyncio.gather(*(self._prepare_again(s, tensor=True) for s in members))
            port = {s.node: p for s, p in zip(members, prepared, strict=True)}
            fields = [
                self._group_fields(
                    Member(
                        stage=s.report.index,
                        rank=s.report.rank,
                        node=s.node,
                        start=s.report.start,
                        end=s.report.end,
                        group=tuple(first.group),
                        backend=s.report.backend or "ring",
                    ),
                    port,
                )
                for s in members
            ]
            loads = [
                asyncio.ensure_future(self._load_again(s, f))
                for s, f in zip(members, fields, strict=True)
            ]
            try:
                await asyncio.gather(*loads)
            finally:
                for task in loads:
                    task.cancel()
                await asyncio.gather(*loads, return_exceptions=True)
        except BaseException:
            await asyncio.gather(
                *(self.peer(s.node).request("unload", placement=s.placement) for s in members),
                return_exceptions=True,
            )
            raise

    async def shutdown(self, names: list[str]) -> dict[str, str]:
        results = await asyncio.gather(
            *(self.peer(n).request("shutdown", timeout=5.0) for n in names),
            return_exceptions=True,
        )
        return {
            n: ("stopped" if not isinstance(r, BaseException) else f"not answering: {r}")
            for n, r in zip(names, results, strict=True)
        }

    async def read_log(self, name: str, lines: int = 200) -> list[str]:
        reply = await self.peer(name).ask("read_log", control.LogLines, lines=lines)
        return reply.lines


def _write_json(path: Path, data: Any) -> None:
    """Replace `path` whole (a reader in another process never sees half of it)."""
    with contextlib.suppress(OSError):
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)


def join_seconds(env: Mapping[str, str]) -> float:
    """How long a tensor group's ranks wait for one another: STUDIOTUI_JOIN_S if it is
    positive seconds (a loaded or slow machine), else GROUP_JOIN_S."""
    try:
        value = float(env.get(control.JOIN_S_VAR, control.GROUP_JOIN_S))
    except ValueError:
        return control.GROUP_JOIN_S
    return value if 0 < value < float("inf") else control.GROUP_JOIN_S


def _spans(adapter: Adapter) -> str:
    """The adapted layers as people read them: 6-7, or 0-3, 6."""
    runs: list[list[int]] = []
    for n in adapter.layers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def _clock(when: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when))


def _stage(shard: ShardState) -> str:
    return f"stage {shard.index + 1} of {shard.count}, layers {shard.start}-{shard.end - 1}"


def _stopped_by_down(placement: PlacementState, nodes: tuple[NodeState, ...]) -> bool:
    """Every node of `placement` that is missing was stopped by `studiotui down`."""
    gone = [n for n in nodes if n.name in placement.missing]
    return bool(gone) and all(n.message.startswith(STOPPED_BY_DOWN) for n in gone)


def _reload_hint(node: str) -> str:
    """What loads a lost or failed shard again: a restart of its node (`restart_nodes`
    reloads it from what its agent or the controller recorded)."""
    return (
        f"restart {node} (studiotui restart {node}, r on the dashboard) to load it again "
        "on the same layers"
    )


def _not_ready_hint(placement: PlacementState, nodes: tuple[NodeState, ...] = ()) -> str:
    """What an operator can do about a placement that cannot answer yet."""
    if placement.state in ("loading", "prepared"):
        return f"wait until {placement.name!r} is ready"
    silent = [s for s in placement.shards if s.state == "silent"]
    if silent:
        # Nothing is lost yet: the shard is loaded and only silent; say so, not "reload".
        s = silent[0]
        return (
            f"its shard on {s.node} ({_stage(s)}) is {s.message or 'silent'}; "
            f"{placement.name!r} is used again by itself as soon as it answers; if it "
            f"stays silent, restart {s.node} (studiotui restart {s.node}, which reloads "
            "its shards)"
        )
    failed = [s for s in placement.shards if s.state == "failed"]
    if failed:
        s = failed[0]
        why = f": {s.message}" if s.message else ""
        return f"its shard on {s.node} ({_stage(s)}) failed{why}; {_reload_hint(s.node)}"
    # A node that fell silent may come back with its shards (a stopped agent, a blip):
    # say what is known first, and reloading only as what to do if it stays away.
    away = [n for n in nodes if n.name in placement.missing and n.state == "down"]
    if away:
        n = away[0]
        stages = placement.stages
        where = next(
            (
                f" (stage {i + 1} of {len(stages)}, layers {start}-{end - 1})"
                for i, (names, start, end) in enumerate(stages)
                if n.name in names
            ),
            "",
        )
        if n.message.startswith(STOPPED_BY_DOWN):
            return (
                f"node {n.name}{where} was {n.message}; `studiotui up` or `studiotui restart "
                f"{n.name}` (r on the dashboard) starts it and loads its shard again"
            )
        return (
            f"node {n.name}{where}: {n.message or 'down'}; {placement.name!r} is used again by "
            f"itself if {n.name} comes back with its shard; if it stays silent, restart it "
            f"(studiotui restart {n.name}) or place {placement.name!r} again (R on the "
            "dashboard)"
        )
    return (
        f"unload it and place the model again (studiotui unload {placement.name}, then "
        "studiotui place; R on the dashboard does both)"
    )
