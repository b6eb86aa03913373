"""The Topology pane: nodes as boxes, links as lines between them, placement rings.

The drawing is a pure function of the state (`draw_topology`) onto a character
canvas, so it is tested without an app and redrawn only when something it shows
changes (node state, links, rings), not on every memory sample.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content

from studiotui.app.render import (
    PLACEMENT_STYLES,
    Drawing,
    fit,
    percent,
    state_style,
    wrap_hops,
)
from studiotui.app.render import ring_hops as ring_hops_text
from studiotui.core.placement import Link
from studiotui.core.state import ClusterState, LinkState, NodeState, PlacementState
from worker.shared import probes

BOX_H = 4
MAX_DRAWN_LINKS = 6  # a full mesh of 4 nodes; beyond that only rings and measured links
_DIAG = {(1, 1): "╲", (-1, -1): "╲", (1, -1): "╱", (-1, 1): "╱"}


# --------------------------------------------------------------------------- links


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _link_from_report(node: str, raw: Any) -> Link | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("peer"), str):
        return None

    def number(key: str) -> float | None:
        value = raw.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        return None

    kind = str(raw.get("kind", "unknown"))
    return Link(node, raw["peer"], number("latency_us"), number("gbps"), kind)


def cluster_links(state: ClusterState) -> list[Link]:
    """The links to show, best known first.

    Measured links come from `ClusterState.links` once the controller has it, else
    from the agents' `facts["links"]`; until then every pair is shown with its kind
    guessed from the addresses and "not measured".
    """
    names = {n.name for n in state.nodes}
    found: dict[tuple[str, str], Link] = {}
    reported: Iterable[Any] = getattr(state, "links", None) or ()
    for link in reported:
        if isinstance(link, LinkState):
            link = Link(link.a, link.b, link.latency_us, link.gbps, link.kind)
        if isinstance(link, Link):
            found.setdefault(_pair(link.a, link.b), link)
    for node in state.nodes:
        for raw in node.facts.get("links") or ():
            link = _link_from_report(node.name, raw)
            if link is not None and link.b in names:
                found.setdefault(_pair(link.a, link.b), link)
    nodes = list(state.nodes)
    for i, a in enumerate(nodes):
        for b in nodes[i + 1 :]:
            found.setdefault(_pair(a.name, b.name), Link(a.name, b.name, None, None, _kind(a, b)))
    order = {n.name: i for i, n in enumerate(nodes)}
    out = [link for link in found.values() if link.a in names and link.b in names]
    return sorted(out, key=lambda k: sorted((order[k.a], order[k.b])))


def _kind(a: NodeState, b: NodeState) -> str:
    """An unmeasured pair's kind: from both agents' interface facts once they have
    reported them, else only what the addresses say."""
    ends = [probes.LinkEnd.from_facts(n.facts.get("link_end")) for n in (a, b)]
    if all(ends):
        return probes.pair_link_kind(*ends)
    return "loopback" if _is_loopback(a.address) and _is_loopback(b.address) else "unknown"


def kind_label(kind: str) -> str:
    return probes.LINK_KIND_LABELS.get(kind, kind)


def describe_link(link: Link) -> str:
    if link.latency_us is None and link.gbps is None:
        return f"{kind_label(link.kind)} · not measured"
    parts = [kind_label(link.kind)]
    parts.append(f"{link.latency_us:.0f} µs" if link.latency_us is not None else "latency ?")
    parts.append(f"{link.gbps:.1f} Gb/s" if link.gbps is not None else "Gb/s ?")
    return " · ".join(parts)


def ring_hops(placement: PlacementState) -> list[tuple[str, str]]:
    # The planned ring: a broken placement's lines stay where its hops were.
    nodes = tuple(p.node for p in placement.ring)
    if len(nodes) < 2:
        return []
    return list(zip(nodes, [*nodes[1:], nodes[0]], strict=True))


# --------------------------------------------------------------------------- canvas


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.chars = [[" "] * width for _ in range(height)]
        self.styles = [[""] * width for _ in range(height)]
        self.owner: list[list[object]] = [[None] * width for _ in range(height)]

    def inside(self, x: int, y: int) -> bool:
        return 0 <= x < self.width and 0 <= y < self.height

    def put(self, x: int, y: int, char: str, style: str = "", owner: object = None) -> None:
        if self.inside(x, y):
            self.chars[y][x] = char
            self.styles[y][x] = style
            self.owner[y][x] = owner

    def text(self, x: int, y: int, text: str, style: str = "", owner: object = None) -> None:
        for i, char in enumerate(text):
            self.put(x + i, y, char, style, owner)

    def content(self) -> Content:
        lines = []
        for chars, styles in zip(self.chars, self.styles, strict=True):
            runs: list[tuple[str, str]] = []
            for char, style in zip(chars, styles, strict=True):
                if runs and runs[-1][1] == style:
                    runs[-1] = (runs[-1][0] + char, style)
                else:
                    runs.append((char, style))
            lines.append(Content.assemble(*runs).rstrip())
        return Content("\n").join(lines)


def _cells(x0: int, y0: int, x1: int, y1: int) -> list[tuple[int, int]]:
    """Bresenham's line from (x0, y0) to (x1, y1), both ends included."""
    cells = []
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
    err = dx + dy
    while True:
        cells.append((x0, y0))
        if x0 == x1 and y0 == y1:
            return cells
        e2 = 2 * err
        if e2 >= dy:
            err += dy
            x0 += sx
        if e2 <= dx:
            err += dx
            y0 += sy


@dataclass(frozen=True)
class _Box:
    name: str
    x: int
    y: int
    w: int

    @property
    def centre(self) -> tuple[int, int]:
        return self.x + self.w // 2, self.y + BOX_H // 2

    def covers(self, x: int, y: int) -> bool:
        return self.x <= x < self.x + self.w and self.y <= y < self.y + BOX_H


def _layout(names: list[str], width: int) -> tuple[list[_Box], int, int]:
    """Boxes around an ellipse, clockwise from the top left, stretched to the corners."""
    n = len(names)
    box_w = max(11, min(18, max((len(x) for x in names), default=0) + 4))
    if n <= 2:
        height = BOX_H
        canvas_w = min(width, box_w * 2 + 24) if n == 2 else box_w
    else:
        height = BOX_H * 2 + 5 if n <= 4 else BOX_H * 3 + 4
        canvas_w = min(width, 72)
    canvas_w = max(canvas_w, box_w)
    if n == 1:
        return [_Box(names[0], 0, 0, box_w)], box_w, height
    angles = [math.radians(-90 - 180 / n + 360 * k / n) for k in range(n)]
    xs = [math.cos(a) for a in angles]
    ys = [math.sin(a) for a in angles]

    def spread(values: list[float], room: int) -> list[int]:
        lo, hi = min(values), max(values)
        if hi - lo < 1e-9:
            return [room // 2] * len(values)
        return [round((v - lo) / (hi - lo) * room) for v in values]

    lefts = spread(xs, canvas_w - box_w)
    tops = spread(ys, height - BOX_H)
    boxes = [_Box(name, x, y, box_w) for name, x, y in zip(names, lefts, tops, strict=True)]
    return boxes, canvas_w, height


def _line_char(step: tuple[int, int], heavy: bool) -> str:
    if step[1] == 0:
        return "━" if heavy else "─"
    if step[0] == 0:
        return "┃" if heavy else "│"
    return _DIAG[step]


_AXIS = {"─": "h", "━": "h", "│": "v", "┃": "v", "╲": "d", "╱": "a"}


def _crossing(under: str, char: str) -> str:
    """Where two links cross, show both; where they run together, one line is enough."""
    a, b = _AXIS.get(under), _AXIS.get(char)
    if a is None or a == b:
        return char
    if {a, b} == {"h", "v"}:
        return "┼"
    if {a, b} == {"d", "a"}:
        return "╳"
    return char


def _draw_link(
    canvas: Canvas, boxes: dict[str, _Box], link: Link, label: str, style: str, heavy: bool
) -> None:
    a, b = boxes[link.a], boxes[link.b]
    path = [c for c in _cells(*a.centre, *b.centre) if not (a.covers(*c) or b.covers(*c))]
    previous = None
    full = _cells(*a.centre, *b.centre)
    for x, y in full:
        if previous is not None and (x, y) in path:
            step = (x - previous[0], y - previous[1])
            char = _line_char(step, heavy)
            if canvas.inside(x, y):
                char = _crossing(canvas.chars[y][x], char)
            canvas.put(x, y, char, style, label)
        previous = (x, y)
    # The label sits on the line, away from the middle where diagonals cross.
    for frac in (0.5, 0.35, 0.65, 0.25, 0.75, 0.15, 0.85):
        if not path:
            break
        x, y = path[min(len(path) - 1, int(len(path) * frac))]
        if canvas.owner[y][x] == label:
            canvas.put(x, y, label, f"{style} bold reverse" if heavy else "bold", ("label", label))
            break


def _draw_box(canvas: Canvas, box: _Box, node: NodeState, selected: bool) -> None:
    style = "$accent bold" if selected else state_style(node.state)
    tl, tr, bl, br, h, v = "┏┓┗┛━┃" if selected else "╭╮╰╯─│"
    inner = box.w - 2
    canvas.text(box.x, box.y, tl + h * inner + tr, style, box.name)
    canvas.text(box.x, box.y + BOX_H - 1, bl + h * inner + br, style, box.name)
    for row in (1, 2):
        canvas.text(box.x, box.y + row, v + " " * inner + v, style, box.name)
    canvas.text(box.x + 1, box.y + 1, fit(node.name, inner).center(inner), "bold", box.name)
    status: str = node.state
    if node.state == "up" and node.memory_total:
        status += f" {percent(node.memory_used / node.memory_total)}"
    canvas.text(
        box.x + 1, box.y + 2, fit(status, inner).center(inner), state_style(node.state), box.name
    )


def draw_topology(state: ClusterState, width: int, selected: str | None = None) -> Content:
    """Boxes, lines, a legend of links and the ring of every placement."""
    if not state.nodes:
        return Content.styled("no nodes in the inventory", "$text-muted")
    width = max(24, width)
    links = cluster_links(state)
    ring_style: dict[tuple[str, str], str] = {}
    for i, placement in enumerate(state.placements):
        for a, b in ring_hops(placement):
            ring_style[_pair(a, b)] = PLACEMENT_STYLES[i % len(PLACEMENT_STYLES)]
    drawn = [
        link
        for link in links
        if len(links) <= MAX_DRAWN_LINKS
        or _pair(link.a, link.b) in ring_style
        or link.latency_us is not None
    ]
    labels = {_pair(link.a, link.b): _label(i) for i, link in enumerate(links)}

    names = [n.name for n in state.nodes]
    boxes, canvas_w, height = _layout(names, width)
    by_name = {b.name: b for b in boxes}
    canvas = Canvas(canvas_w, height)
    for link in drawn:
        key = _pair(link.a, link.b)
        heavy = key in ring_style
        _draw_link(canvas, by_name, link, labels[key], ring_style.get(key, "$text-muted"), heavy)
    for box, node in zip(boxes, state.nodes, strict=True):
        _draw_box(canvas, box, node, node.name == selected)

    lines: list[Content] = [canvas.content(), Content("")]
    name_w = max(len(n) for n in names)
    for link in links:
        key = _pair(link.a, link.b)
        style = ring_style.get(key, "")
        measured = link.latency_us is not None or link.gbps is not None
        lines.append(
            Content.assemble(
                (f"{labels[key]} ", f"{style} bold" if style else "bold"),
                (f"{link.a:<{name_w}} ↔ {link.b:<{name_w}}  ", style),
                (describe_link(link), "" if measured else "$text-muted"),
            )
        )
    if state.placements:
        lines.append(Content(""))
    for i, placement in enumerate(state.placements):
        style = PLACEMENT_STYLES[i % len(PLACEMENT_STYLES)]
        # A pipeline's ring says its shape; a tensor group's shape is said in words.
        head = Content.assemble(("ring ", "$text-muted"), (placement.name, f"{style} bold"), "  ")
        if "×" in placement.shape:
            head = Content.assemble(head, (f"{placement.shape}  ", "$text-muted"))
        hops = [hop.stylize_before(style) for hop in ring_hops_text(placement, closed=True)]
        tail = Content.styled(placement.state, state_style(placement.state))
        lines += wrap_hops(head, hops, width, tail)
    return Content("\n").join(lines)


def _label(i: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return letters[i] if i < len(letters) else "·"


def topology_signature(state: ClusterState, selected: str | None) -> tuple:
    """What the drawing depends on; memory is shown rounded to a percent."""
    nodes = tuple(
        (
            n.name,
            n.state,
            round(100 * n.memory_used / n.memory_total) if n.memory_total else -1,
            repr(n.facts.get("links")),
        )
        for n in state.nodes
    )
    rings = tuple((p.name, p.state, p.ring, p.missing) for p in state.placements)
    return nodes, rings, repr(getattr(state, "links", None)), selected


class TopologyPane(VerticalScroll):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = "Topology"
        self._signature: tuple | None = None
        self._state = ClusterState()
        self._selected: str | None = None

    def compose(self) -> ComposeResult:
        yield Drawing(self._draw, id="topology-drawing")

    def _draw(self, width: int) -> Content:
        return draw_topology(self._state, width, self._selected)

    def show(self, state: ClusterState, selected: str | None) -> None:
        self._state, self._selected = state, selected
        signature = topology_signature(state, selected)
        if signature != self._signature:
            self._signature = signature
            self.query_one(Drawing).redraw()
