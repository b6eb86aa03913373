"""The RDMA pane under Pilot reads each agent's `facts["rdma"]` as the typed RdmaFacts:
a current agent's report (made by the real probe from recorded macOS outputs,
tests/support/rdma_mesh.py) shows its devices and cables; an older agent's, without ports or in
a shape this operator does not read, is named "agent too old" with the command that
updates it, and the pane keeps drawing the others. A frozen cluster, no I/O."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from studiotui.app.app import StudioApp
from studiotui.app.panes.rdma import RdmaPane
from studiotui.core.state import ClusterState, NodeState
from tests.support import rdma_mesh
from tests.support.app_fixtures import fixed_models

GiB = 1024**3
NAMES = ["studio-1", "studio-2", "studio-3"]


def _cluster(rdma: dict[str, Any]) -> ClusterState:
    nodes = tuple(
        NodeState(
            n, f"10.0.0.{i}", 52500, "ssh", state="up", chip="Apple M3 Ultra", os="Darwin",
            memory_total=512 * GiB, memory_used=8 * GiB,
            facts={"os": "macOS", "os_version": "26.2", "rdma": rdma[n]},
        )
        for i, n in enumerate(NAMES, start=11)
    )  # fmt: skip
    return ClusterState(name="desk", nodes=nodes)


async def test_the_pane_reads_typed_facts_and_names_an_agent_too_old(tmp_path: Path) -> None:
    outputs = rdma_mesh.mesh(rdma_mesh.STUDIO, NAMES[:2])
    current = rdma_mesh.facts(outputs, tmp_path / "replay")
    rdma = {
        "studio-1": current["studio-1"],
        # What an agent from before the ports were reported sends: the same verdict.
        "studio-2": {k: v for k, v in current["studio-2"].items() if k != "ports"},
        # A shape this operator cannot read (a port numbered in words).
        "studio-3": {**current["studio-2"], "ports": [{"receptacle": "one"}]},
    }
    app = StudioApp(tmp_path / "home", state=_cluster(rdma), models=fixed_models())
    async with app.run_test(size=(170, 50)) as pilot:
        await pilot.press("2")
        await pilot.pause()
        assert app.query_one("#top-tabs").active == "tab-rdma"
        pane = app.query_one(RdmaPane)
        text = " ".join(str(pane.query_one("#rdma-body").content).split())
        devices = ", ".join(current["studio-1"]["active_devices"])
        assert f"studio-1 enabled ({devices})" in text, text
        assert "studio-2 enabled (" in text and "agent too old to report its ports" in text
        assert "studio-3 agent too old: its RDMA report does not read here (" in text
        assert "receptacle" in text  # the reader names the field it stumbled on
        for node in ("studio-2", "studio-3"):
            assert f"studiotui provision {node}" in text
        # studio-1's cable to studio-2, from studio-1's own typed ports (studio-2's
        # report has none to match from its side).
        assert "Thunderbolt cables:" in text and "→ studio-2" not in text
        assert "a Mac outside the cluster" in text
