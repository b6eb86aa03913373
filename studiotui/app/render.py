"""Small pure helpers the panes share: bars, sparklines, colour tones, short numbers.

Styles are Textual theme variables (`$success`…) so every pane follows the theme,
including the 16-colour one, without re-rendering by hand on a theme switch.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable
from typing import Any

from textual.content import Content
from textual.geometry import Size
from textual.widget import Widget

WARN_AT = 0.80
CRITICAL_AT = 0.95
_TICKS = "▁▂▃▄▅▆▇█"

STATE_STYLE = {
    "up": "$success",
    "ready": "$success",
    "down": "$error",
    "failed": "$error",
    "broken": "$error",
    "loading": "$warning",
    "prepared": "$warning",
    "provisioning": "$warning",
    "unknown": "$text-muted",
    "stopped": "$text-muted",
}

# Placements are told apart by colour in the topology and placements panes.
PLACEMENT_STYLES = ("$accent", "$secondary", "$primary", "$warning")


def state_style(state: str) -> str:
    return STATE_STYLE.get(state, "$warning")


def usage_style(fraction: float) -> str:
    """Green below 80 %, yellow from 80 %, red from 95 %: memory full means OOM kills."""
    if fraction >= CRITICAL_AT:
        return "$error"
    if fraction >= WARN_AT:
        return "$warning"
    return "$success"


def bar(fraction: float, width: int, style: str | None = None) -> Content:
    """A horizontal gauge in eighths of a cell, so small changes still move it.

    Coloured by `usage_style` unless a style is given (progress is not pressure).
    """
    width = max(1, width)
    fraction = min(1.0, max(0.0, fraction))
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part and full < width else ""
    filled = "█" * full + partial.strip()
    rest = "░" * (width - len(filled))
    return Content.assemble((filled, style or usage_style(fraction)), (rest, "$text-muted"))


def sparkline(values: tuple[float, ...] | list[float], width: int) -> str:
    """The last `width` fractions (0–1) as block characters on an absolute scale.

    Absolute, not min–max scaled: a flat line should mean flat memory, not noise
    blown up to full height.
    """
    if width <= 0 or not values:
        return ""
    tail = list(values)[-width:]
    top = len(_TICKS) - 1
    return "".join(_TICKS[round(min(1.0, max(0.0, v)) * top)] for v in tail)


def percent(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def short_count(n: int) -> str:
    """Parameter counts the way model cards write them: 235B, 7.6B, 12.6M."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value >= 100 else f"{value:.1f}{unit}"
    return str(n)


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def fit(text: str, width: int) -> str:
    """Cut `text` to `width` cells with an ellipsis; names and chips can be long."""
    if width <= 0:
        return ""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def rich_colour(variables: dict[str, str], name: str) -> str:
    """A theme colour for Rich renderables (tables), which know no `$variables`.

    ANSI themes name colours `ansi_red`; Rich calls the same colour `red`.
    """
    value = variables.get(name, "")
    return value.removeprefix("ansi_") if value.startswith("ansi_") else value


class Drawing(Widget):
    """Content made for the width the widget really has, at render time.

    During the first layouts a pane's width is not known yet (or changes when a
    scrollbar appears), so panes whose text depends on the width (wrapped log
    lines, the topology canvas) draw here and are redrawn only when the width or
    the data changes.
    """

    DEFAULT_CSS = "Drawing { height: auto; width: 1fr; }"

    def __init__(self, make: Callable[[int], Content], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._make = make
        self._cache: tuple[int, Content] | None = None

    def redraw(self, make: Callable[[int], Content] | None = None) -> None:
        if make is not None:
            self._make = make
        self._cache = None
        self.refresh(layout=True)

    def content_for(self, width: int) -> Content:
        if self._cache is None or self._cache[0] != width:
            self._cache = (width, self._make(width))
        return self._cache[1]

    @property
    def content(self) -> Content:
        return self.content_for(self.content_size.width)

    def render(self) -> Content:
        return self.content

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        # Measured the way Textual will draw it, so a line that still folds counts twice.
        # (Textual's own widgets pass their styles here too; its stubs name a narrower type.)
        return self.content_for(width).get_height(self.styles, width)  # type: ignore[arg-type]


def wrapped(text: str, width: int, indent: int, style: str = "") -> Content:
    """`text` wrapped to `width`, continuation lines indented by `indent` cells."""
    room = width - indent
    lines = textwrap.wrap(text, room, break_on_hyphens=False) if room >= 12 else [text]
    return Content.styled(("\n" + " " * indent).join(lines or [""]), style)
