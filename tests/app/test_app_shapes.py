"""The preview's shapes: each with its forecast, `t` cycling the ones that fit.

The real app and the real planner and forecast, over a frozen cluster of four
512 GB M3 Ultras (two pairs with RDMA between them), placing the header-only
Qwen3-235B-A22B 8-bit (tests/support/seed_models.py) through a stand-in that has the
controller's `state` and `preview` and does no I/O.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from textual.containers import VerticalScroll

from studiotui.app.app import StudioApp
from studiotui.app.place.preview import PlaceRequest, PreviewScreen
from studiotui.app.render import Drawing
from studiotui.core.forecast import chips_from_state, choose, links_from_state
from studiotui.core.model_facts import ModelInfo, read_model
from studiotui.core.placement import NodeBudget, Plan, Refusal
from studiotui.core.state import (
    ClusterState,
    LinkState,
    NodeState,
    PlacementState,
    PlannedShard,
    ShardState,
)
from tests.support.app_fixtures import fixed_models
from tests.support.seed_models import seed_model
from worker.shared.adapters import Adapter

GiB = 1024**3
NAMES = ("studio-1", "studio-2", "studio-3", "studio-4")


class Stand:
    """The controller's `state` and `preview` over a frozen state."""

    def __init__(self, state: ClusterState, info: ModelInfo) -> None:
        self.state = state
        self.info = info
        self.asked: list[int | None] = []

    def preview(
        self,
        model_dir: Path,
        nodes: list[str],
        context_tokens: int = 4096,
        streams: int | None = None,
        tensor: int | None = None,
        adapter: Adapter | None = None,  # none asked for here
        kv_bits: int = 0,  # full precision here (k is tried in test_app_place)
        kv_group_size: int | None = None,
    ) -> tuple[ModelInfo, Plan | Refusal]:
        self.asked.append(tensor)
        budgets = [
            NodeBudget(n, node.memory_free, node.memory_total)
            for n in nodes
            if (node := self.state.node(n)) is not None
        ]
        verdict = choose(
            self.info.facts,
            budgets,
            links_from_state(self.state),
            chips_from_state(self.state, nodes),
            tensor=tensor,
            context_tokens=context_tokens,
            streams=streams or 1,
        ).verdict
        return self.info, verdict


async def planned(pilot: Any, screen: PreviewScreen) -> None:
    """Wait until the preview has planned its shapes (the planner runs in a worker)."""
    for _ in range(200):
        await pilot.pause(0.05)
        if screen.phase not in ("planning", "measuring") and screen.shapes:
            return
    raise AssertionError(f"not planned: {screen.phase} {screen.message}")


def cluster() -> ClusterState:
    nodes = tuple(
        NodeState(
            n, f"10.0.0.{i}", 52500, "ssh", state="up", chip="Apple M3 Ultra", os="Darwin",
            memory_total=512 * GiB, memory_used=8 * GiB,
        )
        for i, n in enumerate(NAMES, start=11)
    )  # fmt: skip
    pairs = [(a, b) for i, a in enumerate(NAMES) for b in NAMES[i + 1 :]]
    rdma = ({"studio-1", "studio-2"}, {"studio-3", "studio-4"})
    links = tuple(
        LinkState(a, b, 150.0, 40.0, "thunderbolt", rdma={a, b} in rdma) for a, b in pairs
    )
    placed = PlacementState(
        "other",
        "qwen3-235b",
        "/m/qwen3-235b",
        (),
        planned=tuple(
            PlannedShard(n, 0 if n in ("studio-1", "studio-2") else 47,
                         47 if n in ("studio-1", "studio-2") else 94, "jaccl")
            for n in NAMES
        ),
    )  # fmt: skip
    return ClusterState(name="desk", nodes=nodes, links=links, placements=(placed,))


async def test_the_preview_shows_each_shape_with_its_forecast_and_t_cycles_them(
    tmp_path: Path,
) -> None:
    info = read_model(seed_model(tmp_path / "seeds", "qwen3-235b-a22b", "8bit"))
    state = cluster()
    app = StudioApp(tmp_path / "home", state=state, models=fixed_models())
    stand = Stand(state, info)
    request = PlaceRequest(info.path, info.name, NAMES, "all up nodes", "qwen")
    async with app.run_test(size=(170, 60)) as pilot:
        screen = PreviewScreen(request, stand, lambda s: None)
        app.push_screen(screen)

        await planned(pilot, screen)
        assert screen.phase == "plan", screen.text
        text = screen.text
        # Every shape 4 nodes and Qwen3's heads divide into, each with its forecast.
        assert [size for size, _, _ in screen.shapes] == [1, 2, 4]
        assert "shapes (t cycles)" in text
        for shape in ("4 stages", "2 stages × 2 (jaccl)", "1 stage × 4 (ring)"):
            line = next(x for x in text.splitlines() if shape in x)
            # The batched figure is for the streams the placement admits, as its
            # "× N streams" says (not a fixed 8).
            n = screen.planned_streams
            assert (f"{n} streams" in line) if n > 1 else ("streams" not in line), line
            assert "tok/s" in line and "first token of 2k" in line
        # RDMA only within two pairs: 94 layers × 2 all-reduces cost the groups more
        # than they save, and the pipeline is forecast fastest, so it is chosen.
        first = screen.plan
        assert first is not None and first.shape == "4 stages"
        fastest = max(screen.shapes, key=lambda s: s[2].tps_1 if s[2] else 0.0)
        assert fastest[0] == 1
        assert "▸ 4 stages" in text
        # The key is bound with an id and shown in the footer.
        bindings = {b.binding.id: b for b in screen.active_bindings.values()}
        assert "preview-shape" in bindings and bindings["preview-shape"].binding.show
        assert "t shape" in str(screen.query_one("#preview-dialog").border_subtitle)

        await pilot.press("t")
        await planned(pilot, screen)
        assert screen.tensor == 2 and screen.plan is not None
        assert screen.plan.shape == "2 stages × 2 (jaccl)"
        text = screen.text
        assert "▸ 2 stages × 2 (jaccl)" in text
        assert "every pair of studio-1, studio-2 has RDMA enabled: JACCL over RDMA" in text
        # One row per node of a group, each holding half of its stage's layers.
        assert sum("÷2" in x for x in text.splitlines()) == 4
        await pilot.press("t")
        await planned(pilot, screen)
        assert screen.tensor == 4 and screen.plan is not None
        assert screen.plan.shape == "1 stage × 4 (ring)"
        assert "▸ 1 stage × 4 (ring)" in screen.text
        assert "studio-1 ↔ studio-3" in screen.text  # why not JACCL: no RDMA there
        await pilot.press("t")
        await planned(pilot, screen)
        assert screen.plan is not None and screen.plan.shape == "4 stages"
        assert "▸ 4 stages" in screen.text
        # Asked for (then the other two shapes, for their forecasts), not chosen.
        assert stand.asked[-3:] == [1, 2, 4]


def test_the_topology_and_placements_panes_name_a_hybrid_placements_shape() -> None:
    from studiotui.app.panes.placements import ring_text
    from studiotui.app.panes.topology import draw_topology

    state = cluster()
    (placed,) = state.placements
    assert placed.shape == "2 stages × 2 (jaccl)"
    drawn = draw_topology(state, 160).plain
    ring = next(x for x in drawn.splitlines() if x.startswith("ring other"))
    assert "2 stages × 2 (jaccl)" in ring
    # One hop per stage, its group's nodes joined.
    assert ring_text(placed) == "✗studio-1+✗studio-2[0:47] → ✗studio-3+✗studio-4[47:94]"


def _in_view(screen: PreviewScreen) -> list[str]:
    """The body's lines a user can see: those the scroll shows, within the dialog (a
    scroll taller than its dialog was cut off, with nothing to scroll)."""
    body = screen.query_one("#preview-body", Drawing)
    scroll = screen.query_one("#preview-scroll", VerticalScroll)
    seen = scroll.region.intersection(screen.query_one("#preview-dialog").content_region)
    top = scroll.scroll_offset.y
    return [body.render_line(y).text for y in range(top, top + seen.height)]


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_the_chosen_shape_stays_in_view_as_t_cycles(
    tmp_path: Path, size: tuple[int, int]
) -> None:
    """At 80 × 24 the plan, its caption and the shapes take more rows than the dialog
    has: each `t` re-plans, and the ▸ row of the shape now shown must be on screen."""
    info = read_model(seed_model(tmp_path / "seeds", "qwen3-235b-a22b", "8bit"))
    state = cluster()
    app = StudioApp(tmp_path / "home", state=state, models=fixed_models())
    request = PlaceRequest(info.path, info.name, NAMES, "all up nodes", "qwen")
    async with app.run_test(size=size) as pilot:
        screen = PreviewScreen(request, Stand(state, info), lambda s: None)
        app.push_screen(screen)

        async def shown(shape: str) -> None:
            for _ in range(200):
                await pilot.pause(0.05)
                if screen.phase == "plan" and screen.plan and screen.plan.shape == shape:
                    await pilot.pause(0.1)  # drawn, and scrolled after the refresh
                    return
            raise AssertionError(f"{shape} not planned: {screen.phase} {screen.message}")

        await shown("4 stages")
        for shape in ("2 stages × 2 (jaccl)", "1 stage × 4 (ring)", "4 stages"):
            await pilot.press("t")
            await shown(shape)
            seen = _in_view(screen)
            assert any(line.startswith(f"▸ {shape}") for line in seen), (shape, seen)
            # No shape's forecast runs past the dialog to be folded mid-figure.
            width = screen.query_one("#preview-body", Drawing).content_size.width
            assert all(len(line.rstrip()) <= width for line in seen)
        # The keys under the dialog end whole (at 80 columns they ended "esc …").
        dialog = screen.query_one("#preview-dialog")
        keys = str(dialog.border_subtitle)
        assert keys.endswith("esc cancel") and len(keys) + 4 <= dialog.outer_size.width, keys


@pytest.mark.parametrize(
    ("names", "half", "expect"),
    [
        # `studiotui place DEMO --tensor 2` on `studiotui up --local 4`: the names fit.
        (
            ("local-1", "local-2", "local-3", "local-4"),
            4,
            ["local-1+local-2[0:4] → local-3+local-4[4:8]", "→ local-1+local-2"],
        ),
        # Names that would take a fourth line: the short names of the table's column.
        (NAMES, 47, ["s1+s2[0:47] → s3+s4[47:94] → s1+s2"]),
    ],
)
async def test_a_tensor_placements_ring_line_reads_whole_at_80_columns(
    tmp_path: Path, names: tuple[str, ...], half: int, expect: list[str]
) -> None:
    """At 80 × 24 the line under the Placements table held `ring demo  2 stages × 2
    (ring)` and then the hops indented under the first one, each past the pane's edge:
    the terminal broke them anywhere, leaving an arrow on a line of its own."""
    base = cluster()
    nodes = tuple(replace(node, name=name) for node, name in zip(base.nodes, names, strict=True))
    ring = [(n, 0, half) for n in names[:2]] + [(n, half, 2 * half) for n in names[2:]]
    shards = tuple(
        ShardState("demo", node, i // 2, 2, start, end, "ready", rank=i % 2,
                   group=tuple(n for n, s, _ in ring if s == start))
        for i, (node, start, end) in enumerate(ring)
    )  # fmt: skip
    planned = tuple(PlannedShard(node, start, end, "ring") for node, start, end in ring)
    placed = PlacementState("demo", "demo", "/m/demo", shards, planned=planned)
    assert placed.shape == "2 stages × 2 (ring)"
    state = replace(base, nodes=nodes, links=(), placements=(placed,))
    app = StudioApp(tmp_path, state=state, models=fixed_models())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.3)
        line = app.query_one("#placement-ring")
        width = line.content_size.width
        assert 30 < width < 60  # the pane's share of 80 columns
        shown = [line.render_line(y).text.rstrip() for y in range(line.size.height)]
        # The shape on a line of its own, then every hop whole within the pane.
        assert shown == ["ring demo  2 stages × 2 (ring)", *expect], shown
        assert all(len(x) <= width for x in shown), shown
