"""Measuring this node's links to others, the way the ring moves activations: pings over
the control socket for latency, a stream of large CURVE PUSH messages to a PULL the peer
opens (open_sink / close_sink) for bandwidth."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from worker.agent.host import Ask, Host, Route, route
from worker.shared.protocol import control, curve
from worker.shared.protocol.control import Message, encode
from worker.shared.protocol.limits import LINK_MEASURE_BOUNDS, out_of_bounds
from worker.shared.protocol.messages import CodedError, MessageError

R = TypeVar("R", bound=Message)

LINK_PINGS = 21
# Bandwidth the way the ring moves activations: CURVE PUSH -> PULL, several large
# messages in flight (the PUSH queues up to LINK_IN_FLIGHT while one is on the wire),
# for a short while, timed at the receiver from the first message to the last.
LINK_CHUNK_BYTES = 4 << 20
LINK_IN_FLIGHT = 4
LINK_BULK_SECONDS = 0.3
LINK_BULK_MAX_BYTES = 1 << 30
LINK_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class LinkSizes:
    """How `measure_links` measures: pings (and their padding), and the bulk stream."""

    pings: int = LINK_PINGS
    pad_bytes: int = 0
    bulk_seconds: float = LINK_BULK_SECONDS
    chunk_bytes: int = LINK_CHUNK_BYTES
    in_flight: int = LINK_IN_FLIGHT


def link_sizes(asked: control.LinkSizes) -> LinkSizes:
    """The sizes a `measure_links` request asks for, the defaults for the rest; a size
    out of its bounds (limits.LINK_MEASURE_BOUNDS) is refused, naming it (its type and
    an unknown one were checked when the message was decoded)."""
    given = {k: v for k, v in msgspec.structs.asdict(asked).items() if v is not None}
    problem = out_of_bounds(given, LINK_MEASURE_BOUNDS)
    if problem:
        raise ValueError(f"link measurement: {problem}")
    return dataclasses.replace(LinkSizes(), **given)


class AgentLinkError(RuntimeError):
    """A peer refused a link-measurement step."""


class Links:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.sinks: dict[str, asyncio.Task[control.SinkResult]] = {}

    def routes(self) -> Iterable[Route]:
        return (
            route(control.MeasureLinks, self.measure_links),
            route(control.PingPeer, self.ping_peer),
            route(control.OpenSink, self.open_sink),
            route(control.CloseSink, self.close_sink),
        )

    async def ping_peer(self, ask: Ask, req: control.PingPeer) -> None:
        # An activation-sized ping is sent back whole, so its round trip carries it both ways.
        await ask.answer(control.Pong(pad=req.pad if req.echo else b""))

    async def measure_links(self, ask: Ask, req: control.MeasureLinks) -> None:
        try:
            sizes = link_sizes(req.sizes)
        except ValueError as exc:
            raise CodedError("bad_request", str(exc)) from None
        results = [await self.measure(peer, sizes) for peer in req.peers]
        await ask.answer(control.Links(links=results))

    async def measure(self, peer: control.LinkPeer, sizes: LinkSizes) -> control.LinkResult:
        """Latency from small pings over the control socket; bandwidth from a
        stream of large messages over a CURVE PUSH to a PULL the peer opens."""
        keys = self.host.config.keys()
        server_key = peer.key.encode()
        sock = self.host.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        curve.make_client(sock, keys, server_key)
        sock.connect(peer.endpoint)
        out: dict[str, Any] = {"kind": self.host.facts.get("link_kind", "unknown")}
        try:
            rtts = [await _ping(sock, i, b"") for i in range(sizes.pings)]
            # The first ping makes the connection (CURVE handshake): not a latency.
            out["latency_us"] = statistics.median(rtts[1:]) / 2 * 1e6
            out["latency_p90_us"] = _quantile(rtts[1:], 0.9) / 2 * 1e6
            if sizes.pad_bytes:
                pad = bytes(sizes.pad_bytes)
                padded = [await _ping(sock, i, pad) for i in range(sizes.pings)]
                out["latency_pad_us"] = statistics.median(padded[1:]) / 2 * 1e6
                out["pad_bytes"] = sizes.pad_bytes
            token = os.urandom(8).hex()
            asked = control.OpenSink(token=token, in_flight=sizes.in_flight)
            opened = await _ask(sock, asked, control.SinkOpen)
            host = peer.endpoint.rsplit(":", 1)[0]
            sent = await self.stream(keys, server_key, f"{host}:{opened.port}", sizes)
            closing = control.CloseSink(token=token)
            got = await _ask(sock, closing, control.SinkResult, timeout=2 * LINK_TIMEOUT_S)
            if got.seconds > 0 and got.bytes > 0:
                out["gbps"] = got.bytes * 8 / got.seconds / 1e9
            out.update(
                method="curve push-pull",
                chunk_bytes=sizes.chunk_bytes,
                in_flight=sizes.in_flight,
                sent_bytes=sent,
                received_bytes=got.bytes,
                seconds=got.seconds,
            )
        except TimeoutError:
            out["error"] = f"{peer.name} did not answer in time"
        except (AgentLinkError, zmq.ZMQError, MessageError) as exc:
            out["error"] = f"{peer.name}: {exc}"
        finally:
            sock.close(linger=0)
        return control.LinkResult(peer=peer.name, **out)

    async def stream(
        self, keys: curve.CurveKeys, server_key: bytes, endpoint: str, sizes: LinkSizes
    ) -> int:
        push = self.host.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        curve.make_client(push, keys, server_key)
        # After make_client, which sets the usual high-water marks: set before it, this
        # one was overwritten and the whole 1 GiB cap was queued at once (the stream then
        # lasted ~3 s here, whatever bulk_seconds said).
        push.setsockopt(zmq.SNDHWM, sizes.in_flight)
        payload = bytes(sizes.chunk_bytes)
        sent = 0
        try:
            push.connect(endpoint)
            # A small message first: a large first message on a new CURVE pipe to an
            # asyncio PULL stalled here (4 MiB hung, 64 KiB did not; seen with pyzmq's
            # asyncio sockets), and the receiver starts its clock at the first data.
            await asyncio.wait_for(push.send_multipart([b"warm"]), LINK_TIMEOUT_S)
            began = time.perf_counter()
            while time.perf_counter() - began < sizes.bulk_seconds and sent < LINK_BULK_MAX_BYTES:
                # copy=False: zero-copy, as the runner sends large activations.
                await asyncio.wait_for(
                    push.send_multipart([b"data", payload], copy=False), LINK_TIMEOUT_S
                )
                sent += len(payload)
            await asyncio.wait_for(push.send_multipart([b"end"]), LINK_TIMEOUT_S)
        finally:
            push.close(linger=int(LINK_TIMEOUT_S * 1000))
        return sent

    async def open_sink(self, ask: Ask, req: control.OpenSink) -> None:
        token = req.token
        try:
            in_flight = link_sizes(control.LinkSizes(in_flight=req.in_flight)).in_flight
        except ValueError as exc:
            raise CodedError("bad_request", str(exc)) from None
        sink = self.host.ctx.socket(zmq.PULL)
        sink.setsockopt(zmq.LINGER, 0)
        curve.make_server(sink, self.host.config.keys())
        sink.setsockopt(zmq.RCVHWM, in_flight)  # after make_server, which sets its own
        sink.bind(f"tcp://{self.host.config.address}:*")
        port = int(sink.get_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        task = self.sinks[token] = asyncio.create_task(_drain(sink))
        # A measurer that never comes back for its result must not leave it here.
        task.add_done_callback(
            lambda _: asyncio.get_running_loop().call_later(
                LINK_TIMEOUT_S * 4, self.sinks.pop, token, None
            )
        )
        await ask.answer(control.SinkOpen(port=port))

    async def close_sink(self, ask: Ask, req: control.CloseSink) -> None:
        task = self.sinks.pop(req.token, None)
        if task is None:
            raise CodedError("not_found", "no such link sink")
        await ask.answer(await task)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _ask(
    sock: zmq.asyncio.Socket, msg: Message, reply: type[R], timeout: float = LINK_TIMEOUT_S
) -> R:
    await sock.send(encode(msg))
    got = control.decode(await asyncio.wait_for(sock.recv(), timeout))
    if isinstance(got, control.Error):
        raise AgentLinkError(got.message)
    if not isinstance(got, reply):
        raise AgentLinkError(f"answered {got.kind}, not {reply.__struct_config__.tag}")
    return got


async def _drain(sink: zmq.asyncio.Socket) -> control.SinkResult:
    """Receive a measurement stream until its end marker (or silence); the bytes
    after the first message over the time from the first to the last."""
    first = last = 0.0
    count = received = 0
    try:
        # poll, not wait_for around recv: a cancelled recv can lose a message.
        while await sink.poll(int(LINK_TIMEOUT_S * 1000)):  # POLLIN, the default
            frames = await sink.recv_multipart(copy=False)
            if frames[0].bytes == b"warm":
                continue
            if frames[0].bytes != b"data":
                break
            now = time.perf_counter()
            if count:
                received += len(frames[1])
            else:
                first = now
            last, count = now, count + 1
    finally:
        sink.close(linger=0)
    return control.SinkResult(bytes=received, seconds=last - first, messages=count)


async def _ping(sock: zmq.asyncio.Socket, n: int, pad: bytes) -> float:
    began = time.perf_counter()
    await sock.send(encode(control.PingPeer(id=n, pad=pad, echo=bool(pad))))
    await asyncio.wait_for(sock.recv(), LINK_TIMEOUT_S)
    return time.perf_counter() - began
