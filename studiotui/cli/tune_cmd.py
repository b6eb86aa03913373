"""`finetune` and `jobs`: fine-tuning across a node group, and the jobs the nodes run."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from studiotui.cli.args import inventory_of
from studiotui.cli.argtypes import positive, positive_float
from studiotui.cli.nodes_cmd import start_hint
from studiotui.cli.output import transfer_shown
from studiotui.cli.place_cmd import resolve_model
from studiotui.cluster import jobs
from studiotui.cluster.adapter_fetch import AdapterFetchError, fetch_adapter
from studiotui.cluster.controller import Controller
from studiotui.cluster.session import open_controller
from studiotui.core.errors import UserError
from studiotui.core.inventory import Inventory, SelectionError, resolve_group
from studiotui.core.jobs import JobProgress, JobWatch
from studiotui.core.placement import format_bytes
from studiotui.core.text import counted
from studiotui.tune import finetune as ft
from worker.shared.protocol import control

console = Console(highlight=False)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser(
        "finetune",
        help="fine-tune a model with LoRA (QLoRA if quantized) across a node group",
        description="Train a LoRA adapter with mlx-lm's trainer, data-parallel over the "
        "group (gradients averaged by mx.distributed). The job runs on the nodes: "
        "Ctrl-C only stops watching it (studiotui jobs, studiotui jobs stop NAME).",
    )
    tune.add_argument("model", nargs="?", help="model directory, or a model's catalog name")
    tune.add_argument(
        "--data",
        help="a .jsonl file (chat, completions or text examples), mlx-lm's data folder "
        "(train.jsonl, valid.jsonl), or a folder of text, Markdown and PDF documents",
    )
    tune.add_argument("--nodes", help="a group name or comma list of nodes (default: all up)")
    # The defaults are the request's (ft.FinetuneRequest), filled in by request_of: an
    # option left out is None, so --resume can refuse one that was given.
    tune.add_argument("--iters", type=positive, help="iterations (default: 100)")
    tune.add_argument("--rank", type=positive, help="LoRA rank (default: 8)")
    tune.add_argument("--name", help="job name (default: the model's name and a time)")
    tune.add_argument(
        "--batch-size", type=positive, help="global batch, split over the nodes (default: 8)"
    )
    tune.add_argument("--learning-rate", type=positive_float, help="(default: 1e-5)")
    tune.add_argument("--layers", type=positive, help="last layers given LoRA (default: 16)")
    tune.add_argument("--save-every", type=positive, help="iterations between saves (default: 50)")
    tune.add_argument(
        "--resume",
        metavar="NAME",
        help="go on with job NAME from its last saved adapter, with its own model, data, "
        "nodes and settings (--iters: to how many iterations)",
    )
    tune.add_argument(
        "--detach", action="store_true", help="start the job and return (it runs on the nodes)"
    )
    jobs_p = sub.add_parser(
        "jobs", help="cluster jobs: list, follow, stop or forget them, or fetch their adapter"
    )
    jobs_p.add_argument(
        "action",
        nargs="?",
        choices=["list", "stop", "follow", "forget", "fetch"],
        default="list",
    )
    jobs_p.add_argument(
        "name", nargs="?", help="the job to stop, follow, forget, or fetch the adapter of"
    )


def _nodes(inv: Inventory, spec: str | None, ctl: Controller) -> tuple[str, ...]:
    if spec:
        try:
            return resolve_group(inv, spec)
        except SelectionError as exc:
            raise UserError(str(exc)) from None
    up = tuple(n.name for n in ctl.state.nodes if n.state == "up")
    if not up:
        raise UserError(f"no node is up: start the cluster with {start_hint(inv)}")
    return up


def request_of(args: argparse.Namespace, home: Path, nodes: tuple[str, ...]) -> ft.FinetuneRequest:
    if not args.model or not args.data:
        raise UserError(
            "finetune needs a MODEL and --data",
            "e.g. studiotui finetune MODEL_DIR --data examples.jsonl --nodes GROUP",
        )
    model = resolve_model(Path(args.model), home).expanduser().resolve()
    name = args.name or f"{model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return ft.FinetuneRequest(
        model=str(model),
        data=str(Path(args.data).expanduser().resolve()),
        nodes=nodes,
        name=name,
        **{
            field: value
            for field, value in (
                ("iters", args.iters),
                ("lora_rank", args.rank),
                ("batch_size", args.batch_size),
                ("learning_rate", args.learning_rate),
                ("num_layers", args.layers),
                ("save_every", args.save_every),
            )
            if value is not None
        },
    )


def resume_conflicts(args: argparse.Namespace) -> list[str]:
    """What was given beside --resume that a resumed job cannot change (it goes on with
    its own model, data, nodes and settings; only --iters says how far)."""
    given = [
        ("MODEL", args.model),
        ("--data", args.data),
        ("--nodes", args.nodes),
        ("--name", args.name),
        ("--rank", args.rank),
        ("--batch-size", args.batch_size),
        ("--learning-rate", args.learning_rate),
        ("--layers", args.layers),
        ("--save-every", args.save_every),
    ]
    return [option for option, value in given if value is not None]


async def cmd_finetune(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    async with open_controller(inv, home) as ctl:
        if args.resume:
            conflicts = resume_conflicts(args)
            if conflicts:
                raise UserError(
                    f"--resume {args.resume} goes on with the job's own model, data, nodes "
                    f"and settings: {', '.join(conflicts)} cannot change them",
                    f"leave {'it' if len(conflicts) == 1 else 'them'} out (--iters says "
                    "how far it trains), or start a new job without --resume",
                )
            req = ft.resume_request(ctl, args.resume)
            if args.iters is not None:
                req = replace(req, iters=args.iters)
        else:
            req = request_of(args, home, _nodes(inv, args.nodes, ctl))
        prepared = ft.prepare(ctl, req, resuming=bool(args.resume))
        ex = prepared.examples
        console.print(
            f"{prepared.method} of {prepared.info.name} as job [bold]{req.name}[/] on "
            f"{', '.join(req.nodes)} ({prepared.backend_reason}); "
            f"{counted(len(ex.train), 'training example')} and "
            f"{counted(len(ex.valid), 'validation example')} ({ex.format}), "
            f"batch {req.batch_size}, {req.iters} iterations"
        )
        # The base's first hashing (its identity; what a copy to a remote node is
        # checked by) and the copies of the model and the data shares, in bytes.
        why = "to stamp the adapter with its base"
        with transfer_shown(prepared.info.path, why) as (hashed, copied):
            record = await ft.launch(
                ctl, prepared, resume=bool(args.resume), hashing=hashed, progress=copied
            )
        if args.detach:
            console.print(f"job {req.name} runs on the nodes: studiotui jobs follow {req.name}")
            return 0
        return await _follow(ctl, record)


async def _follow(ctl: Controller, record: jobs.JobRecord) -> int:
    watch = JobWatch(record.name, record.kind, list(record.nodes))
    shown = [-1]

    def changed() -> None:
        p = watch.progress
        if p.train_loss and p.train_loss[-1].iteration != shown[0]:
            console.print(progress_line(p, since=shown[0]))
            shown[0] = p.train_loss[-1].iteration

    try:
        end = await ft.attach(ctl, record, watch, changed)
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print(
            f"stopped watching; job {record.name} goes on on the nodes "
            f"(studiotui jobs follow {record.name}, studiotui jobs stop {record.name})"
        )
        return 130
    p = watch.progress
    if end.state == "done":
        console.print(
            f"job {record.name} done: adapter in {p.adapter_dir or '(see the nodes)'} on "
            f"{record.nodes[0]} (and every node of the job)"
        )
        if record.kind != ft.KIND:
            return 0
        try:
            await _fetch(ctl, record)
        except AdapterFetchError as exc:
            console.print(f"[red]the adapter was not brought here: {exc}[/]")
            return 1
        return 0
    console.print(f"[red]{end.message or end.state}[/]")
    if end.state == "failed":
        console.print(
            f"resume from its last saved adapter: studiotui finetune --resume {record.name}"
        )
    return 1


async def _fetch(ctl: Controller, record: jobs.JobRecord) -> None:
    """The job's adapter brought to the operator (so it can be placed or fused by name)."""
    where = await fetch_adapter(ctl, record)
    for line in ctl.state.log[-1:]:
        console.print(line.text)
    base = str(record.request.get("model") or "") or "MODEL"
    console.print(
        f"adapter {record.name} is at {where}: studiotui place {shlex.quote(base)} "
        f"--adapter {record.name}"
    )


def progress_line(p: JobProgress, since: int = -1) -> str:
    """One line of a job's progress; the validation loss only when it was measured
    after iteration `since` (the line before), not repeated on every line."""
    last = p.train_loss[-1] if p.train_loss else None
    fresh = p.val_loss and p.val_loss[-1].iteration > since
    val = f" val {p.val_loss[-1].value:.3f}" if fresh else ""
    eta = f" ETA {_duration(p.eta_s)}" if p.eta_s is not None else ""
    mem = max((n.memory or 0 for n in p.nodes), default=0)
    return (
        f"iter {p.iteration}/{p.total} loss {last.value if last else float('nan'):.3f}{val} "
        f"{p.iterations_per_second or 0:.2f} it/s {p.tokens_per_second or 0:.0f} tok/s "
        f"mem {format_bytes(mem)}{eta}"
    )


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


async def cmd_jobs(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    async with open_controller(inv, home) as ctl:
        up = [n.name for n in ctl.state.nodes if n.state == "up"]
        if args.action in ("stop", "follow", "forget", "fetch"):
            if not args.name:
                raise UserError(
                    f"jobs {args.action} needs a job's name: studiotui jobs {args.action} NAME",
                    "`studiotui jobs` lists them",
                )
            record = jobs.load_record(home, args.name)
            if record is None:
                known = ", ".join(r.name for r in jobs.all_records(home)) or "none"
                raise UserError(f"no job named {args.name!r}", f"known: {known}")
            if args.action == "follow":
                return await _follow(ctl, record)
            if args.action == "fetch":
                await _fetch(ctl, record)  # a refusal is a StudioError: said, exit 2
                return 0
            if args.action == "forget":
                await jobs.forget(ctl, record)
                console.print(
                    f"job {record.name} forgotten (its adapters stay on the nodes, under "
                    f"jobs/{record.name}/adapters)"
                )
                return 0
            said = await jobs.stop(ctl, record.name, list(record.nodes))
            for node, what in said.items():
                # The rank's state after the stop: done or failed means it had ended.
                ended = what in ("done", "failed")
                console.print(
                    f"{node}: already {what}, nothing to stop" if ended else f"{node}: {what}"
                )
            return 0
        found = await jobs.status(ctl, up)
        rows = []
        names = [r.name for r in jobs.all_records(home)]
        names += [n for n in found if n not in names]
        for name in names:
            record = jobs.load_record(home, name)
            nodes = record.nodes if record else tuple(found.get(name, {}))
            for node in nodes:
                rank = found.get(name, {}).get(node)
                rows.append([name, record.kind if record else "?", node, *_rank_cells(rank)])
        console.print(jobs_table(rows))
    return 0


JOB_COLUMNS = ("job", "kind", "node", "state", "iter", "loss", "tok/s")


def jobs_table(rows: list[list[str]]) -> Group:
    """The jobs, a row per node, each cell whole on its line (a job name folded over two
    lines reads as two jobs); each row's message (an adapter's path, why it failed),
    the long part, on its own line under the table, where it has the width."""
    table = Table(title="jobs")
    longest = max((len(row[0]) for row in rows), default=0)
    for col in JOB_COLUMNS:
        # The name is what a row is known by: the figures give way first, never below
        # their header ("tok/s" was cut to "tok…" at 80 columns).
        table.add_column(col, no_wrap=True, min_width=longest if col == "job" else len(col))
    for row in rows:
        table.add_row(*row[: len(JOB_COLUMNS)])
    notes = [Text(f"{row[0]} on {row[2]}: {row[-1]}", overflow="fold") for row in rows if row[-1]]
    return Group(table, *notes)


def _rank_cells(rank: control.JobRank | None) -> list[str]:
    if rank is None:
        return ["unknown", "", "", "", "node down, or the job was forgotten there"]
    metrics = rank.latest.get("metrics") or {}
    it = f"{metrics.get('iteration', 0)}/{metrics.get('total', '?')}" if metrics else ""
    loss = f"{metrics['train_loss']:.3f}" if "train_loss" in metrics else ""
    rate = f"{metrics['tokens_per_second']:.0f}" if "tokens_per_second" in metrics else ""
    note = rank.message
    finished = rank.latest.get("finished") or {}
    if finished.get("adapter_dir") and not note:
        note = f"adapter: {finished['adapter_dir']}"
    return [rank.state, it, loss, rate, note]
