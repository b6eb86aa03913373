"""The nodes as `status` and `up` print them: a table fitted to the terminal, each
node's shards in its last column."""

from __future__ import annotations

from collections.abc import Mapping

from rich.markup import escape
from rich.table import Table

from studiotui.core.placement import format_bytes
from studiotui.core.state import ClusterState

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
