"""`studiotui benchmark`: measure the cluster, save the run, compare two runs."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from studiotui.cli.args import inventory_of, nodes_of
from studiotui.cluster.benchmark import Benchmark
from studiotui.cluster.session import open_controller
from studiotui.core import benchmark as figures
from studiotui.core.benchmark import Sizes, Step
from studiotui.core.errors import UserError
from studiotui.views.benchmark import compare_markdown, compare_table, markdown, report

console = Console(highlight=False)
# Progress goes to stderr, so `--json` leaves stdout one JSON object.
errors = Console(stderr=True, highlight=False)


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "benchmark",
        help="measure the cluster: MLX GFLOP/s and memory GB/s per node, each link, the "
        "group's distributed product, each placement's streams; saved to compare",
        description="Each node's agent measures its own device with MLX (matrix products in "
        "float32, bfloat16 and float16; memory bandwidth), each node measures its links over "
        "CURVE ZeroMQ as the ring sends, the agents launch a distributed matrix product over "
        "mx.distributed, and every ready placement on the nodes decodes 1, 2, 4 and 8 streams "
        "at once. The run is saved under STUDIOTUI_HOME/benchmarks with its date, machine and "
        "build.",
    )
    bench.add_argument("--nodes", help="a group name or comma list of nodes (default: all up)")
    bench.add_argument(
        "--placement",
        action="append",
        help="measure this placement's streams (repeatable; default: every ready placement "
        "on the nodes)",
    )
    bench.add_argument("--quick", action="store_true", help="smaller sizes, a few seconds a node")
    bench.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="change one size (repeatable), e.g. matmul_n=1024, seconds=0.2, "
        'stream_counts=1,2,4; the names are the fields of a run\'s "sizes"',
    )
    bench.add_argument("--json", action="store_true", help="print the run as one JSON object")
    bench.add_argument(
        "--markdown",
        type=Path,
        metavar="FILE",
        help="also write the run (or comparison) as Markdown",
    )
    bench.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="instead of measuring, show two saved runs side by side (an id, the start of "
        "one, latest, previous, or a .json file)",
    )
    bench.add_argument("--list", action="store_true", help="list the saved runs")


def _write(path: Path, text: str) -> None:
    try:
        path.expanduser().write_text(text)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc}") from None
    errors.print(f"wrote {path}", soft_wrap=True)


def _check_writable(path: Path | None) -> None:
    """Refuse a `--markdown FILE` that cannot be written before anything is measured: a
    run takes minutes and the file is written last."""
    if path is None:
        return
    target = path.expanduser()
    if target.is_dir():
        raise UserError(f"--markdown {path} is a folder", "name a file to write")
    if not target.parent.is_dir():
        raise UserError(
            f"--markdown {path}: there is no folder {target.parent}",
            "create it or name a file in a folder that exists",
        )
    if not os.access(target.parent, os.W_OK):
        raise UserError(f"--markdown {path}: {target.parent} is not writable", "pick another file")


def cmd_compare(args: argparse.Namespace, home: Path) -> int:
    a, b = (figures.find(home, ref) for ref in args.compare)
    rows = figures.compare(a, b)
    if args.json:
        print(
            json.dumps(
                {
                    "a": a.id,
                    "b": b.id,
                    "rows": [{**asdict(r), "change": r.change} for r in rows],
                }
            )
        )
    else:
        console.print(compare_table(a, b, rows))
    if args.markdown:
        _write(args.markdown, compare_markdown(a, b))
    return 0


def cmd_list(home: Path, as_json: bool = False) -> int:
    runs = figures.saved(home)
    if as_json:  # for scripts: the ids --compare takes, and what each run covered
        listed = [
            {
                "id": run.id,
                "date": run.date,
                "cluster": run.cluster,
                "nodes": [n.name for n in run.nodes],
                "build": run.build,
                "failed": len(run.errors),
                "path": str(figures.runs_dir(home) / f"{run.id}.json"),
            }
            for run in runs
        ]
        print(json.dumps(listed))
        return 0
    if not runs:
        errors.print(f"no saved run in {figures.runs_dir(home)}: run `studiotui benchmark`")
        return 0
    table = Table(title=f"saved runs ({figures.runs_dir(home)})")
    # The id (UTC time and cluster) is what --compare takes: it is never folded.
    table.add_column("id (UTC time, cluster)", no_wrap=True)
    table.add_column("nodes", overflow="fold")
    table.add_column("build", overflow="fold")
    table.add_column("failed", justify="right")
    for run in runs:
        names = ", ".join(n.name for n in run.nodes)
        table.add_row(run.id, names, run.build, str(len(run.errors)))
    console.print(table)
    return 0


def _check_modes(args: argparse.Namespace) -> None:
    """`--compare` and `--list` measure nothing: a measuring option beside them would be
    silently ignored, so it is refused, as is asking for both."""
    if args.compare and args.list:
        raise UserError("--compare and --list are two things", "give one of them")
    mode = "--compare" if args.compare else "--list" if args.list else None
    if mode is None:
        return
    given = [
        flag
        for flag, value in (
            ("--nodes", args.nodes),
            ("--placement", args.placement),
            ("--quick", args.quick),
            ("--size", args.size),
        )
        if value
    ]
    if given:
        raise UserError(
            f"{mode} reads saved runs and measures nothing: {', '.join(given)} would be ignored",
            f"leave out {', '.join(given)}, or drop {mode} to measure",
        )


async def cmd_benchmark(args: argparse.Namespace, home: Path) -> int:
    _check_modes(args)
    _check_writable(args.markdown)
    if args.compare:
        return cmd_compare(args, home)
    if args.list:
        return cmd_list(home, args.json)
    # Every refusal comes before a node is asked anything.
    sizes = (Sizes.quick() if args.quick else Sizes()).changed(args.size)
    inv = inventory_of(args, home)
    nodes = nodes_of(args, inv)
    async with open_controller(inv, home, ask=None) as ctl:
        bench = Benchmark(ctl, nodes, sizes, None, args.placement)
        # Unknown nodes and placements refused before the bar shows (`run` asks again:
        # a placement may have gone meanwhile).
        await bench.choose()
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=errors,
        ) as bar:
            task = bar.add_task("asking the nodes", total=None)

            def on_step(step: Step) -> None:
                what = f"{step.label}: {step.detail}" if step.detail else step.label
                if step.state == "failed":
                    errors.print(f"[red]{step.label} failed:[/] {step.detail}")
                done = step.index - (step.state == "running")
                bar.update(task, description=what, completed=done, total=step.total)

            bench.on_step = on_step
            run = await bench.run()
    path = figures.save(home, run)
    if args.json:
        print(json.dumps(figures.to_json(run)))
    else:
        console.print(report(run, min(console.width, 120)))
    if args.markdown:
        _write(args.markdown, markdown(run))
    # soft_wrap: a command folded at the terminal's width cannot be pasted back.
    errors.print(
        f"saved {run.id} to {path}; compare later with "
        f"`studiotui benchmark --compare {run.id} latest`",
        soft_wrap=True,
    )
    return 1 if run.errors else 0
