"""The RDMA pane: per node whether RDMA over Thunderbolt works, and how to turn it on.

The verdict comes from the agent's `facts["rdma"]` (a serialised
`worker.shared.probes.RdmaSummary`) when the agent probes it; otherwise the pane says why
RDMA cannot exist on that node. Nodes that need the same steps share one list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content

from studiotui.app.render import Drawing, wrapped
from studiotui.core.members import cables
from studiotui.core.state import NodeState
from worker.shared.probes import MIN_RDMA_MACOS, RdmaSummary, rdma_enable_steps

_MAC_NAMES = ("darwin", "macos", "mac os x", "macosx", "osx")


@dataclass(frozen=True)
class RdmaView:
    node: str
    status: str  # what the operator reads in the table
    style: str
    steps: tuple[str, ...]


def _summary(raw: Any) -> RdmaSummary | None:
    if not isinstance(raw, dict):
        return None

    def names(key: str) -> tuple[str, ...]:
        value = raw.get(key) or ()
        return tuple(str(v) for v in value) if isinstance(value, list | tuple) else ()

    status = raw.get("status")
    return RdmaSummary(
        status=status if status in ("enabled", "disabled") else "unknown",
        usable=bool(raw.get("usable")),
        devices=names("devices"),
        interfaces=names("interfaces"),
        active_devices=names("active_devices"),
        bridge_exists=bool(raw.get("bridge_exists")),
        bridge_members=names("bridge_members"),
        bridge_active=bool(raw.get("bridge_active")),
        notes=names("notes"),
    )


def _version(text: str) -> tuple[int, int] | None:
    parts = text.strip().split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def rdma_view(node: NodeState) -> RdmaView:
    facts = node.facts
    os_name = str(facts.get("os") or node.os or "")
    os_version = str(facts.get("os_version") or "")
    summary = _summary(facts.get("rdma"))
    steps = tuple(
        rdma_enable_steps(
            summary or RdmaSummary(status="unknown", usable=False, devices=(), interfaces=()),
            os_name,
            os_version,
        )
    )
    if not os_name:
        return RdmaView(node.name, "unknown until the node answers", "$text-muted", ())
    if os_name.strip().lower() not in _MAC_NAMES:
        return RdmaView(node.name, f"not a Mac ({os_name})", "$text-muted", steps)
    version = _version(os_version)
    if version is not None and version < MIN_RDMA_MACOS:
        return RdmaView(node.name, f"not macOS 26.2+ ({os_version})", "$warning", steps)
    if summary is None and node.state != "up":
        return RdmaView(node.name, f"unknown while the node is {node.state}", "$text-muted", ())
    if summary is None:
        return RdmaView(node.name, "not probed by this agent", "$text-muted", steps)
    if summary.usable:
        active = summary.active_devices or summary.devices
        return RdmaView(node.name, f"enabled ({', '.join(active)})", "$success", steps)
    notes = f": {summary.notes[0]}" if summary.notes else ""
    return RdmaView(node.name, f"{summary.status}{notes}", "$error", steps)


def rdma_content(nodes: tuple[NodeState, ...], width: int = 0) -> Content:
    views = [rdma_view(n) for n in nodes]
    if not views:
        return Content.styled("no nodes", "$text-muted")
    name_w = max(len(v.node) for v in views)
    lines: list[Content] = [
        Content.assemble((f"{v.node:<{name_w}}  ", "bold"), (v.status, v.style)) for v in views
    ]
    lines += _cable_lines(nodes, name_w)
    groups: dict[tuple[str, ...], list[str]] = {}
    for view in views:
        if view.steps:
            groups.setdefault(view.steps, []).append(view.node)
    for steps, names in groups.items():
        lines.append(Content(""))
        lines.append(Content.styled(", ".join(names) + ":", "$accent bold"))
        numbered = len(steps) > 1
        for i, step in enumerate(steps, start=1):
            bullet = f"  {i}. " if numbered else "  "
            body = wrapped(step, width, len(bullet)) if width > 0 else Content(step)
            lines.append(Content.assemble(bullet, body))
    return Content("\n").join(lines)


def _cable_lines(nodes: tuple[NodeState, ...], name_w: int) -> list[Content]:
    """Which Thunderbolt port of each node leads to which node (core/members.cables):
    the cabling JACCL's device matrix is made from."""
    found = cables({n.name: n.facts.get("rdma") for n in nodes})
    if not found:
        return []
    lines = [Content(""), Content.styled("Thunderbolt cables:", "$accent bold")]
    for c in found:
        down = c.state is not None and c.state != "PORT_ACTIVE"
        lines.append(
            Content.assemble(
                (f"{c.node:<{name_w}}  ", "bold"),
                f"port {c.receptacle} {c.device or '(no RDMA device)'} → ",
                c.peer or "a Mac outside the cluster",
                (" (port down)", "$error") if down else "",
            )
        )
    return lines


def rdma_signature(nodes: tuple[NodeState, ...]) -> tuple:
    return tuple(
        (n.name, n.state, n.os, repr(n.facts.get("os_version")), repr(n.facts.get("rdma")))
        for n in nodes
    )


class RdmaPane(VerticalScroll):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = "RDMA"
        self._signature: tuple | None = None
        self._node_states: tuple[NodeState, ...] = ()

    def compose(self) -> ComposeResult:
        yield Drawing(lambda width: rdma_content(self._node_states, width), id="rdma-body")

    def show(self, nodes: tuple[NodeState, ...]) -> None:
        self._node_states = nodes
        signature = rdma_signature(nodes)
        if signature != self._signature:
            self._signature = signature
            self.query_one(Drawing).redraw()
