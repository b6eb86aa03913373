"""Small pure helpers the panes share: bars, sparklines, colour tones, short numbers.

Styles are Textual theme variables (`$success`…) so every pane follows the theme,
including the 16-colour one, without re-rendering by hand on a theme switch.
"""

from __future__ import annotations

import os
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any

from textual.content import Content
from textual.geometry import Size
from textual.widget import Widget

from studiotui.core.state import PlacementState

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


# --------------------------------------------------------------------------- rings

_SEPARATORS = "-_."


def node_abbreviations(names: Sequence[str]) -> dict[str, str]:
    """Short node names for tight rings: 'local-3' → 'l3', 'studio-12' → 's12'.

    The first letter and what follows the names' shared prefix (cut back to a
    separator, so local-10 and local-11 stay l10 and l11); names sharing nothing,
    or shortening to the same thing, stay whole.
    """
    unique = list(dict.fromkeys(names))
    same = {n: n for n in unique}
    if len(unique) < 2:
        return same
    prefix = os.path.commonprefix(unique)  # noqa: RUF071 - names, not paths
    cut = max(prefix.rfind(c) for c in _SEPARATORS)
    prefix = prefix[: cut + 1] if cut >= 0 else prefix.rstrip("0123456789")
    if not prefix or any(len(n) == len(prefix) for n in unique):
        return same
    short = {n: n[0] + n[len(prefix) :] for n in unique}
    return short if len(set(short.values())) == len(short) else same


def ring_hops(
    placement: PlacementState, short: bool = False, closed: bool = False
) -> list[Content]:
    """One piece per shard in ring order, `node[start:end]`; a planned shard whose node
    reports nothing is marked ✗ in the error colour. `closed` repeats the first node."""
    ring = placement.ring
    names = node_abbreviations([p.node for p in ring]) if short else {}
    missing = set(placement.missing)
    # The nodes of a tensor group share their stage's layers: one hop, `a+b[0:40]`.
    stages: list[list[str]] = []
    spans: list[tuple[int, int]] = []
    for p in ring:
        if spans and spans[-1] == (p.start, p.end):
            stages[-1].append(p.node)
        else:
            stages.append([p.node])
            spans.append((p.start, p.end))
    hops = []
    for nodes, (start, end) in zip(stages, spans, strict=True):
        parts = [
            Content.styled(f"✗{names.get(n, n)}", "$error")
            if n in missing
            else Content(names.get(n, n))
            for n in nodes
        ]
        text = Content.assemble(Content("+").join(parts), f"[{start}:{end}]")
        gone = all(n in missing for n in nodes)
        hops.append(text.stylize_before("$error") if gone else text)
    if closed and len(stages) > 1:
        hops.append(Content("+".join(names.get(n, n) for n in stages[0])))
    return hops


def join_hops(hops: Sequence[Content], arrow: str = " → ") -> Content:
    return Content(arrow).join(hops)


def fit_hops(hops: Sequence[Content], width: int, arrow: str = "→") -> Content:
    """As many whole hops as fit in `width` cells, then '…' (never half a hop)."""
    out = Content("")
    for i, hop in enumerate(hops):
        piece = hop if i == 0 else Content.assemble(arrow, hop)
        rest = 1 if i < len(hops) - 1 else 0
        if out.cell_length + piece.cell_length + rest > width and i > 0:
            return Content.assemble(out, "…")
        out = Content.assemble(out, piece)
    return out


def wrap_hops(head: Content, hops: Sequence[Content], width: int, tail: Content) -> list[Content]:
    """`head` then the hops joined by arrows and `tail` two cells on, folded between
    hops (never inside one or an arrow), continuation lines indented under the first
    hop.

    A head that leaves the hops less than half the width (a tensor placement's shape,
    at 80 columns) stands on a line of its own and the hops start under it: folded
    under a long head each hop ran past the edge, and the terminal broke it wherever
    it fell."""
    widest = max((hop.cell_length for hop in hops), default=0)
    lines: list[Content] = []
    if hops and (head.cell_length + widest > width or head.cell_length > width // 2):
        lines.append(head.rstrip())
        head = Content("")
    indent = head.cell_length
    line = head
    for i, hop in enumerate(hops):
        piece = hop if i == 0 else Content.assemble(" → ", hop)
        if i > 0 and line.cell_length + piece.cell_length > width:
            lines.append(line)
            line = Content.assemble(" " * max(0, indent - 2), "→ ", hop)
        else:
            line = Content.assemble(line, piece)
    if tail.cell_length and line.cell_length + 2 + tail.cell_length > width:
        lines.append(line)
        line = Content.assemble(" " * indent, tail)
    elif tail.cell_length:
        line = Content.assemble(line, "  ", tail)
    lines.append(line)
    return lines
