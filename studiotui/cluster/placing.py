"""Deciding where a model goes and putting it there: the plan for these nodes as they
are now (their reports, the memory promised on them, the links, the chips), placing
that plan (or exactly the one a preview showed), rolling back what fails, unloading."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from studiotui.cluster import model_files
from studiotui.cluster.draft import DraftRefused, check_draft, draft_bytes, with_draft
from studiotui.cluster.errors import PlacementError, PlacementRefused
from studiotui.cluster.hub import CHECK_EVERY_S, UNLOAD_QUIET_S, Hub
from studiotui.cluster.kept import KeptShards
from studiotui.cluster.loading import Loading, Progress
from studiotui.cluster.peers import AgentError, AgentUnreachable
from studiotui.cluster.telemetry import Telemetry
from studiotui.core import benchmark
from studiotui.core.adapter_catalog import (
    AdapterRefused,
    adapter_placement_name,
    adapter_tensor,
    check_adapter,
)
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
from studiotui.core.load_watch import node_gone
from studiotui.core.members import members
from studiotui.core.memory import Promises, disk_room, promises_note, room
from studiotui.core.model_facts import ModelDirError, ModelInfo, read_model, with_kv_quant
from studiotui.core.placement import (
    NodeBudget,
    Plan,
    Refusal,
    fit_disk,
    format_bytes,
    longest_context,
    with_adapter,
    with_prompt_cache,
)
from studiotui.core.state import (
    PlacementState,
    PlannedPlacement,
    PlannedShard,
    node_start_hint,
)
from studiotui.ssh.client import SshError
from worker.shared.adapters import Adapter
from worker.shared.kv_quant import DEFAULT_KV_GROUP_SIZE
from worker.shared.manifest import Hashing
from worker.shared.protocol.limits import DEFAULT_STREAMS


@dataclass(frozen=True)
class PlaceResult:
    plan: Plan
    placement: PlacementState


def spans(adapter: Adapter) -> str:
    """The adapted layers as people read them: 6-7, or 0-3, 6."""
    runs: list[list[int]] = []
    for n in adapter.layers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


class Placing:
    def __init__(self, hub: Hub, telemetry: Telemetry, loading: Loading, kept: KeptShards) -> None:
        self.hub = hub
        self.telemetry = telemetry
        self.loading = loading
        self.kept = kept
        # What a placement being decided holds on each node until the node reports its
        # prepared shard: a preview in that round trip must not offer the same memory.
        self._promises: dict[str, dict[str, int]] = {}

    @property
    def unreported_promises(self) -> Promises:
        """The placements this controller is deciding, by node, until their nodes
        report the prepared shards (a copy: for views and tests)."""
        return {name: dict(on) for name, on in self._promises.items()}

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
        links = links_from_state(self.hub.state)
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
        if isinstance(verdict, Plan):
            # The disk budget against each node's free disk (its telemetry says it).
            verdict = fit_disk(verdict, prompt_cache_disk, self._disk_free(nodes))
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
            group = [s for name in nodes if (s := self.hub.state.node(name)) is not None]
            if note := promises_note(group, self._promises):
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
        """What each node can take now (`memory.room`), or why one cannot take anything."""
        budgets = []
        for name in nodes:
            node = self.hub.state.node(name)
            if node is None:
                return Refusal(f"unknown node {name!r}", "node")
            if node.state != "up":
                return Refusal(f"{name} is {node.state}: {node_start_hint(name)}", "node")
            free = max(0, room(node, self._promises))
            budgets.append(NodeBudget(name, free, node.memory_total))
        return budgets

    def _disk_free(self, nodes: Sequence[str]) -> dict[str, int | None]:
        """Bytes each node's disk can still give a prompt cache, as its last telemetry
        said, less what its placements' caches may still write (None: unsaid)."""
        return {
            name: disk_room(node) if (node := self.hub.state.node(name)) is not None else None
            for name in nodes
        }

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
        links = links_from_state(self.hub.state)
        return longest_context(info.facts, budgets, links, streams=streams, tensor=tensor)

    def node_chips(self, nodes: Sequence[str]) -> dict[str, Chip]:
        """What the forecast knows of each node's speed: its chip, or a bandwidth its
        agent reports or the newest saved benchmark run of this cluster measured."""
        runs = benchmark.saved(self.hub.home)
        measured = measured_bandwidths(runs, self.hub.inventory.name)
        chips = chips_from_state(self.hub.state, nodes, measured)
        return with_benchmark(chips, runs, self.hub.inventory.name)

    def last_measured(self, model: str, shape: str) -> LastMeasured | None:
        """What the newest saved benchmark of this cluster measured for `model` on
        `shape` (one stream's decode tok/s), shown beside the forecast."""
        return last_measured(benchmark.saved(self.hub.home), self.hub.inventory.name, model, shape)

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
        hub = self.hub
        model_dir = model_dir.expanduser().resolve()
        adapter = None
        if adapter_dir is not None:
            adapter_dir = adapter_dir.expanduser().resolve()
            adapter = await asyncio.to_thread(self.check_adapter, adapter_dir, model_dir)
            try:
                tensor = adapter_tensor(tensor)  # pipeline stages only
            except AdapterRefused as exc:
                raise PlacementError(str(exc)) from None
            hub.record(f"adapter {adapter.name} matches {model_dir.name} (layers {spans(adapter)})")
        await self.telemetry.refresh()
        nodes = nodes or [n.name for n in hub.state.nodes if n.state == "up"]
        name = name or (
            adapter_placement_name(model_dir, adapter_dir) if adapter_dir else model_dir.name
        )
        if hub.state.placement(name) is not None:
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
        hub.record(
            f"placing {info.name}{with_adapter} as {name!r} on {', '.join(m.node for m in procs)}"
        )
        hub.unloading.pop(name, None)  # placed again under a name just unloaded
        # Every node of a tensor-group stage is remembered with the stage's layers, so
        # the placement's shape ("2 stages × 2") is known from its ring alone.
        ring = tuple(
            PlannedShard(node, s.start, s.end, s.backend or "")
            for s in the_plan.shards
            for node in s.nodes
        )
        hub.placing.add(name)
        promise = self._promises.setdefault(name, {})
        for shard in the_plan.shards:
            for node in shard.nodes:
                promise[node] = (
                    shard.weight_bytes
                    + shard.kv_bytes
                    + shard.adapter_bytes
                    + shard.prompt_cache_bytes
                    + shard.draft_bytes
                )
        planned = PlannedPlacement(str(model_dir), ring, placed_at=int(time.time()))
        if adapter is not None:
            planned = replace(planned, adapter_dir=str(adapter.path), adapter=adapter.name)
        hub.remember_plan(name, planned)

        def reported() -> None:
            self._promises.pop(name, None)  # the nodes' reports hold the promise from here

        try:
            await self.loading.deploy(
                the_plan,
                model_dir,
                name,
                progress,
                prefill_chunk,
                adapter,
                hashing,
                (draft, guesser, draft_tokens),
                on_prepared=reported,
            )
            hub.placing.discard(name)
            placed = await self._deployed(the_plan, name)
        except (AgentError, AgentUnreachable, PlacementError, SshError) as exc:
            # SshError: the operator's copy over SFTP could not reach the node; its
            # prepared shards (and the memory promised to them) are given back too.
            hub.record(f"placement {name!r} failed, rolling back: {exc}", "error")
            await self._roll_back(name, [m.node for m in procs])
            raise PlacementError(f"placement {name!r} failed and was rolled back: {exc}") from None
        except asyncio.CancelledError:
            # Interrupted (Ctrl-C on `place`, the dashboard quitting): what was loaded so
            # far is unloaded, as after a failure, rather than left half made with nobody
            # watching it (a load under way would otherwise finish and stay).
            hub.record(f"placement {name!r} interrupted, rolling back", "warning")
            await asyncio.shield(self._roll_back(name, [m.node for m in procs]))
            raise
        finally:
            hub.placing.discard(name)
            self._promises.pop(name, None)
        await self.kept.record_shards(name)
        hub.record(f"placement {name!r} is ready")
        return PlaceResult(plan=the_plan, placement=placed)

    async def _deployed(self, the_plan: Plan, name: str) -> PlacementState:
        """The placement as the nodes now report it, if every planned shard is there.

        A node can die after its shard said ready and before the others finished,
        faster than the load watchdog notices: ask them all once more. One that does
        not answer in time but keeps its connection is asked again, as the watchdog
        would (`node_gone`): a busy node is not a lost one."""
        hub = self.hub
        started = time.monotonic()
        while True:
            await self.telemetry.refresh()
            placed = hub.state.placement(name)
            lost = [
                m.node for m in members(the_plan) if placed is None or m.node not in placed.nodes
            ]
            if placed is not None and not lost:
                return placed
            now = time.monotonic()
            # A node that answers without its shard has lost it; one that does not
            # answer is given the watchdog's time.
            answered = {n.name for n in hub.state.nodes if n.state == "up"}
            if any(
                n in answered or node_gone(n, hub.peer(n).down_for(), now - started) for n in lost
            ):
                break
            await asyncio.sleep(CHECK_EVERY_S)
        raise PlacementError(f"{', '.join(lost)} stopped answering while the shards loaded")

    def _no_longer_fits(self, expected: Plan) -> str | None:
        for shard, name in ((s, n) for s in expected.shards for n in s.nodes):
            # Every node of a tensor group holds the same share (its byte figures).
            node = self.hub.state.node(name)
            if node is None or node.state != "up":
                return f"{name} is not up"
            adds = shard.free_before - shard.free_after
            free = room(node, self._promises)
            if adds > free:
                note = promises_note([node], self._promises)
                return (
                    f"{name} now has {format_bytes(max(free, 0))} free, the plan needs "
                    f"{format_bytes(adds)} there; preview again"
                ) + (f" ({note})" if note else "")
        return None

    async def unload(self, name: str) -> None:
        hub = self.hub
        await self.telemetry.refresh()
        placement = hub.state.placement(name)
        if placement is None:
            known = ", ".join(p.name for p in hub.state.placements) or "none"
            raise PlacementError(f"no placement named {name!r} (known: {known})")
        # Forgotten first: a dashboard watching reads that before a shard stops.
        hub.unloading[name] = time.monotonic() + UNLOAD_QUIET_S
        hub.remember_plan(name, None)
        await self.loading.unload_everywhere(name, list(placement.nodes))
        await self.telemetry.refresh()
        hub.record(f"placement {name!r} unloaded")

    async def _roll_back(self, name: str, nodes: list[str]) -> None:
        await self.loading.unload_everywhere(name, nodes)
        self.hub.remember_plan(name, None)
