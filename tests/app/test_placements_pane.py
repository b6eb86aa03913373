"""The Placements pane under Pilot: its table keeps every column in view.

Found by hand: after a placement loaded on four nodes the group column stayed as
wide as "4 nodes (✗ local-1, local-2, local-4, local-3)" (every node not yet
reported during the load), and tok/s, tokens and the ring were pushed past the
pane's edge for as long as the dashboard ran.
"""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.widgets import DataTable

from studiotui.app.panes.placements import PlacementsPane, group_label
from studiotui.core.state import PlacementState, PlannedShard, ShardState

NODES = ("local-1", "local-2", "local-3", "local-4")
PLAN = tuple(PlannedShard(n, i * 2, i * 2 + 2) for i, n in enumerate(NODES))


def _placement(shards: int, state: str = "ready", placing: bool = False) -> PlacementState:
    reported = tuple(
        ShardState("demo", n, i, len(NODES), i * 2, i * 2 + 2, state)  # type: ignore[arg-type]
        for i, n in enumerate(NODES[:shards])
    )
    return PlacementState("demo", "demo", "/m/demo", reported, planned=PLAN, placing=placing)


class PaneApp(App[None]):
    def compose(self) -> ComposeResult:
        yield PlacementsPane()


def test_loading_placement_names_no_node_missing() -> None:
    # Nodes that have not reported yet while this operator loads are coming, not gone.
    assert group_label(_placement(0, placing=True), {}) == "4 nodes"
    assert group_label(_placement(2, "loading", placing=True), {}) == "4 nodes"
    # Once placed, a node without its shard is named.
    assert group_label(_placement(3), {}) == "4 nodes (✗ local-4)"


async def test_columns_shrink_back_after_a_long_label() -> None:
    app = PaneApp()
    async with app.run_test(size=(96, 16)) as pilot:
        pane = app.query_one(PlacementsPane)
        table = pane.query_one(DataTable)
        # A placement with two nodes gone: a long group label.
        pane.show((_placement(2),), "dark", {})
        await pilot.pause()
        assert table.columns["group"].get_render_width(table) >= len("4 nodes (✗ local-3, local-4)")
        pane.show((_placement(4),), "dark", {})
        await pilot.pause()
        widths = {str(c.key.value): c.get_render_width(table) for c in table.columns.values()}
        # "4 nodes" (or the header) plus a cell of padding either side, no more.
        assert widths["group"] == len("4 nodes") + 2, widths
        assert sum(widths.values()) <= table.size.width, (widths, table.size.width)


async def test_an_adapter_placement_leaves_tokens_and_the_ring_whole() -> None:
    """An adapter's placement (`model+adapter`, model `model + adapter`) cut the tokens
    and ring columns to "t" and "rin" at 160 columns (the dashboard's pane, the web
    view's too): the long names give way with "…" instead."""
    app = PaneApp()
    plain = _placement(4)
    adapted = PlacementState(
        "demo-instruct+legal-summaries-v2",
        "demo-instruct",
        "/m/demo-instruct",
        plain.shards,
        planned=PLAN,
        adapter="legal-summaries-v2",
    )
    async with app.run_test(size=(78, 16)) as pilot:
        pane = app.query_one(PlacementsPane)
        table = pane.query_one(DataTable)
        pane.show((plain, adapted), "dark", {})
        await pilot.pause()
        widths = {str(c.key.value): c.get_render_width(table) for c in table.columns.values()}
        assert sum(widths.values()) <= table.size.width, (widths, table.size.width)
        for column in ("tok/s", "tokens", "ring"):
            key = column.split()[0]
            assert widths[key] >= len(column) + 2, widths
        assert "…" in str(table.get_row("demo-instruct+legal-summaries-v2")[2])
