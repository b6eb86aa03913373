"""The stages of one placement in one process, frames crossing a work queue as bytes.

Shared by the family matrix (tests/integration/test_families.py) and the batching tests
(tests/integration/test_batching.py): both drive real `Stage`s over real shards with no
sockets, so a difference from mlx-lm is the engine's, not the wire's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import load_tokenizer

from worker.shard import load_shard
from worker.shared.protocol.frames import RingHeader
from worker.stage import Stage

CHUNK = 8


class InProcessRing:
    """N stages in one process; `stage_options` go to every Stage (streams, batch, ...),
    `shard_options` to every load_shard (kv_bits, kv_group_size)."""

    def __init__(
        self,
        model: Path,
        ranges: list[tuple[int, int]],
        shard_options: dict[str, Any] | None = None,
        **stage_options: Any,
    ) -> None:
        self._build([model] * len(ranges), ranges, stage_options, shard_options or {})

    @classmethod
    def from_parts(
        cls, parts: list[Path], ranges: list[tuple[int, int]], **stage_options: Any
    ) -> Any:
        """A ring whose shard i loads from directory parts[i]."""
        ring = cls.__new__(cls)
        ring._build(parts, ranges, stage_options, {})
        return ring

    def _build(
        self,
        parts: list[Path],
        ranges: list[tuple[int, int]],
        options: dict[str, Any],
        shard_options: dict[str, Any],
    ) -> None:
        self.work: deque[Callable[[], None]] = deque()
        self.client: list[tuple[str, dict[str, Any]]] = []
        tok = load_tokenizer(parts[0])
        self.stages = [
            Stage(
                load_shard(part, a, b, **shard_options),
                tok,
                Links(self, i),
                schedule=self.work.append,
                prefill_chunk=CHUNK,
                hops=len(ranges),
                **options,
            )
            for i, (part, (a, b)) in enumerate(zip(parts, ranges, strict=True))
        ]

    def drain(self, steps: int | None = None) -> None:
        done = 0
        while self.work and (steps is None or done < steps):
            self.work.popleft()()
            done += 1

    def tokens(self, rid: str) -> list[int]:
        return [t for k, f in self.client if k == "delta" and f["rid"] == rid for t in f["tokens"]]


class Links:
    def __init__(self, ring: InProcessRing, index: int) -> None:
        self.ring, self.index = ring, index

    def to_next(self, header: RingHeader, activation: mx.array | None) -> None:
        payload = bytes(memoryview(activation)) if activation is not None else b""
        nxt = self.ring.stages[self.index + 1]
        self.ring.work.append(lambda: nxt.on_frame(header, payload))

    def to_head(self, header: RingHeader) -> None:
        head = self.ring.stages[0]
        self.ring.work.append(lambda: head.on_frame(header, b""))

    def to_client(self, client: bytes, kind: str, **fields: Any) -> None:
        self.ring.client.append((kind, fields))
