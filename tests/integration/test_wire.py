"""The wire: validation of every message, CURVE on every socket, bad frames dropped."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from studiotui.cluster import keys
from studiotui.cluster.controller import Controller
from tests.integration.test_engine import collect, place, prompt_tokens
from tests.support.cluster_fixture import LocalCluster
from worker.shared.protocol import (
    FrameError,
    MessageError,
    RingHeader,
    decode,
    decode_ring_header,
    encode,
    encode_ring_header,
)
from worker.shared.protocol.curve import CurveKeys, load_keypair, make_client


def test_messages_round_trip_and_refuse_bad_ones() -> None:
    msg = decode(encode("generate", rid="r1", params={"max_tokens": 3}, prompt="hi"))
    assert msg["rid"] == "r1" and msg["prompt"] == "hi"
    bad = {
        b"\xc1": "not a msgpack message",
        msgpack.packb([1, 2]): "expected a map",
        msgpack.packb({"v": 99, "type": "hello"}): "protocol version 99",
        msgpack.packb({"v": 1, "type": "bogus"}): "unknown message type 'bogus'",
        msgpack.packb({"v": 1, "type": "cancel"}): "missing field 'rid'",
        msgpack.packb({"v": 1, "type": "cancel", "rid": 5}): "field 'rid' should be str",
    }
    for data, expected in bad.items():
        with pytest.raises(MessageError, match=expected):
            decode(data)


def test_a_failed_pack_leaves_nothing_behind_for_the_next_message() -> None:
    # The packer is reused across messages: a failure half way must not leak bytes.
    with pytest.raises(TypeError):
        encode("cancel", rid="r1", junk=object())
    assert encode("cancel", rid="r2") == msgpack.packb({"v": 1, "type": "cancel", "rid": "r2"})


def test_ring_headers_check_payload_against_shape_and_dtype() -> None:
    h = RingHeader(rid="a", kind="decode", offset=3, dtype="bfloat16", shape=(1, 1, 8))
    assert decode_ring_header(encode_ring_header(h), 16) == h
    with pytest.raises(FrameError, match="payload has 15 bytes") as err:
        decode_ring_header(encode_ring_header(h), 15)
    assert err.value.rid == "a"
    wrong_dtype = RingHeader(rid="b", kind="decode", dtype="int64", shape=(1,))
    with pytest.raises(FrameError, match="dtype 'int64'"):
        decode_ring_header(encode_ring_header(wrong_dtype), 8)
    with pytest.raises(FrameError, match="unknown ring message kind"):
        decode_ring_header(msgpack.packb({"rid": "c", "kind": "explode"}), 0)
    with pytest.raises(FrameError, match="not msgpack"):
        decode_ring_header(b"\xc1", 0)


def _node_keys(cluster: LocalCluster, node: str) -> CurveKeys:
    return load_keypair(cluster.home / "keys" / "nodes" / f"{node}.key_secret")


def _silent(sock: zmq.Socket, seconds: float) -> bool:
    return sock.poll(int(seconds * 1000)) == 0


def test_peers_without_the_key_get_nothing(engine_cluster: LocalCluster) -> None:
    node = engine_cluster.inventory.nodes[0]
    server_key = keys.node_public_key(engine_cluster.home, node.name)
    ctx = zmq.Context()
    try:
        stranger = ctx.socket(zmq.DEALER)
        public, secret = zmq.curve_keypair()
        make_client(stranger, CurveKeys(public, secret), server_key)
        stranger.connect(node.control_endpoint)
        stranger.send(encode("hello", id=1))
        plain = ctx.socket(zmq.DEALER)
        plain.connect(node.control_endpoint)
        plain.send(encode("hello", id=1))
        assert _silent(stranger, 1.5), "an unauthorized key must get no answer"
        assert _silent(plain, 0.5), "a client without CURVE must get no answer"
        # The agent's own cluster key still works.
        friend = ctx.socket(zmq.DEALER)
        make_client(friend, keys.controller_keys(engine_cluster.home), server_key)
        friend.connect(node.control_endpoint)
        friend.send(encode("hello", id=1))
        assert friend.poll(5000), "the controller's key must be answered"
        assert decode(friend.recv())["type"] == "hello_reply"
    finally:
        ctx.destroy(linger=0)


def test_agent_answers_bad_messages_and_keeps_serving(engine_cluster: LocalCluster) -> None:
    node = engine_cluster.inventory.nodes[1]
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        make_client(
            sock,
            keys.controller_keys(engine_cluster.home),
            keys.node_public_key(engine_cluster.home, node.name),
        )
        sock.connect(node.control_endpoint)
        replies = []
        for data in (
            b"\x00garbage",
            msgpack.packb({"v": 1, "type": "bogus"}),
            msgpack.packb({"v": 1, "type": "unload"}),
            encode("generate", rid="x", params={}),
            # well-formed envelopes whose fields are of the wrong type (control.parse)
            encode("read_log", lines="all"),
            encode("measure_links", peers=[{"name": "b"}]),
            encode("start_job", job="j", job_kind="finetune", rank=0, size=1, spec=[1]),
            encode("job_ports", count="2"),
        ):
            sock.send(data)
            assert sock.poll(5000), f"no answer to {data!r}"
            replies.append(decode(sock.recv()))
        assert [r["type"] for r in replies] == ["error"] * 8
        assert "unknown message type 'bogus'" in replies[1]["message"]
        assert "missing field 'placement'" in replies[2]["message"]
        assert "not for an agent" in replies[3]["message"]
        assert "read_log: Expected `int`, got `str` - at `$.lines`" in replies[4]["message"]
        assert "measure_links: Object missing required field" in replies[5]["message"]
        assert "`$.peers[0]`" in replies[5]["message"]
        assert "start_job: Expected `object`, got `array` - at `$.spec`" in replies[6]["message"]
        assert "job_ports: Expected `int`, got `str` - at `$.count`" in replies[7]["message"]
        sock.send(encode("hello", id=7))
        assert sock.poll(5000)
        assert decode(sock.recv())["re"] == 7
    finally:
        ctx.destroy(linger=0)


def test_malformed_frames_are_dropped_and_requests_in_flight_finish(
    engine_cluster: LocalCluster, family_models: dict[str, Path]
) -> None:
    model = family_models["qwen3"]
    tokens = prompt_tokens(model)

    async def run() -> tuple[list[int], list[int], int]:
        ctl: Controller = engine_cluster.controller()
        try:
            names = list(engine_cluster.inventory.names[:2])
            await place(ctl, model, names, "wire")
            alone, _, _ = await collect(ctl, "wire", tokens, 48)
            tail = ctl.state.placement("wire").shards[-1]
            spec = engine_cluster.inventory.node(tail.node)
            task = asyncio.create_task(collect(ctl, "wire", tokens, 48))
            await asyncio.sleep(0.2)
            await asyncio.to_thread(
                _send_garbage, engine_cluster, names[0], spec.address, tail.data_port, tail.node
            )
            during, _, _ = await task
            dropped = 0
            for _ in range(20):
                await asyncio.sleep(0.3)
                await ctl.refresh()
                reply = await ctl.peer(tail.node).request("list_shards")
                stats = next(s["stats"] for s in reply["shards"] if s["placement"] == "wire")
                dropped = int(stats.get("dropped", 0)) + int(stats.get("errors", 0))
                if dropped >= 4:
                    break
            await ctl.unload("wire")
            return alone, during, dropped
        finally:
            await ctl.close()

    alone, during, dropped = asyncio.run(run())
    assert during == alone
    assert dropped >= 4


def _send_garbage(cluster: LocalCluster, as_node: str, address: str, port: int, to: str) -> None:
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        make_client(push, _node_keys(cluster, as_node), keys.node_public_key(cluster.home, to))
        push.connect(f"tcp://{address}:{port}")
        lying = RingHeader(
            rid="intruder", kind="decode", offset=0, dtype="float32", shape=(1, 1, 64)
        )
        for frames in (
            [b"only one frame"],
            [b"\xc1not msgpack", b""],
            [encode_ring_header(lying), b"\x00" * 12],  # 12 bytes, header says 256
            [msgpack.packb({"rid": "y", "kind": "nonsense"}), b""],
            [b"a", b"b", b"c"],
        ):
            push.send_multipart(frames)
        time.sleep(0.5)
    finally:
        ctx.destroy(linger=0)


def test_agents_measure_their_links(engine_cluster: LocalCluster) -> None:
    async def run() -> list:
        ctl = engine_cluster.controller()
        try:
            await ctl.refresh()
            return list(await ctl.measure_links())
        finally:
            await ctl.close()

    links = asyncio.run(run())
    # The measurement is kept: a new controller (a restarted TUI) starts with it.
    fresh = engine_cluster.controller()
    assert fresh.state.links == tuple(links)
    asyncio.run(fresh.close())
    names = engine_cluster.inventory.names
    assert {frozenset((x.a, x.b)) for x in links} == {
        frozenset((a, b)) for i, a in enumerate(names) for b in names[i + 1 :]
    }
    for link in links:
        assert link.kind == "loopback"
        assert link.latency_us is not None and 0 < link.latency_us < 100_000
        assert link.gbps is not None and link.gbps > 0.01
