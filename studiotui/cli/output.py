"""Output shared by the verbs: the consoles and the progress bars of long work."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Column

from worker.shared.manifest import Hashing

console = Console(stderr=False, highlight=False)
errors = Console(stderr=True, highlight=False)


def node_bars() -> Progress:
    """One bar in bytes per node (or per shard process), labelled by its name: a
    placement's loading, a model's copy to nodes."""
    return Progress(
        TextColumn("{task.description:>12}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


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
