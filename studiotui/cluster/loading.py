"""Putting a plan on the nodes: each shard prepared (its memory promised, its ports
taken), its files found or copied (the leases renewed meanwhile), then loaded, with a
tensor group's members told of one another; unloading again."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from studiotui.cluster import model_files, model_sync
from studiotui.cluster.errors import PlacementError
from studiotui.cluster.hub import HEALTH_CHECK_S, UNLOAD_QUIET_S, Hub
from studiotui.cluster.peers import AgentUnreachable
from studiotui.cluster.telemetry import Telemetry
from studiotui.core.load_watch import LoadWatch, node_gone
from studiotui.core.members import Member, jaccl_devices, members
from studiotui.core.model_facts import read_model
from studiotui.core.placement import Plan
from worker.shared.adapters import FILES as ADAPTER_FILES
from worker.shared.adapters import WEIGHTS_NAME, Adapter
from worker.shared.manifest import Hashing, manifest, model_digest
from worker.shared.protocol import control

UNLOAD_TIMEOUT_S = 10.0
# A placing controller renews its prepared shards this often while their files are
# copied: an agent drops one unrenewed for 5 min (control.PREPARED_LEASE_S), so
# the memory promised to a placement whose operator died mid-copy is not held for ever.
LEASE_RENEW_EVERY_S = 30.0
Progress = Callable[[str, int, int], None]
# What a placement speculates with: "lookup" or "model" (with the draft model's
# folder on this machine) and how many tokens a guess runs ahead; ("", None, 0): none.
Speculation = tuple[str, Path | None, int]


def join_seconds(env: Mapping[str, str]) -> float:
    """How long a tensor group's ranks wait for one another: STUDIOTUI_JOIN_S if it is
    positive seconds (a loaded or slow machine), else GROUP_JOIN_S."""
    try:
        value = float(env.get(control.JOIN_S_VAR, control.GROUP_JOIN_S))
    except ValueError:
        return control.GROUP_JOIN_S
    return value if 0 < value < float("inf") else control.GROUP_JOIN_S


def _tied(model_dir: Path) -> bool:
    try:
        return bool(json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings"))
    except (OSError, ValueError):
        return False


class Loading:
    def __init__(self, hub: Hub, telemetry: Telemetry) -> None:
        self.hub = hub
        self.telemetry = telemetry
        # The lease its prepared shards ask for (None: the agent's, 5 min); renewed
        # every lease_renew_s while their files are copied (see keep_leases).
        self.lease_s: float | None = None
        self.lease_renew_s = LEASE_RENEW_EVERY_S
        # How long a tensor group's ranks wait for one another to start (each told it
        # with its load; meanwhile the agents' heartbeats keep the load alive).
        self.join_s = join_seconds(os.environ)

    async def deploy(
        self,
        the_plan: Plan,
        model_dir: Path,
        name: str,
        progress: Progress | None,
        prefill_chunk: int,
        adapter: Adapter | None = None,
        hashing: Hashing | None = None,
        speculation: Speculation = ("", None, 0),
        on_prepared: Callable[[], None] = lambda: None,
    ) -> None:
        """Prepare, provide and load every shard of `the_plan` as placement `name`;
        `on_prepared` once the nodes report the prepared shards (and their promise)."""
        hub = self.hub
        shards = the_plan.shards
        procs = members(the_plan)
        if speculation[0] == "model" and len(shards[0].group) > 1:
            # Every rank of a head group must guess alike; the draft runs on one node.
            raise PlacementError(
                "--draft DRAFT_DIR: a draft model runs on one head node, and this head "
                f"stage is a tensor group ({' + '.join(shards[0].group)}): place the "
                "head stage on one node, or use --draft lookup"
            )
        prepared = await asyncio.gather(
            *(
                hub.peer(m.node).ask(
                    "prepare_shard",
                    control.Prepared,
                    placement=name,
                    tensor=bool(m.group),
                    # Promised from here, through the copy, until loaded (memory.promised_bytes).
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
        await asyncio.gather(*(self.telemetry.hello(n, 2.0) for n in dict.fromkeys(port)))
        on_prepared()
        count = len(shards)
        # The copies may take hours: the shards' leases renewed until they load.
        keeper = asyncio.create_task(self.keep_leases(name, list(port), self.lease_renew_s))
        try:
            dirs = await self.model_dirs(procs, model_dir, progress, hashing)
            adapter_dirs = await self._adapter_dirs(procs, adapter, progress) if adapter else {}
            draft, guesser, draft_tokens = speculation
            head = next(m for m in procs if m.stage == 0 and m.rank == 0)
            draft_at = ""
            if guesser is not None:
                # The draft model goes whole to the head node, as a model's files do.
                whole = [Member(0, 0, head.node, 0, read_model(guesser).n_layers, (), None)]
                draft_at = (await self.model_dirs(whole, guesser, progress, hashing))[head.node]
            # The model by its bytes, for every shard: it names the prefix cache's
            # entries on disk, so a folder whose weights were replaced never serves the
            # old ones' and a re-copied one (new times, same bytes) keeps them. Files
            # hashed for a copy above are cached already; the rest are read once, and
            # not at all when nothing goes to disk.
            digest = ""
            if any(s.prompt_cache_bytes and s.prompt_cache_disk_bytes for s in shards):
                digest = await asyncio.to_thread(model_digest, model_dir, on_progress=hashing)
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        leaders = [next(m for m in procs if m.stage == i and m.rank == 0) for i in range(count)]

        async def load(m: Member) -> None:
            nxt = leaders[(m.stage + 1) % count]
            endpoint = f"tcp://{hub.spec(nxt.node).address}:{port[nxt.node].data_port}"
            # No fixed wait: the agent heartbeats while the shard loads, and only its
            # silence (see LoadWatch) ends a load, however slow the disk.
            quiet = LoadWatch(m.node, time.monotonic())
            stream = hub.peer(m.node).stream(
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
                next_key=hub.node_key(nxt.node),
                prefill_chunk=prefill_chunk,
                context_tokens=the_plan.context_tokens,
                streams=the_plan.streams,
                kv_bytes=shards[m.stage].kv_bytes,
                **self.group_fields(m, port),
                adapter=adapter.name if adapter else "",
                adapter_dir=adapter_dirs.get(m.node, ""),
                adapter_bytes=shards[m.stage].adapter_bytes,
                kv_bits=the_plan.kv_bits,
                kv_group_size=the_plan.kv_group_size,
                prompt_cache_bytes=shards[m.stage].prompt_cache_bytes,
                prompt_cache_disk_bytes=shards[m.stage].prompt_cache_disk_bytes,
                model_digest=digest,
                **(
                    {"draft": draft, "draft_dir": draft_at, "draft_tokens": draft_tokens}
                    if m is head
                    # A head group's followers run the leader's steps: its guesses too.
                    else {"draft": draft, "draft_tokens": draft_tokens}
                    if m.stage == 0
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

    def group_fields(self, m: Member, port: dict[str, control.Prepared]) -> dict[str, Any]:
        """What a tensor group's member needs besides a shard's fields: the group (rank
        order), every member's bridge address and mx.distributed port (the agent writes
        the hostfile from them), the backend; the leader gets its followers' mirror
        endpoints, a follower its leader's key. Nothing for a one-node stage."""
        if not m.group:
            return {}
        hub = self.hub
        fields: dict[str, Any] = {
            "group": list(m.group),
            "rank": m.rank,
            "backend": m.backend or "ring",
            "group_addresses": [hub.spec(n).address for n in m.group],
            "group_ports": [port[n].group_port for n in m.group],
            "join_s": self.join_s,
        }
        if m.backend == "jaccl":
            rdma = {
                n: (node.facts.get("rdma") or {}) for n in m.group if (node := hub.state.node(n))
            }
            devices = jaccl_devices(m.group, rdma)
            if isinstance(devices, str):
                raise PlacementError(f"JACCL for {', '.join(m.group)}: {devices}")
            fields["devices"] = devices
        if m.rank == 0:
            fields["followers"] = [
                [f"tcp://{hub.spec(n).address}:{port[n].data_port}", hub.node_key(n)]
                for n in m.group[1:]
            ]
        else:
            fields["leader_key"] = hub.node_key(m.group[0])
        return fields

    async def model_dirs(
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
        hub = self.hub
        where = {s.node: str(model_dir) for s in shards if hub.spec(s.node).is_local}
        config = read_model(model_dir)
        tied = config.facts.head_bytes > 0 and _tied(model_dir)
        needs: dict[str, dict[str, model_files.NeededFile]] = {}
        for s in shards:
            if s.node not in where:
                found = model_files.needed_files(model_dir, s.start, s.end, config.n_layers, tied)
                needs.setdefault(s.node, {}).update({f.name: f for f in found})
        if needs:
            wanted = {node: list(files.values()) for node, files in needs.items()}
            where |= await self._provide(model_dir, wanted, progress, hashing=hashing)
        return where

    async def _provide(
        self,
        source: Path,
        wanted: dict[str, list[model_files.NeededFile]],
        progress: Progress | None,
        folder: str | None = None,
        hashing: Hashing | None = None,
    ) -> dict[str, str]:
        """`model_sync.provide`, its refusals (no room, bad files) a PlacementError."""
        try:
            return await model_sync.provide(
                self.hub, source, wanted, progress, folder=folder, hashing=hashing
            )
        except (model_sync.SyncRefused, model_files.ModelFilesError) as exc:
            raise PlacementError(str(exc)) from None

    async def _adapter_dirs(
        self, shards: Any, adapter: Adapter, progress: Progress | None
    ) -> dict[str, str]:
        """Where each node whose layers the adapter touches finds its files: the
        operator's path on this machine, else a copy (by content, as model files are)
        under the node's `models/<adapter>@<hash>`. A node whose layers it does not
        touch gets nothing: its layers are the base model's."""
        hub = self.hub
        touched = [s for s in shards if adapter.touches(s.start, s.end)]
        where = {s.node: str(adapter.path) for s in touched if hub.spec(s.node).is_local}
        remote = sorted({s.node for s in touched if s.node not in where})
        if remote:
            ids = await asyncio.to_thread(manifest, adapter.path, ADAPTER_FILES)
            weights = ids[WEIGHTS_NAME].sha256
            files = [model_files.NeededFile(f.name, f.size) for f in ids.values()]
            wanted = {node: files for node in remote}
            folder = f"{adapter.name}@{weights[:12]}"
            where |= await self._provide(adapter.path, wanted, progress, folder=folder)
        return where

    async def renew_leases(self, name: str, nodes: Sequence[str]) -> list[str]:
        """Renew the leases of `name`'s prepared shards on `nodes`; the nodes that no
        longer hold one prepared (a node not answering is left to the load's watch)."""
        replies = await asyncio.gather(
            *(
                self.hub.peer(n).ask("renew_shards", control.Renewed, placements=[name])
                for n in nodes
            ),
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
                self.hub.record(
                    f"{node} no longer holds {name!r} prepared (its lease lapsed?)", "warning"
                )
                kept.remove(node)

    async def _watch_nodes(self, nodes: list[str]) -> str:
        """Return (only) when one of `nodes` is gone (see `node_gone`), saying which."""
        hub = self.hub
        heard = dict.fromkeys(nodes, time.monotonic())
        while True:
            await asyncio.sleep(HEALTH_CHECK_S)
            replies = await asyncio.gather(
                *(hub.peer(n).request("hello", timeout=HEALTH_CHECK_S) for n in nodes),
                return_exceptions=True,
            )
            now = time.monotonic()
            for node, reply in zip(nodes, replies, strict=True):
                if not isinstance(reply, BaseException):
                    heard[node] = now
                gone = node_gone(node, hub.peer(node).down_for(), now - heard[node])
                if gone:
                    return gone

    async def unload_everywhere(self, name: str, nodes: list[str]) -> None:
        hub = self.hub
        hub.unloading[name] = time.monotonic() + UNLOAD_QUIET_S
        await asyncio.gather(
            *(
                hub.peer(n).request("unload", timeout=UNLOAD_TIMEOUT_S, placement=name)
                for n in nodes
            ),
            return_exceptions=True,
        )
        # The head's socket goes with its runner: a placement of the same name placed
        # again on the same node and port must not inherit the old socket's "down
        # since the unload", which fails its first request after RECONNECT_GRACE_S.
        await hub.drop_heads(name)
