"""Restarts that restore: after an agent killed with `kill -9`, a shard runner killed,
and `down` of every node, `studiotui restart` (and `up`) brings the placement back on
the same layers and it answers mlx-lm's own greedy tokens, as before.

Real agents and runners (`tests/cluster_fixture.py`), the real CLI in a subprocess.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from studiotui.cluster import local_cluster
from studiotui.core.inventory import dump_inventory
from tests.integration.test_engine import collect, prompt_tokens, reference_tokens
from tests.support.cluster_fixture import LocalCluster, cluster_fixture, runner_pids
from tests.support.output import read_until
from worker.shared.demo_model import DemoSpec, write_demo_model

BASE, PORT = 246, 57700  # 127.0.0.246-247
NAME = "dense"
N = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("restore-home"), 2, BASE, PORT, 2.0)


@pytest.fixture(scope="module")
def placed(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    """'dense' over both nodes; the prompt's reference answer (mlx-lm's greedy tokens)."""
    spec = DemoSpec(layers=8, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=11)
    model = write_demo_model(tmp_path_factory.mktemp("restore-model") / "m", spec)
    assert cli(cluster, "place", str(model), "--name", NAME, "--context", "1024").returncode == 0
    return reference_tokens(model, prompt_tokens(model), N)


def cli(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    path = cluster.home / "restore-cluster.toml"
    path.write_text(dump_inventory(cluster.inventory))
    env = {**os.environ, "STUDIOTUI_HOME": str(cluster.home), "NO_COLOR": "1", "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "studiotui", "-i", str(path), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    print(f"$ studiotui {' '.join(args)} -> {done.returncode}\n{done.stdout}{done.stderr}")
    return done


def answer(cluster: LocalCluster, model_tokens: list[int] | None = None) -> tuple[str, list[int]]:
    """The placement's state and, when ready, its greedy answer to the test prompt."""

    async def run() -> tuple[str, list[int]]:
        ctl = cluster.controller()
        try:
            await ctl.refresh()
            p = ctl.state.placement(NAME)
            if p is None or p.state != "ready":
                return (p.state if p else "gone"), []
            tokens = prompt_tokens(Path(p.model_dir))
            return p.state, (await collect(ctl, NAME, tokens, N))[0]
        finally:
            await ctl.close()

    return asyncio.run(run())


def state(cluster: LocalCluster) -> str:
    async def run() -> str:
        ctl = cluster.controller()
        try:
            await ctl.refresh()
            p = ctl.state.placement(NAME)
            return p.state if p else "gone"
        finally:
            await ctl.close()

    return asyncio.run(run())


def pids(cluster: LocalCluster) -> dict[str, int]:
    async def run() -> dict[str, int]:
        ctl = cluster.controller()
        try:
            return await runner_pids(ctl, NAME)
        finally:
            await ctl.close()

    return asyncio.run(run())


def gone(pid: int, timeout: float = 10.0) -> None:
    assert local_cluster.wait_gone(pid, timeout), f"pid {pid} still there after {timeout} s"


def test_restart_after_an_agent_killed_hard_reloads_from_the_recorded_ring(
    cluster: LocalCluster, placed: list[int]
) -> None:
    assert answer(cluster) == ("ready", placed)
    node = cluster.inventory.node("local-2")
    agent = local_cluster.running_pid(node)
    runner = pids(cluster)["local-2"]
    assert agent is not None
    os.kill(agent, signal.SIGKILL)
    gone(agent)
    gone(runner)  # a runner ends with its agent
    again = cli(cluster, "restart", "local-2", "--yes")
    assert again.returncode == 0, again.stderr
    assert "reloaded its shards on local-2" in again.stdout
    assert answer(cluster) == ("ready", placed)


def test_restart_after_a_runner_killed_relaunches_it(
    cluster: LocalCluster, placed: list[int]
) -> None:
    assert answer(cluster) == ("ready", placed)
    before = pids(cluster)
    os.kill(before["local-1"], signal.SIGKILL)
    gone(before["local-1"])
    deadline = time.monotonic() + 15
    while state(cluster) == "ready":
        assert time.monotonic() < deadline, "the placement still reads ready"
        time.sleep(0.3)
    again = cli(cluster, "restart", "local-1")
    assert again.returncode == 0, again.stderr
    assert "reloaded its shards on local-1" in again.stdout
    assert answer(cluster) == ("ready", placed)
    after = pids(cluster)
    assert after["local-1"] != before["local-1"] and psutil.pid_exists(after["local-1"])


@pytest.mark.parametrize("verb", ["restart", "up"])
def test_down_of_every_node_then_restart_or_up_brings_the_shards_back(
    cluster: LocalCluster, placed: list[int], verb: str
) -> None:
    assert answer(cluster) == ("ready", placed)
    down = cli(cluster, "down")
    assert down.returncode == 0, down.stderr
    assert f"studiotui {verb}" in down.stdout
    again = cli(cluster, verb)
    assert again.returncode == 0, again.stderr
    assert "reloaded its shards on" in again.stdout
    assert answer(cluster) == ("ready", placed)


@pytest.fixture
def serve(cluster: LocalCluster) -> Iterator[str]:
    """`studiotui serve` in a process of its own, as an operator runs it; its base URL."""
    path = cluster.home / "restore-cluster.toml"
    path.write_text(dump_inventory(cluster.inventory))
    env = {**os.environ, "STUDIOTUI_HOME": str(cluster.home), "NO_COLOR": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "studiotui", "-i", str(path), "serve", "--port", "0"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        # Port 0: a fixed port can be taken by one of the agents' own outgoing sockets.
        found, _ = read_until(proc.stdout, r"studiotui serve: (http://\S+/v1)")
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_api_follows_an_unload_and_place_at_once_and_names_what_broke(
    cluster: LocalCluster, placed: list[int], serve: str
) -> None:
    """After `unload X` and `place … --name X` said ready, the API serves X at once with
    a new `created`; a request to a placement whose shard failed is told the node, the
    stage and what to do, as the stream's own error says."""
    import openai

    client = openai.OpenAI(base_url=serve, api_key="unused", max_retries=0, timeout=60)

    def ask() -> str:
        out = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "Tell me about the sea"}],
            max_tokens=N,
            temperature=0.0,
        )
        return out.choices[0].message.content or ""

    deadline = time.monotonic() + 20
    while NAME not in [m.id for m in client.models.list().data]:
        assert time.monotonic() < deadline, "the API never listed the placement"
        time.sleep(0.2)
    before = ask()
    created = client.models.retrieve(NAME).created
    model = asyncio.run(_model_dir(cluster))
    assert cli(cluster, "unload", NAME).returncode == 0
    time.sleep(1.1)  # `created` counts seconds
    placed_again = cli(cluster, "place", model, "--name", NAME, "--context", "1024")
    assert placed_again.returncode == 0
    assert ask() == before  # at once: no 503 while the API catches up
    assert client.models.retrieve(NAME).created > created

    # A shard's runner killed: the API's refusal says where and what to do.
    runner = pids(cluster)["local-1"]
    os.kill(runner, signal.SIGKILL)
    gone(runner)
    deadline = time.monotonic() + 15
    while True:
        try:
            ask()
        except openai.APIStatusError as exc:
            refused = exc
            break
        assert time.monotonic() < deadline, "the API still answers"
        time.sleep(0.3)
    said = str(refused.message)
    print(said)
    assert refused.status_code == 503, said
    assert "local-1" in said and "of 2, layers" in said, said
    assert "studiotui restart local-1" in said, said
    assert cli(cluster, "restart", "local-1").returncode == 0
    assert ask() == before


async def _model_dir(cluster: LocalCluster) -> str:
    ctl = cluster.controller()
    try:
        await ctl.refresh()
        p = ctl.state.placement(NAME)
        assert p is not None
        return p.model_dir
    finally:
        await ctl.close()
