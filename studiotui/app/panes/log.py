"""The Log pane: the controller's log, newest last, errors in full and in red.

Entries arrive rarely (a node comes or goes, a placement loads), so the pane simply
re-renders its text when the log changes and never on telemetry. It follows the
end unless the operator has scrolled up to read something.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content

from studiotui.app.render import Drawing, clock, wrapped
from studiotui.core.state import LogEntry

_LEVEL_STYLE = {"error": "$error", "warning": "$warning"}


_CLOCK = 9  # "HH:MM:SS "
_LEVEL = 8  # "warning "
_WIDE = 60


def log_line(entry: LogEntry, width: int = 0) -> Content:
    """One entry; long text wraps under itself so times (and levels) stay a column.

    Where the pane is narrow the level moves into the text ("error: …") to leave
    room for the words; the colour still says it on colour terminals.
    """
    style = _LEVEL_STYLE.get(entry.level, "")
    text = entry.text
    if width >= _WIDE or width <= 0:
        level = f"{entry.level:<7} " if entry.level != "info" else " " * _LEVEL
        indent = _CLOCK + _LEVEL
    else:
        level = ""
        indent = _CLOCK
        if entry.level != "info":
            text = f"{entry.level}: {text}"
    return Content.assemble(
        (clock(entry.time) + " ", "$text-muted"),
        (level, f"{style} bold" if style else ""),
        wrapped(text, width, indent, style) if width > 0 else Content.styled(text, style),
    )


class LogPane(VerticalScroll):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = "Log"
        self._shown: tuple[LogEntry, ...] = ()

    def compose(self) -> ComposeResult:
        yield Drawing(self._draw, id="log-body")

    def _draw(self, width: int) -> Content:
        if not self._shown:
            return Content.styled("nothing yet", "$text-muted")
        return Content("\n").join(log_line(e, width) for e in self._shown)

    def show(self, entries: tuple[LogEntry, ...]) -> None:
        if entries is self._shown or entries == self._shown:
            return
        self._shown = entries
        following = self.scroll_y >= self.max_scroll_y - 1
        self.query_one(Drawing).redraw()
        if following:
            self.call_after_refresh(self.scroll_end, animate=False)

    @property
    def text(self) -> str:
        return "\n".join(f"{e.level} {e.text}" for e in self._shown)
