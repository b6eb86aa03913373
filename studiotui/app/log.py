"""The Log pane: the controller's log, newest last, errors in full and in red.

Entries arrive rarely (a node comes or goes, a placement loads), so the pane simply
re-renders its text when the log changes and never on telemetry. It follows the
end unless the operator has scrolled up to read something.
"""

from __future__ import annotations

import textwrap
from typing import Any

from textual.containers import VerticalScroll
from textual.content import Content
from textual.geometry import Size
from textual.widget import Widget

from studiotui.app.render import clock
from studiotui.state import LogEntry

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
    room = width - indent
    lines = textwrap.wrap(text, room, break_on_hyphens=False) if room >= 12 else [text]
    body = ("\n" + " " * indent).join(lines or [""])
    return Content.assemble(
        (clock(entry.time) + " ", "$text-muted"),
        (level, f"{style} bold" if style else ""),
        (body, style),
    )


class LogBody(Widget):
    """The entries, wrapped at render time: the width is only certain then."""

    DEFAULT_CSS = "LogBody { height: auto; width: 1fr; }"

    def __init__(self) -> None:
        super().__init__(id="log-body")
        self.entries: tuple[LogEntry, ...] = ()
        self._cache: tuple[int, tuple[LogEntry, ...], Content] | None = None

    def _content(self, width: int) -> Content:
        if not self.entries:
            return Content.styled("nothing yet", "$text-muted")
        if self._cache and self._cache[0] == width and self._cache[1] is self.entries:
            return self._cache[2]
        content = Content("\n").join(log_line(e, width) for e in self.entries)
        self._cache = (width, self.entries, content)
        return content

    def render(self) -> Content:
        return self._content(self.content_size.width)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return self._content(width).plain.count("\n") + 1


class LogPane(VerticalScroll):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = "Log"
        self._shown: tuple[LogEntry, ...] = ()

    def compose(self):  # type: ignore[no-untyped-def]
        yield LogBody()

    def show(self, entries: tuple[LogEntry, ...]) -> None:
        if entries is self._shown or entries == self._shown:
            return
        self._shown = entries
        following = self.scroll_y >= self.max_scroll_y - 1
        body = self.query_one(LogBody)
        body.entries = entries
        body.refresh(layout=True)
        if following:
            self.call_after_refresh(self.scroll_end, animate=False)

    @property
    def text(self) -> str:
        return "\n".join(f"{e.level} {e.text}" for e in self._shown)
