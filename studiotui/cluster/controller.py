"""The one owner of cluster state and of all I/O with the nodes.

Command-line verbs, the API and the TUI drive the same Controller. It keeps a frozen
`ClusterState`, replaces it on every change and tells its listeners. Commands are
named in the imperative (`place`, `unload`, `generate`); what happened is recorded in
the state's log.

The Controller is a front: each verb is a room's, and the rooms share one `Hub`
(the state, the planned rings, the sockets):

- `hub`: the state store and the connections (`hub.py`), the files kept under the
  home (`records.py`);
- `telemetry`: `hello`, the agents' telemetry and their silence (`telemetry.py`);
- `placing`: previews, placing and unloading, the memory promised (`placing.py`,
  with `core/memory.py`); `loading`: preparing, copying and loading the shards, and
  the leases meanwhile (`loading.py`);
- `generation`: requests to a placement's head (`generation.py`);
- `links`: link measurement (`links.py`);
- `kept`: shards kept across a restart and loaded again (`kept.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from studiotui.cluster.errors import GenerationError, PlacementError, PlacementRefused
from studiotui.cluster.generation import RECONNECT_GRACE_S, Generation
from studiotui.cluster.hints import not_ready_hint
from studiotui.cluster.hub import Hub, Listener
from studiotui.cluster.kept import KeptShards, ReloadResult
from studiotui.cluster.links import LINKS_EVERY_S, LINKS_FIRST_S, Links
from studiotui.cluster.loading import Loading, Progress, join_seconds
from studiotui.cluster.placing import PlaceResult, Placing
from studiotui.cluster.records import SavedShard
from studiotui.cluster.telemetry import DOWN_AFTER_S, Telemetry
from studiotui.core.inventory import Inventory
from studiotui.core.memory import RUNNER_OVERHEAD_BYTES, Promises
from studiotui.core.state import ClusterState, PlacementState
from worker.shared.protocol import control

__all__ = [
    "DOWN_AFTER_S",
    "LINKS_EVERY_S",
    "LINKS_FIRST_S",
    "RECONNECT_GRACE_S",
    "RUNNER_OVERHEAD_BYTES",
    "Controller",
    "GenerationError",
    "Listener",
    "PlaceResult",
    "PlacementError",
    "PlacementRefused",
    "Progress",
    "ReloadResult",
    "SavedShard",
    "join_seconds",
]


class Controller:
    def __init__(self, home: Path, inventory: Inventory) -> None:
        hub = self.hub = Hub(home, inventory)
        self.telemetry = Telemetry(hub)
        self.links = Links(hub)
        self.generation = Generation(hub)
        self.loading = Loading(hub, self.telemetry)
        self.kept = KeptShards(hub, self.telemetry, self.loading)
        self.placing = Placing(hub, self.telemetry, self.loading, self.kept)
        self.home, self.inventory = hub.home, hub.inventory
        self.ctx, self.keys, self.peers, self.session = hub.ctx, hub.keys, hub.peers, hub.session

        # The state and the connections.
        self.subscribe = hub.subscribe
        self.unsubscribe = hub.unsubscribe
        self.record = hub.record
        self.mark_provisioning = hub.mark_provisioning
        self.forget_placements_on = hub.forget_placements_on
        self.spec = hub.spec
        self.peer = hub.peer
        self.head_key = hub.head_key
        self.head_peer = hub.head_peer
        # What the nodes say of themselves.
        self.refresh = self.telemetry.refresh
        # Placing.
        self.preview = self.placing.preview
        self.context_offer = self.placing.context_offer
        self.node_chips = self.placing.node_chips
        self.last_measured = self.placing.last_measured
        self.check_adapter = self.placing.check_adapter
        self.place = self.placing.place
        self.unload = self.placing.unload
        self.renew_leases = self.loading.renew_leases
        self.keep_leases = self.loading.keep_leases
        # Generation.
        self.pick_placement = self.generation.pick_placement
        self.generate = self.generation.generate
        self.placement_problem = self.generation.placement_problem
        self.cancel = self.generation.cancel
        self.clear_cache = self.generation.clear_cache
        # Links.
        self.measure_links = self.links.measure
        self.link_results = self.links.results
        self.links_quiet = self.links.quiet
        # Shards kept across restarts.
        self.shards_on = self.kept.shards_on
        self.kept_shards = self.kept.kept_shards
        self.keep_shards = self.kept.keep_shards
        self.recorded_shards = self.kept.recorded_shards
        self.reload_shards = self.kept.reload_shards
        self._measuring: asyncio.Task[Any] | None = None

    @property
    def state(self) -> ClusterState:
        return self.hub.state

    @property
    def unreported_promises(self) -> Promises:
        """This controller's promises its nodes do not report yet (core/memory.py)."""
        return self.placing.unreported_promises

    @property
    def telemetry_dropped(self) -> int:
        return self.telemetry.dropped

    @property
    def lease_s(self) -> float | None:
        """The lease a placing's prepared shards ask for (None: the agent's)."""
        return self.loading.lease_s

    @lease_s.setter
    def lease_s(self, value: float | None) -> None:
        self.loading.lease_s = value

    @property
    def lease_renew_s(self) -> float:
        return self.loading.lease_renew_s

    @lease_renew_s.setter
    def lease_renew_s(self, value: float) -> None:
        self.loading.lease_renew_s = value

    @property
    def join_s(self) -> float:
        return self.loading.join_s

    def not_ready_hint(self, placement: PlacementState) -> str:
        """Why `placement` cannot answer now and what to do, naming the node and stage
        (the words a request to it fails with)."""
        return not_ready_hint(placement, self.state.nodes)

    async def start(self, telemetry: bool = True) -> None:
        await self.refresh()
        if telemetry:
            self._start_telemetry()

    def _start_telemetry(self) -> None:
        self.telemetry.start()
        self._measuring = asyncio.create_task(self.links.measure_periodically())

    async def close(self) -> None:
        if self._measuring is not None:
            self._measuring.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._measuring
        await self.telemetry.close()
        await self.hub.aclose()

    async def shutdown(self, names: list[str]) -> dict[str, str]:
        """Stop the agents of `names`; what each said."""
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
