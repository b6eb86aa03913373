"""A dashboard open while the CLI (another process, its own controller) places and
unloads on the same cluster: real agents, real telemetry.

What a user does first with two terminals: `studiotui place` and `studiotui unload` in
one while the dashboard runs in the other. The dashboard follows both: the placement
appears, and once unloaded it goes, without being called broken.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

from studiotui.cli import exits
from studiotui.cli.main import main
from studiotui.cluster import local_cluster
from studiotui.core.inventory import dump_inventory
from tests.support.cluster_fixture import LocalCluster, cluster_fixture, wait_up
from worker.shared.demo_model import DemoSpec, write_demo_model

BASE, PORT = 236, 58940
SPEC = DemoSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("other-home"), 2, BASE, PORT)


async def _until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.1)


def test_a_placement_the_cli_unloads_leaves_the_dashboard_unbroken(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    model = write_demo_model(tmp_path / "tiny", SPEC)

    async def run() -> None:
        dashboard, cli = cluster.controller(), cluster.controller()
        await dashboard.start()  # with telemetry, as the dashboard runs it
        try:
            await cli.place(model, name="theirs", context_tokens=256, streams=1)

            def shown() -> str | None:
                p = dashboard.state.placement("theirs")
                return p.state if p is not None else None

            await _until(lambda: shown() == "ready", "the CLI's placement ready on the dashboard")
            # A dashboard opened now finds it ready as its nodes report one by one:
            # nothing "answers again", since nothing stopped answering.
            later = cluster.controller()
            try:
                await later.start(telemetry=False)
                p = later.state.placement("theirs")
                assert p is not None and p.state == "ready", p
                log = [e.text for e in later.state.log]
                assert not any("answers again" in line for line in log), log
            finally:
                await later.close()
            await cli.unload("theirs")
            await _until(lambda: shown() is None, "the unloaded placement gone from the dashboard")
            # Telemetry goes on: the plan another process dropped stays dropped.
            await asyncio.sleep(2.0)
            assert shown() is None
            errors = [e.text for e in dashboard.state.log if e.level == "error"]
            assert not errors, errors
        finally:
            await cli.close()
            await dashboard.close()

    asyncio.run(run())


def test_a_placement_interrupted_while_loading_is_rolled_back(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Ctrl-C on `studiotui place` (its task cancelled) once a shard is loading: what
    was loaded is unloaded and the ring forgotten, not left to finish with nobody
    watching it."""
    model = write_demo_model(tmp_path / "tiny", SPEC)

    async def run() -> None:
        ctl, other = cluster.controller(), cluster.controller()
        try:
            started = asyncio.Event()
            task = asyncio.ensure_future(
                ctl.place(
                    model,
                    name="halfway",
                    context_tokens=256,
                    streams=1,
                    progress=lambda node, done, total: started.set(),
                )
            )
            await asyncio.wait_for(started.wait(), 30)  # a shard is loading
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

            async def gone() -> bool:
                await other.refresh(timeout=1.0)
                return not any(
                    s.placement == "halfway" for n in other.state.nodes for s in n.shards
                )

            deadline = time.monotonic() + 20
            while not await gone():
                assert time.monotonic() < deadline, other.state.nodes
                await asyncio.sleep(0.2)
            # Still gone once a load that was under way would have finished.
            await asyncio.sleep(2.0)
            assert await gone()
            assert other.state.placement("halfway") is None
            assert any("'halfway' interrupted, rolling back" in e.text for e in ctl.state.log)
        finally:
            await ctl.close()
            await other.close()

    asyncio.run(run())


def test_restart_names_a_placement_whose_every_shard_is_gone(
    cluster: LocalCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Its node's agent was replaced (killed and started again, as `provision --upgrade`
    does): the placement reports no shard at all. `restart` of another node names it
    broken instead of failing on it."""
    model = write_demo_model(tmp_path / "tiny", SPEC)
    one, two = cluster.inventory.nodes

    async def place() -> None:
        ctl = cluster.controller()
        try:
            await ctl.place(model, [two.name], "emptied", context_tokens=256, streams=1)
        finally:
            await ctl.close()

    asyncio.run(place())
    local_cluster.stop_agent(two)
    local_cluster.start_agent(cluster.home, two, cluster.inventory)
    asyncio.run(wait_up(cluster.home, cluster.inventory))
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(cluster.inventory))
    monkeypatch.setenv("STUDIOTUI_HOME", str(cluster.home))
    code = main(["restart", one.name, "-i", str(inventory)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1, err
    assert "placement 'emptied' is broken after the restart" in err, err
    assert main(["unload", "emptied", "-i", str(inventory)]) == 0


def test_a_node_that_is_down_is_refused_with_the_command_that_starts_it(
    cluster: LocalCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`studiotui up` starts local nodes only; `restart NODE` starts any node's agent
    (over SSH for an SSH node): what placing, fetching and fine-tuning say, and it
    works."""
    model = write_demo_model(tmp_path / "tiny", SPEC)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"text": "line {i}"}}\n' for i in range(20)))
    _, two = cluster.inventory.nodes
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(cluster.inventory))
    monkeypatch.setenv("STUDIOTUI_HOME", str(cluster.home))
    hint = f"start it: studiotui restart {two.name} (r on the dashboard)"
    local_cluster.stop_agent(two)
    try:
        placed = ["place", str(model), "--nodes", two.name, "--dry-run", "-i", str(inventory)]
        assert main(placed) == exits.REFUSED["node"]  # the plan shown: a refusal
        assert main(["fetch", str(model), "--nodes", two.name, "-i", str(inventory)]) == 2
        tune = ["finetune", str(model), "--data", str(data), "--nodes", two.name]
        assert main([*tune, "--batch-size", "1", "-i", str(inventory)]) == 2
        shown = capsys.readouterr()
        said = " ".join((shown.out + shown.err).split())  # rich folds long lines
        assert said.count(hint) == 3, said
    finally:
        assert main(["restart", two.name, "-i", str(inventory)]) == 0
    asyncio.run(wait_up(cluster.home, cluster.inventory))


def test_place_notes_a_context_beyond_the_models_positions(
    cluster: LocalCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = write_demo_model(tmp_path / "tiny", SPEC)  # max_position_embeddings 4096
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(cluster.inventory))
    monkeypatch.setenv("STUDIOTUI_HOME", str(cluster.home))
    for context, noted in ((4096, False), (8192, True)):
        argv = ["place", str(model), "--context", str(context), "--dry-run"]
        assert main([*argv, "-i", str(inventory)]) == 0
        err = " ".join(capsys.readouterr().err.split())
        assert ("beyond the 4096 positions tiny was trained for" in err) == noted, err


def test_chat_from_the_command_line_samples_as_mlx_lm_and_stops_at_a_stop_string(
    cluster: LocalCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`studiotui chat --temperature T --seed S` is mlx-lm's seeded answer to the same
    chat (its template, `make_sampler(temp=T)` after `mx.random.seed(S)`), through two
    stages; `--temperature 0` its greedy answer; `--stop S` ends the answer before S."""
    model = write_demo_model(tmp_path / "tiny", SPEC)
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(cluster.inventory))
    monkeypatch.setenv("STUDIOTUI_HOME", str(cluster.home))
    where = ["-i", str(inventory)]
    assert main(["place", str(model), "--name", "said", "--context", "256", *where]) == 0
    capsys.readouterr()

    loaded, tokenizer = mlx_lm.load(str(model))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )

    def chat(*options: str) -> tuple[str, str]:
        argv = ["chat", "--placement", "said", "--max-tokens", "24", *options, "hello"]
        assert main([*argv, *where]) == 0
        shown = capsys.readouterr()
        return shown.out, " ".join(shown.err.split())

    def mlx_lm_says(temp: float, seed: int) -> str:
        mx.random.seed(seed)
        sampler = make_sampler(temp=temp)
        return mlx_lm.generate(loaded, tokenizer, prompt, max_tokens=24, sampler=sampler)

    try:
        greedy, _ = chat("--temperature", "0")
        assert greedy == mlx_lm_says(0.0, 0) + "\n"
        seeded, _ = chat("--temperature", "1.5", "--seed", "7")
        want = mlx_lm_says(1.5, 7)
        assert want not in (greedy.rstrip("\n"), mlx_lm_says(1.5, 8)), "the seed decides nothing"
        assert seeded == want + "\n"
        assert chat("--temperature", "1.5", "--seed", "7")[0] == seeded

        # Three characters of the answer's second half, cut where they first appear.
        half = len(greedy) // 2
        stop = next(
            greedy[i : i + 3] for i in range(half, len(greedy) - 3) if greedy[i : i + 3].strip()
        )
        cut = greedy[: greedy.index(stop)]
        assert cut, (greedy, stop)
        stopped, figures = chat("--temperature", "0", "--stop", stop)
        assert stopped == cut + "\n" and "finish: stop" in figures, (stopped, figures)
    finally:
        assert main(["unload", "said", *where]) == 0
