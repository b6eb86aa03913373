"""`up`, `down` and `logs` on local nodes (provision_cmd hands them local nodes)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from studiotui.cli.args import inventory_of
from studiotui.cli.output import console, errors
from studiotui.cluster import local_cluster, running, stops
from studiotui.cluster.controller import (
    Controller,
    SavedShard,
)
from studiotui.cluster.records import Records
from studiotui.cluster.session import open_controller, wait_until_up
from studiotui.core.errors import UserError
from studiotui.core.inventory import (
    Inventory,
    free_control_port,
    local_inventory,
)
from studiotui.core.state import PlannedPlacement
from studiotui.provision import restart
from studiotui.provision.deploy import Outcome
from studiotui.views.status import status_table


async def cmd_up(args: argparse.Namespace, home: Path) -> int:
    if args.local:
        try:
            inv = local_inventory(
                args.local, home=home, memory_gb=args.memory_gb, control_port=args.port
            )
        except ValueError as exc:
            raise UserError(str(exc)) from None
        orphans = local_cluster.running_outside(home, inv)
        if orphans:
            verb = "is" if len(orphans) == 1 else "are"
            raise UserError(
                f"{', '.join(orphans)} {verb} running in the local cluster that "
                f"`up --local {args.local}` would replace",
                "stop it first with `studiotui down`, then run this again",
            )
        taken = local_cluster.ports_taken(inv)
        if taken:
            # Refused before anything starts: the agents would exit at once and `up`
            # would wait out its 30 s for them.
            free = free_control_port(args.local, sys.platform, local_cluster.port_free, args.port)
            raise UserError(
                f"{', '.join(taken)} already in use: another simulated cluster (from "
                "another STUDIOTUI_HOME) or another program holds it",
                "stop that one, or start this cluster beside it"
                + (f": studiotui up --local {args.local} --port {free}" if free else ""),
            )
        local_cluster.save_local_inventory(home, inv)
        for said in forget_placements_outside(home, inv):
            console.print(said)
    else:
        inv = inventory_of(args, home)
    local = [n for n in inv.nodes if n.is_local]
    remote = [n for n in inv.nodes if not n.is_local]
    done: restart.Restarted | None = None
    async with open_controller(inv, home, ask=None) as ctl:
        names = [n.name for n in local]
        if names and restart.has_kept(ctl, names):
            # `down` kept these nodes' shards: started, they load them again, as after
            # `restart` (a placement whose every node was stopped too).
            async def bounce() -> list[Outcome]:
                return await restart.restart_local_agents(ctl, local, stop=False)

            done = await restart.keep_placements(
                ctl, names, bounce, on_reload=say_reloading, doing="start"
            )
            missing = [o.node for o in done.outcomes if not o.ok]
        else:
            for node in local:
                local_cluster.start_agent(home, node, inv)
            missing = await wait_until_up(ctl, names, timeout=30.0)
        print_nodes(ctl)
    if done is not None:
        print_restarted(done)
    if remote:
        ssh = ", ".join(n.name for n in remote)
        console.print(f"SSH nodes ({ssh}) are started by `studiotui provision`.")
    if missing:
        for name in missing:
            tail = local_cluster.agent_output_tail(inv.node(name))
            errors.print(f"[red]{name} did not answer within 30 s.[/] Last lines of its output:")
            errors.print(tail or "(nothing)")
        return 1
    return 0 if done is None or done.ok else 1


def placements_outside(
    planned: Mapping[str, PlannedPlacement], names: Collection[str]
) -> dict[str, list[str]]:
    """Each planned placement with a shard on a node outside `names`, with those
    nodes: a cluster without them can never load it again."""
    gone: dict[str, list[str]] = {}
    for name, placement in planned.items():
        missing = sorted({s.node for s in placement.shards if s.node not in names})
        if missing:
            gone[name] = missing
    return gone


def forget_placements_outside(home: Path, inv: Inventory) -> list[str]:
    """`up --local N` of fewer nodes than the last: a placement that ran on a node it
    no longer has stays broken for good, and its name blocks placing the model again
    (the README's tour after the first run's four nodes). Forget it, saying so."""
    records = Records(home, inv.name)
    planned = records.read_planned()
    gone = placements_outside(planned, set(inv.names))
    if not gone:
        return []
    records.write_planned({k: v for k, v in planned.items() if k not in gone})
    for name in gone:
        records.write_recorded(name, [])
    records.write_kept(records.read_kept())  # read_kept keeps the planned ones only
    return [
        f"placement '{name}' ran on {', '.join(nodes)}, which this cluster has no more: "
        "forgotten (place the model again)"
        for name, nodes in gone.items()
    ]


async def cmd_down(args: argparse.Namespace, home: Path, inv: Inventory | None = None) -> int:
    """Stop local agents; `inv`: the inventory the caller loaded already (and named:
    loading it again printed the "inventory" line twice)."""
    inv = inv or inventory_of(args, home)
    names = args.nodes or list(inv.names)
    unknown = [n for n in names if n not in inv.names]
    if unknown:
        raise UserError(f"unknown node(s) {', '.join(unknown)}; known: {', '.join(inv.names)}")
    # A local agent with no live pid cannot answer: asking it would only wait out the
    # request's timeout (5 s) before saying so.
    idle = [
        n for n in names if inv.node(n).is_local and local_cluster.running_pid(inv.node(n)) is None
    ]
    async with open_controller(inv, home, ask=None) as ctl:
        live = [n for n in names if n not in idle]
        # Placements stay planned, even one whose every node stops: `restart` and `up`
        # load the kept shards again (`unload` forgets one for good).
        kept = await keep_for_restart(ctl, live)
        # Said before the agents stop: an open dashboard reads it as they fall silent.
        stops.record_stops(home, inv.name, live)
        results = await ctl.shutdown(live)
        results.update({n: "not running" for n in idle})
    for name in names:
        node = inv.node(name)
        if node.is_local:
            await asyncio.to_thread(_wait_local_stop, node)
        console.print(f"{name}: {results[name]}")
    stops.record_stops(home, inv.name, live)  # stopped now, after the last word of any
    say_kept(kept)
    return 0


async def keep_for_restart(ctl: Controller, names: list[str]) -> list[SavedShard]:
    """Before `down` stops `names`: stopping an agent stops its shards, so keep what
    `restart` needs to load them again where they were (the placement whole again
    without a re-place). Only the stopped nodes' own: a tensor group's members that go
    on running elsewhere are found again (and relaunched with it) by `restart`."""
    saved, _ = await ctl.shards_on(names) if names else ([], [])
    kept = [s for s in saved if s.node in names]
    ctl.keep_shards(kept, forget=names)
    return kept


def say_kept(kept: list[SavedShard], ssh: bool = False) -> None:
    """What `down` kept, and the verbs that bring it back (an SSH node's `provision`
    too, `provision_cmd.cmd_provision`; a local node's `up`)."""
    for name, placement in sorted({(k.node, k.placement) for k in kept}):
        other = f"`studiotui provision {name}`" if ssh else "`studiotui up`"
        verbs = f"`studiotui restart {name}` or {other}"
        console.print(
            f"{name} held a shard of {placement!r}: {verbs} starts it and loads that shard again"
        )


# `down --all` stops a browser view before its tabs (it ends them itself) and both
# before the API servers; the agents after all of them, so none of them starts one.
STOP_ORDER = ("web", "tab", "api")


def stop_running(home: Path) -> None:
    """Stop the API servers and browser views running for `home`, saying each."""
    for kind in STOP_ORDER:
        for entry in running.running(home):
            if entry.kind != kind:
                continue
            where = f" {entry.what}" if entry.what else ""
            if running.stop(entry):
                console.print(f"stopped {entry.label}{where} (pid {entry.pid})")
            else:
                errors.print(f"{entry.label}{where} (pid {entry.pid}) did not stop")


def print_running(home: Path) -> None:
    """The API servers and browser views running for `home` (`running`)."""
    for entry in running.running(home):
        since = time.strftime("%H:%M:%S", time.localtime(entry.started))
        where = f" {entry.what}" if entry.what else ""
        console.print(f"{entry.label}{where} (pid {entry.pid}, since {since})")


def running_json(home: Path) -> list[dict[str, Any]]:
    return [
        {"kind": e.kind, "pid": e.pid, "address": e.what, "started": round(e.started, 3)}
        for e in running.running(home)
    ]


def say_reloading(placement: str, where: str) -> None:
    console.print(
        f"placement {placement!r}: loading its shards again on {where}…",
        markup=False,
        highlight=False,
    )


def print_restarted(done: restart.Restarted) -> None:
    """What a restart, an upgrade or `up` did to the placements (`restart`'s and the
    upgrade's node outcomes are printed as they come back)."""
    for text in done.dropped:
        errors.print(text, markup=False, highlight=False)
    for text in done.lost:
        errors.print(text, markup=False, highlight=False)
    for result in done.reloads:
        (console if result.ok else errors).print(result.text, markup=False, highlight=False)
    for text in done.broken:
        errors.print(text, markup=False, highlight=False)


def _wait_local_stop(node: Any) -> None:
    pid = local_cluster.running_pid(node)
    if pid is not None and not local_cluster.wait_gone(pid, 10.0):
        local_cluster.stop_agent(node)


def start_hint(inv: Inventory) -> str:
    """How to start this cluster's agents, in commands."""
    local = any(n.is_local for n in inv.nodes)
    remote = any(not n.is_local for n in inv.nodes)
    if local and remote:
        return "`studiotui up` (local nodes) and `studiotui provision` (SSH nodes)"
    return "`studiotui provision`" if remote else "`studiotui up` (or `studiotui`, the dashboard)"


def nobody_home(inv: Inventory) -> bool:
    """Every node is local and none has a running agent: no need to wait for answers."""
    return all(n.is_local and local_cluster.running_pid(n) is None for n in inv.nodes)


def print_nodes(ctl: Controller) -> None:
    console.print(status_table(ctl.state, console.width))
    for p in ctl.state.placements:
        gone = set(p.missing)
        # A tensor group is one hop, `a+b[0:4]`, as the dashboard draws it.
        ring = " → ".join(
            "+".join(f"{'✗' * (n in gone)}{n}" for n in nodes) + f"[{start}:{end}]"
            for nodes, start, end in p.stages
        )
        console.print(f"placement [bold]{p.name}[/] ({p.label}) {p.state}, {p.shape}: {ring}")


async def cmd_logs(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    if args.node not in inv.names:
        raise UserError(f"unknown node {args.node!r}; known: {', '.join(inv.names)}")
    async with open_controller(inv, home, ask=None) as ctl:
        seen: list[str] = []
        while True:
            try:
                lines = await ctl.read_log(args.node, args.lines)
            except Exception as exc:
                raise UserError(f"{args.node}: cannot read its log: {exc}") from None
            start = _new_lines_start(seen, lines)
            for line in lines[start:]:
                print(line)
            seen = lines
            if not args.follow:
                return 0
            await asyncio.sleep(1.0)


def _new_lines_start(seen: list[str], lines: list[str]) -> int:
    if not seen:
        return 0
    last = seen[-1]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i] == last:
            return i + 1
    return 0
