"""How fast the nodes reach one another: every up node measures every other (latency,
and bandwidth over CURVE), now and then by itself and on demand; kept in the state
and in `links-<cluster>.json` for the planner."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from studiotui.cluster.hub import Hub
from studiotui.cluster.peers import AgentError, AgentUnreachable
from studiotui.core.members import rdma_link
from studiotui.core.state import LinkState, NodeState
from worker.shared import probes
from worker.shared.protocol import control

LINKS_FIRST_S = 30.0
LINKS_EVERY_S = 300.0


class Links:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        # While a benchmark runs (quiet) the periodic link measurement waits: it
        # shares the wire and the CPUs with the figures being taken. One under way
        # (holding _periodic) finishes before the benchmark starts.
        self._quiet = 0
        self._allowed = asyncio.Event()
        self._allowed.set()
        self._periodic = asyncio.Lock()

    async def measure_periodically(self) -> None:
        await asyncio.sleep(LINKS_FIRST_S)
        while True:
            # Due during a benchmark: measured once it ends.
            await self._allowed.wait()
            async with self._periodic:
                if not self._allowed.is_set():
                    continue  # a benchmark began while this waited for the lock
                try:
                    await self.measure()
                except Exception as exc:  # a failed measurement must not stop the loop
                    self.hub.record(f"link measurement failed: {exc}", "warning")
            await asyncio.sleep(LINKS_EVERY_S)

    @contextlib.asynccontextmanager
    async def quiet(self) -> AsyncIterator[None]:
        """No periodic link measurement inside this block (a benchmark): one under way
        finishes first, and one that comes due meanwhile runs when the last such block
        ends."""
        self._quiet += 1
        self._allowed.clear()
        try:
            async with self._periodic:
                pass
            yield
        finally:
            self._quiet -= 1
            if not self._quiet:
                self._allowed.set()

    async def measure(self) -> tuple[LinkState, ...]:
        """Every up node measures every other, one node at a time so that
        measurements do not share the wire."""
        hub = self.hub
        up = [n.name for n in hub.state.nodes if n.state == "up"]
        found: dict[frozenset[str], list[control.LinkResult]] = {}
        for node in up:
            try:
                results = await self.results(node, [p for p in up if p != node])
            except (AgentError, AgentUnreachable) as exc:
                hub.record(f"{node} could not measure its links: {exc}", "warning")
                continue
            for result in results:
                link = control.parse(result, control.LinkResult)  # checked by results()
                found.setdefault(frozenset((node, link.peer)), []).append(link)
        links = tuple(
            self._link(pair, results)
            for pair, results in sorted(found.items(), key=lambda kv: sorted(kv[0]))
        )
        hub.set(replace(hub.state, links=links))
        hub.records.save_links(links)
        hub.record(f"measured {len(links)} links")
        return links

    async def results(
        self, node: str, peers: list[str], sizes: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """What `node` measures towards each of `peers` (latency, and bandwidth over a
        CURVE PUSH to a PULL the peer opens), each result marked with `from`; `sizes`
        changes how long and with what messages (limits.LINK_MEASURE_BOUNDS)."""
        if not peers:
            return []
        hub = self.hub
        targets = [
            {"name": p, "endpoint": hub.spec(p).control_endpoint, "key": hub.node_key(p)}
            for p in peers
        ]
        extra = {"sizes": sizes} if sizes else {}
        peer = hub.peer(node)
        reply = await peer.ask("measure_links", control.Links, timeout=60.0, peers=targets, **extra)
        return [{**control.to_wire(r), "from": node} for r in reply.links]

    def _link(self, pair: frozenset[str], results: list[control.LinkResult]) -> LinkState:
        a, b = sorted(pair)
        good = [r.latency_us for r in results if r.latency_us is not None]
        state = self.hub.state
        # RDMA when an active cable joins the two (core/members.rdma_link), with the
        # reason when both have RDMA but no such cable.
        facts = {n: (state.node(n) or NodeState(n, "", 0, "")).facts for n in (a, b)}
        judged = rdma_link(a, b, {n: f.get("rdma") for n, f in facts.items()})
        rdma, rdma_why = judged if judged is not None else (False, "")
        # The kind from both ends' interfaces; an agent's own end is the fallback.
        ends = [probes.LinkEnd.from_facts(facts[n].get("link_end")) for n in (a, b)]
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
