"""Cluster jobs (worker/jobs.py): one rank of a job per node, as studiotui.cluster.jobs
asks — free ports for a group, start, follow (its events, a beat, its end), status,
stop, forget."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from worker import jobs
from worker.agent.host import Ask, Host, Route, route
from worker.shared.protocol import control
from worker.shared.protocol.messages import CodedError

log = logging.getLogger("studiotui.agent")

# Followers of one job at once (a dashboard, a CLI, ...); an older one gives way.
MAX_FOLLOWERS = 8


class Jobs:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.follows: dict[str, list[asyncio.Task[Any]]] = {}

    def routes(self) -> Iterable[Route]:
        return (
            route(control.JobPorts, self.ports),
            route(control.StartJob, self.start),
            route(control.FollowJob, self.follow),
            route(control.JobStatusAsk, self.status),
            route(control.StopJob, self.stop),
            route(control.ForgetJob, self.forget),
        )

    def refused(self, exc: jobs.JobError) -> CodedError:
        return CodedError(exc.code, f"{self.host.config.name}: {exc}")

    async def ports(self, ask: Ask, req: control.JobPorts) -> None:
        """Free ports on this node's address, for a rank of a group job to listen on."""
        if not 1 <= req.count <= 16:
            raise CodedError("bad_request", "job_ports wants a count of 1-16")
        await ask.answer(control.JobPortsFree(ports=self.host.free_ports(req.count)))

    async def start(self, ask: Ask, req: control.StartJob) -> None:
        try:
            job = await self.host.jobs.start(req)
        except jobs.JobError as exc:
            raise self.refused(exc) from None
        assert job.proc is not None
        log.info(
            "job %s rank %d/%d (%s) pid %d", job.job, job.rank, job.size, job.kind, job.proc.pid
        )
        await ask.answer(control.JobStarted(**job.describe()))

    async def follow(self, ask: Ask, req: control.FollowJob) -> None:
        """Every event of a job's rank after `since`, a beat each second, then its end."""
        # A follower that went away (a closed TUI) is not told; its relay ends when the
        # job does. Bounded: the oldest relays of a job give way to new followers.
        relays = self.follows.setdefault(req.job, [])
        relays[:] = [t for t in relays if not t.done()]
        if (me := asyncio.current_task()) is not None:
            relays.append(me)
        while len(relays) > MAX_FOLLOWERS:
            relays.pop(0).cancel()
        node = self.host.config.name
        try:
            async for kind, body in self.host.jobs.follow(req.job, req.since):
                if kind == "event":
                    # The job's own fields stay in `data`: they cannot clash with ours.
                    await ask.answer(
                        control.JobEvent(
                            node=node, event=str(body["event"]), seq=int(body["seq"]), data=body
                        )
                    )
                elif kind == "beat":
                    await ask.answer(control.JobBeat(node=node, **body))
                else:
                    await ask.answer(control.JobEnd(node=node, **body))
        except jobs.JobError as exc:
            raise self.refused(exc) from None

    async def status(self, ask: Ask, req: control.JobStatusAsk) -> None:
        found = [
            control.JobRank(**j.describe())
            for j in self.host.jobs.jobs.values()
            if j.job == req.job or not req.job
        ]
        await ask.answer(control.JobsFound(node=self.host.config.name, jobs=found))

    async def stop(self, ask: Ask, req: control.StopJob) -> None:
        try:
            job = await self.host.jobs.stop(req.job)
        except jobs.JobError as exc:
            raise self.refused(exc) from None
        log.info("job %s stopped (%s)", job.job, job.state)
        await ask.answer(control.JobStopped(**job.describe()))

    async def forget(self, ask: Ask, req: control.ForgetJob) -> None:
        await ask.answer(control.Forgotten(forgotten=self.host.jobs.forget(req.job)))
