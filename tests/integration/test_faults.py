"""Faults on a real local cluster: hung stages, stopped agents, bad messages.

Processes are stopped (SIGSTOP) and resumed (SIGCONT) by the pids their agent
reports; every stopped process is resumed even when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from studiotui.api.server import start_server
from studiotui.bench import soak
from studiotui.cluster import keys
from studiotui.cluster.controller import (
    RECONNECT_GRACE_S,
    Controller,
    GenerationError,
    PlacementError,
)
from studiotui.cluster.peers import Peer
from studiotui.core.inventory import dump_inventory, local_inventory
from tests.integration.test_engine import collect, prompt_tokens, reference_tokens
from tests.support.cluster_fixture import LocalCluster, cluster_fixture, runner_pids
from worker import agent as agent_mod
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import PROTOCOL_VERSION, control, curve
from worker.shared.protocol.frames import RingHeader, encode_ring_header

BASE, PORT = 111, 59100  # 127.0.0.111-113: far from the other test modules
N = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("faults-home"), 3, BASE, PORT, 2.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = DemoSpec(layers=6, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=3)
    return write_demo_model(tmp_path_factory.mktemp("faults-model") / "m", spec)


@pytest.fixture(scope="module")
def placed(cluster: LocalCluster, model: Path) -> tuple[str, list[int], list[int]]:
    """A placement 'p' over the three nodes, its prompt and the reference answer. Two
    streams, not the default, so a reload that forgets the plan's streams shows."""

    async def run() -> None:
        ctl = cluster.controller()
        try:
            await ctl.refresh()
            await ctl.place(model, list(cluster.inventory.names), "p", prefill_chunk=16, streams=2)
        finally:
            await ctl.close()

    asyncio.run(run())
    tokens = prompt_tokens(model)
    return "p", tokens, reference_tokens(model, tokens, N)


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def stage_node(cluster: LocalCluster, placement: str, index: int) -> str:
    """The node that runs stage `index` (the planner picks the order, not the inventory)."""

    async def run() -> str:
        ctl = cluster.controller()
        try:
            await ctl.refresh()
            return ctl.state.placement(placement).shards[index].node
        finally:
            await ctl.close()

    return asyncio.run(run())


async def listed_models(ctl: Controller) -> list[str]:
    """What `/v1/models` of `studiotui serve`'s app offers, asked with the openai client."""
    import openai

    server = await start_server(ctl, "127.0.0.1", 0)
    try:
        client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
        try:
            return [m.id for m in (await client.models.list()).data]
        finally:
            await client.close()
    finally:
        await server.close()


async def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:g} s")
        await asyncio.sleep(0.2)


async def fail_time(
    ctl: Controller, placement: str, tokens: list[int], **kw: Any
) -> tuple[str, float]:
    """Run a request that must fail; its message and how long it took."""
    began = time.monotonic()
    try:
        await collect(ctl, placement, tokens, 100_000, **kw)
    except GenerationError as exc:
        return str(exc), time.monotonic() - began
    raise AssertionError("the request did not fail")


def test_a_hung_stage_is_found_in_seconds_and_comes_back_by_itself(
    cluster: LocalCluster, placed: tuple[str, list[int], list[int]]
) -> None:
    name, tokens, expected = placed
    middle = stage_node(cluster, name, 1)

    async def run() -> dict[str, Any]:
        ctl = cluster.controller()
        seen: dict[str, Any] = {}
        try:
            await ctl.start()
            pids = await runner_pids(ctl, name)
            assert (await collect(ctl, name, tokens, N))[0] == expected
            # 1. stopped mid-answer: the answer is long enough to be running.
            agen = ctl.generate(
                name, {"tokens": tokens}, {"max_tokens": 100_000, "ignore_eos": True}
            )
            async for msg in agen:
                if isinstance(msg, control.Delta):
                    break
            with stopped(pids[middle]):
                began = time.monotonic()
                try:
                    async for _ in agen:
                        pass
                except GenerationError as exc:
                    seen["mid"] = (str(exc), time.monotonic() - began)
                await wait_for(lambda: ctl.state.placement(name).state == "broken", 10, "broken")
                seen["state"] = ctl.state.placement(name).state
                seen["models"] = await listed_models(ctl)
                # 2. a new request is refused at once, saying what is known.
                seen["new"] = await fail_time(ctl, name, tokens)
            # 3. resumed: the placement is ready again by itself, nothing reloaded.
            await wait_for(lambda: ctl.state.placement(name).state == "ready", 15, "ready")
            seen["models_after"] = await listed_models(ctl)
            seen["after"] = (await collect(ctl, name, tokens, N))[0]
            seen["pids"] = (pids, await runner_pids(ctl, name))
            seen["log"] = [e.text for e in ctl.state.log]
        finally:
            await ctl.close()
        return seen

    seen = asyncio.run(run())
    print(seen["mid"], seen["new"], sep="\n")
    message, took = seen["mid"]
    assert middle in message and "stage 2 of 3" in message and "silent" in message
    assert took < 8.0, f"the silent stage took {took:.1f} s to surface"
    assert seen["state"] == "broken"
    assert seen["models"] == [] and seen["models_after"] == [name]
    refused, took = seen["new"]
    assert "silent since" in refused and middle in refused and took < 1.0
    assert "unload it" not in refused
    assert seen["after"] == expected
    assert seen["pids"][0] == seen["pids"][1]
    assert any("answers again" in line for line in seen["log"])


def test_a_stage_stopped_before_the_request_fails_it_in_seconds(
    cluster: LocalCluster, placed: tuple[str, list[int], list[int]]
) -> None:
    name, tokens, expected = placed
    tail = stage_node(cluster, name, 2)

    async def run() -> tuple[tuple[str, float], list[int]]:
        ctl = cluster.controller()
        try:
            await ctl.refresh()  # no telemetry: the request itself must find the hang
            pids = await runner_pids(ctl, name)
            with stopped(pids[tail]):
                failed = await fail_time(ctl, name, tokens)
            await ctl.refresh()
            deadline = time.monotonic() + 15
            while ctl.state.placement(name).state != "ready" and time.monotonic() < deadline:
                await asyncio.sleep(0.3)
                await ctl.refresh()
            return failed, (await collect(ctl, name, tokens, N))[0]
        finally:
            await ctl.close()

    (message, took), after = asyncio.run(run())
    print(message)
    assert tail in message and "stage 3 of 3" in message
    assert took < 8.0, f"took {took:.1f} s"
    assert after == expected


def test_a_stopped_agent_hangs_nothing_and_its_node_comes_back_by_itself(
    cluster: LocalCluster, placed: tuple[str, list[int], list[int]]
) -> None:
    name, tokens, expected = placed
    victim = cluster.inventory.names[1]

    async def run() -> dict[str, Any]:
        ctl = cluster.controller()
        seen: dict[str, Any] = {}
        try:
            await ctl.start()
            pids = await runner_pids(ctl, name)
            with stopped(cluster.pids[victim]):
                await wait_for(lambda: ctl.state.node(victim).state == "down", 10, "down")
                seen["new"] = await fail_time(ctl, name, tokens)
                began = time.monotonic()
                await ctl.refresh()
                seen["refresh_s"] = time.monotonic() - began
                await asyncio.sleep(max(0.0, 10 - (time.monotonic() - began)))
            await wait_for(lambda: ctl.state.placement(name).state == "ready", 15, "ready")
            seen["node"] = ctl.state.node(victim).state
            seen["after"] = (await collect(ctl, name, tokens, N))[0]
            seen["pids"] = (pids, await runner_pids(ctl, name))
        finally:
            await ctl.close()
        return seen

    seen = asyncio.run(run())
    message, took = seen["new"]
    print(message)
    assert victim in message and "silent since" in message and "used again by itself" in message
    assert "unload it" not in message and "place the model again" not in message
    assert took < 1.0 and seen["refresh_s"] < 5.0
    assert seen["node"] == "up"
    assert seen["after"] == expected
    assert seen["pids"][0] == seen["pids"][1], "nothing may have been reloaded"


# ---- one bad message -------------------------------------------------------------------


def test_a_bad_token_frame_fails_only_its_request(
    cluster: LocalCluster, placed: tuple[str, list[int], list[int]]
) -> None:
    """A token frame whose `work_us` is not a number reaches the head: that request
    fails with the reason, one running beside it is untouched, the runner lives."""
    name, tokens, expected = placed
    head_node = cluster.inventory.node(stage_node(cluster, name, 0))
    tail_node = cluster.inventory.node(stage_node(cluster, name, 2))
    workdir = Path(tail_node.workdir).expanduser()

    async def run() -> tuple[str, list[int], dict[str, int], dict[str, int]]:
        ctl = cluster.controller()
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        try:
            await ctl.refresh()
            pids = await runner_pids(ctl, name)
            head = ctl.state.placement(name).shards[0]
            # Speak as the tail node does, with its own key, to the head's ring port.
            own = curve.load_keypair(curve.key_dir(workdir) / "self.key_secret")
            curve.make_client(push, own, keys.node_public_key(cluster.home, head_node.name))
            push.setsockopt(zmq.LINGER, 0)
            push.connect(f"tcp://{head_node.address}:{head.data_port}")
            victim = ctl.generate(
                name, {"tokens": tokens}, {"max_tokens": 100_000, "ignore_eos": True}
            )
            rid = ""
            async for msg in victim:
                if isinstance(msg, control.Accepted):
                    rid = msg.rid
                if isinstance(msg, control.Delta):
                    break
            neighbour = asyncio.create_task(collect(ctl, name, tokens, N))
            bad = RingHeader(rid=rid, kind="token", token=1, extra={"work_us": "not a number"})
            await push.send_multipart([encode_ring_header(bad), b""])
            try:
                async for _ in victim:
                    pass
                failure = "not failed?!"
            except GenerationError as exc:
                failure = str(exc)
            beside = (await neighbour)[0]
            return failure, beside, pids, await runner_pids(ctl, name)
        finally:
            push.close(linger=0)
            ctx.term()
            await ctl.close()

    failure, beside, before, after = asyncio.run(run())
    print(failure)
    assert "bad frame" in failure and "ValueError" in failure
    assert beside == expected
    assert before == after


def test_the_agent_reader_survives_long_lines_and_non_object_json(tmp_path: Path) -> None:
    """A real process writes what a broken runner could: the agent reads on."""
    script = (
        "import json, sys\n"
        "print('x' * 300_000)\n"  # longer than the pipe reader's line limit
        "print('[1, 2, 3]'); print('\"text\"'); print('not json {')\n"
        "print(json.dumps({'event': 'progress', 'done': 'half', 'total': None}))\n"
        "print(json.dumps({'event': 'stats', 'tokens': 5, 'in_flight': 0}))\n"
        "sys.stdout.flush()\n"
    )

    async def run() -> agent_mod.ShardProc:
        config = agent_mod.AgentConfig("n", "127.0.0.1", 1, tmp_path)
        agent = agent_mod.Agent(config)
        # Replies go to an identity nobody has: a ROUTER drops them, as for a gone client.
        agent.control = agent.ctx.socket(zmq.ROUTER)
        agent.control.bind("inproc://control")
        shard = agent_mod.ShardProc("p", 0, 0)
        shard.state = "loading"
        shard.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            script,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        nobody = agent_mod.Ask(agent._send, b"nobody", 1)
        room = agent.shard_room
        await asyncio.gather(room.follow(nobody, shard), room.read_stderr(shard))
        agent.control.close(linger=0)
        agent.ctx.term()
        return shard

    shard = asyncio.run(run())
    assert shard.stats.tokens == 5, "the line after the bad ones was read"
    assert shard.bad_lines >= 5
    assert shard.state == "failed" and "exited with code 0" in shard.message


def test_telemetry_takes_the_node_from_the_connection_and_survives_bad_messages(
    tmp_path: Path,
) -> None:
    """A node's PUB (its real key) sends garbage, a sample naming another node, then a
    good one: the controller reads on, and only the sender's node changes."""
    home = tmp_path / "home"
    inv = local_inventory(2, base_octet=BASE + 10, control_port=PORT + 100, home=home)
    sender, other = inv.nodes

    async def run() -> tuple[str, str, int, float]:
        ctl = Controller(home, inv)
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        try:
            curve.make_server(pub, keys.node_keys(home, sender.name))
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(sender.telemetry_endpoint)
            ctl._start_telemetry()

            def sample(name: str, **extra: Any) -> bytes:
                # As a map: some of these are wrong on purpose, as no struct may be.
                fields = {"v": PROTOCOL_VERSION, "type": "telemetry", "name": name, **extra}
                return msgspec.msgpack.encode({**fields, "time": time.time()})

            bad = [
                [b"telemetry", b"\xc1not msgpack"],
                [b"telemetry"],
                [b"telemetry", sample(sender.name, memory_used="lots", memory_total=1)],
                [b"telemetry", sample(sender.name, shards=[1, "x"], memory_total=1)],
                [b"telemetry", sample(other.name, memory_used=1, memory_total=2)],  # spoof
            ]
            good = sample(sender.name, memory_used=3 << 30, memory_total=8 << 30, version="9")
            deadline = time.monotonic() + 10
            while ctl.state.node(sender.name).state != "up" and time.monotonic() < deadline:
                for frames in bad:
                    await pub.send_multipart(frames)
                await pub.send_multipart([b"telemetry", good])
                await asyncio.sleep(0.2)
            node = ctl.state.node(sender.name)
            return (
                node.state,
                ctl.state.node(other.name).state,
                ctl.telemetry_dropped,
                node.memory_used,
            )
        finally:
            pub.close(linger=0)
            ctx.term()
            await ctl.close()

    sender_state, other_state, dropped, used = asyncio.run(run())
    assert sender_state == "up" and used == 3 << 30
    assert other_state != "up", "a message naming another node must not speak for it"
    assert dropped >= 4


# ---- a controller that reconnects ----------------------------------------------------------


class Blip:
    """A TCP relay between the controller and a head shard that can drop every
    connection and refuse new ones for a while: a network blip, a laptop's sleep."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.refusing_until = 0.0
        self.links: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._accept, host, port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self.refusing_until:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.links.append((writer, up_writer))
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def drop(self, for_s: float) -> None:
        self.refusing_until = time.monotonic() + for_s
        for a, b in self.links:
            a.close()
            b.close()
        self.links.clear()

    async def close(self) -> None:
        self.drop(0)
        if self.server is not None:
            self.server.close()


RELAY = ("127.0.0.114", PORT + 50)


def test_a_stream_resumes_after_a_blip_or_fails_clearly_within_seconds(
    cluster: LocalCluster, model: Path, placed: tuple[str, list[int], list[int]]
) -> None:
    name, tokens, _ = placed
    long_prompt = (tokens * 80)[:2500]  # a prefill long enough to blip inside it
    expected = reference_tokens(model, long_prompt, N)

    async def run() -> dict[str, Any]:
        ctl = cluster.controller()
        seen: dict[str, Any] = {}
        try:
            await ctl.refresh()
            p = ctl.state.placement(name)
            head = p.shards[0]
            blip = Blip((cluster.inventory.node(head.node).address, head.client_port))
            await blip.start(*RELAY)
            # The controller's head socket, through the relay (same keys and identity
            # rules as its own).
            ctl.peers[ctl.head_key(p)] = Peer(
                ctl.ctx,
                f"tcp://{RELAY[0]}:{RELAY[1]}",
                ctl.keys,
                keys.node_public_key(cluster.home, head.node),
                "head via relay",
                identity=b"studiotui:test-session:head",
            )
            params = {"max_tokens": N, "ignore_eos": True}
            # 1. dropped during the prefill: the head keeps what it says meanwhile and
            # the reconnected socket (same identity) gets all of it.
            got: list[int] = []
            async for msg in ctl.generate(name, {"tokens": long_prompt}, params):
                if isinstance(msg, control.Accepted):
                    blip.drop(1.0)
                if isinstance(msg, control.Delta):
                    got += msg.tokens
            seen["resumed"] = got
            seen["reconnects"] = ctl.peers[ctl.head_key(p)].reconnects
            # 2. dropped mid-answer: whole and right, or a clear failure, in seconds.
            began = time.monotonic()
            got = []
            try:
                async for msg in ctl.generate(name, {"tokens": long_prompt}, params):
                    if isinstance(msg, control.Delta):
                        got += msg.tokens
                        if len(got) == 3:
                            blip.drop(0.5)
                seen["mid"] = ("whole", got == expected, time.monotonic() - began)
            except GenerationError as exc:
                seen["mid"] = (str(exc), False, time.monotonic() - began)
            # 2b. down since long before a request is sent (the head restarted): the
            # request waits for ZeroMQ's next reconnect and is answered, not failed for
            # the time the connection was down before it was sent.
            blip.drop(RECONNECT_GRACE_S + 2.5)
            await asyncio.sleep(RECONNECT_GRACE_S + 1.5)
            got = []
            try:
                async for msg in ctl.generate(name, {"tokens": tokens}, params):
                    if isinstance(msg, control.Delta):
                        got += msg.tokens
                seen["late"] = got
            except GenerationError as exc:
                seen["late"] = str(exc)
            # 3. gone for longer than the grace: failed, naming the head's node.
            began = time.monotonic()
            try:
                async for msg in ctl.generate(name, {"tokens": long_prompt}, params):
                    if isinstance(msg, control.Accepted):
                        blip.drop(30.0)
                seen["gone"] = ("answered?!", 0.0)
            except GenerationError as exc:
                seen["gone"] = (str(exc), time.monotonic() - began)
            blip.refusing_until = 0.0
            await blip.close()
            await ctl.peers.pop(ctl.head_key(p)).aclose()
            # The placement itself is fine: a request on the direct socket answers.
            seen["after"] = (await collect(ctl, name, long_prompt, N))[0]
        finally:
            await ctl.close()
        return seen

    seen = asyncio.run(run())
    print(seen["mid"], seen["gone"], sep="\n")
    assert seen["resumed"] == expected and seen["reconnects"] >= 1
    outcome, right, took = seen["mid"]
    assert right or "lost while its connection was down" in outcome, outcome
    assert took < 15.0
    assert seen["late"] == reference_tokens(model, tokens, N), seen["late"]
    message, took = seen["gone"]
    assert "dropped" in message and "has not come back" in message, message
    assert took < 12.0
    assert seen["after"] == expected


# ---- cancel storms and soak ----------------------------------------------------------------


def test_a_cancel_storm_leaves_no_cache_and_the_answers_right(
    cluster: LocalCluster, placed: tuple[str, list[int], list[int]]
) -> None:
    name, tokens, expected = placed

    async def run() -> tuple[soak.StormResult, list[int]]:
        ctl = cluster.controller()
        try:
            await ctl.refresh()
            storm = await soak.cancel_storm(ctl, name, tokens, n=50, at_once=10, seed=14)
            return storm, (await collect(ctl, name, tokens, N))[0]
        finally:
            await ctl.close()

    storm, after = asyncio.run(run())
    assert storm.failed == []
    assert storm.caches_after == [0, 0, 0], storm.caches_after
    assert after == expected


def test_a_soak_over_concurrent_openai_clients_loses_and_mixes_nothing(
    cluster: LocalCluster, placed: tuple[str, list[int], list[int]]
) -> None:
    """A short soak for CI (`studiotui bench --soak` runs 200 requests)."""
    name, _, _ = placed

    async def run() -> soak.SoakResult:
        ctl = cluster.controller()
        try:
            await ctl.start()
            server = await start_server(ctl, "127.0.0.1", 0)
            try:
                return await soak.soak(
                    ctl, server.url, name, requests=48, clients=8, max_tokens=8, distinct=8
                )
            finally:
                await server.close()
        finally:
            await ctl.close()

    result = asyncio.run(run())
    print(result.figures())
    assert result.errors == []
    assert result.answered == 48 and result.lost == 0 and result.mixed == 0
    assert len(result.rss_mb_end) == 7, result.rss_mb_end  # 3 agents, 3 runners, us
    # Flat after warm-up, with room for the allocator's and the caches' ups and downs.
    assert max(result.growth_mb.values()) < 64, result.growth_mb


# ---- restarting nodes --------------------------------------------------------------------


def studiotui_cli(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    path = cluster.home / "faults-cluster.toml"
    path.write_text(dump_inventory(cluster.inventory))
    env = {**os.environ, "STUDIOTUI_HOME": str(cluster.home), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "studiotui", "-i", str(path), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def test_restart_reloads_the_shards_it_stopped_and_the_placement_stays_whole(
    cluster: LocalCluster, placed: tuple[str, list[int], list[int]]
) -> None:
    name, tokens, expected = placed
    middle = stage_node(cluster, name, 1)

    async def state() -> tuple[str, list[list[int]], dict[str, int], list[int], list[int], int]:
        ctl = cluster.controller()
        try:
            await ctl.refresh()
            p = ctl.state.placement(name)
            got, cached = [], -1
            if p and p.state == "ready":
                got, _, done = await collect(ctl, name, tokens, N)
                assert done is not None
                cached = done.usage["cached_tokens"]
            return (
                (p.state if p else "gone"),
                (p.layers if p else []),
                await runner_pids(ctl, name),
                got,
                [s.streams for s in p.shards] if p else [],
                cached,
            )
        finally:
            await ctl.close()

    before = asyncio.run(state())
    one = studiotui_cli(cluster, "restart", middle)
    after_one = asyncio.run(state())
    every = studiotui_cli(cluster, "restart")
    after_all = asyncio.run(state())
    print(one.stdout, one.stderr, every.stdout, every.stderr, sep="\n")
    assert one.returncode == 0 and every.returncode == 0
    assert f"reloaded its shards on {middle}" in one.stdout
    assert after_one[0] == "ready" and after_one[1] == before[1] and after_one[3] == expected
    # Only the restarted node's runner is new.
    assert {n: p for n, p in after_one[2].items() if n != middle} == {
        n: p for n, p in before[2].items() if n != middle
    }
    assert after_one[2][middle] != before[2][middle]
    assert after_all[0] == "ready" and after_all[1] == before[1] and after_all[3] == expected
    # Reloaded shards serve the streams the plan reserved KV memory for, not the default.
    assert before[4] == after_one[4] == after_all[4] == [2, 2, 2]
    # The prompt's prefix cache entry came back from each restarted node's disk (the
    # head's index too, when every node restarted): reused whole, the same answer.
    assert after_one[5] == after_all[5] == len(tokens) - 1


def test_restart_after_down_loads_the_shard_down_stopped_and_the_placement_is_whole(
    cluster: LocalCluster, placed: tuple[str, list[int], list[int]]
) -> None:
    """`down` on one node of a placement stops its shard; the advice it and `status`
    give, `studiotui restart NODE`, loads that shard again: no unload, no re-place."""
    name, tokens, expected = placed
    last = stage_node(cluster, name, 2)

    async def state() -> tuple[str, list[int]]:
        ctl = cluster.controller()
        try:
            await ctl.refresh()
            p = ctl.state.placement(name)
            got = (await collect(ctl, name, tokens, N))[0] if p and p.state == "ready" else []
            return (p.state if p else "gone"), got
        finally:
            await ctl.close()

    down = studiotui_cli(cluster, "down", last)
    status = studiotui_cli(cluster, "status")
    assert asyncio.run(state())[0] == "broken"
    again = studiotui_cli(cluster, "restart", last)
    print(down.stdout, status.stdout, again.stdout, again.stderr, sep="\n")
    assert down.returncode == 0 and again.returncode == 0
    assert f"studiotui restart {last}" in down.stdout
    assert f"reloaded its shards on {last}" in again.stdout
    assert asyncio.run(state()) == ("ready", expected)


def test_a_controller_open_before_a_placement_made_elsewhere_knows_its_ring(
    cluster: LocalCluster, model: Path
) -> None:
    """A dashboard open while the CLI places a model shows that placement with its whole
    ring (so a node of it going down is named, not dropped from its group)."""
    two = list(cluster.inventory.names)[:2]

    async def run() -> tuple[tuple[str, ...], tuple[str, ...]]:
        early = cluster.controller()
        other = cluster.controller()
        try:
            await other.refresh()
            await other.place(model, two, "q", prefill_chunk=16)
            await early.refresh()
            placement = early.state.placement("q")
            assert placement is not None
            return tuple(p.node for p in placement.planned), tuple(sorted(placement.nodes))
        finally:
            with contextlib.suppress(PlacementError):
                await other.unload("q")
            await other.close()
            await early.close()

    planned, nodes = asyncio.run(run())
    assert sorted(planned) == sorted(two) and nodes == tuple(sorted(two))


# ---- the TUI and CLI re-attach -------------------------------------------------------------


def test_the_tui_and_cli_reattach_to_a_loaded_placement_with_nothing_reloaded(
    cluster: LocalCluster, placed: tuple[str, list[int], list[int]]
) -> None:
    """Quit the app and start it again: the placement is shown and answers the same,
    from the same runner processes; the CLI, a new process each time, too."""
    from textual.widgets import DataTable, Input

    from studiotui.app.app import StudioApp
    from studiotui.app.panes.placements import PlacementsPane
    from studiotui.app.screens.chat import ChatScreen

    name, _, _ = placed

    async def until(pilot: Any, check: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
            await pilot.pause(0.05)

    async def session() -> tuple[list[tuple[str, str]], str, dict[str, int]]:
        app = StudioApp(cluster.home, cluster.inventory)
        async with app.run_test(size=(160, 48)) as pilot:
            await until(
                pilot,
                lambda: (
                    app.controller is not None
                    and any(
                        p.name == name and p.state == "ready"
                        for p in app.controller.state.placements
                    )
                ),
                20,
                "the placement is known",
            )
            table = app.query_one(PlacementsPane).query_one("#placements-table", DataTable)

            def shown() -> list[tuple[str, str]]:
                """Each row's placement name and state, as the table shows them."""
                rows = [table.get_row_at(row) for row in range(table.row_count)]
                return [(str(r[0]), str(r[1])) for r in rows]

            await until(pilot, lambda: (name, "ready") in shown(), 10, "the placement is shown")
            pids = await runner_pids(app.controller, name)
            await pilot.press("c")
            await until(pilot, lambda: isinstance(app.screen, ChatScreen), 5, "chat screen")
            screen = app.screen
            await screen.action_new_conversation()  # the app reopens the last one; ask afresh
            await pilot.pause(0.1)
            screen.query_one("#chat-temperature", Input).value = "0"
            screen.query_one("#chat-max-tokens", Input).value = "12"
            prompt = screen.query_one("#chat-prompt", Input)
            prompt.focus()
            prompt.value = "are you still there?"
            app.simulate_key("enter")
            await until(
                pilot, lambda: screen.turn is not None and screen.turn.finished, 60, "answer"
            )
            turn = screen.turn
            assert turn.error is None, turn.error
            return shown(), turn.text, pids

    first = asyncio.run(session())
    second = asyncio.run(session())
    status = studiotui_cli(cluster, "status")
    said = studiotui_cli(
        cluster, "chat", "--placement", name, "--max-tokens", "12", "are you still there?"
    )
    third = asyncio.run(session())
    assert (name, "ready") in first[0] and (name, "ready") in second[0]
    assert first[1] and first[1] == second[1] == third[1]
    assert first[2] == second[2] == third[2], "a runner was restarted: something reloaded"
    assert status.returncode == 0 and name in status.stdout and "ready" in status.stdout
    assert said.returncode == 0, said.stderr
    assert said.stdout.strip() == first[1]
