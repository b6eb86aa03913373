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


async def test_the_prompt_cache_shows_under_the_ring_once_used() -> None:
    """Entries (the head's), bytes (every shard's), hits: what the runners' stats say."""
    import dataclasses

    app = PaneApp()
    async with app.run_test(size=(120, 16)) as pilot:
        pane = app.query_one(PlacementsPane)
        fresh = _placement(4)
        pane.show((fresh,), "dark", {})
        await pilot.pause()
        assert "prompt cache" not in pane._ring_lines(110).plain  # never used: no line
        used = dataclasses.replace(
            fresh,
            shards=tuple(
                dataclasses.replace(
                    s,
                    cache_entries=3,
                    cache_bytes=2 << 20,  # 2 MiB on each of 4 shards
                    cache_hits=3 if s.index == 0 else 0,
                    cache_misses=1 if s.index == 0 else 0,
                )
                for s in fresh.shards
            ),
        )
        pane.show((used,), "dark", {})
        await pilot.pause()
        line = pane._ring_lines(110).plain
        assert "prompt cache 3 entries · 8 MB in memory · 75% hits" in line, line


async def test_name_and_state_never_run_together() -> None:
    """Issue 30: "qwen3-32bbroken" was read off the Placements table. The table's own
    lines, as drawn, keep a blank cell between the placement and its state, whatever
    the state and the width (a name cut with "…" included). The run-together text is
    what the snapshot SVG holds (each cell a <text> element of its own), not what the
    terminal shows."""
    from textual.geometry import Region

    plan = (PlannedShard("studio-3", 0, 32), PlannedShard("studio-4", 32, 64))

    def one(name: str, state: str, shards: int, placing: bool = False) -> PlacementState:
        reported = tuple(
            ShardState(name, p.node, i, 2, p.start, p.end, state, progress=(5, 100))  # type: ignore[arg-type]
            for i, p in enumerate(plan[:shards])
        )
        return PlacementState(name, name, f"/m/{name}", reported, planned=plan, placing=placing)

    for width in (48, 80, 100, 160):
        app = PaneApp()
        async with app.run_test(size=(width, 12)) as pilot:
            pane = app.query_one(PlacementsPane)
            table = pane.query_one(DataTable)
            for name in ("qwen3-32b", "qwen3-32b-instruct-with-a-long-name"):
                for state, shards, placing in (
                    ("loading", 0, True),
                    ("loading", 1, True),
                    ("ready", 2, False),
                    ("ready", 1, False),  # broken: a shard is gone
                    ("failed", 2, False),
                ):
                    p = one(name, state, shards, placing)
                    pane.show((p,), "dark", {})
                    await pilot.pause()
                    lines = [s.text for s in table.render_lines(Region(0, 0, table.size.width, 2))]
                    row = lines[1]
                    assert p.state in row, (width, row)
                    before = row[: row.index(p.state)]
                    # The name (or its cut) and then at least one blank cell.
                    assert before.endswith(" ") and before.strip(), (width, p.state, row)
