"""The Models pane: the catalog's models (folders and the Hugging Face cache).

Reading safetensors headers touches the disk, so the catalog is read in a thread
(`read_catalog`); the pane only shows rows it is given, which also lets snapshot
tests give fixed ones. A row is where a placement starts: `p` places the row under
the cursor on the marked nodes, and a row can be dragged onto a node card, a group
chip or the marked nodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.events import Key, MouseDown, MouseMove, MouseRelease, MouseUp
from textual.message import Message
from textual.widgets import DataTable, Static

from studiotui.app.drag import DragSession, DropSurface, DropTarget
from studiotui.app.panes.filter import filter_note, matches
from studiotui.app.panes.nodes import NodesPane
from studiotui.app.render import short_count
from studiotui.core.adapter_catalog import AdapterCatalog, scan_home_adapters
from studiotui.core.catalog import Catalog, models_stamp, scan_home, settling
from studiotui.core.placement import format_bytes
from worker.shared.adapters import Adapter


@dataclass(frozen=True)
class ModelRow:
    name: str
    path: str
    family: str = ""
    params: int = 0
    layers: int = 0
    size: int = 0
    dtype: str = ""  # the quantisation ("4-bit") or, unquantised, the weights' dtype
    problem: str = ""
    source: str = ""
    # Readable, but no shard can run it (family, quantization): said in the row, and
    # the preview refuses it with the same words.
    unsupported: str = ""
    # An adapter row, under its base model's row: `path` is the base model's, this is
    # the adapter directory; placing the row places the base with the adapter.
    adapter: str = ""

    @property
    def placeable(self) -> bool:
        return not self.problem

    @property
    def key(self) -> str:
        """The table's row key: a model's path, an adapter's own directory."""
        return self.adapter or self.path

    @property
    def words(self) -> tuple[str, ...]:
        """What the `/` filter looks in."""
        return (self.name, self.family, self.dtype, self.source, self.problem, self.path)


def rows_from_catalog(catalog: Catalog, adapters: AdapterCatalog | None = None) -> list[ModelRow]:
    """Placeable models first (by name), each followed by the adapters stamped as
    trained on it, then what was skipped and why."""
    rows: list[ModelRow] = []
    for info in catalog.models:
        row = ModelRow(
            name=info.name,
            path=str(info.path),
            family=info.family,
            params=info.params,
            layers=info.n_layers,
            size=info.disk_bytes,
            dtype=info.quantization or info.dtype.lower(),
            source=catalog.source(info),
            unsupported=info.unsupported or "",
        )
        rows.append(row)
        if adapters is not None:
            rows += [_adapter_row(row, a) for a in adapters.for_model(info.path.name)]
    rows += [
        ModelRow(s.name, str(s.path), problem=s.reason, source=s.source) for s in catalog.skipped
    ]
    return rows


def _adapter_row(base: ModelRow, adapter: Adapter) -> ModelRow:
    span = f"{adapter.layers[0]}–{adapter.layers[-1]}" if adapter.layers else ""
    return ModelRow(
        name=f"{base.name}+{adapter.name}",
        path=base.path,
        family=f"{adapter.fine_tune_type} r{adapter.rank}",
        params=base.params,
        layers=base.layers,
        size=adapter.weight_bytes,
        dtype=f"layers {span}",
        source=f"adapter · {adapter.path.parent}",
        unsupported=base.unsupported,
        adapter=str(adapter.path),
    )


@dataclass(frozen=True)
class Listing:
    rows: list[ModelRow]
    where: str  # where models were looked for (said when there are none)
    stamp: tuple[tuple[str, int], ...]  # the folders' `models_stamp` before the scan
    held: bool = False  # a directory still being written was left out: look again soon
    empty: tuple[Path, ...] = ()  # directories in the model folders that hold no model


def read_catalog(home: Path, settle_s: float = 0.0, shown: frozenset[str] = frozenset()) -> Listing:
    """Rows for the pane. With `settle_s`, a directory that cannot be read and changed
    within that many seconds is left out, unless its problem is already shown (`shown`:
    row keys): a model being written must not flash as broken on its way in. `held`
    says such a directory was found: the caller scans again until it settles."""
    # Stamped first: a change while the headers are read is seen by the next check.
    stamp = models_stamp(home)
    catalog = scan_home(home)
    rows = rows_from_catalog(catalog, scan_home_adapters(home))
    now = time.time()
    # Still changing: looked at again at the next check even when the stamp stands (a
    # file growing changes no directory's mtime), and not shown unless already shown.
    young = {
        r.key for r in rows if settle_s and r.problem and settling(Path(r.path), settle_s, now)
    }
    kept = [r for r in rows if r.key not in young or r.key in shown]
    return Listing(kept, ", ".join(catalog.searched), stamp, held=bool(young), empty=catalog.empty)


# Said under the table: the pane's own keys (the footer keeps to the first ones).
MODELS_KEYS = "a folders · H fetch from hub · D delete · / filter"


def models_note(where: str, empty: str = "", filtered: str = "") -> str:
    """The line under the Models table: where models are looked for, the directories
    that hold none (a count, quietly), the filter when one is on; the keys first."""
    # The keys before the folders: at 80x24 the note's two lines ended before "/ filter".
    parts = [filtered] if filtered else []
    parts += [MODELS_KEYS, f"looks in {where}" if where else "", empty]
    return " · ".join(p for p in parts if p)


class ModelsPane(DataTable[Any]):
    # The pane's own keys, for the model under the cursor; `?` lists them, and the
    # line under the table names them (the footer keeps to a newcomer's first keys).
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("a", "app.model_folders", "Model folders: add, remove", show=False,
                id="model-folders"),
        Binding("H", "app.fetch_hub", "Fetch a model from the hub", key_display="H",
                show=False, id="fetch-hub"),
        Binding("D,delete", "app.delete_model", "Delete the selected model (asks first)",
                key_display="D", show=False, id="delete-model"),
    ]  # fmt: skip

    class Dropped(Message):
        """A model row was dragged onto nodes."""

        def __init__(self, model: ModelRow, target: DropTarget) -> None:
            super().__init__()
            self.model = model
            self.target = target

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)
        self.border_title = "Models"
        self.rows_shown: list[ModelRow] = []
        self.all_rows: list[ModelRow] = []
        self.filter_text = ""
        self.where: Path | str | None = None
        self.empty_said = ""
        self.drag: DragSession | None = None
        self._told: set[tuple[str, str]] = set()

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self) -> None:
        self.add_column("model", key="model")
        self.add_column("family", key="family")
        self.add_column("params", key="params")
        self.add_column("layers", key="layers")
        self.add_column("quant", key="quant")
        self.add_column("size", key="size")
        self.add_column("from", key="source")  # or why a model was skipped

    def show(self, rows: list[ModelRow], where: Path | str | None = None, empty: str = "") -> None:
        """The catalog's rows; `where` the folders looked in, `empty` the quiet count of
        directories there that hold no model (`models_note`)."""
        self.empty_said = empty
        if rows == self.all_rows and where == self.where and self.row_count and self.columns:
            self._show_note()
            return
        self.all_rows, self.where = list(rows), where
        self._draw()

    def _show_note(self) -> None:
        """The line under the table (a sibling in the Models tab, when there is one)."""
        if self.parent is None:
            return
        for note in self.parent.query("#models-note"):
            if isinstance(note, Static):
                note.update(models_note(str(self.where or ""), self.empty_said, self.filter_said))

    def set_filter(self, text: str) -> None:
        """Keep the rows holding every word of `text` (`/`); "" shows them all."""
        if text != self.filter_text:
            self.filter_text = text
            self._draw()

    @property
    def filter_said(self) -> str:
        if not self.filter_text.strip():
            return ""
        return filter_note(self.filter_text, len(self.rows_shown), len(self.all_rows))

    def take_keys(self) -> None:
        self.focus()

    def _draw(self) -> None:
        selected = self.selected_row
        rows = [r for r in self.all_rows if matches(self.filter_text, r.words)]
        self.rows_shown = rows
        self._show_note()
        # Rebuild the columns too: widths stick to the widest cell ever shown.
        self.clear(columns=True)
        self._add_columns()
        if not rows:
            if self.all_rows:
                said = f"no model matches {self.filter_text.strip()!r} (esc clears the filter)"
            else:
                said = f"no models in {self.where}" if self.where else "no models"
            self.add_row(Text(said, style="dim"), *[""] * 6)
            return
        for row in rows:
            if row.problem:
                # The reason goes last: a long sentence in a middle column would push
                # every figure of every other row off to the right.
                self.add_row(
                    Text(row.name, style="dim"),
                    *[""] * 5,
                    Text(f"skipped: {row.problem}", style="red"),
                    key=row.key,
                )
                continue
            self.add_row(
                row.name,
                row.family,
                Text(short_count(row.params), justify="right"),
                Text(str(row.layers), justify="right"),
                row.dtype,
                Text(format_bytes(row.size), justify="right"),
                Text(f"✗ {row.unsupported}", style="red")
                if row.unsupported
                else Text(row.source, style="dim"),
                key=row.key,
            )
        # A rescan must not move the operator's choice to another model.
        if selected is not None and selected in self.rows_shown:
            self.move_cursor(row=self.rows_shown.index(selected), animate=False)

    def new_problems(self, rows: list[ModelRow]) -> list[ModelRow]:
        """Skipped rows not told before: the Log gets the whole reason once, the table
        only has room for its start."""
        fresh = [r for r in rows if r.problem and (r.path, r.problem) not in self._told]
        self._told |= {(r.path, r.problem) for r in fresh}
        return fresh

    @property
    def selected_row(self) -> ModelRow | None:
        if not self.rows_shown or not 0 <= self.cursor_row < len(self.rows_shown):
            return None
        return self.rows_shown[self.cursor_row]

    def select_model(self, name: str) -> bool:
        for i, row in enumerate(self.rows_shown):
            if row.name == name:
                self.move_cursor(row=i, animate=False)
                return True
        return False

    # ---- dragging a row onto nodes -----------------------------------------------------

    def _row_under(self, event: MouseDown) -> int | None:
        row = event.style.meta.get("row") if event.style else None
        if not isinstance(row, int):
            # The style carries no row where a cell's text does not reach; count lines.
            row = event.y + int(self.scroll_y) - (self.header_height if self.show_header else 0)
        return row if 0 <= row < len(self.rows_shown) else None

    def _drop_surface(self) -> DropSurface | None:
        try:
            return self.screen.query_one(NodesPane)
        except Exception:  # no Nodes pane on this screen (a dialog is up)
            return None

    def on_mouse_down(self, event: MouseDown) -> None:
        if event.button != 1:
            return
        row = self._row_under(event)
        if row is None or not self.rows_shown[row].placeable:
            return
        self.move_cursor(row=row, animate=False)
        self.drag = DragSession(
            self, self.rows_shown[row].name, event.screen_offset, self._drop_surface
        )
        # Captured, the pane keeps receiving the pointer over other panes until the drop.
        self.capture_mouse()

    def on_mouse_move(self, event: MouseMove) -> None:
        if self.drag is not None:
            self.drag.move(event.screen_offset)

    def on_mouse_up(self, event: MouseUp) -> None:
        if self.drag is None:
            return
        drag, self.drag = self.drag, None
        self.release_mouse()
        target = drag.drop(event.screen_offset)
        row = self.selected_row
        if target is not None and row is not None:
            self.post_message(self.Dropped(row, target))

    def on_mouse_release(self, event: MouseRelease) -> None:
        # Capture taken away (another widget captured, the app lost the pointer).
        self._cancel_drag()

    def on_key(self, event: Key) -> None:
        if event.key == "escape" and self.drag is not None:
            event.stop()
            self.release_mouse()
            self._cancel_drag()
        elif event.key == "escape" and self.filter_text:
            event.stop()
            self.set_filter("")

    def _cancel_drag(self) -> None:
        if self.drag is not None:
            drag, self.drag = self.drag, None
            drag.end()
