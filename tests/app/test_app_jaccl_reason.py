"""The preview says why a tensor group of four Mac Studios does or does not run JACCL,
from what their agents report about their Thunderbolt ports: the real app, planner and
forecast over a frozen cluster whose nodes carry RDMA facts made from recorded macOS
outputs (tests/support/rdma_mesh.py), placing the header-only Qwen3-235B-A22B 8-bit with
the 4-node group picked with `t` (the stand-in of tests/app/test_app_shapes.py, no I/O)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from studiotui.app.app import StudioApp
from studiotui.app.place.preview import PlaceRequest, PreviewScreen
from studiotui.core.model_facts import read_model
from studiotui.core.state import ClusterState, LinkState, NodeState
from tests.app.test_app_shapes import Stand, planned
from tests.support import rdma_mesh
from tests.support.app_fixtures import fixed_models
from tests.support.seed_models import seed_model

GiB = 1024**3
NAMES = ["studio-1", "studio-2", "studio-3", "studio-4"]


def cluster(rdma: dict[str, Any]) -> ClusterState:
    nodes = tuple(
        NodeState(
            n, f"10.0.0.{i}", 52500, "ssh", state="up", chip="Apple M3 Ultra", os="Darwin",
            memory_total=512 * GiB, memory_used=8 * GiB, facts={"rdma": rdma[n]},
        )
        for i, n in enumerate(NAMES, start=11)
    )  # fmt: skip
    # Links measured over the bridge; whether they carry RDMA is judged from the ports.
    links = tuple(
        LinkState(a, b, 150.0, 40.0, "thunderbolt")
        for i, a in enumerate(NAMES)
        for b in NAMES[i + 1 :]
    )
    return ClusterState(name="desk", nodes=nodes, links=links)


@pytest.mark.parametrize(
    ("missing", "shape", "reason"),
    [
        ((), "1 stage × 4 (jaccl)", "every pair of studio-1, studio-2, studio-3, studio-4 has"),
        (
            (("studio-2", "studio-4"),),
            "1 stage × 4 (ring)",
            "studio-2 has no cable to studio-4: ring backend over TCP",
        ),
    ],
)
async def test_the_preview_names_the_backend_and_a_missing_cable(
    tmp_path: Path, missing: tuple[tuple[str, str], ...], shape: str, reason: str
) -> None:
    info = read_model(seed_model(tmp_path / "seeds", "qwen3-235b-a22b", "8bit"))
    outputs = rdma_mesh.mesh(rdma_mesh.STUDIO, NAMES, missing=missing)
    state = cluster(rdma_mesh.facts(outputs, tmp_path / "replay"))
    app = StudioApp(tmp_path / "home", state=state, models=fixed_models())
    request = PlaceRequest(info.path, info.name, tuple(NAMES), "all up nodes", "qwen")
    async with app.run_test(size=(170, 60)) as pilot:
        screen = PreviewScreen(request, Stand(state, info), lambda s: None)
        app.push_screen(screen)

        await planned(pilot, screen)
        for _ in range(3):
            if screen.plan is not None and screen.plan.shape.startswith("1 stage × 4"):
                break
            await pilot.press("t")
            await planned(pilot, screen)
        assert screen.phase == "plan", screen.text
        assert screen.plan is not None and screen.plan.shape == shape
        assert reason in screen.text, screen.text
