"""Admission on a real model in-process: a head runs at most `streams` requests, a few
wait in order, the rest are told "busy"; the waiting ones then get their own answers."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from tests.unit.test_stage import Loopback, answer
from worker.shard import load_shard
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol.limits import BUSY, DEFAULT_STREAMS
from worker.stage import WAITING_PER_STREAM, Stage


def stage_of(model: Path, streams: int) -> tuple[Stage, Loopback, deque[Callable[[], None]]]:
    work: deque[Callable[[], None]] = deque()
    links = Loopback(work)
    stage = Stage(
        load_shard(model, 0, 2), load_tokenizer(model), links, schedule=work.append, streams=streams
    )
    links.stage = stage
    return stage, links, work


def test_a_head_runs_its_streams_queues_a_few_and_refuses_the_rest(tmp_path: Path) -> None:
    spec = DemoSpec(layers=2, hidden=32, heads=2, kv_heads=1, dtype="float32", recite=True)
    model = write_demo_model(tmp_path / "m", spec)
    params = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    prompts = [f"Request number {i} says" for i in range(2 + 2 * WAITING_PER_STREAM + 2)]

    alone, links, work = stage_of(model, streams=8)
    for i, prompt in enumerate(prompts):
        alone.submit(b"c", {"rid": f"r{i}", "params": params, "prompt": prompt})
        while work:
            work.popleft()()
    want = {f"r{i}": answer(links, f"r{i}") for i in range(len(prompts))}
    assert all(finish == "length" for _, finish in want.values())

    streams = 2
    stage, links, work = stage_of(model, streams=streams)
    for i, prompt in enumerate(prompts):
        stage.submit(b"c", {"rid": f"r{i}", "params": params, "prompt": prompt})
    admitted = streams + WAITING_PER_STREAM * streams
    assert len(stage.head_requests) == streams
    assert list(stage.waiting) == [f"r{i}" for i in range(streams, admitted)]
    busy = [f for k, f in links.client if k == "failed"]
    assert [f["rid"] for f in busy] == [f"r{i}" for i in range(admitted, len(prompts))]
    assert all(f["message"].startswith(BUSY) and "--streams" in f["message"] for f in busy)
    # A waiting request cancelled before its turn ends at once, and frees its place.
    stage.cancel("r3")
    assert answer(links, "r3") == ("", "cancelled") and "r3" not in stage.waiting

    peak = 0
    while work:
        work.popleft()()
        peak = max(peak, len(stage.head_requests), len(stage.caches))
    assert peak <= streams  # never more requests holding KV than the plan reserved for
    for i in range(admitted):
        if i != 3:
            assert answer(links, f"r{i}") == want[f"r{i}"], i
    accepted = [f["rid"] for k, f in links.client if k == "accepted"]
    assert accepted == [f"r{i}" for i in range(admitted) if i != 3]  # in arrival order
    assert not stage.waiting and not stage.head_requests and not stage.caches


def test_the_plan_reserves_kv_for_its_streams_and_says_so() -> None:
    from rich.console import Console

    from studiotui.core.placement import (
        ModelFacts,
        NodeBudget,
        Plan,
        plan,
        plan_to_dict,
    )
    from studiotui.views.plan import render_plan

    facts = ModelFacts("m", "llama", 4, (1 << 20,) * 4, 1 << 20, 1 << 20, 4096)
    nodes = [NodeBudget("a", 8 << 30, 16 << 30), NodeBudget("b", 8 << 30, 16 << 30)]
    one = plan(facts, nodes, context_tokens=1024)
    four = plan(facts, nodes, context_tokens=1024, streams=4)
    assert isinstance(one, Plan) and isinstance(four, Plan)
    assert four.streams == 4 and plan_to_dict(four)["streams"] == 4
    assert sum(s.kv_bytes for s in four.shards) == 4 * sum(s.kv_bytes for s in one.shards)
    console = Console(width=120, record=True)
    console.print(render_plan(four))
    assert "4 streams at once" in console.export_text()


async def test_the_preview_sets_the_streams_it_plans_for(tmp_path: Path) -> None:
    from studiotui.app.app import StudioApp
    from studiotui.app.place.preview import PlaceRequest, PreviewScreen
    from tests.app.test_app_place_units import FixedPreview, fixed_models, fixed_state, model

    info = model("qwen3-235b", 94, 2.1)
    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    request = PlaceRequest(info.path, info.name, ("studio-1", "studio-3"), "marked", info.name)
    screen = PreviewScreen(request, FixedPreview(app.cluster, info), lambda s: None)
    async with app.run_test(size=(160, 48)) as pilot:
        app.push_screen(screen)
        await pilot.pause(0.3)
        default = screen.plan
        assert default is not None and default.streams == DEFAULT_STREAMS
        await pilot.press(*["S"] * DEFAULT_STREAMS)  # never below one
        await pilot.pause(0.3)
        one = screen.plan
        assert one is not None and one.streams == 1 and "× 1 stream at once" in screen.text
        await pilot.press("s", "s")
        await pilot.pause(0.3)
        three = screen.plan
        assert three is not None and three.streams == 3 and "× 3 streams at once" in screen.text
        kv = [s.kv_bytes for s in three.shards]
        assert sum(kv) == 3 * sum(s.kv_bytes for s in one.shards)
