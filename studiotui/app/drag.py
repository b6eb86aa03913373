"""Dragging a model onto nodes: drop targets, their highlight, the groups strip.

A drag starts on a model row (the Models pane captures the mouse on MouseDown),
follows the pointer with a small label, and asks what lies under the pointer with
`screen.get_widget_at`: a node card, a group chip or one of the marked nodes.
Whatever would receive the model is highlighted (`-drop-target`) while the pointer
is over it, so the operator sees which nodes a drop means before letting go.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.content import Content
from textual.errors import NoWidget
from textual.events import Click
from textual.geometry import Offset
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Static


class DropSurface(Protocol):
    """Where drops land (the Nodes pane): what a drop on `widget` would mean."""

    def drop_target_at(self, widget: Widget | None) -> DropTarget | None: ...


DROP_CLASS = "-drop-target"


@dataclass(frozen=True)
class DropTarget:
    """Nodes a drop would place on, and how the operator picked them."""

    kind: str  # node, group, marked
    label: str  # "node local-1", "group left", "marked nodes"
    nodes: tuple[str, ...]
    widgets: tuple[Widget, ...] = field(default=(), compare=False)


class GroupChip(Static):
    """A named group (or the marked set) in the Nodes pane: a drop target, and a click
    marks its nodes so `p` places on it from the keyboard."""

    DEFAULT_CSS = """
    GroupChip {
        width: auto;
        height: 1;
        padding: 0 1;
        margin-right: 1;
        background: $boost;
    }
    GroupChip.-empty {
        background: transparent;
        color: $text-muted;
        padding: 0;
    }
    GroupChip.-drop-target {
        background: $accent;
        color: $text;
        text-style: bold;
    }
    """

    class Picked(Message):
        def __init__(self, nodes: tuple[str, ...]) -> None:
            super().__init__()
            self.nodes = nodes

    def __init__(self, kind: str, name: str, nodes: tuple[str, ...], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kind = kind
        self.group = name
        self.nodes = nodes
        self._draw()

    def set_nodes(self, nodes: tuple[str, ...]) -> None:
        if nodes != self.nodes:
            self.nodes = nodes
            self._draw()

    def _draw(self) -> None:
        if self.kind == "marked":
            self.set_class(not self.nodes, "-empty")
            if self.nodes:
                self.update(Content.assemble(("✓ ", "$accent bold"), ", ".join(self.nodes)))
            else:
                # 31 cells: whole in the Nodes pane at 80 columns (it ended "drag a model he").
                self.update("space marks · drag a model here")
            return
        self.update(Content.assemble((self.group, "bold"), (f" ·{len(self.nodes)}", "dim")))
        self.tooltip = f"group {self.group}: {', '.join(self.nodes)} (click to mark them)"

    def target(self) -> DropTarget | None:
        if not self.nodes:
            return None
        label = "marked nodes" if self.kind == "marked" else f"group {self.group}"
        return DropTarget(self.kind, label, self.nodes, (self,))

    def on_click(self, event: Click) -> None:
        event.stop()
        if self.kind == "group" and self.nodes:
            self.post_message(self.Picked(self.nodes))


class GroupsStrip(Horizontal):
    """One line at the top of the Nodes pane: the inventory's groups and the marks."""

    DEFAULT_CSS = """
    GroupsStrip {
        dock: top;
        height: 1;
        width: 1fr;
        margin-bottom: 1;
    }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._groups: dict[str, tuple[str, ...]] = {}

    def compose(self) -> ComposeResult:
        yield GroupChip("marked", "marked", (), id="chip-marked")

    def set_groups(self, groups: Mapping[str, Sequence[str]]) -> None:
        wanted = {name: tuple(members) for name, members in groups.items()}
        if wanted == self._groups:
            return
        self._groups = wanted
        for chip in list(self.query(GroupChip)):
            if chip.kind == "group":
                chip.remove()
        marked = self.query_one("#chip-marked")
        self.mount_all(
            [GroupChip("group", name, members) for name, members in wanted.items()],
            before=marked,
        )

    def set_marked(self, nodes: tuple[str, ...]) -> None:
        self.query_one("#chip-marked", GroupChip).set_nodes(nodes)

    def chip(self, name: str) -> GroupChip:
        """The chip of a group by name, or "marked"."""
        for chip in self.query(GroupChip):
            if chip.group == name:
                return chip
        raise KeyError(name)


class DragGhost(Static):
    """The model's name following the pointer, saying where a drop would go."""

    DEFAULT_CSS = """
    DragGhost {
        overlay: screen;
        position: absolute;
        constrain: inside inside;
        width: auto;
        max-width: 60;
        height: 1;
        padding: 0 1;
        background: $accent;
        color: $text;
        text-style: bold;
    }
    DragGhost.-nowhere {
        background: $panel-lighten-2;
        text-style: none;
    }
    """


class DragSession:
    """One drag of one model: started by the Models pane, ended by a drop or a cancel."""

    # The label sits beside the pointer, not under it, or it would hide the target.
    GHOST_OFFSET = Offset(2, 1)

    def __init__(
        self,
        source: Widget,
        model: str,
        origin: Offset,
        surface: Callable[[], DropSurface | None],
    ) -> None:
        self.source = source
        self.surface = surface  # found when the pointer moves: panes come and go
        self.model = model
        self.origin = origin
        self.started = False
        self.target: DropTarget | None = None
        self.ghost: DragGhost | None = None

    def move(self, at: Offset) -> None:
        if not self.started:
            if at == self.origin:
                return
            self.started = True
            self.ghost = DragGhost(classes="-nowhere")
            self.source.screen.mount(self.ghost)
        nodes = self.surface()
        target: DropTarget | None = None
        if nodes is not None:
            try:
                widget, _ = self.source.screen.get_widget_at(at.x, at.y)
            except NoWidget:
                widget = None
            # Kept inside the screen at an edge, the label can slide under the pointer;
            # what it hides is still the target it names.
            target = self.target if widget is self.ghost else nodes.drop_target_at(widget)
        self._highlight(target)
        if self.ghost is not None:
            where = f" → {_describe(target)}" if target else " → drop on a node, group or marks"
            self.ghost.update(f"⇢ {self.model}{where}")
            self.ghost.set_class(target is None, "-nowhere")
            self.ghost.styles.offset = (at.x + self.GHOST_OFFSET.x, at.y + self.GHOST_OFFSET.y)

    def drop(self, at: Offset) -> DropTarget | None:
        """End the drag at `at`; the target under it, or None for a drop on nothing."""
        if not self.started:
            self.end()
            return None
        self.move(at)
        target = self.target
        self.end()
        return target

    def end(self) -> None:
        self._highlight(None)
        if self.ghost is not None:
            self.ghost.remove()
            self.ghost = None

    def _highlight(self, target: DropTarget | None) -> None:
        same = target == self.target
        if same and (
            target is None or self.target is None or target.widgets == self.target.widgets
        ):
            return
        if self.target is not None:
            for widget in self.target.widgets:
                widget.remove_class(DROP_CLASS)
        self.target = target
        if target is not None:
            for widget in target.widgets:
                widget.add_class(DROP_CLASS)


def _describe(target: DropTarget) -> str:
    if target.kind == "node":
        return target.label
    return f"{target.label} ({', '.join(target.nodes)})"
