"""The node as the operator sees it: who it is (hello), what it holds and how loaded it
is (telemetry, published every second), its probes (RDMA and link facts, power and
memory pressure), its log (read_log), and stopping (shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import zmq.asyncio

from worker import __version__, node_probe, telemetry
from worker.agent.host import Ask, Host, Route, route
from worker.shared.protocol import control
from worker.shared.protocol.control import encode
from worker.shared.protocol.limits import tail_lines

log = logging.getLogger("studiotui.agent")
TELEMETRY_EVERY_S = 1.0
PROBE_EVERY_S = 60.0  # RDMA and link facts (cables come and go)


class Node:
    def __init__(
        self,
        host: Host,
        shards: Callable[[], list[control.ShardReport]],
        pids: Callable[[], list[int]],
        counts: Callable[[], tuple[int, int]],
    ) -> None:
        self.host = host
        self.started = time.time()
        self.shards = shards  # this node's shards, as reported
        self.pids = pids  # the processes whose memory and CPU count as the agent's
        self.counts = counts  # control messages dropped and refused so far

    def routes(self) -> Iterable[Route]:
        return (
            route(control.Hello, self.hello),
            route(control.ReadLog, self.read_log),
            route(control.Shutdown, self.shutdown),
        )

    def sample(self) -> dict[str, Any]:
        """Memory, CPU (this agent's and its processes'), power and pressure now."""
        sample = {**telemetry.sample(self.host.config.memory_gb, self.pids()), **self.host.live}
        sample.pop("time", None)
        # The prompt cache's disk budget is checked against it (core.placement.disk).
        with contextlib.suppress(OSError):
            sample["disk_free"] = shutil.disk_usage(self.host.config.home).free
        return sample

    async def hello(self, ask: Ask, req: control.Hello) -> None:
        config = self.host.config
        fields = {
            **self.sample(),
            "name": config.name,
            "version": __version__,
            "pid": os.getpid(),
            "address": config.address,
            "control_port": config.control_port,
            "started": self.started,
            "facts": self.host.facts,
        }
        reply = msgspec.convert(fields, control.HelloReply)
        await ask.answer(msgspec.structs.replace(reply, shards=self.shards()))

    async def read_log(self, ask: Ask, req: control.ReadLog) -> None:
        # Off the loop and bounded: a slow disk or a huge log must not stall every
        # other request, nor grow the agent by the log's size.
        path = self.host.config.home / "agent.log"
        lines = await asyncio.to_thread(tail_lines, path, req.lines)
        await ask.answer(control.LogLines(lines=lines))

    async def shutdown(self, ask: Ask, req: control.Shutdown) -> None:
        await ask.answer(control.Ok())
        self.host.stopping.set()

    async def publish(self, pub: zmq.asyncio.Socket, reload_keys: Callable[[], int]) -> None:
        """A telemetry message every TELEMETRY_EVERY_S (and the authorized keys taken up
        again when they changed on disk)."""
        config = self.host.config
        while True:
            if keys := reload_keys():
                log.info("authorized keys reloaded (%d)", keys)
            dropped, refused = self.counts()
            fields = {
                **self.sample(),
                "name": config.name,
                "time": time.time(),
                "version": __version__,
                "facts": self.host.facts,
                "dropped": dropped,
                "refused": refused,
            }
            msg = msgspec.structs.replace(
                msgspec.convert(fields, control.Telemetry), shards=self.shards()
            )
            await pub.send_multipart([b"telemetry", encode(msg)])
            await asyncio.sleep(TELEMETRY_EVERY_S)

    async def probe(self) -> None:
        """Gather RDMA and link facts off the loop (probes may take seconds on a Mac),
        again every PROBE_EVERY_S: a cable plugged in or a port that went down changes
        which RDMA device reaches which node, and JACCL's device matrix with it. Each
        round runs the cheap probes; `system_profiler` (seconds) only on a change."""
        config = self.host.config
        replay = config.home / node_probe.REPLAY_FOLDER
        # Between rounds: the slow Thunderbolt listing is read again only when the
        # cheap probes (ifconfig, the hardware ports, RDMA port states) changed.
        memo = node_probe.ProbeMemo()
        while True:
            try:
                rdma = await asyncio.to_thread(
                    node_probe.rdma_facts, replay if replay.is_dir() else None, memo
                )
                log.debug("probes ran: %s", ", ".join(memo.ran))
                end = await asyncio.to_thread(node_probe.link_end, config.address)
            except Exception:  # a probe must never stop the agent: the next round retries
                log.exception("probing RDMA and link facts failed")
            else:
                facts = self.host.facts
                self.host.facts = {**facts, "rdma": rdma, "link_end": end, "link_kind": end["kind"]}
            await asyncio.sleep(PROBE_EVERY_S)

    async def meter(self) -> None:
        meter = await asyncio.to_thread(telemetry.Meter.for_this_machine)
        await telemetry.keep_reading(meter, self.host.live)
