"""The Models pane: model directories under `$STUDIOTUI_HOME/models`, read without loading.

Reading safetensors headers touches the disk, so `scan_models` runs in a thread;
the pane only shows rows it is given (which also lets snapshot tests give fixed ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from studiotui.app.render import short_count
from studiotui.model_facts import ModelDirError, read_model
from studiotui.placement import format_bytes


@dataclass(frozen=True)
class ModelRow:
    name: str
    path: str
    family: str = ""
    params: int = 0
    layers: int = 0
    size: int = 0
    dtype: str = ""
    problem: str = ""


def scan_models(folder: Path) -> list[ModelRow]:
    """One row per subdirectory; a broken one says what is wrong instead of vanishing."""
    if not folder.is_dir():
        return []
    rows = []
    for path in sorted(p for p in folder.iterdir() if p.is_dir()):
        try:
            info = read_model(path)
        except ModelDirError as exc:
            rows.append(ModelRow(path.name, str(path), problem=str(exc)))
            continue
        except Exception as exc:  # a damaged file must not take the pane down
            rows.append(ModelRow(path.name, str(path), problem=f"{type(exc).__name__}: {exc}"))
            continue
        rows.append(
            ModelRow(
                name=info.name,
                path=str(info.path),
                family=info.family,
                params=info.params,
                layers=info.n_layers,
                size=info.disk_bytes,
                dtype=info.quantization or info.dtype.lower(),
            )
        )
    return rows


class ModelsPane(DataTable[Any]):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)
        self.border_title = "Models"
        self.rows_shown: list[ModelRow] = []

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self) -> None:
        self.add_column("model", key="model")
        self.add_column("family", key="family")
        self.add_column("params", key="params")
        self.add_column("layers", key="layers")
        self.add_column("size", key="size")
        self.add_column("dtype", key="dtype")

    def show(self, rows: list[ModelRow], folder: Path | None = None) -> None:
        if rows == self.rows_shown and self.row_count and self.columns:
            return
        self.rows_shown = list(rows)
        # Rebuild the columns too: widths stick to the widest cell ever shown.
        self.clear(columns=True)
        self._add_columns()
        if not rows:
            where = f" in {folder}" if folder else ""
            self.add_row(Text(f"no models{where}", style="dim"), "", "", "", "", "")
            return
        for row in rows:
            if row.problem:
                self.add_row(row.name, Text(row.problem, style="red"), "", "", "", "", key=row.path)
                continue
            self.add_row(
                row.name,
                row.family,
                Text(short_count(row.params), justify="right"),
                Text(str(row.layers), justify="right"),
                Text(format_bytes(row.size), justify="right"),
                row.dtype,
                key=row.path,
            )

    @property
    def selected_row(self) -> ModelRow | None:
        if not self.rows_shown or not 0 <= self.cursor_row < len(self.rows_shown):
            return None
        return self.rows_shown[self.cursor_row]
