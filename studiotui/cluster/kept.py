"""Shards kept across a restart: which shards a node held (or was recorded holding
when its placement became ready), kept aside by `down`, and loaded again on the same
nodes, layers and ports, a tensor group relaunched whole."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from studiotui.cluster.errors import PlacementError
from studiotui.cluster.hub import Hub
from studiotui.cluster.loading import Loading
from studiotui.cluster.peers import AgentError, AgentUnreachable
from studiotui.cluster.records import SavedShard
from studiotui.cluster.telemetry import Telemetry
from studiotui.core.members import Member
from studiotui.core.state import ShardState
from worker.shared.protocol import control

RELOAD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ReloadResult:
    placement: str
    ok: bool
    text: str


class KeptShards:
    def __init__(self, hub: Hub, telemetry: Telemetry, loading: Loading) -> None:
        self.hub = hub
        self.telemetry = telemetry
        self.loading = loading

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
        hub = self.hub
        await self.telemetry.refresh()
        recorded = self.recorded_shards()
        saved: list[SavedShard] = []
        dropped: list[str] = []
        for placement in hub.state.placements:
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
                        next_endpoint=f"tcp://{hub.spec(node).address}:{port}",
                        next_key=hub.node_key(node),
                    )
                )
            saved.extend(away)
        return saved, dropped

    def kept_shards(self) -> list[SavedShard]:
        """Shards `down` took off nodes, kept for `restart` to load again; only those of
        placements still planned (an unloaded or forgotten one is not brought back)."""
        return self.hub.records.read_kept()

    def keep_shards(self, saved: Sequence[SavedShard], forget: Sequence[str] = ()) -> None:
        """Remember `saved` for `restart` (replacing what was kept for their nodes) and
        forget what was kept for the nodes `forget` (restarted with their shards)."""
        nodes = {s.node for s in saved} | set(forget)
        kept = [k for k in self.kept_shards() if k.node not in nodes] + list(saved)
        self.hub.records.write_kept(kept)

    def recorded_shards(self) -> list[SavedShard]:
        """Every shard of each planned placement as it was when the placement became
        ready (`record_shards`): what a restart loads again on a node whose agent died
        with its shards (`kill -9`, a crash), which can no longer say what it held."""
        return self.hub.records.read_recorded()

    async def record_shards(self, name: str) -> None:
        """Record the ready placement `name`'s shards (layers, ports, streams, where its
        ring goes on), asked of their agents, for `recorded_shards`."""
        placement = self.hub.state.placement(name)
        if placement is None:
            return
        saved, _ = await self.shards_on(list(placement.nodes))
        self.hub.records.write_recorded(name, [s for s in saved if s.placement == name])

    async def _shard_report(self, shard: ShardState) -> control.ShardReport:
        """What the shard's agent says about it; what the controller last knew when the
        agent does not answer (a dead agent's shards are reloaded all the same)."""
        with contextlib.suppress(AgentError, AgentUnreachable):
            peer = self.hub.peer(shard.node)
            reply = await peer.ask("list_shards", control.Shards, timeout=5.0)
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
            backend=self.hub.planned_backend(shard),
        )

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
                self.hub.record(text, "error")
                results.append(ReloadResult(name, False, text))
                continue
            text = f"placement {name!r}: reloaded its shards on {where}"
            if groups:
                text += f" (tensor group{'s' if len(groups) > 1 else ''} formed again)"
            self.hub.record(text)
            results.append(ReloadResult(name, True, text))
        await self.telemetry.refresh()
        return results

    async def _prepare_again(self, saved: SavedShard, tensor: bool = False) -> control.Prepared:
        """The shard prepared again on its node, with the ports it had."""
        r, peer = saved.report, self.hub.peer(saved.node)
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
        async for _msg in self.hub.peer(saved.node).stream(
            "load_shard",
            timeout=RELOAD_TIMEOUT_S,
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
            model_digest=r.model_digest,
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
        hub = self.hub
        first = saved[0].report
        order = {node: rank for rank, node in enumerate(first.group)}
        members = sorted(saved, key=lambda s: order.get(s.node, len(order)))
        if [s.node for s in members] != list(first.group):
            raise PlacementError(
                f"the tensor group {', '.join(first.group)} of stage {first.index + 1} "
                f"is not whole (saved: {', '.join(s.node for s in members)})"
            )
        await asyncio.gather(
            *(hub.peer(s.node).request("unload", placement=s.placement) for s in members)
        )
        try:
            prepared = await asyncio.gather(*(self._prepare_again(s, tensor=True) for s in members))
            port = {s.node: p for s, p in zip(members, prepared, strict=True)}
            fields = [
                self.loading.group_fields(
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
                *(hub.peer(s.node).request("unload", placement=s.placement) for s in members),
                return_exceptions=True,
            )
            raise
