"""Command-line verbs for SSH nodes: provision, restart, and SSH-aware logs and down.

`add_parsers(subparsers)` adds `provision` and `restart`; `cmd_logs` and `cmd_down`
take the same arguments as the existing `logs` and `down` verbs and hand local
nodes to `nodes_cmd.cmd_logs` / `nodes_cmd.cmd_down`, so the CLI can route those
verbs here for every inventory.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from studiotui.cli import nodes_cmd
from studiotui.cli.args import inventory_of
from studiotui.cli.output import console, errors
from studiotui.cluster import local_cluster, stops
from studiotui.cluster.session import open_controller
from studiotui.core.errors import UserError
from studiotui.core.inventory import Inventory, NodeSpec
from studiotui.core.placement import format_bytes
from studiotui.provision import deploy as provision
from studiotui.provision import restart
from studiotui.provision.deploy import Outcome
from studiotui.ssh.client import SshError
from studiotui.tune import finetune as ft

# Steps a node can go through, for the length of its progress bar.
_BAR_STEPS = ("connect", "probe", "plan", "venv", "deps", "mlx", "wheel", "keys", "start", "wait")
_COLOURS = {"up": "green", "unchanged": "green", "kept": "yellow", "failed": "red"}


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prov = subparsers.add_parser(
        "provision", help="install and start the worker agent on every SSH node"
    )
    # SUPPRESS: without it this default would overwrite a `-i` given before the verb.
    prov.add_argument(
        "-i", "--inventory", type=Path, default=argparse.SUPPRESS, help="cluster.toml to use"
    )
    prov.add_argument("nodes", nargs="*", help="nodes or groups to provision (default: all)")
    prov.add_argument(
        "--upgrade", action="store_true", help="replace running agents of another version"
    )
    prov.add_argument(
        "--yes",
        action="store_true",
        help="with --upgrade: " + YES_HELP.format(verb="upgrade"),
    )
    prov.add_argument(
        "--accept-new-host-keys",
        action="store_true",
        help="trust (and record) the host key of nodes not yet in known_hosts",
    )

    restart = subparsers.add_parser("restart", help="stop and start agents (same build)")
    restart.add_argument(
        "-i", "--inventory", type=Path, default=argparse.SUPPRESS, help="cluster.toml to use"
    )
    restart.add_argument("nodes", nargs="*", help="nodes to restart (default: all)")
    restart.add_argument("--yes", action="store_true", help=YES_HELP.format(verb="restart"))


YES_HELP = "{verb} even a node running a rank of a job (which ends the job on every node)"


def _select(inv: Inventory, names: Sequence[str]) -> list[NodeSpec]:
    if not names:
        return list(inv.nodes)
    from studiotui.core.inventory import SelectionError, resolve_group

    try:
        selected = resolve_group(inv, ",".join(names))
    except SelectionError as exc:
        raise UserError(str(exc)) from None
    return [inv.node(n) for n in selected]


# --------------------------------------------------------------------------- progress


class _Display:
    """Per-node progress: rich bars in a terminal, one plain line per event otherwise."""

    def __init__(self, console: Console, names: Sequence[str]) -> None:
        self.console = console
        self.live = console.is_terminal
        self.started = time.monotonic()
        self.progress: Progress | None = None
        self.tasks: dict[str, TaskID] = {}
        if self.live:
            width = max((len(n) for n in names), default=4)
            self.progress = Progress(
                TextColumn(f"{{task.fields[node]:>{width}}}"),
                BarColumn(bar_width=24),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            )
            for name in names:
                self.tasks[name] = self.progress.add_task(
                    "waiting", total=len(_BAR_STEPS), node=name
                )

    def __enter__(self) -> _Display:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def event(self, node: str, step: str, status: str, detail: str) -> None:
        if self.progress is None:
            self._line(node, step, status, detail)
            return
        task = self.tasks.get(node)
        if task is None:
            return
        first = detail.splitlines()[0] if detail else ""
        if step == "result":
            colour = "red" if status == "fail" else "green"
            self.progress.update(
                task, completed=len(_BAR_STEPS), description=f"[{colour}]{first[:70]}[/]"
            )
        elif status == "start":
            self.progress.update(task, description=f"{step}: {first[:60]}" if first else step)
        elif status == "done":
            self.progress.advance(task)
        elif status == "fail":
            self.progress.update(task, description=f"[red]{step} failed[/]")
        elif status == "info":
            self.progress.update(task, description=f"{step}: {first[:60]}")

    def _line(self, node: str, step: str, status: str, detail: str) -> None:
        if status == "done" and not detail and step != "result":
            return
        at = time.monotonic() - self.started
        first = detail.splitlines()[0] if detail else ""
        word = {"start": "...", "done": "ok", "fail": "FAILED", "info": "-"}.get(status, status)
        if step == "result":
            word = "FAILED" if status == "fail" else "ok"
            step = "result"
        self.console.print(
            f"{at:6.1f}s {node}: {step} {word}{' ' + first if first else ''}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


def summary_table(outcomes: Sequence[Outcome]) -> Table:
    table = Table(title="provisioning")
    for col in ("node", "outcome", "version", "address", "memory", "time", "details"):
        table.add_column(col)
    for o in outcomes:
        colour = _COLOURS.get(o.status, "white")
        first = o.message.splitlines()[0] if o.message else ""
        table.add_row(
            o.node,
            f"[{colour}]{o.status}[/]",
            o.version,
            o.address,
            format_bytes(o.memory_total) if o.memory_total else "",
            f"{o.seconds:.1f} s",
            first,
        )
    return table


def print_outcomes(console: Console, errors: Console, outcomes: Sequence[Outcome]) -> None:
    console.print(summary_table(outcomes))
    for o in outcomes:
        if o.status == "failed":
            text = Text(f"{o.node}: {o.message}", style="red")
            if o.log_tail:
                text.append("\n    " + o.log_tail.replace("\n", "\n    "), style="dim")
            if o.hint:
                text.append(f"\n  hint: {o.hint}")
            errors.print(text, highlight=False)
        elif o.status == "kept":
            errors.print(f"[yellow]{o.node}[/]: {o.message}", highlight=False)


# --------------------------------------------------------------------------- verbs


async def cmd_provision(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    selected = _select(inv, getattr(args, "nodes", []) or [])
    names = [n.name for n in selected]
    upgrade = bool(getattr(args, "upgrade", False))

    async def run() -> list[Outcome]:
        with _Display(console, names) as display:
            try:
                outcomes = await provision.provision(
                    home,
                    inv,
                    upgrade=upgrade,
                    accept_new_host_keys=bool(getattr(args, "accept_new_host_keys", False)),
                    on_event=display.event,
                    nodes=names,
                )
            except provision.BuildError as exc:
                raise UserError(str(exc)) from None
        return [outcomes[n] for n in names]

    # Replacing an agent stops its shards, and a node `down` stopped had shards kept for
    # it: load them again, as `restart` does. Otherwise nothing is asked of the agents.
    async with open_controller(inv, home, ask=None) as ctl:
        if upgrade and not getattr(args, "yes", False):
            # Replacing an agent stops the job ranks it runs, as a restart does.
            ending_jobs_refused("upgrade", "upgrading", await ft.jobs_on(ctl, names))
        if not upgrade and not restart.has_kept(ctl, names):
            results = await run()
            print_outcomes(console, errors, results)
            return 0 if all(o.ok for o in results) else 1
        done = await restart.keep_placements(
            ctl,
            names,
            run,
            on_reload=nodes_cmd.say_reloading,
            doing="upgrade" if upgrade else "provisioning",
            on_back=_say_back,
        )
    nodes_cmd.print_restarted(done)
    return 0 if done.ok else 1


def _say_back(outcomes: Sequence[Outcome]) -> None:
    print_outcomes(console, errors, outcomes)


async def cmd_restart(args: argparse.Namespace, home: Path) -> int:
    """Restart agents, then load again the shards they held (same layers and ports), so
    placements stay whole; what cannot be reloaded is named (`restart.restart_nodes`)."""
    inv = inventory_of(args, home)
    selected = _select(inv, getattr(args, "nodes", []) or [])
    names = [n.name for n in selected]
    async with open_controller(inv, home, ask=None) as ctl:
        if not getattr(args, "yes", False):
            ending_jobs_refused("restart", "restarting", await ft.jobs_on(ctl, names))
        done = await restart.restart_nodes(
            ctl, names, on_reload=nodes_cmd.say_reloading, on_back=_say_back
        )
    nodes_cmd.print_restarted(done)
    return 0 if done.ok else 1


async def cmd_down(args: argparse.Namespace, home: Path) -> int:
    """Stop agents: SSH nodes by the pid in their pid file, over SSH; local ones as before.
    With --all, first the API servers and browser views of this home (`running`)."""
    inv = inventory_of(args, home)
    if getattr(args, "all", False):
        await asyncio.to_thread(nodes_cmd.stop_running, home)
    names = list(getattr(args, "nodes", []) or inv.names)
    unknown = [n for n in names if n not in inv.names]
    if unknown:
        raise UserError(f"unknown node(s) {', '.join(unknown)}; known: {', '.join(inv.names)}")
    local = [n for n in names if inv.node(n).is_local]
    remote_nodes = [inv.node(n) for n in names if not inv.node(n).is_local]
    if not getattr(args, "yes", False):
        # A local node with no agent runs nothing, and asking it would wait out a timeout.
        running = [n for n in names if n not in local or local_cluster.running_pid(inv.node(n))]
        async with open_controller(inv, home, ask=None) as ctl:
            ending_jobs_refused("stop", "stopping", await ft.jobs_on(ctl, running))
    code = 0
    if local:
        code = await nodes_cmd.cmd_down(
            argparse.Namespace(**{**vars(args), "nodes": local}), home, inv
        )

    async def one(node: NodeSpec) -> tuple[str, str, bool]:
        try:
            return node.name, await provision.stop_agent(home, node), True
        except SshError as exc:
            return node.name, str(exc), False

    kept = []
    if remote_nodes:
        async with open_controller(inv, home, ask=None) as ctl:
            kept = await nodes_cmd.keep_for_restart(ctl, [n.name for n in remote_nodes])
    remote = [n.name for n in remote_nodes]
    stopped: set[str] = set()
    stops.record_stops(home, inv.name, remote)
    for name, text, ok in await asyncio.gather(*(one(n) for n in remote_nodes)):
        target = console if ok else errors
        target.print(f"{name}: {text}", markup=False, highlight=False)
        code = code if ok else 1
        if ok:
            stopped.add(name)
    stops.record_stops(home, inv.name, [n for n in remote if n in stopped])
    nodes_cmd.say_kept(kept, ssh=True)
    return code


def ending_jobs_refused(verb: str, doing: str, ending: dict[str, list[str]]) -> None:
    """Refuse, before stopping any agent, a verb that would end the running jobs
    `ending` (`ft.jobs_ended_by`): saying which, on which nodes, and how to go ahead."""
    if not ending:
        return
    jobs_said = "; ".join(
        f"job {job!r} (a rank of it runs on {', '.join(nodes)})" for job, nodes in ending.items()
    )
    first = next(iter(ending))
    raise UserError(
        f"{doing} {', '.join(sorted({n for ns in ending.values() for n in ns}))} would end "
        f"{jobs_said}: a job stops on every node when one of its ranks stops; nothing "
        "was stopped",
        f"to {verb} anyway, add --yes (resume the job later from its last save: "
        f"studiotui finetune --resume {first}), or stop it first: studiotui jobs stop {first}",
    )


async def cmd_logs(args: argparse.Namespace, home: Path) -> int:
    """An agent's log: over SSH (SFTP) for SSH nodes, from the agent for local ones."""
    inv = inventory_of(args, home)
    if args.node not in inv.names:
        raise UserError(f"unknown node {args.node!r}; known: {', '.join(inv.names)}")
    node = inv.node(args.node)
    if node.is_local:
        return await nodes_cmd.cmd_logs(args, home)
    try:
        conn = await provision.connect(home, node)
    except SshError as exc:
        raise UserError(str(exc)) from None
    try:
        async for line in provision.follow_log(
            conn, node, int(getattr(args, "lines", 100)), follow=bool(args.follow)
        ):
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
    except SshError as exc:
        raise UserError(
            f"{exc}\n  (has {node.name} been provisioned? `studiotui provision`)"
        ) from None
    finally:
        conn.close()
    return 0
