"""The Nodes pane: one card per node with memory, load and the shards it holds.

Cards are kept and updated in place; a telemetry sample re-renders only the card
of the node it came from (the controller keeps unchanged NodeState objects
identical, so an `is` check finds the changed ones).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.content import Content
from textual.events import Click
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget

from studiotui.app.drag import DropTarget, GroupChip, GroupsStrip
from studiotui.app.guard import guard_actions
from studiotui.app.panes.filter import filter_note, matches
from studiotui.app.render import bar, fit, percent, sparkline, state_style, usage_style
from studiotui.core.placement import format_bytes
from studiotui.core.state import NodeState, ShardState

SORT_KEYS = ("name", "memory", "cpu", "state")
_STATE_RANK = {"down": 0, "unknown": 1, "provisioning": 2, "up": 3}


def memory_fraction(node: NodeState) -> float:
    return node.memory_used / node.memory_total if node.memory_total else 0.0


def sort_key(key: str) -> Callable[[NodeState], tuple]:
    """Busiest or most troubled first, names breaking ties so the order is stable."""
    if key == "memory":
        return lambda n: (-memory_fraction(n), n.name)
    if key == "cpu":
        return lambda n: (-n.cpu_pct, n.name)
    if key == "state":
        return lambda n: (_STATE_RANK.get(n.state, 1), n.name)
    return lambda n: (n.name,)


def memory_figures(node: NodeState, compact: bool) -> str:
    used, total = format_bytes(node.memory_used), format_bytes(node.memory_total)
    if compact and used.split()[-1] == total.split()[-1]:
        # "441.0/512.0 GB" saves the repeated unit where the card is narrow.
        return f"{used.split()[0]}/{total}"
    return f"{used} / {total}"


def shard_label(shard: ShardState) -> Content:
    text = f"{shard.placement}[{shard.start}:{shard.end}] {shard.state}"
    done, total = shard.progress
    if shard.state == "loading" and total:
        text += f" {done * 100 // total}%"
    return Content.styled(text, state_style(shard.state))


def node_lines(node: NodeState, width: int, selected: bool, marked: bool = False) -> Content:
    """The card's text; pure, so the layout can be tested without an app."""
    width = max(30, width)
    # Selection and mark share the two leading cells, so marking moves nothing.
    marker = Content.styled(("▶" if selected else " ") + ("✓" if marked else " "), "$accent bold")
    version = f" · v{node.version}" if node.version else ""
    head = Content.assemble(
        marker,
        ("● ", state_style(node.state)),
        (node.name, "bold"),
        "  ",
        (node.state, state_style(node.state)),
        (version, "$text-muted"),
    )
    room = width - head.cell_length - 2
    if node.chip and room > 4:
        head = Content.assemble(head, "  ", (fit(node.chip, room), "$text-muted"))

    if node.memory_total:
        frac = memory_fraction(node)
        figures = f" {memory_figures(node, compact=width < 60)} {percent(frac):>4}"
        gauge = max(8, min(30, (width - 6 - len(figures)) // 2))
        spark_room = width - 6 - gauge - len(figures) - 2
        spark = sparkline(node.memory_history, spark_room)
        memory = Content.assemble(
            ("  mem ", "$text-muted"),
            bar(frac, gauge),
            (figures, usage_style(frac)),
            "  ",
            (spark, "$primary"),
        )
    else:
        memory = Content.styled("  mem  not reported yet", "$text-muted")

    load = Content.assemble(("  cpu ", "$text-muted"), f"{node.cpu_pct:.0f}%")
    extras: list[Content] = []
    if node.gpu_pct is not None:
        extras.append(Content.assemble(("gpu ", "$text-muted"), f"{node.gpu_pct:.0f}%"))
    if node.message:
        extras.append(
            Content.styled(node.message, "$error" if node.state == "down" else "$warning")
        )
    extras.append(Content.styled(node.endpoint, "$text-muted"))
    # Whole items or nothing: a cut-off address is worse than none.
    for item in extras:
        if load.cell_length + 3 + item.cell_length <= width:
            load = Content.assemble(load, "   ", item)
    load_line = load

    if node.shards:
        parts: list[Content | str] = [Content.styled("  shards ", "$text-muted")]
        for i, shard in enumerate(node.shards):
            if i:
                parts.append(" · ")
            parts.append(shard_label(shard))
        shards = Content.assemble(*parts)
    else:
        shards = Content.styled("  no shards", "$text-muted")
    lines = [head, memory, load_line, shards]
    power = power_line(node, width)
    if power is not None:
        lines.insert(3, power)
    return Content("\n").join(line.truncate(width, ellipsis=True) for line in lines)


def _watts(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) else "–"


def power_line(node: NodeState, width: int) -> Content | None:
    """Watts (total, then CPU/GPU/ANE where the source splits them) and memory
    pressure, each with its history; or why there is no figure. None before the
    agent has said anything about either."""
    if not node.power and not node.pressure:
        return None
    parts: list[Content | str] = [Content.styled("  pwr  ", "$text-muted")]
    if node.power_w is not None:
        parts.append(Content.styled(f"{node.power_w:.0f} W", "bold"))
        split = [(k, node.power.get(f"{k}_w")) for k in ("cpu", "gpu", "ane")]
        shown = [(k, v) for k, v in split if v is not None]
        if len(shown) > 1:
            parts.append(
                Content.styled("  " + " ".join(f"{k} {_watts(v)}" for k, v in shown), "$text-muted")
            )
        top = max(node.power_history, default=0.0) or 1.0
        spark = sparkline(tuple(v / top for v in node.power_history), 12)
        parts += ["  ", Content.styled(spark, "$primary")]
    elif node.power:
        parts.append(Content.styled("n/a", "$text-muted"))
    pct = node.pressure_pct
    if pct is not None:
        label = str(node.pressure.get("label") or "pressure")
        spark = sparkline(tuple(v / 100 for v in node.pressure_history), 8)
        parts += [
            "   ",
            Content.styled(f"{label} ", "$text-muted"),
            Content.styled(f"{pct:.1f}%" if pct < 10 else f"{pct:.0f}%", usage_style(pct / 100)),
            " ",
            Content.styled(spark, "$primary"),
        ]
    reasons = [str(r) for r in (node.power.get("reason"), node.pressure.get("reason")) if r]
    if node.power_w is None and reasons:
        reason = reasons[0]
        # Cut at the edge, the reason read "no RAPL: /sys/class/powercap does not exi…"
        # on every node: where it does not fit, its head before the colon says it.
        if Content.assemble(*parts).cell_length + 2 + len(reason) > width:
            reason = reason.split(":", 1)[0]
        parts += ["  ", Content.styled(reason, "$text-muted")]
    return Content.assemble(*parts)


def cluster_power_title(nodes: Sequence[NodeState]) -> str:
    """The Nodes pane's subtitle: the cluster's watts with their history, and the
    highest memory pressure and where it is. Empty when neither is known."""
    parts = []
    total, history, machines = cluster_power(nodes)
    if total is not None:
        top = max(history, default=0.0) or 1.0
        spark = sparkline(tuple(v / top for v in history), 16)
        of = (
            f" ({machines} machine{'s' if machines != 1 else ''})" if machines != len(nodes) else ""
        )
        parts.append(f"cluster {total:.0f} W{of} {spark}")
    pressed = [n for n in nodes if n.state == "up" and n.pressure_pct is not None]
    if pressed:
        worst = max(pressed, key=lambda n: n.pressure_pct or 0.0)
        pct = worst.pressure_pct or 0.0
        label = str(worst.pressure.get("label") or "pressure")
        parts.append(f"{label} ≤ {pct:.1f}%" if pct < 10 else f"{label} ≤ {pct:.0f}%")
        parts[-1] += f" ({worst.name})"
    return " · ".join(parts)


def power_reasons(node: NodeState) -> str:
    """Why power or pressure has no figure, in full (the card's tooltip)."""
    said = [
        f"{what}: {d['reason']}"
        for what, d in (("power", node.power), ("memory pressure", node.pressure))
        if d.get("reason")
    ]
    return "\n".join(said)


def cluster_power(nodes: Sequence[NodeState]) -> tuple[float | None, tuple[float, ...], int]:
    """The cluster's watts now, their history, and how many machines it counts.

    Simulated nodes share one machine and each reports that machine's watts:
    a machine (the agent's host) counts once. Nodes that are down or have no
    figure count nothing; the total is None when no machine has one.
    """
    hosts: dict[str, NodeState] = {}
    for node in nodes:
        if node.state == "up" and node.power_w is not None:
            hosts.setdefault(str(node.power.get("host") or node.name), node)
    if not hosts:
        return None, (), 0
    total = sum(n.power_w or 0.0 for n in hosts.values())
    depth = min(len(n.power_history) for n in hosts.values())
    history = tuple(
        sum(n.power_history[len(n.power_history) - depth + i] for n in hosts.values())
        for i in range(depth)
    )
    return total, history, len(hosts)


class NodeCard(Widget):
    """One node. Not focusable itself: the pane holds the focus and the selection."""

    selected: reactive[bool] = reactive(False)
    marked: reactive[bool] = reactive(False)

    def __init__(self, node: NodeState) -> None:
        super().__init__(id=f"node-{_css_id(node.name)}", classes="node-card")
        self.node = node
        self.set_class(node.state == "down", "-down")

    def show(self, node: NodeState) -> None:
        if node is not self.node:
            # The power line comes with the first report: only then the height changes.
            grows = bool(node.power or node.pressure) != bool(self.node.power or self.node.pressure)
            self.node = node
            self.set_class(node.state == "down", "-down")
            self.tooltip = power_reasons(node) or None
            self.refresh(layout=grows)

    def watch_selected(self, selected: bool) -> None:
        self.set_class(selected, "-selected")

    def watch_marked(self, marked: bool) -> None:
        self.set_class(marked, "-marked")

    def render(self) -> Content:
        return node_lines(self.node, self.content_size.width, self.selected, self.marked)

    def on_click(self, event: Click) -> None:
        self.post_message(NodesPane.Picked(self.node.name))


def node_words(node: NodeState, groups: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """What the `/` filter looks in: the card's name, state, chip, address, message,
    the placements of its shards and the groups it belongs to."""
    return (
        node.name,
        node.state,
        node.chip or "",
        node.endpoint,
        node.message or "",
        *(s.placement for s in node.shards),
        *(g for g, members in groups.items() if node.name in members),
    )


def _css_id(name: str) -> str:
    # Node names allow '.', which CSS ids do not.
    return name.replace(".", "_")


@guard_actions
class NodesPane(VerticalScroll, can_focus=True):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("down,j", "move(1)", "Next node", show=False, id="node-next"),
        Binding("up,k", "move(-1)", "Previous node", show=False, id="node-previous"),
        Binding("s", "cycle_sort", "Sort", id="sort-nodes"),
        Binding("space", "toggle_mark", "Mark", id="mark-node"),
        Binding("escape", "clear_marks", "Clear marks", show=False, id="clear-marks"),
    ]

    sort_by: reactive[str] = reactive("name")

    class Selected(Message):
        def __init__(self, name: str | None) -> None:
            super().__init__()
            self.name = name

    class Picked(Message):
        """A card was clicked."""

        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

    class MarksChanged(Message):
        def __init__(self, marked: tuple[str, ...]) -> None:
            super().__init__()
            self.marked = marked

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.cards: dict[str, NodeCard] = {}
        self.selected: str | None = None
        self.marked: set[str] = set()
        self.border_title = "Nodes"
        self.strip = GroupsStrip(id="groups-strip")
        self.filter_text = ""  # `/`: only the nodes holding every word
        self.groups: Mapping[str, Sequence[str]] = {}

    def compose(self) -> ComposeResult:
        yield self.strip

    def update_nodes(self, nodes: tuple[NodeState, ...]) -> None:
        new = [NodeCard(n) for n in nodes if n.name not in self.cards]
        for card in new:
            self.cards[card.node.name] = card
        if new:
            self.mount_all(new)
        names = {n.name for n in nodes}
        for name in [n for n in self.cards if n not in names]:
            self.cards.pop(name).remove()
        if self.marked - names:
            self.set_marked(self.marked & names)
        for node in nodes:
            self.cards[node.name].show(node)
        if self.selected not in names:
            self._select(nodes[0].name if nodes else None)
        self._order()
        if self.filter_text:
            self._apply_filter()
        self.border_subtitle = cluster_power_title(nodes)

    # ---- the `/` filter -------------------------------------------------------------

    def set_filter(self, text: str) -> None:
        """Show the cards holding every word of `text`; "" shows them all. Marks stay
        on hidden cards: p still places on every marked node."""
        self.filter_text = text
        self._apply_filter()

    def take_keys(self) -> None:
        self.focus()

    def _apply_filter(self) -> None:
        for card in self.cards.values():
            card.display = matches(self.filter_text, node_words(card.node, self.groups))
        shown = self.visible_order
        if shown and self.selected not in shown:
            self._select(shown[0])
        self._title()

    def _title(self) -> None:
        # Filtered, the filter is what the title says (the sort would push it past a
        # narrow pane's edge).
        if self.filter_text.strip():
            note = filter_note(self.filter_text, len(self.visible_order), len(self.cards))
            self.border_title = f"Nodes · {note}"
        else:
            self.border_title = f"Nodes · sorted by {self.sort_by}"

    def _order(self) -> None:
        wanted = sorted((c.node for c in self.cards.values()), key=sort_key(self.sort_by))
        # Positions count cards only: the groups strip is a child too.
        for i, node in enumerate(wanted):
            card = self.cards[node.name]
            shown = [c for c in self.children if isinstance(c, NodeCard)]
            if i < len(shown) and shown[i] is not card:
                self.move_child(card, before=shown[i])

    @property
    def order(self) -> list[str]:
        return [c.node.name for c in self.children if isinstance(c, NodeCard)]

    @property
    def visible_order(self) -> list[str]:
        """The cards the filter leaves, in order: where ↑↓ go."""
        return [c.node.name for c in self.children if isinstance(c, NodeCard) and c.display]

    def watch_sort_by(self, key: str) -> None:
        self._title()
        self._order()

    def action_cycle_sort(self) -> None:
        self.sort_by = SORT_KEYS[(SORT_KEYS.index(self.sort_by) + 1) % len(SORT_KEYS)]

    def action_move(self, step: int) -> None:
        order = self.visible_order
        if not order:
            return
        index = order.index(self.selected) if self.selected in order else 0
        self._select(order[(index + step) % len(order)])

    # ---- marks: the nodes `p` places on ---------------------------------------------

    def set_groups(self, groups: Mapping[str, Sequence[str]]) -> None:
        self.groups = groups
        self.strip.set_groups(groups)

    def action_toggle_mark(self) -> None:
        if self.selected is not None:
            self.set_marked(self.marked ^ {self.selected})

    def action_clear_marks(self) -> None:
        # Escape: a filter goes first (as in the other tables), then the marks.
        if self.filter_text:
            self.set_filter("")
            return
        self.set_marked(set())

    def set_marked(self, names: set[str] | Sequence[str]) -> None:
        self.marked = {n for n in names if n in self.cards}
        for name, card in self.cards.items():
            card.marked = name in self.marked
        marked = self.marked_in_order()
        self.strip.set_marked(marked)
        self.post_message(self.MarksChanged(marked))

    def marked_in_order(self) -> tuple[str, ...]:
        return tuple(n for n in self.order if n in self.marked)

    def drop_target_at(self, widget: Widget | None) -> DropTarget | None:
        """What a drop on `widget` means: walk up from it to a card or a chip."""
        node: Any = widget
        while node is not None:
            if isinstance(node, GroupChip):
                target = node.target()
                if target is None:
                    return None
                return DropTarget(
                    target.kind, target.label, target.nodes, (node, *self.cards_of(target.nodes))
                )
            if isinstance(node, NodeCard):
                name = node.node.name
                # Dropping on any marked card means the marked set: that is why one marks.
                if name in self.marked:
                    marked = self.marked_in_order()
                    chip = self.strip.chip("marked")
                    return DropTarget(
                        "marked", "marked nodes", marked, (chip, *self.cards_of(marked))
                    )
                return DropTarget("node", f"node {name}", (name,), (node,))
            node = node.parent
        return None

    def cards_of(self, names: Sequence[str]) -> list[NodeCard]:
        return [self.cards[n] for n in names if n in self.cards]

    def on_group_chip_picked(self, event: GroupChip.Picked) -> None:
        event.stop()
        self.focus()
        self.set_marked(set(event.nodes))

    def on_nodes_pane_picked(self, event: Picked) -> None:
        event.stop()
        self.focus()
        self._select(event.name)

    def select(self, name: str) -> None:
        if name in self.cards:
            self._select(name)

    def _select(self, name: str | None) -> None:
        if name == self.selected:
            return
        self.selected = name
        for card_name, card in self.cards.items():
            card.selected = card_name == name
        if name is not None:
            self.cards[name].scroll_visible(animate=False)
        self.post_message(self.Selected(name))
