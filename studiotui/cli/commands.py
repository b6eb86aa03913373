"""What each command-line verb does, on top of the Controller."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Column, Table

from studiotui.cli import exits
from studiotui.cli.args import inventory_of
from studiotui.cli.serve import cmd_serve  # noqa: F401 - the `serve` verb
from studiotui.cluster import jobs, local_cluster, model_fetch, running, stops
from studiotui.cluster import peers as agents
from studiotui.cluster.adapter_fetch import fetch_adapter
from studiotui.cluster.controller import (
    Controller,
    GenerationError,
    PlacementError,
    PlacementRefused,
    SavedShard,
)
from studiotui.cluster.model_sync import SyncRefused
from studiotui.cluster.records import Records
from studiotui.cluster.session import open_controller, wait_until_up
from studiotui.core.adapter_catalog import (
    AdapterRefused,
    adapter_placement_name,
    adapter_tensor,
    check_adapter,
    resolve_adapter,
)
from studiotui.core.catalog import scan_home
from studiotui.core.errors import UserError
from studiotui.core.forecast import describe, forecast, links_from_state
from studiotui.core.inventory import (
    Inventory,
    SelectionError,
    free_control_port,
    local_inventory,
    resolve_group,
)
from studiotui.core.members import cables
from studiotui.core.model_facts import ModelDirError, ModelInfo, read_model
from studiotui.core.model_folders import model_folders, outside_note
from studiotui.core.placement import (
    ModelFacts,
    Plan,
    Refusal,
    context_beyond,
    format_bytes,
    tensor_refusal,
    tensor_sizes,
)
from studiotui.core.state import (
    ClusterState,
    PlacementState,
    PlannedPlacement,
    model_label,
    node_start_hint,
)
from studiotui.core.text import printable
from studiotui.core.traffic import (
    RateMeter,
    placement_acceptance,
    placement_cache,
    placement_in_flight,
    placement_tokens,
)
from studiotui.provision import restart
from studiotui.provision.deploy import Outcome
from studiotui.views.plan import render_plan
from worker.shared.adapters import Adapter
from worker.shared.manifest import Hashing
from worker.shared.protocol import control

console = Console(stderr=False, highlight=False)
errors = Console(stderr=True, highlight=False)


# ---- up / down -----------------------------------------------------------------------


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


# ---- status --------------------------------------------------------------------------


def start_hint(inv: Inventory) -> str:
    """How to start this cluster's agents, in commands."""
    local = any(n.is_local for n in inv.nodes)
    remote = any(not n.is_local for n in inv.nodes)
    if local and remote:
        return "`studiotui up` (local nodes) and `studiotui provision` (SSH nodes)"
    return "`studiotui provision`" if remote else "`studiotui up` (or `studiotui`, the dashboard)"


def _nobody_home(inv: Inventory) -> bool:
    """Every node is local and none has a running agent: no need to wait for answers."""
    return all(n.is_local and local_cluster.running_pid(n) is None for n in inv.nodes)


async def cmd_status(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    # No agent process here to answer: ask briefly rather than wait the full timeout.
    async with open_controller(inv, home, ask=0.3 if _nobody_home(inv) else 2.0) as ctl:
        if args.json:
            rates = await sample_rates(ctl, STATUS_RATE_WINDOW_S)
            console.print_json(
                json.dumps({**status_json(ctl, rates), "services": running_json(home)})
            )
        else:
            print_nodes(ctl)
            print_running(home)
    if not any(n.state == "up" for n in ctl.state.nodes):
        errors.print(f"no node of cluster {inv.name} is up: start it with {start_hint(inv)}")
        return 1
    return 0


# How long `status --json` watches the token counts for its tok/s: the runners count
# once a second, so a shorter window would read 0 for a placement that is answering.
STATUS_RATE_WINDOW_S = 2.0


def rates_to_sample(placements: Sequence[PlacementState]) -> list[str]:
    """The placements whose tok/s is worth watching for: ready ones at work on a
    request. An idle one makes 0 tok/s, known without waiting a window."""
    return [p.name for p in placements if p.state == "ready" and placement_in_flight(p) > 0]


async def sample_rates(ctl: Controller, window: float) -> dict[str, float]:
    """Each ready placement's tokens a second over `window` seconds (the dashboard's
    RateMeter over two of the agents' reports); no wait when none is answering."""
    if not rates_to_sample(ctl.state.placements):
        return {}  # none answering: 0 tok/s, said at once
    meter = RateMeter(window)
    loop = asyncio.get_running_loop()
    for p in ctl.state.placements:
        meter.update(p.name, placement_tokens(p), loop.time())
    await asyncio.sleep(window)
    await ctl.refresh()
    return {
        p.name: meter.update(p.name, placement_tokens(p), loop.time()) for p in ctl.state.placements
    }


def status_json(ctl: Controller, rates: Mapping[str, float] | None = None) -> dict[str, Any]:
    """What `status --json` prints; `rates`: tok/s by placement (`sample_rates`)."""
    st = ctl.state
    rates = rates or {}
    # Which Thunderbolt port of a node leads to which node (agents' RDMA facts matched
    # by domain UUID, core/members.cables): the cabling JACCL's device matrix comes from.
    wired = cables({n.name: n.facts.get("rdma") for n in st.nodes})
    return {
        "cluster": st.name,
        "nodes": [
            {
                "name": n.name,
                "address": n.endpoint,
                "transport": n.transport,
                "state": n.state,
                "version": n.version,
                "memory_total": n.memory_total,
                "memory_used": n.memory_used,
                "chip": n.chip,
                "message": n.message,
                "thunderbolt": [
                    {"port": c.receptacle, "device": c.device, "state": c.state, "reaches": c.peer}
                    for c in wired
                    if c.node == n.name
                ],
            }
            for n in st.nodes
        ],
        "placements": [
            {
                "name": p.name,
                "model": p.model,
                "model_dir": p.model_dir,
                "adapter": p.adapter,
                "state": p.state,
                "nodes": list(p.nodes),
                "layers": p.layers,
                "shape": p.shape,
                "context_tokens": p.context_tokens,
                "streams": p.streams,
                # Quantized KV (0: full precision) and the prompt cache's budget, summed
                # over the nodes (each counts its share in its memory).
                "kv_bits": max((s.kv_bits for s in p.shards), default=0),
                "prompt_cache_bytes": sum(s.prompt_cache_bytes for s in p.shards),
                "prompt_cache_disk_bytes": sum(s.prompt_cache_disk_bytes for s in p.shards),
                # What the dashboard's Placements pane shows (core/traffic.py).
                "in_flight": placement_in_flight(p),
                "tokens": placement_tokens(p),
                "tok_s": round(rates.get(p.name, 0.0), 2),
                # Speculative decoding: the head's guesser and the share of guesses kept.
                "draft": next((s.draft for s in p.shards if s.draft), ""),
                "drafted": sum(s.drafted for s in p.shards),
                "acceptance": placement_acceptance(p),
                "prompt_cache": placement_cache(p).as_dict(),
            }
            for p in st.placements
        ],
    }


# The status table's columns, and those it gives up, first to last, when the terminal
# (or a pipe's 80 columns) is too narrow: the version (`status --json` has it), then
# the address, then the memory figures. The node, its state and its shards stay.
STATUS_COLUMNS = ("node", "address", "state", "version", "memory", "shards")
STATUS_DROP = ("version", "address", "memory")
# A placement name in the shards column is cut (with "…") to no fewer characters than
# this before a column is given up; its `[start:end] state` is never cut.
SHARD_NAME_MIN = 8


def table_width(widths: list[int]) -> int:
    """Cells a Rich table with these column widths takes (box edges and padding)."""
    return sum(widths) + 3 * len(widths) + 1


def fit_status(
    widths: Mapping[str, int], name: int, suffix: int, width: int
) -> tuple[tuple[str, ...], int]:
    """The status table's columns to show within `width` cells, and the room for a
    placement name in a shards cell. `widths`: each column but shards, at its widest
    cell or header; `name`/`suffix`: the longest placement name and `[a:b] state`
    of the shard lines. Columns go in STATUS_DROP's order; once the version is gone
    a name is cut (down to SHARD_NAME_MIN) before the next one goes, and at last to
    whatever is left (one character at least)."""
    kept = [c for c in STATUS_COLUMNS if c in widths]

    def avail() -> int:  # the shards column's width beside the kept columns
        return width - table_width([widths[c] for c in kept] + [0])

    for column in (None, *STATUS_DROP):
        if column is not None:
            kept.remove(column)
        if avail() >= max(name + suffix, len("shards")):
            return tuple(kept), name
        # Past the version, a long name is cut before another column goes.
        if column is not None and avail() - suffix >= min(name, SHARD_NAME_MIN):
            return tuple(kept), avail() - suffix
    return tuple(kept), max(1, avail() - suffix)


def shard_lines(shards: list[tuple[str, str]], room: int) -> str:
    """A node's shards, one a line (a line break never falls inside one), each
    placement name cut to `room` characters."""
    return "\n".join(
        (name if len(name) <= room else name[: max(0, room - 1)] + "…") + suffix
        for name, suffix in shards
    )


def status_table(state: ClusterState, width: int) -> Table:
    """The nodes of `studiotui status` as a table fitting `width` cells."""
    table = Table(title=f"cluster {state.name}")
    rows: list[dict[str, str]] = []
    shards: list[list[tuple[str, str]]] = []
    for n in state.nodes:
        mem = (
            f"{format_bytes(n.memory_used)} / {format_bytes(n.memory_total)}"
            if n.memory_total
            else ""
        )
        rows.append(
            {"node": n.name, "address": n.endpoint, "state": n.state, "version": n.version}
            | {"memory": mem}
        )
        shards.append([(s.placement, f"[{s.start}:{s.end}] {s.state}") for s in n.shards])
    lines = [line for node in shards for line in node]
    widths = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in STATUS_COLUMNS[:-1]}
    kept, room = fit_status(
        widths,
        max((len(name) for name, _ in lines), default=0),
        max((len(suffix) for _, suffix in lines), default=0),
        width,
    )
    # Every cell stays whole on its line: a column is given up, or a placement name
    # cut, rather than a cell folded ("qwen4[0:4" / "] ready").
    for col in kept:
        table.add_column(col, no_wrap=True, overflow="ellipsis")
    table.add_column("shards", no_wrap=True, overflow="ellipsis")
    for row, node_shards in zip(rows, shards, strict=True):
        colour = {"up": "green", "down": "red"}.get(row["state"], "yellow")
        cells = {c: escape(row[c]) for c in kept} | {"state": f"[{colour}]{row['state']}[/]"}
        table.add_row(*(cells[c] for c in kept), escape(shard_lines(node_shards, room)))
    return table


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


# ---- place / unload ------------------------------------------------------------------


def resolve_model(spec: Path, home: Path) -> Path:
    """A model directory, or the catalog's model of that name (models folders, HF cache)."""
    if spec.expanduser().exists():
        return spec.expanduser()
    catalog = scan_home(home)
    named = [m.path for m in catalog.models if m.name == str(spec) or m.path.name == str(spec)]
    if len(named) == 1:
        return named[0]
    known = ", ".join(sorted(m.name for m in catalog.models)) or "none"
    if named:
        raise UserError(f"several models are named {spec}: give its directory")
    raise UserError(
        f"model directory {spec} does not exist and no model has that name (models found: {known})"
    )


async def adapter_here(spec: str | Path, home: Path, inv: Inventory) -> Path:
    """`resolve_adapter`, and when `spec` names a job whose adapter is not on the
    operator yet, that adapter fetched from the job's node first."""
    try:
        return resolve_adapter(spec, home)
    except AdapterRefused:
        record = jobs.load_record(home, str(spec))
        if record is None or Path(spec).expanduser().exists():
            raise
    console.print(f"adapter {spec} is job {spec}'s, not here yet: fetching it from its node")
    async with open_controller(inv, home) as ctl:
        await fetch_adapter(ctl, record)
        for line in ctl.state.log[-1:]:
            console.print(line.text)
    return resolve_adapter(spec, home)


class Bars:
    """One progress display in bytes for an operation's steps (a model's first hashing,
    each node's copies), started at the first report, so nothing is drawn when there is
    nothing to do. A step whose total changes or whose count goes back is the next one
    under that key (a node's model, then its data): a bar of its own below, the done
    one kept. Reports may come from a worker thread (the hashing) and from the loop."""

    def __init__(self, out: Console | None = None) -> None:
        # The label gives way (wrapped) when the line is narrow, never the figures:
        # a long label at 80 columns left "12… 111… 0:0…", sizes without their units.
        whole = Column(no_wrap=True)
        self.bar = Progress(
            TextColumn("{task.description}", table_column=Column(ratio=1)),
            BarColumn(bar_width=12, table_column=Column(no_wrap=True)),
            DownloadColumn(table_column=whole),
            TransferSpeedColumn(table_column=whole),
            TimeRemainingColumn(table_column=whole),
            console=out or console,
        )
        self.tasks: dict[str, TaskID] = {}
        self._lock = threading.Lock()

    def show(self, key: str, label: str, done: int, total: int) -> None:
        with self._lock:
            if not self.tasks:
                self.bar.start()
            task = self.tasks.get(key)
            if task is None or self._next_step(task, done, total):
                task = self.tasks[key] = self.bar.add_task(label, total=total)
            self.bar.update(task, completed=done)

    def _next_step(self, task: TaskID, done: int, total: int) -> bool:
        shown = next(t for t in self.bar.tasks if t.id == task)
        return shown.total != total or done < shown.completed

    def stop(self) -> None:
        with self._lock:
            if self.tasks:
                self.bar.stop()


@contextmanager
def hashing_shown(model_dir: Path, why: str) -> Iterator[Hashing]:
    """A callback for `manifest.model_digest(on_progress=...)` drawing a progress bar
    in bytes, started at its first report: a model's first hashing reads every byte
    (minutes for hundreds of GB), later ones hit the hashes cached beside the files and
    report, and so show, nothing."""
    with transfer_shown(model_dir, why) as (hashed, _copied):
        yield hashed


@contextmanager
def transfer_shown(
    model_dir: Path, why: str
) -> Iterator[tuple[Hashing, Callable[[str, int, int], None]]]:
    """`hashing_shown`'s callback, and one for copies to nodes (node, bytes, of), drawn
    as bars of one display (only one can be live at a time)."""
    bars = Bars()
    label = f"hashing {model_dir.name} {why} (once: cached)"

    def hashed(done: int, total: int) -> None:
        bars.show("", label, done, total)

    def copied(node: str, done: int, total: int) -> None:
        bars.show(node, f"copying to {node}", done, total)

    try:
        yield hashed, copied
    finally:
        bars.stop()


def check_adapter_shown(adapter_dir: Path, model_dir: Path, info: ModelInfo) -> Adapter:
    """`check_adapter`, the base's hashing shown (see hashing_shown)."""
    with hashing_shown(model_dir, "to check the adapter's base") as shown:
        return check_adapter(adapter_dir, model_dir, info, shown)


async def cmd_place(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    args.model_dir = resolve_model(args.model_dir, home)
    try:
        info = read_model(args.model_dir)
    except ModelDirError as exc:
        raise UserError(str(exc)) from None
    if info.unsupported:
        # Before asking any node anything: a model no shard can run is refused outright.
        console.print(
            render_plan(Refusal(f"{info.name} cannot run on a shard: {info.unsupported}", "model"))
        )
        return exits.REFUSED["model"]
    if info.note:
        console.print(f"[yellow]note:[/] {info.name} is {info.note}")
    adapter = None
    if args.adapter:
        # Before asking any node anything too: another model's or a malformed adapter.
        args.adapter = await adapter_here(args.adapter, home, inv)
        adapter = check_adapter_shown(args.adapter, args.model_dir.expanduser().resolve(), info)
        console.print(
            f"adapter [bold]{adapter.name}[/] ({adapter.fine_tune_type}, rank {adapter.rank}, "
            f"layers {adapter.layers[0]}-{adapter.layers[-1]}) matches {info.name}"
        )
    # An adapter is applied by pipeline stages, each to whole layers: no tensor groups.
    tensor = adapter_tensor(args.tensor) if adapter else args.tensor
    try:
        nodes = list(resolve_group(inv, args.nodes)) if args.nodes else None
    except SelectionError as exc:
        raise UserError(str(exc)) from None
    async with open_controller(inv, home) as ctl:
        group = nodes or [n.name for n in ctl.state.nodes if n.state == "up"]
        if not group:
            raise UserError(
                f"no node is up: start the cluster with {start_hint(inv)}, then place again"
            )
        name = args.name or (
            adapter_placement_name(args.model_dir.expanduser().resolve(), args.adapter)
            if adapter
            # A hub snapshot is named by its repo (`org/qwen3` → qwen3), not its commit.
            else model_label(str(args.model_dir.expanduser().resolve())).rsplit("/", 1)[-1]
        )
        if (existing := ctl.state.placement(name)) is not None:
            # Before the plan and progress bars: nothing would be loaded.
            raise UserError(
                f"a placement named {name!r} exists ({existing.state}): unload it first "
                f"(studiotui unload {name}) or pick another --name"
            )
        if args.tensor is not None and (why := tensor_refusal(info.facts, args.tensor, len(group))):
            # Before the plan and before any node is asked to load anything.
            raise UserError(f"--tensor {args.tensor}: {why}")
        draft_arg = getattr(args, "draft", None) or ""
        draft = "lookup" if draft_arg == "lookup" else ("model" if draft_arg else "")
        guesser = Path(draft_arg).expanduser().resolve() if draft == "model" else None
        draft_tokens = getattr(args, "draft_tokens", 0) or 0
        try:
            info, the_plan = ctl.preview(
                args.model_dir.expanduser(),
                group,
                args.context,
                args.streams,
                tensor,
                adapter,
                **place_options(args),
                draft=draft,
                draft_dir=guesser,
                draft_tokens=draft_tokens,
            )
        except ModelDirError as exc:
            raise UserError(str(exc)) from None
        console.print(render_plan(the_plan))
        if isinstance(the_plan, Refusal):
            return exits.refused(the_plan)
        if beyond := context_beyond(info.facts, the_plan.context_tokens):
            errors.print(f"[yellow]note:[/] {beyond}", highlight=False)
        if isinstance(the_plan, Plan) and args.dry_run:
            most = ctl.context_offer(
                args.model_dir.expanduser(),
                [n for s in the_plan.shards for n in s.nodes],
                the_plan.streams,
                the_plan.tensor,
                args.kv_bits,
                args.kv_group_size,
            )
            kv = f"{args.kv_bits}-bit" if args.kv_bits else "full-precision"
            console.print(
                f"these nodes hold up to {most} tokens of context × {the_plan.streams} "
                f"stream{'s' if the_plan.streams != 1 else ''} with {kv} KV (--context)"
            )
        if isinstance(the_plan, Plan):
            print_shapes(ctl, info.facts, the_plan, group, args)
        if args.dry_run:
            return 0
        with Progress(
            TextColumn("{task.description:>12}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        ) as bar:
            # One bar per process: every node of a tensor group loads (and reports) its own.
            tasks = {n: bar.add_task(n, total=None) for s in the_plan.shards for n in s.nodes}

            def progress(node: str, done: int, total: int) -> None:
                task = bar.tasks[tasks[node]]
                if task.total != total or done < task.completed:
                    # A new phase (files copied, then the shard loaded): a new clock.
                    bar.reset(tasks[node], total=total)
                bar.update(tasks[node], completed=done, total=total)

            def hashed(done: int, total: int) -> None:
                # From the copy's hashing thread (rich's bar takes its own lock): the
                # model's first hashing, before its files go to a remote node.
                if "" not in tasks:
                    label = f"hashing {info.name} for the copy (once: cached)"
                    tasks[""] = bar.add_task(label, total=total)
                bar.update(tasks[""], completed=done, total=total)

            try:
                result = await ctl.place(
                    args.model_dir,
                    group,
                    name,
                    progress,
                    prefill_chunk=args.prefill_chunk,
                    context_tokens=args.context,
                    streams=args.streams,
                    tensor=tensor,
                    adapter_dir=args.adapter,
                    hashing=hashed,
                    **place_options(args),
                    draft_dir=str(guesser) if guesser else "",
                    draft=draft,
                    draft_tokens=draft_tokens,
                )
            except PlacementRefused as exc:
                # Made again at placing (another placement's promise, a changed cluster):
                # the same status as the preview's refusal of that kind.
                raise exits.RefusedError(str(exc), exc.refusal) from None
            except (PlacementError, ModelDirError) as exc:
                raise UserError(str(exc)) from None
            except asyncio.CancelledError:  # Ctrl-C: ctl.place has unloaded what it loaded
                errors.print(f"interrupted: placement {name} rolled back, nothing left loaded")
                raise
        console.print(
            f"placement [bold]{result.placement.name}[/] is ready ({result.placement.label})"
        )
    return 0


GIB = 1024**3  # "GB" as the previews show sizes (core/placement.format_bytes)


def place_options(args: argparse.Namespace) -> dict[str, Any]:
    """What `place` asks of the KV cache and the prompt cache (GB said in bytes)."""
    return {
        "kv_bits": args.kv_bits,
        "kv_group_size": args.kv_group_size,
        **{
            key: None if gb is None else int(gb * GIB)
            for key, gb in (
                ("prompt_cache", args.prompt_cache),
                ("prompt_cache_disk", args.prompt_cache_disk),
            )
        },
    }


def print_shapes(
    ctl: Controller, facts: ModelFacts, the_plan: Plan, group: list[str], args: argparse.Namespace
) -> None:
    """The forecast of the plan shown, then of every other shape that divides (what
    `--tensor N` would take), as the preview lists them."""
    chips = ctl.node_chips(group)
    links = links_from_state(ctl.state)
    draft_arg = getattr(args, "draft", None) or ""
    draft = "lookup" if draft_arg == "lookup" else ("model" if draft_arg else "")
    guess = forecast(
        facts,
        the_plan,
        chips,
        links,
        streams=the_plan.streams,
        draft=draft,
        draft_tokens=getattr(args, "draft_tokens", 0) or 0,
    )
    # Saved as `status` names the model (a hub snapshot: org/name, not its commit).
    model = model_label(str(args.model_dir.expanduser().resolve()))
    last = ctl.last_measured(model, the_plan.shape)
    console.print(f"forecast ({the_plan.shape}): {describe(guess, last)}")
    if args.adapter:
        return  # an adapter is applied by pipeline stages only (adapter_tensor): one shape
    for size in tensor_sizes(facts, len(group)):
        if size == the_plan.tensor:
            continue
        _, other = ctl.preview(
            args.model_dir.expanduser(),
            group,
            args.context,
            the_plan.streams,
            size,
            **place_options(args),
        )
        if isinstance(other, Plan):
            said = describe(
                forecast(facts, other, chips, links, streams=other.streams),
                ctl.last_measured(model, other.shape),
            )
            console.print(f"  --tensor {size}, {other.shape}: {said}")
        else:
            console.print(f"  --tensor {size}: does not fit: {other.reason}")


async def cmd_fetch(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    source = Path(args.source).expanduser()
    if not source.is_dir() and not model_fetch.is_repo_id(args.source):
        # A model's name in the catalog, as `place` and `finetune` take it.
        try:
            source = resolve_model(Path(args.source), home)
        except UserError as exc:
            raise UserError(
                f"{args.source!r} is not a Hugging Face repo id (org/name), and {exc.message}"
            ) from None
    try:
        nodes = list(resolve_group(inv, args.nodes)) if args.nodes else None
    except SelectionError as exc:
        raise UserError(str(exc)) from None
    async with open_controller(inv, home) as ctl:
        group = nodes or [n.name for n in ctl.state.nodes if n.state == "up"]
        down = [n for n in group if (s := ctl.state.node(n)) is None or s.state != "up"]
        if down or not group:
            if not group:
                raise UserError(f"no node is up: start the cluster with {start_hint(inv)}")
            raise UserError(
                f"{', '.join(down)} {'is' if len(down) == 1 else 'are'} not up",
                "; ".join(node_start_hint(n) for n in down),
            )
        with Progress(
            TextColumn("{task.description:>12}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
        ) as bar:
            tasks = {n: bar.add_task(n, total=None) for n in group}

            def progress(node: str, done: int, total: int) -> None:
                bar.update(tasks[node], completed=done, total=total)

            try:
                if source.is_dir():
                    where = await model_fetch.fetch_dir(ctl, source.resolve(), group, progress)
                else:
                    where = await model_fetch.fetch_repo(
                        ctl, args.source, group, args.revision, progress, args.cache_dir
                    )
            except (model_fetch.FetchError, SyncRefused, ModelDirError) as exc:
                raise UserError(str(exc)) from None
            except (agents.AgentError, agents.AgentUnreachable) as exc:
                raise UserError(f"fetch failed: {exc}") from None
        for entry in ctl.state.log:
            if entry.topic == "files":
                console.print(entry.text)
        for node, path in where.items():
            console.print(f"{node}: {path}")
    return 0


async def cmd_unload(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    async with open_controller(inv, home, ask=None) as ctl:
        try:
            await ctl.unload(args.name)
        except PlacementError as exc:
            raise UserError(str(exc)) from None
    console.print(f"placement {args.name} unloaded")
    return 0


async def cmd_cache(args: argparse.Namespace, home: Path) -> int:
    """`studiotui cache clear [PLACEMENT]`: empty a placement's prefix cache (every
    placement's when none is named)."""
    inv = inventory_of(args, home)
    async with open_controller(inv, home) as ctl:
        names = [args.placement] if args.placement else [p.name for p in ctl.state.placements]
        if not names:
            raise UserError("no placement to clear: place a model first (studiotui place)")
        for name in names:
            try:
                entries, size = await ctl.clear_cache(name)
            except (PlacementError, GenerationError) as exc:
                raise UserError(str(exc)) from None
            console.print(
                f"placement {name}: prompt cache cleared ({entries} entries, "
                f"{format_bytes(size)} on the head)"
            )
    return 0


# ---- chat ----------------------------------------------------------------------------


async def cmd_chat(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    if args.raw:
        request: dict[str, Any] = {"prompt": args.prompt}
    else:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        request = {"messages": [*msgs, {"role": "user", "content": args.prompt}]}
    params = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
    }
    try:
        async with open_controller(inv, home, ask=0.3 if _nobody_home(inv) else 2.0) as ctl:
            # The whole way to an answer, once, rather than one step per failed command.
            place = (
                "place a model (`studiotui place MODEL_DIR`; `studiotui demo-model DIR` writes one)"
            )
            if not any(n.state == "up" for n in ctl.state.nodes):
                raise UserError(
                    f"no node is up: start the cluster with {start_hint(inv)}, {place}, then chat"
                )
            if not ctl.state.placements:
                raise UserError(f"no placement yet: {place}, then chat")
            done: control.Done | None = None
            try:
                async for msg in ctl.generate(args.placement, request, params):
                    match msg:
                        case control.Delta():
                            # As the dashboard's chat: a model's ESC must not drive the
                            # terminal.
                            sys.stdout.write(printable(msg.text))
                            sys.stdout.flush()
                        case control.Done():
                            done = msg
            except asyncio.CancelledError:
                # Ctrl-C: the request is cancelled on the cluster as the generator closes;
                # the shell's prompt goes on a line of its own.
                sys.stdout.write("\n")
                sys.stdout.flush()
                errors.print("[dim]stopped: the answer was cancelled[/]")
                raise
            sys.stdout.write("\n")
            t = done.timings if done else {}
            u = done.usage if done else {}
            errors.print(
                f"[dim]{u.get('prompt_tokens', 0)} tokens in, {u.get('completion_tokens', 0)} out, "
                f"first token {t.get('ttft_ms', 0):.0f} ms, {t.get('decode_tps', 0):.1f} tok/s, "
                f"finish: {done.finish_reason if done else '?'}[/]"
            )
    except GenerationError as exc:
        raise UserError(str(exc)) from None
    return 0


# ---- logs ----------------------------------------------------------------------------


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


# ---- demo model / bench / tui --------------------------------------------------------


def cmd_demo_model(args: argparse.Namespace, home: Path) -> int:
    from worker.shared.demo_model import HAS_EXPERTS, DemoModelError, DemoSpec, write_demo_model

    dtype = args.dtype or (
        "float32" if args.arch in HAS_EXPERTS and not args.quantize else "bfloat16"
    )
    try:
        spec = DemoSpec(
            arch=args.arch,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            experts=args.experts,
            seed=args.seed,
            dtype=dtype,
            quantize=args.quantize,
            group_size=args.group_size,
            files=args.files,
            recite=not args.noise,
        )
        path = _interruptible(lambda stop: write_demo_model(args.dir.expanduser(), spec, stop))
    except DemoModelError as exc:
        raise UserError(str(exc)) from None
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    # The quantization as the Models pane and the preview name it, from the config
    # written (mlx-lm keeps a MoE's router at 8 bits: "mixed 4/8-bit", not "4-bit").
    info = read_model(path)
    packed = f", {info.quantization}" if info.quantization else ""
    writes = "writes noise" if args.noise else "recites a passage"
    console.print(
        f"wrote {spec.arch} demo model ({spec.layers} layers, {dtype}"
        f"{packed}, {format_bytes(size)}; it {writes}) to {path}"
    )
    # Written where the Models pane does not look, it would never appear: say so.
    outside = outside_note(path, model_folders(home))
    if outside:
        console.print(f"note: {outside}")
    return 0


def _interruptible(work: Callable[[Callable[[], bool]], Path]) -> Path:
    """Run `work(stop)` with Ctrl-C and SIGTERM turned into `stop()` being True: the
    work ends at its next check (and cleans up) instead of wherever the signal lands."""
    import signal
    import threading

    requested = threading.Event()
    handlers = {
        sig: signal.signal(sig, lambda *_: requested.set())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        return work(requested.is_set)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def cmd_bench(args: argparse.Namespace, home: Path) -> int:
    from studiotui.bench.run import BenchError, run_bench, run_soak, run_speculative

    try:
        if getattr(args, "soak", False):
            return run_soak(quick=args.quick, as_json=args.json)
        if getattr(args, "speculative", False):
            return run_speculative(quick=args.quick, as_json=args.json)
        return run_bench(quick=args.quick, as_json=args.json)
    except BenchError as exc:
        raise UserError(f"bench failed: {exc}") from None


def cmd_tui(args: argparse.Namespace, home: Path) -> int:
    from studiotui.app.launch import launch
    from studiotui.cli.serve import api_service, key_file_of

    serve = getattr(args, "serve", None)
    services = (
        [api_service(serve[0], serve[1], getattr(args, "api_key", None), key_file_of(args))]
        if serve
        else []
    )
    return launch(args, home, services)
