"""The Log pane: the controller's log, newest last, errors in full and in red.

Entries arrive rarely (a node comes or goes, a placement loads), so the pane simply
re-renders its text when the log changes and never on telemetry. It is anchored to
its end (Textual keeps an anchored widget at the bottom through every layout, also
while another screen covers the dashboard) until the operator scrolls up to read;
then its border says how many entries arrived below and that End follows again.
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


def log_line(entry: LogEntry, width: int = 0) -> Content:
    """One entry; long text wraps under itself so the times stay a column.

    The level leads the text ("error: …") rather than taking a column of its own:
    most entries are info, and an empty column would only widen the gap after the
    time. The colour says it too on colour terminals.
    """
    style = _LEVEL_STYLE.get(entry.level, "")
    text = entry.text if entry.level == "info" else f"{entry.level}: {entry.text}"
    return Content.assemble(
        (clock(entry.time) + " ", "$text-muted"),
        wrapped(text, width, _CLOCK, style) if width > 0 else Content.styled(text, style),
    )


def paused_note(unseen: int) -> str:
    """The border's words while the log does not follow its end."""
    if unseen <= 0:
        return "scrolled up · End follows"
    return f"↓ {unseen} new below · End follows"


class LogPane(VerticalScroll):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = "Log"
        self._shown: tuple[LogEntry, ...] = ()
        self._seen = 0  # minus the entries that arrived while the pane was scrolled up
        self._released = False  # the operator scrolled away from the end

    def compose(self) -> ComposeResult:
        yield Drawing(self._draw, id="log-body")

    def _draw(self, width: int) -> Content:
        if not self._shown:
            return Content.styled("nothing yet", "$text-muted")
        return Content("\n").join(log_line(e, width) for e in self._shown)

    def show(self, entries: tuple[LogEntry, ...]) -> None:
        if entries is self._shown or entries == self._shown:
            return
        # The controller keeps the newest LOG_KEEP entries: count what is new by time.
        last = self._shown[-1].time if self._shown else float("-inf")
        fresh = sum(e.time > last for e in entries) if self._shown else len(entries)
        self._shown = entries
        self.query_one(Drawing).redraw()
        if not self.following:
            self._seen -= fresh
        self.call_after_refresh(self._note)

    @property
    def following(self) -> bool:
        """Anchored to the end (nobody scrolled up) or back at it: new entries show."""
        return not self._released or self.is_vertical_scroll_end

    def release_anchor(self) -> None:
        # Textual calls this for every scroll the operator makes (keys, wheel, bar).
        super().release_anchor()
        self._released = True

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        if self._released and self.is_vertical_scroll_end:
            self._released = False  # scrolled back down: Textual re-anchors too
        self._note()

    def _note(self) -> None:
        # Anchored only once the entries overflow: an anchored pane shorter than its
        # content area would sit at the bottom, the first entries under blank lines.
        if not self.is_anchored and not self._released and self.max_scroll_y > 0:
            self.anchor()
        if self.following:
            self._seen = 0
            self.border_subtitle = ""
        else:
            self.border_subtitle = paused_note(-self._seen)

    @property
    def text(self) -> str:
        return "\n".join(f"{e.level} {e.text}" for e in self._shown)
