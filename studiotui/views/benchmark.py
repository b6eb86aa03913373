"""The cluster benchmark drawn: unicode bar charts, a curve of tok/s over streams, rich
tables for the terminal and the dashboard, and Markdown to paste anywhere.

Pure: a run (or two) in, text out. The CLI prints these, the Benchmark screen shows them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from studiotui.core.benchmark import DTYPES, CompareRow, Run, compare

EIGHTHS = " ▏▎▍▌▋▊▉"
FULL = "█"


def number(value: float | None, digits: int = 3) -> str:
    """A figure with `digits` significant digits (no exponent below a million); – if none."""
    if value is None or not math.isfinite(value):
        return "–"
    if value == 0:
        return "0"
    places = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{places}f}"


def change(row: CompareRow) -> str:
    if row.change is None:
        return "–"
    return f"{row.change * 100:+.1f} %"


def bar(value: float, top: float, width: int) -> str:
    """A horizontal bar of `width` cells for value/top, in eighths of a cell."""
    if width <= 0 or top <= 0 or not math.isfinite(value) or value <= 0:
        return ""
    eighths = round(min(value / top, 1.0) * width * 8)
    whole, part = divmod(eighths, 8)
    return FULL * whole + (EIGHTHS[part] if part else "")


def bar_chart(rows: Sequence[tuple[str, float | None]], unit: str, width: int) -> list[str]:
    """One line per row: label, a bar scaled to the largest value, the value and unit."""
    if not rows:
        return []
    label_w = max(len(label) for label, _ in rows)
    texts = [number(v) for _, v in rows]
    value_w = max(len(t) for t in texts)
    room = max(4, width - label_w - value_w - len(unit) - 4)
    top = max((v for _, v in rows if v is not None and math.isfinite(v)), default=0.0)
    return [
        f"{label:<{label_w}} {bar(v or 0.0, top, room):<{room}} {text:>{value_w}} {unit}"
        for (label, v), text in zip(rows, texts, strict=True)
    ]


def curve(points: Sequence[tuple[int, float]], width: int, height: int) -> list[str]:
    """A line chart of y over x, x on a log2 scale (1, 2, 4, 8 streams equally apart):
    `height` rows of plot with the y axis labelled at its top and zero, x labels below."""
    if not points or height < 2:
        return []
    top = max(y for _, y in points) or 1.0
    ys = [number(top), "0"]
    axis_w = max(len(t) for t in ys)
    plot_w = max(len(points) * 2, width - axis_w - 2)
    xs = [math.log2(max(x, 1)) for x, _ in points]
    lo, hi = min(xs), max(xs)

    def column(x: float) -> int:
        return 0 if hi == lo else round((x - lo) / (hi - lo) * (plot_w - 1))

    def row(y: float) -> int:
        return height - 1 - round(max(0.0, y) / top * (height - 1))

    grid = [[" "] * plot_w for _ in range(height)]
    marks = [(column(x), row(y)) for x, (_, y) in zip(xs, points, strict=True)]
    for (c0, r0), (c1, r1) in itertools.pairwise(marks):
        for c in range(c0 + 1, c1):
            r = round(r0 + (r1 - r0) * (c - c0) / (c1 - c0))
            grid[r][c] = "·"
    for c, r in marks:
        grid[r][c] = "●"
    lines = []
    for i, cells in enumerate(grid):
        label = ys[0] if i == 0 else ("0" if i == height - 1 else "")
        lines.append(f"{label:>{axis_w}} ┤{''.join(cells)}")
    under = [" "] * plot_w
    for (x, _), (c, _) in zip(points, marks, strict=True):
        text = str(x)
        start = min(max(0, c - len(text) // 2), plot_w - len(text))
        under[start : start + len(text)] = list(text)
    lines.append(f"{'':>{axis_w}} └{'─' * plot_w}")
    lines.append(f"{'':>{axis_w}}  {''.join(under)}")
    return lines


# ---- a run as terminal renderables ----------------------------------------------------


def heading(run: Run) -> str:
    machine = run.machine
    where = " ".join(v for v in (machine.get("host"), machine.get("system")) if v)
    return f"{run.id} · cluster {run.cluster} · {run.date} · {where} · build {run.build}"


def node_chart(run: Run, width: int) -> list[str]:
    matmul = [
        (f"{n.name} {dtype}", n.gflops.get(dtype))
        for n in run.nodes
        for dtype in DTYPES
        if not n.error
    ]
    memory = [(f"{n.name} copy", n.copy_gbs) for n in run.nodes if not n.error]
    lines = bar_chart(matmul, "GFLOP/s", width)
    return [*lines, *bar_chart(memory, "GB/s", width)] if memory else lines


def link_chart(run: Run, width: int) -> list[str]:
    rows: list[tuple[str, float | None]] = []
    for x in run.links:
        if x.gbps is not None:
            rows.append((f"{x.a} → {x.b}", x.gbps))
        if x.gbps_back is not None:
            rows.append((f"{x.b} → {x.a}", x.gbps_back))
    return bar_chart(rows, "Gbit/s", width)


def nodes_table(run: Run) -> Table:
    table = Table(title="nodes: MLX on each node's own device", title_justify="left")
    table.add_column("node", no_wrap=True)
    table.add_column("device")
    for dtype in DTYPES:
        table.add_column(f"{dtype}\nGFLOP/s", justify="right")
    table.add_column("copy\nGB/s", justify="right")
    table.add_column("read\nGB/s", justify="right")
    for n in run.nodes:
        if n.error:
            table.add_row(n.name, Text(n.error, style="red"))
            continue
        sized = [f"{number(n.gflops.get(d))} (n={n.matmul_n.get(d, '?')})" for d in DTYPES]
        device = " ".join(x for x in (n.chip, n.device) if x)
        table.add_row(n.name, device, *sized, number(n.copy_gbs), number(n.read_gbs))
    return table


def links_table(run: Run) -> Table:
    pad = run.sizes.link_pad_bytes
    table = Table(title="links: CURVE ZeroMQ, as the ring sends", title_justify="left")
    for col in ("pair", "kind"):
        table.add_column(col, no_wrap=True)
    table.add_column("latency\nµs", justify="right")
    table.add_column(f"latency {pad // 1024} KiB\nµs", justify="right")
    table.add_column("a → b\nGbit/s", justify="right")
    table.add_column("b → a\nGbit/s", justify="right")
    for x in run.links:
        if x.error and x.latency_us is None:
            table.add_row(f"{x.a} ↔ {x.b}", x.kind, Text(x.error, style="red"))
            continue
        table.add_row(
            f"{x.a} ↔ {x.b}",
            x.kind,
            number(x.latency_us),
            number(x.latency_pad_us),
            number(x.gbps),
            number(x.gbps_back),
        )
    return table


def group_lines(run: Run, width: int = 100) -> list[str]:
    g = run.group
    if g is None:
        return []
    if g.error:
        return [f"group {', '.join(g.nodes)}: {g.error}"]
    rows = [("together", g.gflops), ("sum of parts", g.parts_gflops)]
    lines = [
        f"group: {g.n}×{g.n} float32 product over {', '.join(g.nodes)} "
        f"({g.backend}, launched by {g.launcher})",
        *bar_chart(rows, "GFLOP/s", width),
        f"scaling {number(g.efficiency)}× the sum of its parts; a step "
        f"{number((g.step_s or 0) * 1e3)} ms, of which the slowest share's own product "
        f"{number((g.compute_s or 0) * 1e3)} ms; largest error {number(g.max_error)}",
    ]
    return lines


def placement_table(run: Run) -> Table:
    table = Table(title="placements: concurrent streams", title_justify="left")
    table.add_column("placement", no_wrap=True)
    table.add_column("streams", justify="right")
    table.add_column("tok/s", justify="right")
    table.add_column("first token ms", justify="right")
    for p in run.placements:
        if p.error:
            table.add_row(p.name, "", Text(p.error, style="red"))
        for point in p.points:
            waiting = " (queued)" if p.admitted and point.streams > p.admitted else ""
            table.add_row(
                p.name, f"{point.streams}{waiting}", number(point.tps), number(point.ttft_ms)
            )
    return table


def placement_curves(run: Run, width: int) -> list[str]:
    lines: list[str] = []
    for p in run.placements:
        if not p.points:
            continue
        lines.append(f"{p.name}: decode tok/s over concurrent streams ({p.model})")
        lines += curve([(q.streams, q.tps) for q in p.points], width, 6)
    return lines


def report(run: Run, width: int = 100) -> RenderableType:
    """The whole run for a terminal: tables, then the charts."""
    parts: list[RenderableType] = [Text(heading(run), style="bold")]
    if run.nodes:
        parts += [nodes_table(run), Text("\n".join(node_chart(run, width)))]
    if run.links:
        parts += [links_table(run), Text("\n".join(link_chart(run, width)))]
    if run.group is not None:
        parts.append(Text("\n".join(group_lines(run, width))))
    if run.placements:
        parts += [placement_table(run), Text("\n".join(placement_curves(run, width)))]
    for note in run.notes:
        parts.append(Text(note, style="dim"))
    for error in run.errors:
        parts.append(Text(f"failed: {error}", style="red"))
    return Group(*parts)


def compare_table(a: Run, b: Run, rows: Sequence[CompareRow] | None = None) -> Table:
    """Two runs side by side, a row per figure under a line per section (node, link,
    group, placement); the change is green when better, red when worse (past 2 %)."""
    rows = compare(a, b) if rows is None else rows
    table = Table(title=f"A {a.label}\nB {b.label}", title_justify="left")
    # The figure's name is what tells a node's five rows apart: it never shrinks (rich
    # narrows wrappable columns first, to nothing at 80 columns); a long item (a group
    # of four nodes) wraps instead.
    table.add_column("item", overflow="fold", min_width=8)
    table.add_column("figure", no_wrap=True)
    table.add_column("unit", no_wrap=True)
    for col in ("A", "B", "B vs A"):
        table.add_column(col, justify="right", no_wrap=True)
    section = ""
    for row in rows:
        if row.section != section:
            section = row.section
            table.add_row(Text(section, style="bold"))
        better = row.change is not None and (row.change > 0) == row.higher_is_better
        style = (
            "" if row.change is None or abs(row.change) < 0.02 else ("green" if better else "red")
        )
        table.add_row(
            row.item,
            row.figure,
            row.unit,
            number(row.a),
            number(row.b),
            Text(change(row), style=style),
        )
    return table


# ---- Markdown ---------------------------------------------------------------------------


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: int = 1) -> list[str]:
    """A GitHub table; columns from `right` on are right-aligned (figures)."""
    align = ["---" if i < right else "---:" for i in range(len(header))]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return out


def markdown(run: Run) -> str:
    m = run.machine
    lines = [
        f"# studiotui benchmark {run.id}",
        "",
        f"- date: {run.date}",
        f"- cluster: {run.cluster}",
        f"- machine: {m.get('host', '?')} ({m.get('system', '?')}, Python {m.get('python', '?')}, "
        f"MLX {m.get('mlx', '?')})",
        f"- build: {run.build}",
        f"- took: {number(run.seconds)} s",
        "",
    ]
    if run.nodes:
        lines += ["## Nodes", ""]
        header = ["node", "device", *(f"{d} GFLOP/s" for d in DTYPES), "copy GB/s", "read GB/s"]
        rows = [
            [n.name, " ".join(x for x in (n.chip, n.device) if x) or "–"]
            + [number(n.gflops.get(d)) for d in DTYPES]
            + [number(n.copy_gbs), number(n.read_gbs)]
            for n in run.nodes
        ]
        lines += [*_md_table(header, rows, right=2), ""]
    if run.links:
        lines += ["## Links", ""]
        header = [
            "pair",
            "kind",
            "latency µs",
            "latency activation µs",
            "a → b Gbit/s",
            "b → a Gbit/s",
        ]
        rows = [
            [
                f"{x.a} ↔ {x.b}",
                x.kind,
                *(number(v) for v in (x.latency_us, x.latency_pad_us, x.gbps, x.gbps_back)),
            ]
            for x in run.links
        ]
        lines += [*_md_table(header, rows, right=2), ""]
    if run.group is not None:
        g = run.group
        lines += ["## Group", ""]
        header = ["nodes", "backend", "n", "together GFLOP/s", "sum of parts GFLOP/s", "scaling"]
        rows = [
            [
                ", ".join(g.nodes),
                g.backend or "–",
                str(g.n),
                *(number(v) for v in (g.gflops, g.parts_gflops, g.efficiency)),
            ]
        ]
        lines += [*_md_table(header, rows, right=2), ""]
        if g.error:
            lines += [f"Failed: {g.error}", ""]
    if run.placements:
        lines += ["## Placements", ""]
        header = ["placement", "model", "streams", "tok/s", "first token ms"]
        rows = [
            [p.name, p.model, str(q.streams), number(q.tps), number(q.ttft_ms)]
            for p in run.placements
            for q in p.points
        ]
        lines += [*_md_table(header, rows, right=2), ""]
    if run.errors:
        lines += ["## Failed", "", *(f"- {e}" for e in run.errors), ""]
    return "\n".join(lines)


def compare_markdown(a: Run, b: Run) -> str:
    lines = [
        "# studiotui benchmark comparison",
        "",
        f"- A: {a.label} ({a.date})",
        f"- B: {b.label} ({b.date})",
        "",
    ]
    rows = [
        [r.section, r.item, r.figure, r.unit, number(r.a), number(r.b), change(r)]
        for r in compare(a, b)
    ]
    lines += _md_table(["", "item", "figure", "unit", "A", "B", "B vs A"], rows, right=4)
    return "\n".join([*lines, ""])
