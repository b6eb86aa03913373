"""Cluster jobs on a node: one rank of an `mx.distributed` group, run and watched here.

A job (fine-tuning, the cluster benchmark's distributed product, ...) is a group of
processes, one per node, that talk over MLX's own distributed engine. The operator
asks each node's agent to `start_job` its rank; the agent writes the rank's spec and
the group's files (`worker.group`), starts `python -m worker.<module> SPEC.json` with
the rank's environment, and keeps what the process says (JSON lines on stdout:
`progress`, `metrics`, `saved`, `result`, `fatal`, ...) with a sequence number, so
whoever follows the job — the CLI that started it, or a dashboard opened an hour
later — gets every event since the one it last saw, then the live ones, with a beat
every second. The agent, not the operator, holds a job's truth: closing the TUI
changes nothing for it.

A rank that ends is reported at once (its exit is seen on its pipe); a rank whose
node dies stops beating, which the follower notices (`FOLLOW_BEAT_S`). MLX's ring
backend ends the surviving ranks itself ("connection to a peer was lost").

The job process side: `emit()` writes one event, `start_beating()` a beat every
half second from a thread, `read_spec()` reads the spec.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker import group
from worker.shared.protocol import control
from worker.shared.protocol.messages import ErrorCode

# kind -> the module run as `python -m MODULE SPEC.json`; nothing else can be started.
# Each kind of job adds its module here (and to the node's layers in pyproject.toml).
KINDS: dict[str, str] = {
    # LoRA / QLoRA fine-tuning with mlx-lm's trainer, data parallel
    "finetune": "worker.finetune",
    # the cluster benchmark's distributed matrix product, one rank per node
    "benchmark": "worker.device_bench",
}
# What a follower hears at least this often while the job lives (a beat, or an event).
FOLLOW_BEAT_S = 0.5
# A running rank silent this long (its beat thread included) is "silent": stopped or frozen.
SILENT_AFTER_S = 3.0
STOP_GRACE_S = 5.0
# Events kept per rank for a follower that comes later (a metrics line every few steps:
# days of training at one report a minute).
KEEP_EVENTS = 5000
BEAT_EVERY_S = 0.5
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class JobError(ValueError):
    """A start or stop request that cannot be done, with what to change; `code` says
    which kind of refusal (answered as an error reply's code)."""

    def __init__(self, message: str, code: ErrorCode = "bad_request") -> None:
        super().__init__(message)
        self.code: ErrorCode = code


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _JOB_NAME.match(name):
        raise JobError(
            f"job name {name!r} must be 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass
class JobProc:
    """One rank of a job, as this agent runs it."""

    job: str
    kind: str
    rank: int
    size: int
    backend: str
    directory: Path
    spec: dict[str, Any] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None
    state: str = "starting"  # starting, running, silent, done, failed, stopped
    message: str = ""
    code: int | None = None
    started: float = field(default_factory=time.time)
    ended: float | None = None
    last_heard: float = field(default_factory=time.monotonic)
    events: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    latest: dict[str, Any] = field(default_factory=dict)  # last event of each kind
    stderr_tail: list[str] = field(default_factory=list)
    bad_lines: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        """Its process has ended and the agent has read all it wrote."""
        return self.ended is not None

    def add(self, event: dict[str, Any]) -> None:
        self.seq += 1
        event = {**event, "seq": self.seq}
        self.events = [*self.events[-(KEEP_EVENTS - 1) :], event]
        self.latest[str(event.get("event", ""))] = event
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def describe(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "job_kind": self.kind,
            "rank": self.rank,
            "size": self.size,
            "backend": self.backend,
            "state": self.state,
            "message": self.message,
            "code": self.code,
            "pid": self.proc.pid if self.proc else None,
            "started": self.started,
            "ended": self.ended,
            "seq": self.seq,
            "latest": self.latest,
            "directory": str(self.directory),
            "spec": self.spec,
        }


def exit_message(code: int, fatal: str, stderr_tail: list[str]) -> str:
    """Why a rank ended, in words: its own `fatal` event first, else its exit code and
    the last lines it wrote to stderr."""
    if fatal:
        return fatal
    if code == -signal.SIGKILL:
        why = "killed by SIGKILL (out of memory, or by hand)"
    elif code < 0:
        why = f"killed by signal {-code}"
    else:
        why = f"exited with code {code}"
    tail = " | ".join(line for line in stderr_tail[-3:] if line.strip())
    return f"{why}: {tail}" if tail else why


class Jobs:
    """The jobs of one agent: start, follow, stop, list."""

    def __init__(self, home: Path, address: str) -> None:
        self.home = home
        self.address = address
        self.jobs: dict[str, JobProc] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def ports_held(self) -> set[int]:
        """Ports this agent's live jobs listen on (so a new job is not given them)."""
        held: set[int] = set()
        for job in self.jobs.values():
            if not job.finished:
                held.update(int(p) for p in job.spec.get("_ports", []))
        return held

    def pids(self) -> list[int]:
        return [
            j.proc.pid
            for j in self.jobs.values()
            if j.proc is not None and j.proc.returncode is None
        ]

    async def start(self, req: control.StartJob) -> JobProc:
        """Start this node's rank of a job as `req` asks (see studiotui.cluster.jobs)."""
        name = check_name(req.job)
        kind = req.job_kind
        if kind not in KINDS:
            raise JobError(f"unknown job kind {kind!r}; this node runs {', '.join(sorted(KINDS))}")
        old = self.jobs.get(name)
        if old is not None and not old.finished:
            raise JobError(f"job {name!r} is {old.state} here: stop it first", "conflict")
        rank, size, backend = req.rank, req.size, req.backend
        if not 0 <= rank < size:
            raise JobError(f"rank {rank} is not one of a group of {size} (0-{size - 1})")
        directory = self.home / "jobs" / name / f"rank{rank}"
        directory.mkdir(parents=True, exist_ok=True)
        env: dict[str, str] = {}
        ports: list[int] = []
        if size > 1:
            env, ports = self._group_env(req, directory)
        spec = dict(req.spec)
        spec.update(job=name, rank=rank, size=size, backend=backend, directory=str(directory))
        spec_path = group.write_json(directory / "spec.json", spec)
        job = JobProc(name, kind, rank, size, backend, directory, spec={**spec, "_ports": ports})
        try:
            job.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                KINDS[kind],
                str(spec_path),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                # Its own process group: stopping a job reaches whatever it started too.
                start_new_session=True,
            )
        except OSError as exc:
            raise JobError(f"cannot start job {name!r}: {exc}", "failed") from None
        self.jobs[name] = job
        job.state = "running"
        job.add({"event": "started", "pid": job.proc.pid, "rank": rank})
        self._spawn(self._read(job))
        return job

    def _group_env(
        self, req: control.StartJob, directory: Path
    ) -> tuple[dict[str, str], list[int]]:
        rank, size, backend = req.rank, req.size, req.backend
        if len(req.hosts) != size:
            raise JobError(f"a group of {size} needs {size} hosts, got {len(req.hosts)}")
        addresses = [address for address, _ in req.hosts]
        ports = [port for _, port in req.hosts]
        try:
            if backend == "ring":
                hostfile = group.write_json(
                    directory / "hostfile.json", group.ring_hostfile(addresses, ports)
                )
                env = group.rank_env(rank, size, "ring", hostfile=hostfile)
            elif backend == "jaccl":
                devices = group.write_json(directory / "devices.json", req.devices)
                coordinator = f"{addresses[0]}:{ports[0]}"
                env = group.rank_env(rank, size, "jaccl", coordinator=coordinator, devices=devices)
            else:
                raise JobError(f"unknown backend {backend!r}; use ring or jaccl")
        except group.GroupError as exc:
            raise JobError(str(exc)) from None
        return env, [ports[rank]]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self, job: JobProc) -> None:
        assert job.proc is not None and job.proc.stdout is not None
        self._spawn(self._read_stderr(job))
        while True:
            try:
                line = await job.proc.stdout.readline()
            except ValueError:  # an over-long line: skipped, not fatal
                job.bad_lines += 1
                continue
            if not line:
                break
            job.last_heard = time.monotonic()
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if not isinstance(event, dict) or "event" not in event:
                job.bad_lines += 1
                continue
            if event["event"] == "beat":
                if job.state == "silent":
                    job.state = "running"
                continue
            job.add(event)
        code = await job.proc.wait()
        job.code = code
        fatal = str(job.latest.get("fatal", {}).get("message", ""))
        if job.state == "stopped":
            job.message = "stopped"
        elif code == 0 and not fatal:
            job.state, job.message = "done", ""
        else:
            job.state = "failed"
            job.message = exit_message(code, fatal, job.stderr_tail)
        job.ended = time.time()
        job.add({"event": "ended", "state": job.state, "message": job.message, "code": code})

    async def _read_stderr(self, job: JobProc) -> None:
        assert job.proc is not None and job.proc.stderr is not None
        while True:
            try:
                line = await job.proc.stderr.readline()
            except ValueError:
                continue
            if not line:
                return
            job.stderr_tail = [*job.stderr_tail[-49:], line.decode(errors="replace").rstrip()]

    def judge(self, now: float) -> None:
        """Mark a running rank that has said nothing (not even a beat) for a while."""
        for job in self.jobs.values():
            if job.state == "running" and now - job.last_heard > SILENT_AFTER_S:
                job.state = "silent"
                job._wake()

    async def follow(self, name: str, since: int = 0) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """("event", e) for each event after `since`, ("beat", status) at least every
        FOLLOW_BEAT_S while the rank lives, and a last ("end", status)."""
        job = self.jobs.get(name)
        if job is None:
            raise JobError(f"no job {name!r} on this node", "not_found")
        seen = since
        while True:
            waiter = job.changed  # taken before reading: an event added meanwhile wakes it
            for event in list(job.events):
                if event["seq"] > seen:
                    seen = event["seq"]
                    yield "event", event
            if job.finished and seen >= job.seq:
                yield "end", _status(job)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.wait(), FOLLOW_BEAT_S)
            if not any(e["seq"] > seen for e in job.events):
                yield "beat", _status(job)

    async def stop(self, name: str) -> JobProc:
        """SIGTERM the rank's process group, SIGKILL it after STOP_GRACE_S: nothing is left."""
        job = self.jobs.get(name)
        if job is None:
            raise JobError(f"no job {name!r} on this node", "not_found")
        proc = job.proc
        if proc is None or proc.returncode is not None:
            return job
        job.state = "stopped"
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
        # What the rank started itself (a thread pool, a helper) goes with it.
        _signal_group(proc.pid, signal.SIGKILL)
        return job

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(n) for n in list(self.jobs)), return_exceptions=True)

    def forget(self, name: str) -> bool:
        job = self.jobs.get(name)
        if job is None or not job.finished:
            return False
        del self.jobs[name]
        return True


def _status(job: JobProc) -> dict[str, Any]:
    return {
        "job": job.job,
        "rank": job.rank,
        "state": job.state,
        "message": job.message,
        "code": job.code,
        "seq": job.seq,
    }


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


# ---- the job process's side --------------------------------------------------------------

_emit_lock = threading.Lock()
_events: list[Any] = []  # where events go: the stdout pipe the agent reads


def own_stdout() -> None:
    """Keep the agent's pipe for events alone: whatever else writes to stdout (a
    library's progress bars) goes to stderr, which the agent keeps as the log tail."""
    pipe = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    _events[:] = [pipe]


def emit(event: str, **fields: Any) -> None:
    """One event on stdout, as the agent reads it."""
    line = json.dumps({"event": event, **fields}) + "\n"
    out = _events[0] if _events else sys.stdout
    with _emit_lock:  # the beat thread writes too: lines must not interleave
        out.write(line)
        out.flush()


def start_beating() -> threading.Thread:
    """Beat every BEAT_EVERY_S from a thread, and leave when the agent is gone (a rank
    without its agent has no one to report to; its group fails with it)."""
    parent = os.getppid()

    def beat() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            emit("beat")
            time.sleep(BEAT_EVERY_S)

    thread = threading.Thread(target=beat, name="beat", daemon=True)
    thread.start()
    return thread


def read_spec(path: str) -> dict[str, Any]:
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, dict):
        raise JobError(f"{path} holds no job spec")
    return raw
