"""The Placements pane: every placement's ring, layer ranges, state and traffic.

Above the table a progress block appears while a placement loads, fed by the
controller's progress callback (bytes loaded per node).
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import DataTable, Static

from studiotui.app.render import bar, rich_colour
from studiotui.placement import format_bytes
from studiotui.state import PlacementState

# The ring matters most where the pane is narrow, so the model name comes last.
_COLUMNS = ("placement", "state", "ring (layers per node)", "tokens", "in flight", "model")
_STATE_COLOUR = {"ready": "success", "failed": "error", "broken": "error"}


def ring_text(placement: PlacementState) -> str:
    hops = [f"{s.node}[{s.start}:{s.end}]" for s in placement.shards]
    return " → ".join(hops)


def placements_signature(placements: tuple[PlacementState, ...]) -> tuple:
    return tuple(
        (
            p.name,
            p.model,
            p.state,
            tuple((s.node, s.start, s.end, s.state, s.tokens, s.in_flight) for s in p.shards),
        )
        for p in placements
    )


class PlacementsPane(Vertical):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = "Placements"
        self._signature: tuple | None = None
        self._progress: dict[str, tuple[int, int]] = {}
        self._progress_title = ""

    def compose(self):  # type: ignore[no-untyped-def]
        yield Static(id="place-progress")
        yield Static(
            Content.styled("no placements yet: place a model (studiotui place)", "$text-muted"),
            id="placements-empty",
        )
        table: DataTable[Any] = DataTable(cursor_type="row", id="placements-table")
        yield table

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for column in _COLUMNS:
            table.add_column(column, key=column.split()[0])
        self.query_one("#place-progress").display = False

    def show(
        self, placements: tuple[PlacementState, ...], theme: str, colours: dict[str, str]
    ) -> None:
        signature = (placements_signature(placements), theme)
        if signature == self._signature:
            return
        self._signature = signature
        table = self.query_one(DataTable)
        table.clear()
        # An empty table says nothing; a sentence says what to do.
        table.display = bool(placements)
        self.query_one("#placements-empty").display = not placements
        for p in placements:
            colour = rich_colour(colours, _STATE_COLOUR.get(p.state, "warning"))
            table.add_row(
                Text(p.name, style="bold"),
                Text(p.state, style=colour),
                ring_text(p),
                # Every shard sees every token, so the busiest shard's count is the total.
                Text(str(max((s.tokens for s in p.shards), default=0)), justify="right"),
                Text(str(max((s.in_flight for s in p.shards), default=0)), justify="right"),
                p.model,
                key=p.name,
            )

    # ---- progress of a placement being loaded ---------------------------------------

    def start_progress(self, title: str, nodes: list[str]) -> None:
        self._progress_title = title
        self._progress = {n: (0, 0) for n in nodes}
        self._render_progress()
        self.query_one("#place-progress").display = True

    def progress(self, node: str, done: int, total: int) -> None:
        self._progress[node] = (done, total)
        self._render_progress()

    def end_progress(self) -> None:
        self._progress = {}
        self.query_one("#place-progress").display = False

    @property
    def progress_text(self) -> str:
        return self.query_one("#place-progress", Static).render().plain  # type: ignore[union-attr]

    def _render_progress(self) -> None:
        width = max((len(n) for n in self._progress), default=4)
        lines = [Content.styled(self._progress_title, "$accent bold")]
        for node, (done, total) in self._progress.items():
            frac = done / total if total else 0.0
            figures = f"{format_bytes(done)} / {format_bytes(total)}" if total else "waiting"
            lines.append(
                Content.assemble(f"{node:<{width}} ", bar(frac, 20, "$primary"), f" {figures}")
            )
        self.query_one("#place-progress", Static).update(Content("\n").join(lines))
