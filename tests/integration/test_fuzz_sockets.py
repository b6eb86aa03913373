"""Fuzz every socket kind of a real cluster, and the API: random and mutated messages
(wrong versions and types, huge shapes, truncated payloads, wrong dtypes, invalid
UTF-8) by the thousand; then no process has died, memory has not grown, and a normal
request gives the same tokens as before.

Two agents on 127.0.0.131-132:58500 hold a two-stage placement of a demo model. The
CI run takes seconds; STUDIOTUI_FUZZ_LONG=1 sends many more."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from studiotui.api.server import start_server
from studiotui.cluster import keys
from studiotui.cluster.controller import Controller, GenerationError
from studiotui.core.inventory import local_inventory
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import PROTOCOL_VERSION, control, curve
from worker.shared.protocol.curve import CurveKeys, make_client, make_server
from worker.shared.protocol.frames import RingHeader, encode_ring_header
from worker.shared.protocol.limits import BUSY

LONG = os.environ.get("STUDIOTUI_FUZZ_LONG") == "1"
EXAMPLES = 5000 if LONG else 250
API_EXAMPLES = 1000 if LONG else 80
PLACEMENT = "fz"
HIDDEN = 32
PARAMS = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
PROMPT = {"prompt": "a reference answer, before and after the fuzz"}
# What a process may grow by over a fuzz run (allocator noise, caches warming up).
GROWTH = 64 << 20

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)

# ---- what is sent ------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
V = PROTOCOL_VERSION
FIELDS = ["rid", "params", "prompt", "tokens", "messages", "id", "name", "time", "lines",
          "placement", "peers", "shards", "text", "re", "stream"]  # fmt: skip


def envelope(types: list[str]) -> st.SearchStrategy[bytes]:
    """A map that looks like a message: a version (mostly right), a type, odd fields."""
    return st.builds(
        lambda v, t, extra: msgspec.msgpack.encode({"v": v, "type": t, **extra}),
        st.sampled_from([V, V, V, 0, V + 1, str(V), None, float(V)]),
        st.sampled_from([*types, "bogus", ""]),
        st.dictionaries(st.sampled_from(FIELDS), values, max_size=5),
    )


def raw_messages(types: list[str]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=256),
        st.builds(lambda v: msgspec.msgpack.encode(v), values),
        envelope(types),
        envelope(types).map(lambda b: b[: len(b) // 2]),  # truncated
        st.builds(lambda b: b"\xc1\xff\xfe" + b, st.binary(max_size=32)),  # not msgpack / UTF-8
    )


def generate_messages() -> st.SearchStrategy[bytes]:
    """Requests a head might get: mostly well formed, with odd parameters and prompts."""
    params = st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": st.one_of(st.integers(-5, 6), values),
            "temperature": st.one_of(st.floats(-1, 20), values),
            "top_p": st.one_of(st.floats(-1, 2), values),
            "seed": st.one_of(st.integers(-(2**63), 2**64 - 1), values),
            "stop": st.one_of(st.lists(st.text(max_size=8), max_size=20), values),
            "ignore_eos": values,
            "top_k": st.one_of(st.integers(-(2**63), 2**64 - 1), values),
            "min_p": st.one_of(st.floats(-1, 2), values),
            "xtc_probability": st.one_of(st.floats(-1, 2), values),
            "xtc_threshold": st.one_of(st.floats(-1, 2), values),
            "repetition_penalty": st.one_of(st.floats(0, 1e-30) | st.floats(-1, 20), values),
        },
    )
    body = st.one_of(
        st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=64), values)}),
        st.fixed_dictionaries({"tokens": st.lists(st.integers(-10, 10**6), max_size=40) | values}),
        st.fixed_dictionaries({"messages": values}),
        st.just({}),
    )
    return st.builds(
        lambda rid, p, b, v: msgspec.msgpack.encode(
            {"v": v, "type": "generate", "rid": rid, "params": p, **b}
        ),
        st.text(min_size=1, max_size=8).map(lambda s: "fz-" + s),
        params | values,
        body,
        st.sampled_from([V, V, V, V + 1]),
    )


def ring_frames() -> st.SearchStrategy[list[bytes]]:
    """Ring frames: lying shapes and dtypes, huge dimensions, short payloads, junk."""
    header = st.builds(
        RingHeader,
        rid=st.text(max_size=8).map(lambda s: "fz-" + s),
        kind=st.sampled_from(["prefill", "decode", "free", "error", "token"]),
        offset=st.integers(-3, 10**9),
        dtype=st.sampled_from(["float32", "float16", "bfloat16", "int64", ""]),
        shape=st.one_of(
            st.tuples(st.just(1), st.integers(1, 8), st.just(HIDDEN)),
            st.lists(st.integers(-2, 2**40), max_size=6).map(tuple),
        ),
        token=st.integers(-(2**40), 2**40),
        message=st.text(max_size=20),
    )

    def with_payload(h: RingHeader, short: int) -> list[bytes]:
        try:
            size = h.expected_bytes() if h.dtype in ("float32", "float16", "bfloat16") else 8
        except (KeyError, OverflowError):
            size = 8
        size = max(0, min(size, 1 << 16) - short)  # never send gigabytes: lie instead
        return [encode_ring_header(h), b"\0" * size]

    return st.one_of(
        st.builds(with_payload, header, st.sampled_from([0, 0, 1, 4])),
        st.lists(st.binary(max_size=64), min_size=1, max_size=4),
        st.builds(lambda v, p: [msgspec.msgpack.encode(v), p], values, st.binary(max_size=64)),
    )


# ---- the cluster -------------------------------------------------------------------------


@dataclass
class Target:
    cluster: LocalCluster
    want: list[int]
    pids: dict[str, int]  # agents and runners: every process that must survive
    rss: dict[str, int]
    head: dict[str, Any]
    tail: dict[str, Any]

    def endpoint(self, shard: dict[str, Any], port: str) -> str:
        node = self.cluster.inventory.node(shard["node"])
        return f"tcp://{node.address}:{shard[port]}"


async def answer(ctl: Controller) -> list[int]:
    tokens: list[int] = []
    async for msg in ctl.generate(PLACEMENT, PROMPT, PARAMS):
        if isinstance(msg, control.Delta):
            tokens += msg.tokens
    return tokens


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    tmp = tmp_path_factory.mktemp("fuzz")
    model = write_demo_model(
        tmp / "tiny", DemoSpec(layers=2, hidden=HIDDEN, heads=2, kv_heads=1, dtype="float32")
    )
    for cluster in cluster_fixture(tmp / "home", 2, 131, 58500):
        yield asyncio.run(_setup(cluster, model))


async def _setup(cluster: LocalCluster, model: Path) -> Target:
    ctl = cluster.controller()
    try:
        names = list(cluster.inventory.names)
        await ctl.place(model, names, PLACEMENT, prefill_chunk=8, context_tokens=256)
        want = await answer(ctl)
        shards = []
        for shard in ctl.state.placement(PLACEMENT).shards:
            reply = await ctl.peer(shard.node).ask("list_shards", control.Shards)
            mine = next(s for s in reply.shards if s.placement == PLACEMENT)
            shards.append({**control.to_wire(mine), "node": shard.node})
    finally:
        await ctl.close()
    pids = {f"agent {n}": p for n, p in cluster.pids.items()}
    pids |= {f"runner {s['index']}": int(s["pid"]) for s in shards}
    rss = {k: psutil.Process(p).memory_info().rss for k, p in pids.items()}
    return Target(cluster, want, pids, rss, shards[0], shards[-1])


@contextlib.contextmanager
def alongside(target: Target) -> Iterator[None]:
    """Normal requests, one after another, for as long as the fuzz runs: each must give
    the reference tokens while the sockets take the junk."""
    done = threading.Event()
    answers: list[list[int]] = []
    errors: list[BaseException] = []

    async def keep_asking() -> None:
        ctl = target.cluster.controller()
        try:
            await ctl.refresh()
            while not done.is_set():
                try:
                    answers.append(await answer(ctl))
                except GenerationError as exc:
                    # The fuzz's own well-formed requests may take every stream: "busy"
                    # is the right answer then, and a client asks again.
                    if not str(exc).startswith(BUSY):
                        raise
                    await asyncio.sleep(0.05)
        finally:
            await ctl.close()

    def run() -> None:
        try:
            asyncio.run(keep_asking())
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(120)
    assert not errors, errors
    assert answers and all(a == target.want for a in answers), answers


def still_serving(target: Target) -> None:
    """Every process alive, none grown much, and the reference answer unchanged."""
    for what, pid in target.pids.items():
        proc = psutil.Process(pid)
        assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE, what
        grown = proc.memory_info().rss - target.rss[what]
        assert grown < GROWTH, f"{what} grew by {grown >> 20} MB"

    async def check() -> list[int]:
        ctl = target.cluster.controller()
        try:
            await ctl.refresh()
            got = await answer(ctl)
            # Nothing the fuzz started is left holding memory on the head.
            for _ in range(50):
                head = ctl.head_peer(ctl.pick_placement(PLACEMENT))
                stats = (await head.ask("stats", control.StatsReply)).stats
                if stats.in_flight == 0 and stats.waiting == 0:
                    break
                await asyncio.sleep(0.1)
            assert stats.in_flight == 0 and stats.waiting == 0, stats
            return got
        finally:
            await ctl.close()

    assert asyncio.run(check()) == target.want


def blast(
    endpoint: str, client: CurveKeys, server: bytes, kind: int, strategy: Any, send: Callable
) -> int:
    """Send every example hypothesis draws; replies (on a DEALER) are read and dropped."""
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sent = 0
    try:
        make_client(sock, client, server)
        sock.setsockopt(zmq.SNDTIMEO, 5000)
        sock.connect(endpoint)

        @FUZZ
        @given(strategy)
        def one(data: Any) -> None:
            nonlocal sent
            send(sock, data)
            sent += 1
            while kind == zmq.DEALER and sock.poll(0):
                sock.recv(zmq.NOBLOCK)

        one()
    finally:
        sock.close(linger=0)
        ctx.term()
    return sent


# ---- the sockets -------------------------------------------------------------------------


def test_fuzz_the_control_socket(fuzz_cluster: Target) -> None:
    node = fuzz_cluster.cluster.inventory.nodes[1]
    home = fuzz_cluster.cluster.home
    # Everything but what would stop the node on purpose (shutdown, unload, load_shard,
    # prepare_shard) or reach out to random endpoints (measure_links).
    types = ["hello", "list_shards", "read_log", "ping_peer", "generate", "cancel", "stats",
             "telemetry", "hello_reply", "ok", "error", "log"]  # fmt: skip
    sent = 0
    # As the controller (everything gets to the handlers) and as a peer node.
    with alongside(fuzz_cluster):
        for client in (keys.controller_keys(home), keys.node_keys(home, node.name)):
            sent += blast(
                node.control_endpoint,
                client,
                keys.node_public_key(home, node.name),
                zmq.DEALER,
                raw_messages(types),
                lambda s, d: s.send(d),
            )
    assert sent >= 2 * EXAMPLES * 0.9
    still_serving(fuzz_cluster)


def test_fuzz_the_head_client_socket(fuzz_cluster: Target) -> None:
    home = fuzz_cluster.cluster.home
    head = fuzz_cluster.head
    with alongside(fuzz_cluster):
        sent = blast(
            fuzz_cluster.endpoint(head, "client_port"),
            keys.controller_keys(home),
            keys.node_public_key(home, head["node"]),
            zmq.DEALER,
            st.one_of(generate_messages(), raw_messages(["generate", "cancel", "stats"])),
            lambda s, d: s.send(d),
        )
    assert sent >= EXAMPLES * 0.9
    still_serving(fuzz_cluster)


def test_fuzz_the_ring(fuzz_cluster: Target) -> None:
    home = fuzz_cluster.cluster.home
    head, tail = fuzz_cluster.head, fuzz_cluster.tail
    sent = 0
    # As the stage before each shard would: the head (index 0) sends to the tail and back.
    with alongside(fuzz_cluster):
        for shard, sender in ((tail, head), (head, tail)):
            sent += blast(
                fuzz_cluster.endpoint(shard, "data_port"),
                keys.node_keys(home, sender["node"]),
                keys.node_public_key(home, shard["node"]),
                zmq.PUSH,
                ring_frames(),
                lambda s, frames: s.send_multipart(frames),
            )
    assert sent >= 2 * EXAMPLES * 0.9
    still_serving(fuzz_cluster)


def test_the_ring_takes_frames_only_from_node_keys(fuzz_cluster: Target) -> None:
    home = fuzz_cluster.cluster.home
    tail = fuzz_cluster.tail

    async def dropped() -> int:
        ctl = fuzz_cluster.cluster.controller()
        try:
            reply = await ctl.peer(tail["node"]).ask("list_shards", control.Shards)
            mine = next(s for s in reply.shards if s.placement == PLACEMENT)
            return mine.stats.dropped
        finally:
            await ctl.close()

    def settled() -> int:
        # The agent's copy of a runner's stats is a second old at most.
        time.sleep(2.5)
        return asyncio.run(dropped())

    before = settled()
    free = [encode_ring_header(RingHeader(rid="not-a-request", kind="free")), b""]
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        make_client(push, keys.controller_keys(home), keys.node_public_key(home, tail["node"]))
        push.connect(fuzz_cluster.endpoint(tail, "data_port"))
        for _ in range(5):
            push.send_multipart(free)
        time.sleep(0.5)
    finally:
        ctx.destroy(linger=1000)
    # The controller's well-formed frames were dropped for their key, not their content
    # (a "free" of an unknown request is otherwise taken silently).
    assert settled() - before == 5


def test_fuzz_the_telemetry_reader(tmp_path: Path) -> None:
    """The controller reads telemetry from every agent's PUB: here one that lies."""
    home = tmp_path / "home"
    inv = local_inventory(1, base_octet=133, control_port=58600, home=home)
    node = inv.nodes[0]
    workdir = Path(node.workdir)
    keys.install_locally(workdir, keys.node_key_files(home, node.name, [node.name]))
    good = control.encode(
        control.Telemetry(
            name=node.name, time=1.0, version="9.9.9", memory_used=1, memory_total=2**30
        )
    )

    async def go() -> tuple[Controller, int]:
        from zmq.auth.asyncio import AsyncioAuthenticator

        ctx = zmq.asyncio.Context()
        auth = AsyncioAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=str(curve.authorized_dir(workdir)))
        pub = ctx.socket(zmq.PUB)
        make_server(pub, curve.load_keypair(curve.key_dir(workdir) / "self.key_secret"))
        pub.bind(node.telemetry_endpoint)
        ctl = Controller(home, inv)
        sent = 0
        try:
            ctl._start_telemetry()
            for _ in range(100):  # until the subscription has reached the PUB
                await pub.send_multipart([b"telemetry", good])
                await asyncio.sleep(0.05)
                if ctl.state.node(node.name).version == "9.9.9":
                    break
            assert ctl.state.node(node.name).version == "9.9.9"
            types = ["telemetry", "hello_reply", "error"]

            @FUZZ
            @given(st.one_of(raw_messages(types), telemetry_lies(node.name)))
            def collect(data: bytes) -> None:
                batch.append(data)

            batch: list[bytes] = []
            collect()
            for data in batch:
                await pub.send_multipart([b"telemetry", data])
                sent += 1
                if sent % 50 == 0:
                    await asyncio.sleep(0)  # let the reader keep up; PUB drops otherwise
            changed = control.encode(
                control.Telemetry(name=node.name, time=2.0, version="9.9.10", memory_total=2**31)
            )
            for _ in range(100):
                await pub.send_multipart([b"telemetry", changed])
                await asyncio.sleep(0.05)
                if ctl.state.node(node.name).version == "9.9.10":
                    break
            return ctl, sent
        finally:
            await ctl.close()
            pub.close(linger=0)
            auth.stop()
            ctx.term()

    ctl, sent = asyncio.run(go())
    assert sent >= EXAMPLES * 0.9
    # The reader lived through all of it: the last good message was applied.
    assert ctl.state.node(node.name).version == "9.9.10"


def telemetry_lies(name: str) -> st.SearchStrategy[bytes]:
    """Telemetry that is well formed on the outside and wrong inside."""
    return st.builds(
        lambda n, fields: msgspec.msgpack.encode(
            {"v": V, "type": "telemetry", "name": n, "time": 1.0, **fields}
        ),
        st.sampled_from([name, "nobody", ""]),
        st.dictionaries(
            st.sampled_from(
                [
                    "memory_used",
                    "memory_total",
                    "cpu_pct",
                    "facts",
                    "shards",
                    "version",
                    "gpu_pct",
                    "power_w",
                ]
            ),
            values,
            max_size=4,
        ),
    )


def test_fuzz_the_api(fuzz_cluster: Target) -> None:
    """Random JSON and mutated requests: a 4xx or a right answer, never a 5xx."""
    base = {"model": PLACEMENT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    leaves = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=12)
    json_values = st.recursive(
        leaves | st.floats(allow_nan=False),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=10,
    )
    mutated = st.builds(
        lambda k, v: {**base, k: v},
        st.sampled_from(["model", "messages", "max_tokens", "temperature", "top_p", "seed",
                         "stop", "stream", "n", "stream_options", "max_completion_tokens",
                         "top_k", "min_p", "xtc_probability", "xtc_threshold",
                         "repetition_penalty"]),
        json_values,
    )  # fmt: skip
    bodies = st.one_of(
        json_values.map(lambda v: json.dumps(v).encode()),
        mutated.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.builds(lambda b: b'{"model": "' + b, st.binary(max_size=16)),  # invalid UTF-8
    )
    statuses: list[int] = []

    async def go() -> None:
        ctl = fuzz_cluster.cluster.controller()
        server = None
        try:
            await ctl.refresh()
            server = await start_server(ctl, "127.0.0.1", 0)
            async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as http:
                batch: list[bytes] = []

                @settings(FUZZ, max_examples=API_EXAMPLES)
                @given(bodies)
                def collect(body: bytes) -> None:
                    batch.append(body)

                collect()
                for body in batch:
                    resp = await http.post("/chat/completions", content=body)
                    statuses.append(resp.status_code)
                    assert resp.status_code < 500, (body, resp.text)
                    if resp.status_code >= 400:
                        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        finally:
            if server is not None:
                await server.close()
            await ctl.close()

    with alongside(fuzz_cluster):
        asyncio.run(go())
    assert len(statuses) >= API_EXAMPLES * 0.9 and 400 in statuses
    still_serving(fuzz_cluster)
