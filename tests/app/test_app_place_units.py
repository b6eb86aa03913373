"""Placing's pure parts and the preview dialog, without a cluster.

The preview snapshots run the real planner over the frozen desk cluster of the
dashboard snapshots (`app_fixtures`), through a stand-in that has the
controller's `state` and `preview` but does no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from studiotui.app.app import StudioApp
from studiotui.app.panes.models import ModelsPane
from studiotui.app.panes.nodes import NodesPane, node_lines
from studiotui.app.panes.placements import group_label, state_label
from studiotui.app.place.flow import placement_name, repair_nodes
from studiotui.app.place.preview import (
    PlaceRequest,
    PreviewScreen,
    plan_lines,
    refusal_lines,
    warnings_for,
)
from studiotui.core.forecast import chips_from_state, choose, links_from_state
from studiotui.core.model_facts import ModelInfo, with_kv_quant
from studiotui.core.placement import (
    ModelFacts,
    NodeBudget,
    Plan,
    Refusal,
    plan,
    with_prompt_cache,
)
from studiotui.core.state import (
    ClusterState,
    NodeState,
    PlacementState,
    PlannedPlacement,
    PlannedShard,
    ShardState,
    newly_broken,
    placements_from_shards,
)
from studiotui.core.traffic import RateMeter
from tests.support.app_fixtures import fixed_models, fixed_state
from worker.shared.adapters import Adapter
from worker.shared.protocol.limits import DEFAULT_STREAMS

GB = 1024**3


def model(name: str, layers: int, layer_gb: float, quant: str | None = "8-bit") -> ModelInfo:
    facts = ModelFacts(
        name=name,
        family="qwen3_moe",
        n_layers=layers,
        layer_bytes=(int(layer_gb * GB),) * layers,
        embed_bytes=int(1.2 * GB),
        head_bytes=int(1.2 * GB),
        kv_bytes_per_token=2 * 4 * 128 * 2,
        dtype="bfloat16",
        quantization=quant,
    )
    total = int(layers * layer_gb * GB + 2.4 * GB)
    return ModelInfo(
        path=Path(f"/m/{name}"),
        name=name,
        family=facts.family,
        n_layers=layers,
        params=235_000_000_000,
        disk_bytes=total,
        dtype="U32",
        quantization=quant,
        facts=facts,
    )


class FixedPreview:
    """The controller's `state` and `preview` over a frozen state: the real planner."""

    def __init__(self, state: ClusterState, info: ModelInfo) -> None:
        self.state = state
        self.info = info

    def preview(
        self,
        model_dir: Path,
        nodes: list[str],
        context_tokens: int = 4096,
        streams: int | None = None,
        tensor: int | None = None,
        adapter: Adapter | None = None,
        kv_bits: int = 0,
        kv_group_size: int | None = None,
    ) -> tuple[ModelInfo, Plan | Refusal]:
        info, notes, _ = with_kv_quant(self.info, kv_bits, 64)
        budgets = []
        for name in nodes:
            node = self.state.node(name)
            assert node is not None
            if node.state != "up":
                return self.info, Refusal(f"{name} is {node.state}: start it first")
            budgets.append(NodeBudget(name, node.memory_free, node.memory_total))
        # As the controller does: as many streams as fit, up to the default, else one.
        for n in [streams] if streams else range(DEFAULT_STREAMS, 0, -1):
            verdict = choose(
                info.facts,
                budgets,
                links_from_state(self.state),
                chips_from_state(self.state, nodes),
                tensor=tensor,
                context_tokens=context_tokens,
                streams=n,
            ).verdict
            if isinstance(verdict, Plan):
                verdict = with_prompt_cache(verdict, None, None)
            if isinstance(verdict, Plan):
                verdict = replace(verdict, kv_bits=kv_bits, notes=notes)
                break
        return info, verdict


# --------------------------------------------------------------------------- pure parts


def test_rate_meter_follows_the_token_count() -> None:
    meter = RateMeter(window=5.0)
    assert meter.update("p", 0, 100.0) == 0.0
    assert meter.update("p", 40, 101.0) == pytest.approx(40.0)
    assert meter.update("p", 80, 102.0) == pytest.approx(40.0)
    # Still the same count: the rate holds while the window still sees the burst...
    assert meter.update("p", 80, 104.0) > 0
    # ...and falls to nothing once a whole window has passed without a token.
    assert meter.update("p", 80, 108.0) == 0.0
    # A restarted shard counts from zero: no negative rate.
    assert meter.update("p", 5, 109.0) == 0.0
    assert meter.update("p", 25, 110.0) == pytest.approx(20.0)
    meter.forget(set())
    assert meter.update("p", 25, 111.0) == 0.0


def _placement(name: str, nodes: list[str], state: str = "ready", **kw: object) -> PlacementState:
    count = len(nodes)
    shards = tuple(
        ShardState(name, n, i, count, i * 2, i * 2 + 2, state, **kw)  # type: ignore[arg-type]
        for i, n in enumerate(nodes)
    )
    return PlacementState(name, "m", "/m", shards)


def test_group_and_state_labels() -> None:
    groups = {"left": ("a", "b"), "right": ("c", "d")}
    assert group_label(_placement("p", ["b", "a"]), groups) == "left"
    assert group_label(_placement("p", ["a", "c"]), groups) == "2 nodes"
    assert group_label(_placement("p", ["a"]), groups) == "1 node"
    # A node of the ring down: still the placement's group (or count), the down one named.
    plan = (PlannedShard("a", 0, 2), PlannedShard("b", 2, 4))
    one_down = replace(_placement("p", ["a", "b"]), planned=plan)
    one_down = replace(one_down, shards=one_down.shards[:1])
    assert group_label(one_down, groups) == "left (✗ b)"
    assert group_label(one_down, {}) == "2 nodes (✗ b)"
    # Not planned here: the stage that does not answer is counted, not named.
    unplanned = replace(one_down, planned=())
    assert group_label(unplanned, groups) == "1 of 2 nodes"
    loading = _placement("p", ["a", "b"], state="loading", progress=(25, 100))
    assert state_label(loading) == "loading 25%"
    assert state_label(_placement("p", ["a"])) == "ready"


def test_placement_names_never_collide() -> None:
    assert placement_name("mlx-community/Qwen3-8B-4bit", set()) == "Qwen3-8B-4bit"
    assert placement_name("demo", {"demo"}) == "demo-2"
    assert placement_name("demo", {"demo", "demo-2"}) == "demo-3"


def test_marked_card_shows_its_mark_in_the_same_cells() -> None:
    node = NodeState("n1", "127.0.0.1", 1, "local", state="up")
    plain = node_lines(node, 60, selected=True).plain.splitlines()[0]
    marked = node_lines(node, 60, selected=True, marked=True).plain.splitlines()[0]
    assert marked.startswith("▶✓") and plain.startswith("▶ ")
    assert len(plain) == len(marked)  # marking moves nothing on the card


def test_preview_tables_fit_the_width_they_are_given() -> None:
    state = fixed_state()
    info = model("qwen3-235b", 94, 2.1)
    verdict = FixedPreview(state, info).preview(Path("/m"), ["studio-1", "studio-3"])[1]
    assert isinstance(verdict, Plan)
    wide = plan_lines(verdict, state, "qwen3-235b", 140)
    assert "holds" in wide[0].plain and "deepseek-v3" in wide[1].plain + wide[2].plain
    for width in (110, 90, 70):
        lines = plan_lines(verdict, state, "qwen3-235b", width)
        table = [line for line in lines if "✓ fits" in line.plain or "node" in line.plain]
        assert max(line.cell_length for line in table) <= width, width
    assert "ring: studio-" in lines[-1].plain and "slowest link" in lines[-1].plain

    refusal = Refusal("needs 713.4 GB, the group has 186 GB free")
    lines = refusal_lines(refusal, state, ["studio-3", "studio-4"], "x", 80)
    assert lines[0].plain.startswith("✗ cannot place: needs 713.4 GB")
    text = "\n".join(line.plain for line in lines)
    assert "studio-4" in text and "down" in text and "qwen3-32b" in text


def test_warnings_name_placements_still_loading() -> None:
    loading = _placement("big", ["a", "b"], state="loading")
    state = ClusterState(placements=(loading, _placement("ok", ["a"])))
    (warning,) = warnings_for(state, ["a", "c"], "new")
    assert "a is loading 'big'" in warning
    assert warnings_for(state, ["c"], "new") == []


# --------------------------------------------------------------------------- drop targets


async def test_drop_targets_in_the_nodes_pane(tmp_path: Path) -> None:
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    async with app.run_test(size=(160, 48)) as pilot:
        nodes = app.query_one(NodesPane)
        nodes.set_groups({"pair": ("studio-1", "studio-2")})
        await pilot.pause()
        card = nodes.cards["studio-3"]
        target = nodes.drop_target_at(card)
        assert target is not None and target.nodes == ("studio-3",)
        assert target.label == "node studio-3"
        nodes.set_marked({"studio-3", "studio-1"})
        target = nodes.drop_target_at(card)
        assert target is not None and target.kind == "marked"
        assert target.nodes == ("studio-1", "studio-3")  # in the pane's order
        chip = nodes.strip.chip("pair")
        target = nodes.drop_target_at(chip)
        assert target is not None and target.label == "group pair"
        assert set(target.widgets) == {chip, nodes.cards["studio-1"], nodes.cards["studio-2"]}
        assert nodes.drop_target_at(app.query_one(ModelsPane)) is None
        # A click on a group chip marks its nodes: then `p` places on it from the keys.
        await pilot.click(chip)
        assert nodes.marked_in_order() == ("studio-1", "studio-2")
        # A fixed view has no cluster: placing says so instead of failing; shift-p is
        # what provisions now.
        await pilot.press("p")
        assert any("placing: no cluster is connected" in n.message for n in app._notifications)
        await pilot.press("P")
        assert any("provisioning: no cluster" in n.message for n in app._notifications)


# --------------------------------------------------------------------------- snapshots


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _preview_app(tmp_path: Path, info: ModelInfo, nodes: tuple[str, ...], target: str):
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    stand_in = FixedPreview(app.cluster, info)
    request = PlaceRequest(info.path, info.name, nodes, target, info.name)

    async def open_preview(pilot) -> None:
        app.push_screen(PreviewScreen(request, stand_in, lambda screen: None))
        await pilot.pause(0.3)

    return app, open_preview


def test_preview_snapshot_plan(snap_compare, tmp_path: Path, utc: None) -> None:
    info = model("qwen3-235b", 94, 2.1)
    app, run_before = _preview_app(tmp_path, info, ("studio-1", "studio-3"), "marked nodes")
    assert snap_compare(app, terminal_size=(160, 48), run_before=run_before)


def test_preview_snapshot_refusal_narrow(snap_compare, tmp_path: Path, utc: None) -> None:
    info = model("deepseek-v3", 61, 11.6)
    app, run_before = _preview_app(tmp_path, info, ("studio-3",), "node studio-3")
    assert snap_compare(app, terminal_size=(100, 30), run_before=run_before)


def test_a_broken_placement_goes_back_to_its_own_nodes_only_when_all_are_known_and_up() -> None:
    def shard(node: str, index: int, state: str = "ready") -> ShardState:
        return ShardState("p", node, index, 3, index, index + 1, state)

    def cluster(*down: str) -> ClusterState:
        nodes = tuple(
            NodeState(n, "127.0.0.1", 1, "local", state="down" if n in down else "up")
            for n in ("a", "b", "c", "d")
        )
        return ClusterState(nodes=nodes)

    whole = PlacementState("p", "m", "/m", (shard("c", 0), shard("a", 1, "failed"), shard("b", 2)))
    assert repair_nodes(whole, cluster()) == (("c", "a", "b"), "its own nodes")
    # One of its nodes is down: place where nodes are up.
    assert repair_nodes(whole, cluster("a")) == (("b", "c", "d"), "all up nodes")
    # A dead node's shard is not listed at all: its nodes are not all known.
    partial = PlacementState("p", "m", "/m", (shard("c", 0), shard("b", 2)))
    assert repair_nodes(partial, cluster()) == (("a", "b", "c", "d"), "all up nodes")
    # Planned by this operator: the ring is remembered although a's shard is gone.
    ring = (PlannedShard("c", 0, 1), PlannedShard("a", 1, 2), PlannedShard("b", 2, 3))
    remembered = replace(partial, planned=ring)
    assert remembered.state == "broken" and remembered.missing == ("a",)
    assert repair_nodes(remembered, cluster()) == (("c", "a", "b"), "its own nodes")
    assert repair_nodes(remembered, cluster("a")) == (("b", "c", "d"), "all up nodes")
    # Even with no shard left anywhere it is listed, broken, until it is unloaded.
    [gone] = placements_from_shards(cluster().nodes, {"p": PlannedPlacement("/m/x", ring)})
    assert gone.state == "broken" and gone.model == "x" and gone.ring == ring


def test_loading_is_loading_until_a_shard_fails() -> None:
    """While a placement loads, its shards show up one node at a time, still
    "prepared" (index 0, count 0): never broken on the way to ready."""

    def shard(node: str, state: str, count: int = 0) -> ShardState:
        return ShardState("p", node, 0, count, 0, 0, state)

    def of(*shards: ShardState, plan: bool = False) -> str:
        ring = tuple(PlannedShard(n, i, i + 1) for i, n in enumerate("abc")) if plan else ()
        return PlacementState("p", "m", "/m", shards, planned=ring).state

    for planned in (False, True):
        assert of(shard("a", "prepared"), plan=planned) == "prepared"
        assert of(shard("a", "loading", 3), shard("b", "prepared"), plan=planned) == "loading"
        assert of(shard("a", "ready", 3), shard("b", "loading", 3), plan=planned) == "loading"
        assert of(shard("a", "failed", 3), shard("b", "loading", 3), plan=planned) == "failed"
    assert of(shard("a", "ready", 3), shard("b", "ready", 3)) == "broken"
    assert of(shard("a", "ready", 3), shard("b", "ready", 3), shard("c", "ready", 3)) == "ready"
    assert of(shard("a", "ready", 3), shard("b", "ready", 3), plan=True) == "broken"


def test_a_placement_that_was_ready_and_lost_a_shard_is_reported_once() -> None:
    def shard(node: str, index: int, state: str = "ready", message: str = "") -> ShardState:
        return ShardState("p", node, index, 2, index, index + 1, state, message=message)

    ready = (PlacementState("p", "m", "/m", (shard("a", 0), shard("b", 1))),)
    loading = (PlacementState("p", "m", "/m", (shard("a", 0), shard("b", 1, "loading"))),)
    gone = (PlacementState("p", "m", "/m", (shard("a", 0),)),)
    died = (PlacementState("p", "m", "/m", (shard("a", 0), shard("b", 1, "failed", "exit -9"))),)
    [(p, why)] = newly_broken(ready, gone)
    assert p.state == "broken" and why == "its shard on b is gone"
    [(p, why)] = newly_broken(ready, died)
    assert p.state == "failed" and why == "its shard on b is failed (exit -9)"
    assert newly_broken(gone, gone) == []  # already broken: said before
    assert newly_broken(loading, gone) == []  # never was ready
    assert newly_broken(ready, ()) == []  # gone entirely: the node-down entries say it


def test_the_preview_starts_from_the_memory_the_nodes_pane_shows() -> None:
    """One definition of memory in use: what the node reports, as on its card. The
    planner holds back more (a shard process, what loading shards will take), which
    shows in "after loading", not as memory the node is using now."""
    from studiotui.app.panes.nodes import memory_figures
    from studiotui.cluster.controller import RUNNER_OVERHEAD_BYTES
    from studiotui.core.placement import format_bytes

    state = fixed_state()
    info = model("qwen3-235b", 94, 2.1)
    nodes = ["studio-1", "studio-3"]
    budgets = []
    for name in nodes:
        node = state.node(name)
        assert node is not None
        budgets.append(
            NodeBudget(name, node.memory_free - RUNNER_OVERHEAD_BYTES, node.memory_total)
        )
    verdict = plan(info.facts, budgets)
    assert isinstance(verdict, Plan)
    lines = plan_lines(verdict, state, "x", 200)
    rows = {line.plain.split()[0]: line.plain for line in lines if line.plain.strip()}
    for name in nodes:
        node = state.node(name)
        assert node is not None
        used = format_bytes(node.memory_used)
        assert used in memory_figures(node, compact=False)
        held_back = next(s for s in verdict.shards if s.node == name).free_before
        assert used in rows[name], (rows[name], used)
        assert format_bytes(node.memory_total - held_back) not in rows[name]
