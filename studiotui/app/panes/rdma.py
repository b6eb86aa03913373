"""The RDMA pane: per node whether RDMA over Thunderbolt works, and how to turn it on.

The verdict comes from the agent's `facts["rdma"]`, read once at this edge as the typed
`worker.shared.protocol.rdma.RdmaFacts` it is sent as (`read_rdma`); otherwise the pane
says why RDMA cannot exist on that node. A report this operator cannot read (an agent
older than it sends another shape) is named as such, with the command that updates the
agent, rather than breaking the pane. Nodes that need the same steps share one list.
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
from worker.shared.probes import MIN_RDMA_MACOS, rdma_enable_steps
from worker.shared.protocol.messages import MessageError
from worker.shared.protocol.rdma import RdmaFacts, read_rdma

_MAC_NAMES = ("darwin", "macos", "mac os x", "macosx", "osx")
TOO_OLD = "agent too old"


@dataclass(frozen=True)
class RdmaView:
    node: str
    status: str  # what the operator reads in the table
    style: str
    steps: tuple[str, ...]


@dataclass(frozen=True)
class Unreadable:
    """A `facts["rdma"]` that does not read as RdmaFacts: why, in the reader's words."""

    why: str


def typed_rdma(node: NodeState) -> RdmaFacts | Unreadable | None:
    """The node's `facts["rdma"]` as RdmaFacts; None while its agent has not probed yet."""
    try:
        return read_rdma(node.facts.get("rdma") or None)
    except MessageError as exc:
        return Unreadable(str(exc))


def update_step(node: str) -> str:
    return f"Update the agent on {node} to this operator's build: studiotui provision {node}"


def _version(text: str) -> tuple[int, int] | None:
    parts = text.strip().split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def rdma_view(node: NodeState) -> RdmaView:
    facts = node.facts
    report = typed_rdma(node)
    typed = report if isinstance(report, RdmaFacts) else None
    os_name = str(facts.get("os") or node.os or (typed.os if typed else ""))
    os_version = str(facts.get("os_version") or (typed.os_version if typed else ""))
    # Nothing reported (yet): the steps for a Mac whose RDMA state is unknown.
    steps = tuple(rdma_enable_steps(typed or RdmaFacts(), os_name, os_version))
    if not os_name:
        return RdmaView(node.name, "unknown until the node answers", "$text-muted", ())
    if os_name.strip().lower() not in _MAC_NAMES:
        return RdmaView(node.name, f"not a Mac ({os_name})", "$text-muted", steps)
    version = _version(os_version)
    if version is not None and version < MIN_RDMA_MACOS:
        return RdmaView(node.name, f"not macOS 26.2+ ({os_version})", "$warning", steps)
    if isinstance(report, Unreadable):
        status = f"{TOO_OLD}: its RDMA report does not read here ({report.why})"
        return RdmaView(node.name, status, "$warning", (update_step(node.name),))
    if typed is None and node.state != "up":
        return RdmaView(node.name, f"unknown while the node is {node.state}", "$text-muted", ())
    if typed is None:
        return RdmaView(node.name, "not probed by this agent yet", "$text-muted", steps)
    if typed.usable:
        active = typed.active_devices or typed.devices
        status = f"enabled ({', '.join(active)})"
        if not _reports_ports(node):
            # Reported before agents named their Thunderbolt ports: no cable can be
            # matched, so JACCL's device matrix cannot be made for this node.
            return RdmaView(
                node.name,
                f"{status}; {TOO_OLD} to report its ports",
                "$warning",
                (*steps, update_step(node.name)),
            )
        return RdmaView(node.name, status, "$success", steps)
    notes = f": {typed.notes[0]}" if typed.notes else ""
    return RdmaView(node.name, f"{typed.status}{notes}", "$error", steps)


def _reports_ports(node: NodeState) -> bool:
    """Whether the report has a `ports` field at all (empty or not): every agent since
    the ports were added sends it, typed or not, so its absence dates the agent."""
    raw = node.facts.get("rdma")
    return isinstance(raw, dict) and "ports" in raw


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
