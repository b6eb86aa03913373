"""The node's device benchmark (worker/device_bench.py): matrix-multiply and memory
figures measured in a process of its own, one at a time (device_bench), and given up
on request (stop_bench)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Iterable
from typing import Any

import msgspec

from worker.agent.host import Ask, Host, Route, route
from worker.shared.protocol import control
from worker.shared.protocol.messages import CodedError

log = logging.getLogger("studiotui.agent")

# A device measurement (worker/device_bench.py) runs seconds; one running past this is
# stopped and its request fails.
BENCH_TIMEOUT_S = 300.0
BENCH_STDERR_LINES = 20


class BenchError(RuntimeError):
    """A device or group measurement that gave no figures, in words."""


def bench_exit_reason(code: int | None) -> str:
    if code == -signal.SIGKILL:
        return "its process was killed by SIGKILL (out of memory? ask for smaller sizes)"
    if code is not None and code < 0:
        return f"its process was ended by signal {-code}"
    return f"its process exited with code {code} without figures"


class Bench:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.procs: set[asyncio.subprocess.Process] = set()
        self.stopped: set[int] = set()  # pids ended by stop_bench

    def routes(self) -> Iterable[Route]:
        return (
            route(control.DeviceBench, self.device_bench),
            route(control.StopBench, self.stop_bench),
        )

    async def device_bench(self, ask: Ask, req: control.DeviceBench) -> None:
        """Matrix-multiply and memory figures of this node's device, measured in a process
        of its own; each step is said as it starts."""
        busy = self.running()
        if busy:
            raise CodedError("busy", busy)
        try:
            figures = await self.measurement(
                ask, ["-m", "worker.device_bench", json.dumps(req.sizes)]
            )
        except BenchError as exc:
            raise CodedError("bench_failed", str(exc)) from None
        await ask.answer(
            control.DeviceBenchDone(figures=msgspec.convert(figures, control.DeviceFigures))
        )

    async def measurement(
        self,
        ask: Ask,
        argv: list[str],
        env: dict[str, str] | None = None,
        timeout: float = BENCH_TIMEOUT_S,
    ) -> dict[str, Any]:
        """Run `python ARGV` (a worker.device_bench program), relay its steps as
        `bench_step` replies and return its figures; raise BenchError with its words, or
        how it ended, when it gives none."""
        name = self.host.config.name
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )
        self.procs.add(proc)
        log.info("benchmark pid %d: %s", proc.pid, " ".join(argv[:2]))
        assert proc.stdout is not None and proc.stderr is not None
        tail: list[str] = []
        drain = asyncio.create_task(_tail(proc.stderr, tail, BENCH_STDERR_LINES))
        figures: dict[str, Any] | None = None
        fatal = ""
        try:
            async with asyncio.timeout(timeout):
                async for line in proc.stdout:
                    event = _json_object(line)
                    kind = event.get("event")
                    if kind == "step":
                        await ask.answer(control.BenchStep(step=str(event.get("step"))))
                    elif kind == "figures" and isinstance(event.get("figures"), dict):
                        figures = event["figures"]
                    elif kind == "fatal":
                        fatal = str(event.get("message", ""))
                code = await proc.wait()
        except TimeoutError:
            raise BenchError(
                f"the benchmark on {name} ran over {timeout:g} s and was stopped"
            ) from None
        finally:
            if proc.returncode is None:  # timed out or the request was cancelled
                proc.kill()
                await proc.wait()
            await drain
            self.procs.discard(proc)
        if proc.pid in self.stopped:
            self.stopped.discard(proc.pid)
            raise BenchError(f"the benchmark on {name} was stopped on request")
        if figures is not None:
            return figures
        why = fatal or bench_exit_reason(code)
        words = "\n".join(tail[-8:])
        raise BenchError(f"the benchmark on {name} failed: {why}" + (f"\n{words}" if words else ""))

    def running(self) -> str:
        running = [p.pid for p in self.procs if p.returncode is None]
        if not running:
            return ""
        return (
            f"a benchmark already runs on {self.host.config.name} (pid {running[0]}): wait for it"
        )

    async def stop_all(self) -> int:
        """End every measuring process (the agent stopping, or stop_bench); how many."""
        ended = 0
        for proc in list(self.procs):
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
                ended += 1
        return ended

    async def stop_bench(self, ask: Ask, req: control.StopBench) -> None:
        """The controller gave up a device measurement (Esc on the Benchmark screen,
        Ctrl-C): end its process now, so the node's device is free and another can
        start at once rather than after the rest of this one's seconds."""
        self.stopped.update(p.pid for p in self.procs if p.returncode is None)
        ended = await self.stop_all()
        if ended:
            log.info("stopped %d benchmark process(es) on request", ended)
        await ask.answer(control.BenchStopped(stopped=ended))

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.returncode is None]


def _json_object(line: bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}


async def _tail(stream: asyncio.StreamReader, into: list[str], keep: int) -> None:
    """Keep the last `keep` lines of a pipe (read to its end, so the writer never blocks)."""
    while line := await stream.readline():
        into.append(line.decode(errors="replace").rstrip())
        del into[:-keep]
