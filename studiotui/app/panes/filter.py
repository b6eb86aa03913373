"""The `/` filter of the Nodes, Models and Placements tables (k9s' habit).

`/` opens a one-line box under the panes; what is typed narrows the table that had
the keys to the rows holding every typed word (any case, anywhere in the row's
text), as it is typed. Enter keeps the filter and gives the keys back to the table
(its border says the filter is on); Escape, in the box or on the filtered table,
clears it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

from textual.binding import Binding, BindingType
from textual.widgets import Input


def matches(query: str, fields: Iterable[str]) -> bool:
    """Whether a row with these texts is kept by `query`: every word of it appears
    somewhere in the row, whatever the case; an empty query keeps every row."""
    words = query.lower().split()
    if not words:
        return True
    text = " ".join(fields).lower()
    return all(word in text for word in words)


def filter_note(query: str, shown: int, total: int) -> str:
    """The filtered pane's border subtitle: what is typed and what it leaves."""
    return f"/{query.strip()} · {shown} of {total} · esc clears"


class Filterable(Protocol):
    """A pane the `/` box narrows."""

    filter_text: str

    def set_filter(self, text: str) -> None: ...

    def take_keys(self) -> None: ...


class FilterBar(Input):
    """The box `/` opens; it tells its pane what is typed."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "clear", "Clear filter", show=False, id="filter-clear"),
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(placeholder="filter: type words, enter keeps, esc clears", **kwargs)
        self.target: Filterable | None = None

    def open(self, target: Filterable, what: str) -> None:
        self.target = target
        self.border_title = f"filter {what}"
        self.value = target.filter_text
        self.display = True
        # At once, not at the next idle (`focus()`): keys typed right after `/` (a fast
        # typist, a paste) are already queued and must reach the box, not the panes
        # ("/l" opened a node's log).
        self.screen.set_focus(self)
        self.cursor_position = len(self.value)

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        if self.target is not None and self.display:
            self.target.set_filter(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._close()

    def action_clear(self) -> None:
        if self.target is not None:
            self.target.set_filter("")
        self._close()

    def on_blur(self) -> None:
        # Clicked away: the filter stays as typed, the box goes.
        self.display = False

    def _close(self) -> None:
        target, self.target = self.target, None
        self.display = False
        if target is not None:
            target.take_keys()
