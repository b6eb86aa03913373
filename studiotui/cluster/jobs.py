"""Group jobs from the operator's side: start one rank per node, follow, stop, list.

A job runs on the nodes (worker/jobs.py), not here: each node's agent keeps its rank's
state and events, so this side can go away and come back (`follow` from the last
event it saw). Starting a group: each agent names a free port on its address
(`job_ports`), the operator sends every rank the group's hosts (the inventory's
addresses with those ports; each agent writes the hostfile with
`worker.group.ring_hostfile`) and starts them all. Following: every rank's stream of
events and beats (one a second); a rank that ends badly, or a node that says nothing
for `BEAT_TIMEOUT_S`, fails the job — the others are stopped and the failure names
the node to blame (`core.jobs.blame`).

A record of each job (kind, nodes, backend, what it was asked) is kept in
`STUDIOTUI_HOME/jobs/NAME.json`, so `studiotui jobs` and `--resume` know a job whose
nodes are down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from studiotui.cluster.hub import Cluster
from studiotui.cluster.peers import AgentError, AgentUnreachable
from studiotui.core.errors import StudioError
from studiotui.core.jobs import blame
from worker.shared.protocol import control

# Agents beat twice a second on a follow stream (worker.jobs.FOLLOW_BEAT_S); a node
# silent this long is dead (the bound is 3 s from a kill to the job failing, node named).
BEAT_TIMEOUT_S = 2.0
# Then a `hello` this long: a slow agent answers it, a dead node does not.
HELLO_S = 0.6
STALE_LIMIT = 5  # follow streams in a row that went quiet while the agent answered
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
# After the first failure, how much longer than BEAT_TIMEOUT_S the other ranks get
# to end by themselves (MLX's ring fails them at once) before they are stopped.
SETTLE_S = 0.5

Event = Callable[[str, dict[str, Any]], None]


class JobFailed(StudioError, RuntimeError):
    pass


@dataclass(frozen=True)
class JobRecord:
    name: str
    kind: str
    nodes: tuple[str, ...]
    backend: str
    started: float = field(default_factory=time.time)
    request: dict[str, Any] = field(default_factory=dict)  # the kind's own, to resume

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "nodes": list(self.nodes)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> JobRecord:
        return cls(
            str(raw["name"]),
            str(raw["kind"]),
            tuple(str(n) for n in raw["nodes"]),
            str(raw.get("backend", "ring")),
            float(raw.get("started", 0.0)),
            dict(raw.get("request") or {}),
        )


@dataclass(frozen=True)
class JobEnd:
    state: str  # done, failed, stopped
    message: str = ""
    blamed: tuple[str, ...] = ()
    ends: dict[str, tuple[str, str]] = field(default_factory=dict)


def records_dir(home: Path) -> Path:
    return home / "jobs"


def save_record(home: Path, record: JobRecord) -> None:
    folder = records_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{record.name}.json.tmp"
    tmp.write_text(json.dumps(record.to_json(), indent=1))
    tmp.replace(folder / f"{record.name}.json")
    # Started (or resumed): its coming end is news again.
    with contextlib.suppress(OSError):
        _said_file(home, record.name).unlink()


def _said_file(home: Path, name: str) -> Path:
    return records_dir(home) / f"{name}.said"


def _end_words(end: JobEnd) -> str:
    return json.dumps([end.state, end.message, sorted(end.ends.items())])


def end_said(home: Path, name: str, end: JobEnd) -> bool:
    """Whether a dashboard already announced this end of job `name` (`say_end`): the
    next dashboard that finds the job ended shows it, without announcing it again."""
    try:
        return _said_file(home, name).read_text() == _end_words(end)
    except OSError:
        return False


def say_end(home: Path, name: str, end: JobEnd) -> None:
    with contextlib.suppress(OSError):
        _said_file(home, name).write_text(_end_words(end))


def load_record(home: Path, name: str) -> JobRecord | None:
    try:
        return JobRecord.from_json(json.loads((records_dir(home) / f"{name}.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def all_records(home: Path) -> list[JobRecord]:
    found = [load_record(home, p.stem) for p in sorted(records_dir(home).glob("*.json"))]
    return sorted((r for r in found if r is not None), key=lambda r: r.started)


async def start_group(
    ctl: Cluster, record: JobRecord, specs: list[dict[str, Any]], devices: Any = None
) -> None:
    """Start rank i of `record` on `record.nodes[i]` with `specs[i]`; all or none."""
    nodes = list(record.nodes)
    hosts: list[list[Any]] = []
    if len(nodes) > 1:
        ports = await asyncio.gather(
            *(ctl.peer(n).ask("job_ports", control.JobPortsFree, count=1) for n in nodes),
            return_exceptions=True,
        )
        failed = [
            f"{n}: {p}" for n, p in zip(nodes, ports, strict=True) if isinstance(p, Exception)
        ]
        if failed:
            raise JobFailed(f"cannot start job {record.name!r}: " + "; ".join(failed))
        hosts = [
            [ctl.spec(n).address, p.ports[0]]
            for n, p in zip(nodes, ports, strict=True)
            if not isinstance(p, BaseException)
        ]
    started = await asyncio.gather(
        *(
            ctl.peer(n).ask(
                "start_job",
                control.JobRank,
                timeout=START_TIMEOUT_S,
                job=record.name,
                job_kind=record.kind,
                rank=i,
                size=len(nodes),
                backend=record.backend,
                hosts=hosts,
                devices=devices,
                spec=specs[i],
            )
            for i, n in enumerate(nodes)
        ),
        return_exceptions=True,
    )
    errors = [str(s) for s in started if isinstance(s, BaseException)]
    if errors:
        up = [n for n, s in zip(nodes, started, strict=True) if not isinstance(s, BaseException)]
        await stop(ctl, record.name, up)
        raise JobFailed(f"cannot start job {record.name!r}: " + "; ".join(errors))
    ctl.record(f"job {record.name!r} ({record.kind}) started on {', '.join(nodes)}")


async def follow(
    ctl: Cluster,
    name: str,
    nodes: list[str],
    on_event: Event,
    since: dict[str, int] | None = None,
    on_beat: Callable[[str, str, str], None] | None = None,
) -> JobEnd:
    """Follow every rank until the job ends; on a failure stop the rest and say who."""
    since = since or {}
    ends: dict[str, tuple[str, str]] = {}
    lost: list[str] = []
    first_failure = asyncio.Event()

    seen = dict(since)

    async def relay(node: str) -> None:
        stream = ctl.peer(node).stream(
            "follow_job", timeout=BEAT_TIMEOUT_S, job=name, since=seen.get(node, 0)
        )
        async for msg in stream:
            match msg:
                case control.JobEvent():
                    seen[node] = max(seen.get(node, 0), msg.seq)
                    on_event(node, dict(msg.data))
                case control.JobEnd():  # before JobBeat: an end is a beat too
                    ends[node] = (msg.state, msg.message)
                case control.JobBeat() if on_beat is not None:
                    on_beat(node, msg.state, msg.message)

    async def one(node: str) -> None:
        stale = 0
        while node not in ends:
            try:
                await relay(node)
            except AgentUnreachable:
                # Beats late: a dead node, or an agent starved of CPU for a moment.
                # One quick question tells them apart; a live one is followed on.
                try:
                    await ctl.peer(node).request("hello", timeout=HELLO_S)
                except AgentUnreachable:
                    lost.append(node)
                    silent = BEAT_TIMEOUT_S + HELLO_S
                    ends[node] = ("failed", f"{node} stopped answering (nothing for {silent:g} s)")
                    break
                stale += 1
                if stale >= STALE_LIMIT:
                    why = f"{node} answers but has not relayed job {name!r} for {stale} tries"
                    ends[node] = ("failed", why)
            except AgentError as exc:
                ends[node] = ("failed", str(exc))
        if ends[node][0] != "done":
            first_failure.set()

    tasks = {n: asyncio.create_task(one(n)) for n in nodes}
    waiting = asyncio.gather(*tasks.values())
    failure = asyncio.create_task(first_failure.wait())
    racing: set[asyncio.Future[Any]] = {waiting, failure}
    # Whatever ends this (an answer, or the caller cancelled: the dashboard closing),
    # the ranks' relays stop and their gather is awaited, so none is left running or
    # dies unheard ("exception was never retrieved") when the loop closes.
    try:
        await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            # One rank ended badly: the others cannot go on without it. MLX's ring ends
            # them within moments, and a dead node's stream runs out within BEAT_TIMEOUT_S
            # (so the blame falls on it, not on a rank that only lost its peer); what
            # still runs after that is stopped.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiting), BEAT_TIMEOUT_S + HELLO_S + SETTLE_S)
            if not waiting.done():
                await stop(ctl, name, [n for n in nodes if n not in ends and n not in lost])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(waiting), STOP_TIMEOUT_S)
    finally:
        failure.cancel()
        for task in tasks.values():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
    return outcome(name, nodes, ends, lost)


def outcome(
    name: str, nodes: list[str], ends: dict[str, tuple[str, str]], lost: list[str]
) -> JobEnd:
    states = {ends.get(n, ("failed", "no end heard"))[0] for n in nodes}
    if states == {"done"}:
        return JobEnd("done", ends=ends)
    if "failed" not in states:
        return JobEnd("stopped", "stopped", ends=ends)
    blamed = blame(ends, lost)
    said = {n: ends.get(n, ("", "no end heard"))[1] for n in blamed}
    # Each node named once: its own words may already start with its name.
    why = "; ".join(m if m.startswith(n) else f"{n}: {m}" for n, m in said.items())
    return JobEnd(
        "failed", f"job {name!r} failed on {', '.join(blamed)}: {why}", tuple(blamed), ends
    )


async def stop(ctl: Cluster, name: str, nodes: list[str]) -> dict[str, str]:
    """Stop the job's rank on each node (SIGTERM, then SIGKILL); what each said."""
    replies = await asyncio.gather(
        *(
            ctl.peer(n).ask("stop_job", control.JobRank, timeout=STOP_TIMEOUT_S, job=name)
            for n in nodes
        ),
        return_exceptions=True,
    )
    said = {}
    for node, reply in zip(nodes, replies, strict=True):
        said[node] = str(reply) if isinstance(reply, BaseException) else reply.state
    return said


async def forget(ctl: Cluster, record: JobRecord) -> None:
    """Drop an ended job: its nodes forget its events, the operator its record and
    dealt data (so its name can be used again). Its adapters stay on the nodes."""
    found = await status(ctl, list(record.nodes))
    live = [n for n, rank in found.get(record.name, {}).items() if rank.ended is None]
    if live:
        raise JobFailed(
            f"job {record.name!r} still runs on {', '.join(live)}",
            f"stop it first (studiotui jobs stop {record.name})",
        )
    await asyncio.gather(
        *(ctl.peer(n).request("forget_job", job=record.name) for n in found.get(record.name, {})),
        return_exceptions=True,
    )
    (records_dir(ctl.home) / f"{record.name}.json").unlink(missing_ok=True)
    shutil.rmtree(records_dir(ctl.home) / f"{record.name}.training-data", ignore_errors=True)
    ctl.record(f"job {record.name!r} forgotten")


async def status(ctl: Cluster, nodes: list[str]) -> dict[str, dict[str, control.JobRank]]:
    """job name -> node -> that node's rank as its agent describes it (nodes that do
    not answer are left out)."""
    replies = await asyncio.gather(
        *(ctl.peer(n).ask("job_status", control.JobsFound, timeout=3.0) for n in nodes),
        return_exceptions=True,
    )
    out: dict[str, dict[str, control.JobRank]] = {}
    for node, reply in zip(nodes, replies, strict=True):
        if isinstance(reply, BaseException):
            continue
        for job in reply.jobs:
            out.setdefault(job.job, {})[node] = job
    return out
