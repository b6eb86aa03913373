"""The wire: validation of every message, CURVE on every socket, bad frames dropped."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import typing
from pathlib import Path

import msgspec
import pytest
import zmq

from studiotui.cluster import keys
from studiotui.cluster.controller import Controller
from tests.integration.test_engine import collect, place, prompt_tokens
from tests.support.cluster_fixture import LocalCluster
from worker.shared.protocol import (
    PROTOCOL_VERSION,
    FrameError,
    MessageError,
    RingHeader,
    build,
    control,
    decode,
    decode_ring_header,
    encode_ring_header,
)
from worker.shared.protocol.curve import CurveKeys, load_keypair, make_client


def encode(kind: str, **fields: object) -> bytes:
    """A message as its sender builds it (checked, then encoded)."""
    return control.encode(build(kind, **fields))


def raw(**fields: object) -> bytes:
    """A map sent as it is: what a broken or hostile peer may send."""
    return msgspec.msgpack.encode({"v": PROTOCOL_VERSION, **fields})


def test_messages_round_trip_and_refuse_bad_ones() -> None:
    msg = decode(encode("generate", rid="r1", params={"max_tokens": 3}, prompt="hi"))
    assert isinstance(msg, control.Generate) and msg.rid == "r1" and msg.prompt == "hi"
    bad = {
        b"\xc1": "not a msgpack message",
        msgspec.msgpack.encode([1, 2]): "expected a map",
        raw(type="hello", v=99): "protocol version 99",
        raw(type="bogus"): "unknown message type 'bogus'",
        raw(type="cancel"): "cancel: Object missing required field `rid`",
        raw(type="cancel", rid=5): "cancel: Expected `str`, got `int` - at `\\$.rid`",
        raw(type="cancel", rid=True): "Expected `str`, got `bool`",
    }
    for data, expected in bad.items():
        with pytest.raises(MessageError, match=expected):
            decode(data)


def test_a_message_is_a_map_its_type_tags_and_an_unknown_field_is_ignored() -> None:
    """The bytes: a msgpack map with the type, the version, the request's id; a newer
    peer's extra field is read past."""
    data = encode("cancel", rid="r2", id=4)
    assert msgspec.msgpack.decode(data) == {
        "type": "cancel",
        "v": PROTOCOL_VERSION,
        "id": 4,
        "re": None,
        "rid": "r2",
    }
    later = decode(raw(type="cancel", rid="r3", id=5, priority="high"))
    assert later == control.Cancel(rid="r3", id=5)


def test_a_bad_message_names_the_request_it_answers() -> None:
    """A malformed request that carried an id is answered to that id (`re`), so its
    sender fails at once instead of waiting out its timeout."""
    with pytest.raises(MessageError) as err:
        decode(raw(type="unload", id=17))
    assert err.value.re == 17
    with pytest.raises(MessageError, match="protocol version 1 is not") as old:
        decode(raw(type="hello", v=1, id="a"))
    assert old.value.re == "a"


def test_every_message_type_round_trips() -> None:
    """Each struct of the union, built with its required fields, comes back equal."""
    for kind, cls in control.BY_KIND.items():
        msg = build(kind, **_required(cls))
        assert decode(control.encode(msg)) == msg, kind


def _required(cls: type) -> dict[str, object]:
    return {f.name: _sample(f.type) for f in msgspec.structs.fields(cls) if f.required}


def _sample(t: object) -> object:
    """A value of type `t` (the few kinds a message's required field has)."""
    plain: dict[object, object] = {str: "x", int: 1, float: 0.5, bool: True, bytes: b"x"}
    if t in plain:
        return plain[t]
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Literal:
        return args[0]
    if origin is list:
        return [_sample(args[0])]
    if origin is tuple:
        return tuple(_sample(a) for a in args)
    if origin is dict:
        return {"k": 1}
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        return _required(t)
    if dataclasses.is_dataclass(t):  # a FileId
        return {k: _sample(v) for k, v in typing.get_type_hints(t).items()}
    raise AssertionError(f"no sample for {t!r}")


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
        decode_ring_header(RING_MAP, 0)
    with pytest.raises(FrameError, match="not msgpack"):
        decode_ring_header(b"\xc1", 0)


# A ring header of a kind no stage knows.
RING_MAP = encode_ring_header(RingHeader(rid="c", kind="explode"))


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
        assert isinstance(decode(friend.recv()), control.HelloReply)
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
            raw(type="bogus"),
            raw(type="unload"),
            encode("generate", rid="x", params={}),
            # well-formed envelopes whose fields are of the wrong type
            raw(type="read_log", lines="all"),
            raw(type="measure_links", peers=[{"name": "b"}]),
            raw(type="start_job", job="j", job_kind="finetune", rank=0, size=1, spec=[1]),
            raw(type="job_ports", count="2"),
        ):
            sock.send(data)
            assert sock.poll(5000), f"no answer to {data!r}"
            replies.append(decode(sock.recv()))
        assert all(isinstance(r, control.Error) for r in replies), replies
        errors = [r for r in replies if isinstance(r, control.Error)]
        # The code says which kind of refusal; the words say what to change.
        assert [e.code for e in errors] == ["bad_request"] * 3 + ["unknown_request"] + [
            "bad_request"
        ] * 4
        assert "unknown message type 'bogus'" in errors[1].message
        assert "missing required field `placement`" in errors[2].message
        assert "generate is not for an agent" in errors[3].message
        assert "read_log: Expected `int`, got `str` - at `$.lines`" in errors[4].message
        assert "measure_links: Object missing required field" in errors[5].message
        assert "`$.peers[0]`" in errors[5].message
        assert "start_job: Expected `object`, got `array` - at `$.spec`" in errors[6].message
        assert "job_ports: Expected `int`, got `str` - at `$.count`" in errors[7].message
        sock.send(encode("hello", id=7))
        assert sock.poll(5000)
        assert decode(sock.recv()).re == 7
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
                reply = await ctl.peer(tail.node).ask("list_shards", control.Shards)
                stats = next(s.stats for s in reply.shards if s.placement == "wire")
                dropped = stats.dropped + stats.errors
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
            [encode_ring_header(RingHeader(rid="y", kind="nonsense")), b""],
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
