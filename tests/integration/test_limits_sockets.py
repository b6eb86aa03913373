"""Sockets and ring frames are bounded: an oversized message is refused by ZeroMQ before
it is buffered, a ring frame that cannot be this model's is refused before anything is
allocated for it, and the process goes on serving."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import psutil
import pytest
import zmq
import zmq.asyncio
from mlx_lm.utils import load_tokenizer

from studiotui.cluster import keys
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.agent import LOG_BACKUPS, LOG_BYTES, log_handlers
from worker.shard import load_shard
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control, curve
from worker.shared.protocol.frames import RingHeader
from worker.shared.protocol.limits import (
    MAX_CONTROL_BYTES,
    MAX_LOG_LINES,
    MAX_LOG_TAIL_BYTES,
    ring_frame_limit,
)
from worker.stage import Stage


class TwoStageRing:
    def __init__(self, model: Path, work: deque[Callable[[], None]], context: int) -> None:
        self.work = work
        self.client: list[tuple[str, dict[str, Any]]] = []
        self.errors: list[RingHeader] = []
        tok = load_tokenizer(model)
        kw: dict[str, Any] = {"schedule": work.append, "hops": 2, "context_tokens": context}
        self.head = Stage(load_shard(model, 0, 1), tok, self, prefill_chunk=8, **kw)
        self.tail = Stage(load_shard(model, 1, 2), tok, self, prefill_chunk=8, **kw)

    def to_next(self, header: RingHeader, activation: mx.array | None) -> None:
        payload = bytes(memoryview(activation)) if activation is not None else b""
        self.work.append(lambda: self.tail.on_frame(header, payload))

    def to_head(self, header: RingHeader) -> None:
        if header.kind == "error":
            self.errors.append(header)
        self.work.append(lambda: self.head.on_frame(header, b""))

    def to_client(self, client: bytes, kind: str, **fields: Any) -> None:
        self.client.append((kind, fields))

    def run(self) -> None:
        while self.work:
            self.work.popleft()()


def frame(kind: str, shape: tuple[int, ...], offset: int = 0) -> tuple[RingHeader, bytes]:
    params = {"max_tokens": 4, "temperature": 0.0}
    header = RingHeader(
        rid=f"bad-{kind}-{shape}-{offset}",
        kind=kind,
        offset=offset,
        dtype="float32",
        shape=shape,
        params=params,
    )
    return header, np.zeros(shape, dtype=np.float32).tobytes()


def test_ring_frames_that_cannot_be_this_models_are_refused_before_allocation(
    tmp_path: Path,
) -> None:
    spec = DemoSpec(layers=2, hidden=32, heads=2, kv_heads=1, dtype="float32")
    model = write_demo_model(tmp_path / "m", spec)
    work: deque[Callable[[], None]] = deque()
    ring = TwoStageRing(model, work, context=64)
    bad = [
        (frame("prefill", (1, 4, 33)), "[1, tokens, 32]"),  # another model's width
        (frame("prefill", (4, 32)), "[1, tokens, 32]"),  # no batch axis
        (frame("prefill", (2, 4, 32)), "[1, tokens, 32]"),  # a batch of two
        (frame("prefill", (1, 9, 32)), "at most 8"),  # over the prefill chunk
        (frame("decode", (1, 2, 32)), "at most 1"),  # a decode step is one token
        (frame("prefill", (1, 8, 32), offset=60), "past the context of 64"),
    ]
    for (header, payload), words in bad:
        ring.tail.on_frame(header, payload)
        ring.run()
        assert not ring.tail.caches, words  # no KV cache was made for it
        # The refusal goes to the head as an error for that request, naming the problem.
        assert ring.errors[-1].rid == header.rid and words in ring.errors[-1].message
    assert ring.tail.stats.dropped == len(bad) == len(ring.errors)

    # The ring goes on serving: a real request runs to its end.
    params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    ring.head.submit(b"c", {"rid": "ok", "params": params, "tokens": [40, 41, 42, 43]})
    ring.run()
    kinds = [k for k, f in ring.client if f.get("rid") == "ok"]
    assert kinds == ["accepted"] + ["delta"] * 6 + ["done"]


def test_the_ring_limit_fits_a_prefill_chunk_of_the_widest_dtype() -> None:
    # A float32 chunk, with room for the CURVE box ZeroMQ measures instead of the payload.
    assert 512 * 8192 * 4 < ring_frame_limit(8192, 512) <= 512 * 8192 * 4 + 4096
    assert ring_frame_limit(32, 8) >= 64 * 1024  # a header with 16 long stop strings


# ---- a real agent --------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("sockets-home"), 1, 125, 58200)


def test_an_oversized_control_message_is_refused_unbuffered(one_agent: LocalCluster) -> None:
    node = one_agent.inventory.nodes[0]
    agent = psutil.Process(one_agent.pids[node.name])

    async def go() -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            curve.make_client(
                sock,
                keys.controller_keys(one_agent.home),
                keys.node_public_key(one_agent.home, node.name),
            )
            sock.connect(f"tcp://{node.address}:{node.control_port}")
            await sock.send(control.encode(control.Hello(id=1)))
            hello = control.decode(await asyncio.wait_for(sock.recv(), 10))
            assert isinstance(hello, control.HelloReply)
            before = agent.memory_info().rss
            for _ in range(4):
                await sock.send(b"\0" * (MAX_CONTROL_BYTES + 1024))
            # ZeroMQ dropped the connection on each before reading it whole, so the agent
            # never saw them (it would answer "bad message: over the limit"); the DEALER
            # reconnects and the agent answers as before.
            deadline = asyncio.get_running_loop().time() + 20
            while True:
                await sock.send(control.encode(control.Hello(id=2)))
                try:
                    reply = control.decode(await asyncio.wait_for(sock.recv(), 2))
                    break
                except TimeoutError:
                    assert asyncio.get_running_loop().time() < deadline
            assert isinstance(reply, control.HelloReply) and reply.re == 2, reply
            assert agent.memory_info().rss - before < MAX_CONTROL_BYTES
            assert agent.is_running()
        finally:
            sock.close(linger=0)
            ctx.term()

    asyncio.run(go())


# ---- the agent's log -----------------------------------------------------------------


def test_read_log_reads_a_bounded_tail_of_a_huge_log(one_agent: LocalCluster) -> None:
    node = one_agent.inventory.nodes[0]
    agent = psutil.Process(one_agent.pids[node.name])
    log = Path(node.workdir) / "agent.log"
    line = "x" * 200 + "\n"
    with open(log, "a") as f:
        for _ in range(40):  # 40 MB
            f.write(line * 5000)
        f.write("the last line\n")

    async def go() -> list[str]:
        ctl = one_agent.controller()
        try:
            before = agent.memory_info().rss
            lines = await ctl.read_log(node.name, lines=10**9)
            assert agent.memory_info().rss - before < 16 << 20
            return lines
        finally:
            await ctl.close()

    lines = asyncio.run(go())
    assert lines[-1] == "the last line"
    assert 0 < len(lines) <= MAX_LOG_LINES and sum(map(len, lines)) <= MAX_LOG_TAIL_BYTES


def test_the_agent_log_rotates(tmp_path: Path) -> None:
    handlers = log_handlers(tmp_path)
    logger = logging.getLogger("test-rotation")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    for h in handlers:
        logger.addHandler(h)
    try:
        for i in range((LOG_BYTES * 2) // 1000):
            logger.info("%06d %s", i, "y" * 990)
    finally:
        for h in handlers:
            logger.removeHandler(h)
            h.close()
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert {"agent.log", "agent.log.1"} <= set(sizes), sizes
    assert len(sizes) <= 1 + LOG_BACKUPS and max(sizes.values()) <= LOG_BYTES
