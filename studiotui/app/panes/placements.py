"""The Placements pane: every placement's group, ring, state and traffic.

Above the table a progress block appears while placements load, fed by the
controller's progress callback (bytes loaded per node); several loads can run at
once, each with its own block. In flight, tokens per second and tokens come from
`core/traffic.py` (the rate from the change in the shards' token counts between
telemetry updates), which `studiotui status --json` uses too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.cells import cell_len
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.events import Key
from textual.widgets import DataTable, Static

from studiotui.app.panes.filter import filter_note, matches
from studiotui.app.render import (
    Drawing,
    bar,
    fit_hops,
    join_hops,
    rich_colour,
    ring_hops,
    wrap_hops,
)
from studiotui.core.placement import format_bytes
from studiotui.core.rates import Rates
from studiotui.core.state import PlacementState
from studiotui.core.traffic import (
    CacheFigures,
    RateMeter,
    placement_cache,
    placement_in_flight,
    placement_tokens,
)

# The ring comes last and gets what room is left, abbreviated (l3[0:2]→l2[2:4]…);
# the line under the table spells out the ring of the placement under the cursor.
_COLUMNS = (
    "placement",
    "state",
    "model",
    "group",
    "in flight",
    "tok/s",
    "tokens",
    "ring",
)
_RING_MIN = 16
_FIXED = len(_COLUMNS) - 1  # the columns before the ring, which gets what they leave
RING_LINES = 3  # the most the ring under the table takes from the table's rows
_STATE_COLOUR = {"ready": "success", "failed": "error", "broken": "error"}
# The gauge of the operator's own work for a placement: the model's first hashing
# before its copy to a remote node (every byte once; cached beside its files after).
OPERATOR = "operator"
HASHING_SAID = "hashing the model for the copy to remote nodes (once: cached)…"


def ring_text(placement: PlacementState) -> str:
    """The whole ring in words, a missing shard marked ✗."""
    return join_hops(ring_hops(placement)).plain


def short_ring(placement: PlacementState, width: int) -> str:
    """The ring in at most `width` cells: short names, whole hops, then '…'."""
    return fit_hops(ring_hops(placement, short=True), width).plain


def group_label(placement: PlacementState, groups: Mapping[str, Sequence[str]]) -> str:
    """The inventory group holding exactly its ring's nodes, else how many there are;
    nodes of the ring that hold no shard now are named after it (✗ b), so a placement
    with a node down still shows all its nodes, not the ones left."""
    nodes = {p.node for p in placement.ring}
    if not placement.planned and len(placement.shards) < placement.expected:
        # Not planned here: the ring is what answers; who else was in it is unknown.
        return f"{len(nodes)} of {placement.expected} nodes"
    label = next((name for name, members in groups.items() if set(members) == nodes), "")
    label = label or f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"
    # While this operator loads it, a node that has not reported its shard yet is
    # on its way, not gone: ✗ would name every node of a fresh placement.
    missing = () if placement.placing else placement.missing
    return f"{label} (✗ {', '.join(missing)})" if missing else label


def state_label(placement: PlacementState) -> str:
    state = placement.state
    if state == "loading":
        done = sum(s.progress[0] for s in placement.shards)
        total = sum(s.progress[1] for s in placement.shards)
        if total:
            return f"loading {done * 100 // total}%"
    return state


def cache_text(cache: CacheFigures) -> str:
    """A placement's prefix cache in one line (shown under its ring once it was used)."""
    rate = cache.hit_rate
    hits = f"{rate * 100:.0f}% hits" if rate is not None else "no request yet"
    disk = f" · {format_bytes(cache.disk_bytes)} on disk" if cache.disk_bytes else ""
    return (
        f"prompt cache {cache.entries} entr{'y' if cache.entries == 1 else 'ies'} · "
        f"{format_bytes(cache.bytes)} in memory{disk} · {hits}"
    )


def placements_signature(placements: tuple[PlacementState, ...]) -> tuple:
    return tuple(
        (
            p.name,
            p.label,
            p.state,
            tuple(
                (s.node, s.start, s.end, s.state, s.tokens, s.in_flight, s.progress)
                for s in p.shards
            ),
            tuple(
                (s.cache_entries, s.cache_bytes, s.cache_disk_bytes, s.cache_hits, s.cache_misses)
                for s in p.shards
            ),
        )
        for p in placements
    )


def _cells(cell: Text | str) -> int:
    return cell.cell_len if isinstance(cell, Text) else cell_len(cell)


# The columns cut with "…" when the row is wider than the pane, in this order: an
# adapter's placement is named `model+adapter` and its model `model + adapter`, which
# pushed tokens and the ring past the edge (cut to "t" and "rin" at 160 columns).
_CUT_FIRST = (2, 0)


def cut_widths(widths: list[int], budget: int) -> list[int]:
    """Each fixed column's width so that all of them, with a cell of padding either
    side, take at most `budget` cells: the columns of _CUT_FIRST give way in turn, none
    below its header."""
    out = list(widths)
    for i in _CUT_FIRST:
        over = sum(w + 2 for w in out) - budget
        if over <= 0:
            break
        out[i] = max(len(_COLUMNS[i]), out[i] - over)
    return out


def _cut(cell: Text | str, width: int) -> Text | str:
    if _cells(cell) <= width:
        return cell
    text = cell.copy() if isinstance(cell, Text) else Text(cell)
    text.truncate(width, overflow="ellipsis")
    return text


class PlacementsPane(Vertical):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = "Placements"
        self._signature: tuple | None = None
        self._loads: dict[str, tuple[str, dict[str, tuple[int, int]]]] = {}
        self._rates: dict[str, Rates] = {}
        # A load's model being hashed for its copy (done, total), by load key.
        self._hashing: dict[str, tuple[int, int]] = {}
        self.rates = RateMeter()
        self.groups: Mapping[str, Sequence[str]] = {}
        self.shown: tuple[PlacementState, ...] = ()
        self._wanted: str | None = None
        self._last: tuple[tuple[PlacementState, ...], str, dict[str, str]] | None = None
        self.clock: Callable[[], float] = time.monotonic
        self._widths: tuple[int, ...] = ()  # each column's widest cell, last drawn
        self.filter_text = ""  # `/`: only the placements holding every word
        self._every: tuple[PlacementState, ...] = ()  # before the filter

    def compose(self) -> ComposeResult:
        yield Static(id="place-progress")
        yield Static(
            Content.styled(
                "no placements yet: pick a model (4), mark nodes (5, ↑↓, space), press p "
                "— or drag a model onto a node",
                "$text-muted",
            ),
            id="placements-empty",
        )
        yield Static(id="placements-filter")
        table: DataTable[Any] = DataTable(cursor_type="row", id="placements-table")
        yield table
        # Drawn at the width it really has (the pane's width is not known yet at the
        # first telemetry, and a ring folded for 80 cells was refolded by the terminal).
        yield Drawing(self._ring_lines, id="placement-ring")

    def on_mount(self) -> None:
        self._add_columns(self.query_one(DataTable))
        self.query_one("#place-progress").display = False
        self.query_one("#placements-filter").display = False
        self.query_one("#placement-ring").styles.max_height = RING_LINES

    def set_filter(self, text: str) -> None:
        """Keep the placements holding every word of `text` (`/`); "" shows them all."""
        if text != self.filter_text:
            self.filter_text = text
            if self._last is not None:
                self._signature = None
                self.show(*self._last)

    def take_keys(self) -> None:
        # The keys go to the table: the pane itself holds none.
        self.query_one(DataTable).focus()

    def on_key(self, event: Key) -> None:
        if event.key == "escape" and self.filter_text:
            event.stop()
            self.set_filter("")

    def _kept(self, placements: tuple[PlacementState, ...]) -> tuple[PlacementState, ...]:
        return tuple(
            p
            for p in placements
            if matches(
                self.filter_text,
                (p.name, state_label(p), p.label, group_label(p, self.groups), ring_text(p)),
            )
        )

    @staticmethod
    def _add_columns(table: DataTable[Any]) -> None:
        for column in _COLUMNS:
            table.add_column(column, key=column.split()[0])

    def show(
        self, placements: tuple[PlacementState, ...], theme: str, colours: dict[str, str]
    ) -> None:
        self._last = (placements, theme, colours)
        now = self.clock()
        rates = {p.name: self.rates.update(p.name, placement_tokens(p), now) for p in placements}
        self.rates.forget(set(rates))
        shown_rates = tuple(round(r, 1) for r in rates.values())
        signature = (placements_signature(placements), theme, shown_rates, self.filter_text)
        if signature == self._signature:
            return
        self._signature = signature
        self._every = placements
        placements = self._kept(placements)
        self.shown = placements
        table = self.query_one(DataTable)
        keep = self._wanted if self._wanted in {p.name for p in placements} else self.selected
        if keep == self._wanted:
            self._wanted = None
        # An empty table says nothing; a sentence says what to do.
        table.display = bool(placements)
        self.query_one("#placements-empty").display = not placements
        self._show_filter()
        cells = [
            (
                Text(p.name, style="bold"),
                Text(
                    state_label(p),
                    style=rich_colour(colours, _STATE_COLOUR.get(p.state, "warning")),
                ),
                p.label,  # `model + adapter` for a placement with an adapter
                group_label(p, self.groups),
                Text(str(placement_in_flight(p)), justify="right"),
                Text(f"{rates[p.name]:.1f}" if rates[p.name] else "–", justify="right"),
                Text(str(placement_tokens(p)), justify="right"),
            )
            for p in placements
        ]
        cells = self._fitted(cells)
        # Columns too, when a column's widest cell got narrower: a DataTable's auto
        # widths only grow, so a label that was long once (a broken placement's ✗
        # list) would push tok/s, tokens and the ring past the pane's edge for good.
        # Only then: re-made columns take their widths from the rows at the next
        # refresh, which a table behind a dialog waits for (and most redraws only
        # change figures).
        widths = tuple(max((_cells(row[i]) for row in cells), default=0) for i in range(_FIXED))
        if any(new < old for new, old in zip(widths, self._widths, strict=False)):
            table.clear(columns=True)
            self._add_columns(table)
        else:
            table.clear()
        self._widths = widths
        room = self._ring_room(cells)
        for p, row in zip(placements, cells, strict=True):
            # ✗ marks a shard that is gone; the state column says what that means.
            table.add_row(*row, short_ring(p, room), key=p.name)
        # Redrawing every second must not throw the cursor back to the first row.
        names = [p.name for p in placements]
        if keep in names:
            table.move_cursor(row=names.index(keep), animate=False)
        self._show_ring()

    def _show_filter(self) -> None:
        line = self.query_one("#placements-filter", Static)
        on = bool(self.filter_text.strip())
        line.display = on
        if on:
            said = filter_note(self.filter_text, len(self.shown), len(self._every))
            if self._every and not self.shown:
                said = f"no placement matches {self.filter_text.strip()!r} · {said}"
            line.update(Content.styled(said, "$accent"))
            # The table's sentence for "no placements" would say to place one.
            self.query_one("#placements-empty").display = not self._every

    def _fitted(self, cells: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The rows with their long names cut so tokens and the ring keep their room."""
        available = self.query_one(DataTable).size.width or self.size.width
        if not cells or not available:
            return cells
        widths = [
            max([len(_COLUMNS[i]), *(_cells(row[i]) for row in cells)]) for i in range(_FIXED)
        ]
        fit = cut_widths(widths, available - _RING_MIN - 2)
        if fit == widths:
            return cells
        return [tuple(_cut(c, w) for c, w in zip(row, fit, strict=True)) for row in cells]

    def _ring_room(self, cells: list[tuple[Any, ...]]) -> int:
        """What the table's width leaves the ring column after the others (each
        column pads a cell either side)."""
        widths = [
            max([len(_COLUMNS[i]), *(len(str(row[i])) for row in cells)]) + 2
            for i in range(len(_COLUMNS) - 1)
        ]
        available = self.query_one(DataTable).size.width or self.size.width
        return max(_RING_MIN, available - sum(widths) - 2 - 1)

    def on_resize(self) -> None:
        # The ring column gets what the width leaves: redraw for the new width.
        if self._last is not None:
            self._signature = None
            self.show(*self._last)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_ring()

    def _show_ring(self) -> None:
        """The full ring of the placement under the cursor, folded between hops."""
        line = self.query_one("#placement-ring", Drawing)
        line.display = self._ring_placement() is not None
        line.redraw()

    def _ring_placement(self) -> PlacementState | None:
        name = self.selected
        return next((p for p in self.shown if p.name == name), None)

    def _ring_lines(self, width: int) -> Content:
        """The ring with its nodes' names, or with the short names of the table's ring
        column when the names would take more than RING_LINES lines."""
        placement = self._ring_placement()
        if placement is None:
            return Content("")
        head = Content.assemble(("ring ", "$text-muted"), (placement.name, "bold"), "  ")
        if "×" in placement.shape:
            head = Content.assemble(head, (f"{placement.shape}  ", "$text-muted"))
        for short in (False, True):
            hops = ring_hops(placement, short=short, closed=True)
            lines = wrap_hops(head, hops, width, Content(""))
            if len(lines) <= RING_LINES:
                break
        cache = placement_cache(placement)
        if cache.used:
            lines = [*lines[: RING_LINES - 1], Content.styled(cache_text(cache), "$text-muted")]
        return Content("\n").join(lines)

    @property
    def selected(self) -> str | None:
        """The placement under the table's cursor (what `u` unloads)."""
        table = self.query_one(DataTable)
        if not self.shown or not 0 <= table.cursor_row < len(self.shown):
            return None
        return self.shown[table.cursor_row].name

    def select(self, name: str) -> None:
        """Put the cursor on `name`, now or when it first shows (a new placement)."""
        names = [p.name for p in self.shown]
        if name in names:
            self._wanted = None
            self.query_one(DataTable).move_cursor(row=names.index(name), animate=False)
        else:
            self._wanted = name

    # ---- progress of placements being loaded ------------------------------------------

    def start_progress(self, title: str, nodes: Sequence[str], key: str = "") -> None:
        self._loads[key] = (title, {n: (0, 0) for n in nodes})
        self._render_progress()

    def progress(self, node: str, done: int, total: int, key: str = "") -> None:
        load = self._loads.get(key)
        if load is not None:
            load[1][node] = (done, total)
            self._rates.setdefault(key, Rates()).update(node, done, total, time.monotonic())
            self._render_progress()

    def hashing(self, done: int, total: int, key: str = "") -> None:
        """The operator's first hashing of the model for a copy to a remote node: its
        gauge above the nodes' (gone with end_hashing, once the copies start)."""
        if key in self._loads:
            self._hashing[key] = (done, total)
            self._rates.setdefault(key, Rates()).update(OPERATOR, done, total, time.monotonic())
            self._render_progress()

    def end_hashing(self, key: str = "") -> None:
        if self._hashing.pop(key, None) is not None:
            self._render_progress()

    def end_progress(self, key: str = "") -> None:
        self._loads.pop(key, None)
        self._hashing.pop(key, None)
        self._rates.pop(key, None)
        self._render_progress()

    @property
    def progress_text(self) -> str:
        return self.query_one("#place-progress", Static).render().plain  # type: ignore[union-attr]

    def _render_progress(self) -> None:
        block = self.query_one("#place-progress", Static)
        block.display = bool(self._loads)
        if not self._loads:
            return
        lines: list[Content] = []
        for key, (title, nodes) in self._loads.items():
            lines.append(Content.styled(title, "$accent bold"))
            if (hashing := self._hashing.get(key)) is not None:
                lines.append(Content.styled(HASHING_SAID, "$text-muted"))
                lines.extend(progress_lines({OPERATOR: hashing}, rates=self._rates.get(key)))
            lines.extend(progress_lines(nodes, rates=self._rates.get(key)))
        block.update(Content("\n").join(lines))


def progress_lines(
    nodes: Mapping[str, tuple[int, int]], width: int = 20, rates: Rates | None = None
) -> list[Content]:
    """One gauge per node: bytes copied or loaded of the bytes its layers need, with
    the speed and time left when `rates` has seen enough."""
    now = time.monotonic()
    name_width = max((len(n) for n in nodes), default=4)
    lines = []
    for node, (done, total) in nodes.items():
        frac = done / total if total else 0.0
        figures = f"{format_bytes(done)} / {format_bytes(total)}" if total else "waiting"
        pace = rates.text(node, done, total, now) if rates else ""
        figures += f"  {pace}" if pace else ""
        lines.append(
            Content.assemble(f"{node:<{name_width}} ", bar(frac, width, "$primary"), f" {figures}")
        )
    return lines
