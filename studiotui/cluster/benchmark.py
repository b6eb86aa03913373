"""Running the cluster benchmark against live agents: each node's device, each link, the
group's distributed product and each placement's streams, one step at a time.

Steps run one after another, never two at once: the nodes of a desk cluster may share
a switch, and the simulated nodes of one machine share its cores, so a figure measured
beside another would be neither's. A step that fails is recorded with its words and the
run goes on; the figures in `core/benchmark.py` say what failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from studiotui import __version__
from studiotui.cluster import jobs
from studiotui.cluster.controller import Controller, GenerationError
from studiotui.cluster.jobs import JobFailed, JobRecord
from studiotui.cluster.peers import AgentError, AgentUnreachable
from studiotui.cluster.streams import prompt_tokens, stream
from studiotui.core.benchmark import (
    BenchmarkError,
    GroupFigures,
    LinkFigures,
    NodeFigures,
    PlacementFigures,
    Run,
    Sizes,
    Step,
    StreamPoint,
    group_n,
    iso,
    merge_directions,
    new_id,
    parts_gflops,
    plan_steps,
    stream_point,
)
from studiotui.core.forecast import links_from_state
from studiotui.core.members import group_backend
from studiotui.core.state import PlacementState
from worker.shared import probes
from worker.shared.protocol import control

StepListener = Callable[[Step], None]
# A device step's replies come as each figure starts; one figure takes seconds.
DEVICE_SILENCE_S = 120.0
# Ending a given-up measurement is a kill and a wait on the node: quick, unless the
# node is gone (then its process went with it).
STOP_BENCH_S = 5.0
WARM_UP_TOKENS = 4


def build_id() -> str:
    """This operator's build: the package version and, from a git checkout, `git
    describe` of it (a dirty tree says so)."""
    source = Path(__file__).resolve().parents[2]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "-C", str(source), "describe", "--always", "--dirty", "--tags"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if done.returncode == 0 and done.stdout.strip():
            return f"{__version__} ({done.stdout.strip()})"
    return __version__


def this_machine() -> dict[str, str]:
    """The operator's machine, as a saved run names it."""
    facts = {
        "host": platform.node(),
        "system": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "cpus": str(os.cpu_count() or 0),
    }
    with contextlib.suppress(ImportError):
        from importlib.metadata import version

        facts["mlx"] = version("mlx")
    return facts


class Benchmark:
    """One run: `await Benchmark(ctl, ...).run()` returns the figures (not yet saved)."""

    def __init__(
        self,
        ctl: Controller,
        nodes: list[str] | None = None,
        sizes: Sizes | None = None,
        on_step: StepListener | None = None,
        placements: list[str] | None = None,
    ) -> None:
        self.ctl = ctl
        self.asked_nodes = nodes
        self.asked_placements = placements
        self.sizes = sizes or Sizes()
        self.on_step = on_step
        self.steps: list[str] = []
        self.index = 0
        self.notes: list[str] = []

    # ---- choosing what to measure, before anything is measured ---------------------------

    async def choose(self) -> tuple[list[str], list[PlacementState]]:
        """The nodes and placements to measure; refuse what cannot be, naming it."""
        self.sizes.check("benchmark sizes")
        await self.ctl.refresh()
        state = self.ctl.state
        known = [n.name for n in state.nodes]
        names = list(self.asked_nodes or [n.name for n in state.nodes if n.state == "up"])
        unknown = [n for n in names if n not in known]
        if unknown:
            raise BenchmarkError(
                f"unknown node(s) {', '.join(unknown)}", f"known: {', '.join(known)}"
            )
        down = [n for n in names if (s := state.node(n)) is None or s.state != "up"]
        if down or not names:
            raise BenchmarkError(
                # Nothing asked and nothing up: "no node is up" (it once said "no node is
                # not up").
                f"{', '.join(down)} {'is' if len(down) == 1 else 'are'} not up"
                if down
                else "no node is up",
                "start the cluster (studiotui up, or provision), or pick --nodes that are up",
            )
        chosen: list[PlacementState] = []
        if self.asked_placements is not None:
            for name in self.asked_placements:
                p = state.placement(name)
                if p is None or p.state != "ready":
                    why = "does not exist" if p is None else f"is {p.state}"
                    raise BenchmarkError(f"placement {name!r} {why}", "place it, or leave it out")
                chosen.append(p)
        else:
            chosen = [
                p for p in state.placements if p.state == "ready" and set(p.nodes) <= set(names)
            ]
        return names, chosen

    # ---- running -----------------------------------------------------------------------------

    def _say(self, state: str = "running", detail: str = "") -> None:
        if self.on_step is not None and self.steps:
            label = self.steps[self.index - 1]
            self.on_step(Step(self.index, len(self.steps), label, detail, state))

    def _next(self) -> None:
        self.index += 1
        self._say()

    async def run(self) -> Run:
        began, when = time.monotonic(), datetime.now(UTC)
        names, placements = await self.choose()
        self.steps = plan_steps(names, [p.name for p in placements], self.sizes.stream_counts)
        # The dashboard's periodic link measurement would share the wire and the CPUs
        # with these figures: it waits until the run ends.
        async with self.ctl.links_quiet():
            nodes = [await self.device(name) for name in names]
            links = await self.links(names)
            group = await self.group(names, nodes) if len(names) >= 2 else None
            measured = [await self.placement(p) for p in placements]
        if len(names) < 2:
            self.notes.append("one node: no link to measure and no group product")
        if not placements:
            self.notes.append("no placement is ready on these nodes: no stream figures")
        return Run(
            id=new_id(when, self.ctl.state.name),
            date=iso(when),
            cluster=self.ctl.state.name,
            machine=this_machine(),
            build=build_id(),
            sizes=self.sizes,
            nodes=tuple(nodes),
            links=tuple(links),
            group=group,
            placements=tuple(measured),
            seconds=round(time.monotonic() - began, 1),
            notes=tuple(self.notes),
        )

    async def device(self, name: str) -> NodeFigures:
        self._next()
        node = self.ctl.state.node(name)
        chip = node.chip if node else ""
        try:
            figures = control.DeviceFigures()
            peer = self.ctl.peer(name)
            async for msg in peer.stream(
                "device_bench", timeout=DEVICE_SILENCE_S, sizes=self.sizes.device_spec()
            ):
                if isinstance(msg, control.BenchStep):
                    self._say(detail=msg.step)
                else:
                    figures = peer.read(msg, control.DeviceBenchDone).figures
        except (AgentError, AgentUnreachable) as exc:
            self._say("failed", str(exc))
            return NodeFigures(name, chip, error=str(exc))
        except asyncio.CancelledError:
            # Given up (Esc, Ctrl-C): the node's measuring process goes too, so the
            # device is free for the next run now rather than in its remaining seconds.
            with contextlib.suppress(AgentError, AgentUnreachable):
                await self.ctl.peer(name).request("stop_bench", timeout=STOP_BENCH_S)
            raise
        self._say("done")
        return NodeFigures(
            name,
            chip,
            figures.device,
            gflops={d: f.gflops for d, f in figures.matmul.items()},
            matmul_n={d: f.n for d, f in figures.matmul.items()},
            copy_gbs=figures.memory.copy_gbs,
            read_gbs=figures.memory.read_gbs,
            decode_us=dict(figures.decode),
        )

    async def links(self, names: list[str]) -> list[LinkFigures]:
        """Each direction of each pair measured by its sender, one at a time."""
        found: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for a in names:
            for b in names:
                if a == b:
                    continue
                self._next()
                try:
                    results = await self.ctl.link_results(a, [b], self.sizes.link_spec())
                except (AgentError, AgentUnreachable) as exc:
                    results = [{"peer": b, "from": a, "error": str(exc)}]
                pair = (min(a, b), max(a, b))
                found.setdefault(pair, []).extend(results)
                failed = any(r.get("error") for r in results)
                self._say("failed" if failed else "done")
        return [merge_directions(a, b, rs, self._kind(a, b)) for (a, b), rs in found.items()]

    def _kind(self, a: str, b: str) -> str:
        ends = [
            probes.LinkEnd.from_facts(n.facts.get("link_end"))
            for n in (self.ctl.state.node(a), self.ctl.state.node(b))
            if n is not None
        ]
        if len(ends) == 2 and all(ends):
            return probes.pair_link_kind(*ends)
        return "unknown"

    async def group(self, names: list[str], nodes: list[NodeFigures]) -> GroupFigures:
        """The distributed product over the group, a `benchmark` job on the agents."""
        self._next()
        n = group_n(nodes, names, self.sizes.matmul_n)
        parts = parts_gflops(nodes, names, "float32")
        # JACCL when every pair is joined by an active RDMA cable, with the device
        # matrix the ranks need; else the ring, and where every node has RDMA the run
        # notes why (a missing cable, a port down).
        state = self.ctl.state
        rdma = {x: s.facts.get("rdma") for x in names if (s := state.node(x)) is not None}
        chosen = group_backend(names, links_from_state(state), rdma)
        if chosen.backend == "ring" and chosen.rdma_everywhere:
            self.notes.append(f"the group was measured over ring: {chosen.reason}")
        backend = chosen.backend
        base = GroupFigures(
            nodes=tuple(names), backend=backend, n=n, parts_gflops=parts, launcher="jobs"
        )
        try:
            ranks = await self._ranks(names, n, backend, chosen.devices)
        except (AgentError, AgentUnreachable, JobFailed, BenchmarkError) as exc:
            self._say("failed", str(exc))
            return replace(base, error=str(exc))
        self._say("done")
        # The group is as fast as its slowest rank: every step waits in all_sum for it.
        return replace(
            base,
            gflops=min(float(r["gflops"]) for r in ranks),
            step_s=max(float(r["step_s"]) for r in ranks),
            compute_s=max(float(r["compute_s"]) for r in ranks),
            max_error=max(float(r.get("max_error", 0.0)) for r in ranks),
            allreduce_us=max(
                (float(r["allreduce_us"]) for r in ranks if "allreduce_us" in r), default=None
            ),
        )

    async def _ranks(
        self, names: list[str], n: int, backend: str, devices: Any = None
    ) -> list[dict[str, Any]]:
        """One rank per node, started and followed as a job (cluster/jobs.py), on the
        nodes' own addresses (the Thunderbolt bridge's on a desk cluster)."""
        name = f"benchmark-{uuid.uuid4().hex[:8]}"
        record = JobRecord(name, "benchmark", tuple(names), backend)
        spec = {"n": n, "reps": self.sizes.group_reps}
        found: dict[str, dict[str, Any]] = {}

        def on_event(node: str, event: dict[str, Any]) -> None:
            if event.get("event") == "result":
                found[node] = dict(event.get("figures") or {})

        await jobs.start_group(self.ctl, record, [spec] * len(names), devices)
        try:
            end = await jobs.follow(self.ctl, name, names, on_event)
        except asyncio.CancelledError:
            # The run was given up (Esc, Ctrl-C): its ranks go too.
            await jobs.stop(self.ctl, name, names)
            raise
        finally:
            # Nothing to resume: the ranks' records go once they are read.
            await asyncio.gather(
                *(self.ctl.peer(x).request("forget_job", job=name) for x in names),
                return_exceptions=True,
            )
        missing = [x for x in names if x not in found]
        if end.state != "done" or missing:
            raise BenchmarkError(end.message or f"no figures from {', '.join(missing)}")
        return [found[x] for x in names]

    async def placement(self, p: PlacementState) -> PlacementFigures:
        """Decode tok/s and time to first token with 1, 2, 4, 8 streams at once."""
        sizes = self.sizes
        base = PlacementFigures(p.name, p.model, p.nodes, admitted=p.streams, shape=p.shape)
        points: list[StreamPoint] = []
        error = ""
        try:
            await stream(self.ctl, p.name, prompt_tokens(8), WARM_UP_TOKENS)
        except GenerationError as exc:
            error = str(exc)
        for k in sizes.stream_counts:
            self._next()
            if error:
                self._say("failed", error)
                continue
            try:
                runs = await asyncio.gather(
                    *(
                        stream(
                            self.ctl,
                            p.name,
                            prompt_tokens(sizes.prompt_tokens),
                            sizes.stream_tokens,
                        )
                        for _ in range(k)
                    )
                )
            except GenerationError as exc:
                error = str(exc)
                self._say("failed", error)
                continue
            points.append(stream_point(k, runs))
            self._say("done")
        return replace(base, points=tuple(points), error=error)
