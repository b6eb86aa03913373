"""Stages in-process (alone, or two as a ring) on a real model: steps built ahead, and
what happens to them when building fails or the answer ends before they are due."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer

from worker.shard import load_shard
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol.frames import RingHeader
from worker.stage import RequestError, Stage, fill_slot


class Loopback:
    """A one-stage ring: frames come straight back through the work queue."""

    def __init__(self, work: deque[Callable[[], None]]) -> None:
        self.work = work
        self.stage: Stage | None = None
        self.client: list[tuple[str, dict[str, Any]]] = []

    def to_next(self, header: RingHeader, activation: mx.array | None) -> None:
        payload = bytes(memoryview(activation)) if activation is not None else b""
        self.work.append(lambda: self.stage.on_frame(header, payload))  # type: ignore[union-attr]

    def to_head(self, header: RingHeader) -> None:
        self.work.append(lambda: self.stage.on_frame(header, b""))  # type: ignore[union-attr]

    def to_client(self, client: bytes, kind: str, **fields: Any) -> None:
        self.client.append((kind, fields))


def _fail_third_forward(shard: Any) -> Callable[..., mx.array]:
    """Make the shard's third forward pass fail as MLX does out of memory: 1 is the
    prompt's chunk, 2 the first decode step, 3 the next one, built ahead. Returns the
    original forward."""
    forward, calls = shard.forward, 0

    def failing_third_call(h: mx.array, cache: list[Any]) -> mx.array:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("[metal::malloc] out of memory")
        return forward(h, cache)

    shard.forward = failing_third_call
    return forward


def test_a_step_that_fails_to_build_ahead_fails_only_its_request(tmp_path: Path) -> None:
    spec = DemoSpec(layers=2, hidden=32, heads=2, kv_heads=1, dtype="float32")
    model = write_demo_model(tmp_path / "m", spec)
    shard = load_shard(model, 0, 2)
    work: deque[Callable[[], None]] = deque()
    links = Loopback(work)
    stage = Stage(shard, load_tokenizer(model), links, schedule=work.append)
    links.stage = stage
    _fail_third_forward(shard)
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    stage.submit(b"client", {"rid": "r1", "params": params, "tokens": [40, 41, 42]})
    while work:
        work.popleft()()

    kinds = [kind for kind, _ in links.client]
    assert kinds == ["accepted", "delta", "failed"], links.client
    assert "out of memory" in links.client[-1][1]["message"]
    assert not stage.caches and not stage.prebuilt and not stage.head_requests

    # The stage goes on serving: the next request runs to its end.
    stage.submit(b"client", {"rid": "r2", "params": params, "tokens": [40, 41, 42]})
    while work:
        work.popleft()()
    assert [k for k, _ in links.client[3:]] == ["accepted"] + ["delta"] * 8 + ["done"]


def _lone_stage(tmp_path: Path) -> tuple[Stage, Loopback, deque[Callable[[], None]]]:
    spec = DemoSpec(layers=2, hidden=32, heads=2, kv_heads=1, dtype="float32", recite=True)
    model = write_demo_model(tmp_path / "m", spec)
    work: deque[Callable[[], None]] = deque()
    links = Loopback(work)
    stage = Stage(load_shard(model, 0, 2), load_tokenizer(model), links, schedule=work.append)
    links.stage = stage
    return stage, links, work


def answer(links: Loopback, rid: str) -> tuple[str, str]:
    text = "".join(f["text"] for k, f in links.client if k == "delta" and f["rid"] == rid)
    done = [f for k, f in links.client if k == "done" and f["rid"] == rid]
    return text, done[0]["finish_reason"] if done else ""


def test_a_lone_stage_drops_the_step_it_built_ahead_when_the_answer_ends(
    tmp_path: Path,
) -> None:
    stage, links, work = _lone_stage(tmp_path)
    params: dict[str, Any] = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    stage.submit(b"c", {"rid": "whole", "params": params, "prompt": "Hello"})
    while work:
        work.popleft()()
    whole, finish = answer(links, "whole")
    assert finish == "length" and len(whole) > 40
    assert stage.stats.prebuilt >= 38  # every step after the first was built ahead
    stop = whole[len(whole) // 2 : len(whole) // 2 + 6]
    assert whole.index(stop) == len(whole) // 2, "pick a stop string seen once"

    stage.submit(b"c", {"rid": "cut", "params": {**params, "stop": [stop]}, "prompt": "Hello"})
    stage.submit(b"c", {"rid": "cancelled", "params": params, "prompt": "Hello"})
    for _ in range(12):
        work.popleft()()
    stage.cancel("cancelled")
    while work:
        work.popleft()()
    assert answer(links, "cut") == (whole[: len(whole) // 2], "stop")
    assert answer(links, "cancelled")[1] == "cancelled"
    # Both had a step built ahead when they ended: it went with the request.
    assert not stage.prebuilt and not stage.caches
    assert not stage.head_requests and not stage.tail_requests


class TwoStageRing:
    """Stages 0 and 1 of a ring in one process, frames passed through one work queue."""

    def __init__(self, model: Path, work: deque[Callable[[], None]]) -> None:
        self.work = work
        self.client: list[tuple[str, dict[str, Any]]] = []
        tok = load_tokenizer(model)
        self.head = Stage(load_shard(model, 0, 1), tok, self, schedule=work.append, hops=2)
        self.tail = Stage(load_shard(model, 1, 2), tok, self, schedule=work.append, hops=2)

    def to_next(self, header: RingHeader, activation: mx.array | None) -> None:
        payload = bytes(memoryview(activation)) if activation is not None else b""
        self.work.append(lambda: self.tail.on_frame(header, payload))

    def to_head(self, header: RingHeader) -> None:
        self.work.append(lambda: self.head.on_frame(header, b""))

    def to_client(self, client: bytes, kind: str, **fields: Any) -> None:
        self.client.append((kind, fields))


def test_a_ring_stage_builds_ahead_and_a_failed_build_ends_only_its_request(
    tmp_path: Path,
) -> None:
    model = write_demo_model(tmp_path / "m", DemoSpec(layers=2, hidden=32, heads=2, kv_heads=1))
    work: deque[Callable[[], None]] = deque()
    ring = TwoStageRing(model, work)
    forward = _fail_third_forward(ring.tail.shard)
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    ring.head.submit(b"c", {"rid": "r1", "params": params, "tokens": [40, 41, 42]})
    while work:
        work.popleft()()
    # The token whose step was computing when the build failed still arrives.
    assert [k for k, _ in ring.client] == ["accepted", "delta", "failed"], ring.client
    assert "out of memory" in ring.client[-1][1]["message"]
    for stage in (ring.head, ring.tail):
        assert not stage.caches and not stage.prebuilt and not stage.slots

    ring.tail.shard.forward = forward  # type: ignore[method-assign]
    before = ring.head.stats.prebuilt, ring.tail.stats.prebuilt
    ring.head.submit(b"c", {"rid": "r2", "params": params, "tokens": [40, 41, 42]})
    while work:
        work.popleft()()
    assert [k for k, _ in ring.client[3:]] == ["accepted"] + ["delta"] * 8 + ["done"]
    # Every step after the first ran on a graph built while the one before computed.
    after = ring.head.stats.prebuilt, ring.tail.stats.prebuilt
    assert (after[0] - before[0], after[1] - before[1]) == (7, 7)


def test_a_frame_of_another_dtype_is_refused_not_converted() -> None:
    slot = mx.zeros((1, 1, 4), dtype=mx.float16)
    mx.eval(slot)
    with pytest.raises(RequestError, match="frame holds uint16 x 4, the step expects float16"):
        fill_slot(slot, np.zeros(4, dtype=np.uint16))
    fill_slot(slot, np.arange(4, dtype=np.float16))
    assert slot.tolist() == [[[0.0, 1.0, 2.0, 3.0]]]
