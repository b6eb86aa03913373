"""A tensor-parallel stage: one process per node, each holding a 1/N slice of the layers.

The ranks of a group compute one forward together: every sharded layer ends in an
`mx.distributed.all_sum` (mlx-lm's own `shard()` put it there), so every rank must
evaluate the same steps, on the same inputs, in the same order, or the all-reduces
pair up wrongly and the answer is garbage (or the group hangs).

How the followers learn what to compute: the leader (rank 0) is the stage as a
one-node stage is (its ZeroMQ ring and client sockets, its stage logic); every
follower runs the very same `Stage` code on the same sequence of work items, as
mlx-lm's own tensor parallel runs the same generate loop on every rank. Two kinds of
item make up that sequence:

* items the stage scheduled itself (the next prefill chunk, a one-stage ring's token
  looping back) are scheduled identically on every rank, since every rank ran the
  same items before: a follower runs its own, as far as the leader's *grant* (a count
  kept `WINDOW` items ahead, sent now and then) allows, without waiting for a word per
  item — a per-item message put the message's latency, and on two vCPUs a scheduler
  wake-up behind a busy-polling all-reduce, on every token;
* items from outside (a ring frame, a client's generate or cancel, a client gone) go
  to the followers over a CURVE PUSH on the bridge address, with the number of
  scheduled items the leader ran before it; the leader takes one only at a point no
  follower can have passed (`LeaderQueue`), and each follower runs it at that point.

So the followers run the leader's exact sequence and, the stage being a deterministic
function of it, the same MLX evaluations in the same order. Sampling is part of it:
the all-reduced logits are bit-identical on every rank (a ring all-reduce sums each
chunk once and broadcasts it), so each rank's sampler, seeded by the request, draws
the same token (mlx-lm relies on the same). Followers send nothing to the ring or to
clients: they have no such sockets.

Why not send the arrays over `mx.distributed` itself: a `send`/`recv` pair is a
graph op that blocks both processes until evaluated, and the leader's next input is
known only when it arrives on a socket; a PUSH lets the leader go on at once and the
follower block in its own `recv`, which the all-reduces already pace.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import zmq

from worker.group import Backend, GroupError, join
from worker.shared.protocol import curve

GRANT = b"n"
RING = b"r"
GENERATE = b"g"
CANCEL = b"c"
KINDS = (GRANT, RING, GENERATE, CANCEL)
# How many of its own scheduled items a follower may run ahead of the leader's word.
# Enough that the grant is always there before the follower needs it (it travels while
# the group computes), few enough that an outside item waits only that many items.
WINDOW = 8
# Messages the leader may be ahead of a follower by. Past it a send blocks the leader,
# which the all-reduces would make it wait for anyway.
MIRROR_HWM = 100_000


class MirrorError(RuntimeError):
    pass


@dataclass
class Outside:
    """A work item that came from outside the stage, with the frames a follower needs
    to make the same job."""

    job: Callable[[], None]
    event: list[bytes | memoryview]

    def __call__(self) -> None:
        self.job()


class Mirror:
    """The leader's side: one CURVE PUSH per follower."""

    def __init__(
        self, ctx: zmq.Context, keys: curve.CurveKeys, followers: Sequence[Sequence[str]]
    ) -> None:
        self.socks: list[zmq.Socket] = []
        for endpoint, key in followers:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, MIRROR_HWM)
            curve.make_client(sock, keys, key.encode())
            sock.connect(endpoint)
            self.socks.append(sock)

    def send(self, frames: Sequence[bytes | memoryview]) -> None:
        for sock in self.socks:
            sock.send_multipart(frames, copy=False)

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)


class LeaderQueue:
    """The leader's work queue, which decides where outside items fall in the order.

    Items its stage scheduled ("inside": the next prefill chunk, a one-stage ring's token
    coming back) are scheduled identically on every rank, so followers run theirs on
    their own, up to a *grant*: the count of inside items they may have run, which the
    leader keeps `WINDOW` ahead of its own count. An outside item (a ring frame, a
    client's generate or cancel) runs only at a point no follower can have passed: once
    the leader's count reaches the grant (it stops raising it while one waits), or when
    nothing inside is left (then no follower has anything left either); it goes to the
    followers with that count, and they run it there."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror
        self.inside: deque[Callable[[], None]] = deque()
        self.outside: deque[Outside] = deque()
        self.ran = 0  # inside items run
        self.granted = 0

    def append(self, item: Callable[[], None]) -> None:
        (self.outside if isinstance(item, Outside) else self.inside).append(item)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.inside) + len(self.outside)

    def popleft(self) -> Callable[[], None]:
        if self.outside and (self.ran >= self.granted or not self.inside):
            item = self.outside.popleft()
            kind, *rest = item.event
            self.mirror.send([kind, str(self.ran).encode(), *rest])
            return item
        if not self.inside:
            raise IndexError("pop from an empty work queue")
        self.ran += 1
        if not self.outside and self.granted - self.ran < WINDOW // 2:
            self.granted = self.ran + WINDOW
            self.mirror.send([GRANT, str(self.granted).encode()])
        return self.inside.popleft()


class FollowerQueue:
    """A follower's side: its stage schedules into `inside`; the leader's messages say how
    far it may run those (grants) and where each outside item falls."""

    def __init__(self) -> None:
        self.inside: deque[Callable[[], None]] = deque()
        self.outside: deque[tuple[int, list[bytes]]] = deque()
        self.ran = 0
        self.granted = 0

    def append(self, item: Callable[[], None]) -> None:
        self.inside.append(item)

    def __len__(self) -> int:
        return len(self.inside)

    def hear(self, frames: list[bytes]) -> None:
        kind = check_event(frames)
        at = _count(frames[1])
        if kind == GRANT:
            self.granted = max(self.granted, at)
        else:
            self.outside.append((at, [kind, *frames[2:]]))

    def next(self) -> tuple[str, Any] | None:
        """("outside", frames) or ("inside", job) to run now, or None to wait for word."""
        if self.outside:
            at = self.outside[0][0]
            if at < self.ran:
                # Out of step with the leader: every all-reduce from here would pair wrongly.
                raise MirrorError(
                    f"the leader ran an outside item after {at} scheduled items; "
                    f"this follower has run {self.ran}"
                )
            if at == self.ran:
                return "outside", self.outside.popleft()[1]
        if self.inside and self.ran < self.granted:
            self.ran += 1
            return "inside", self.inside.popleft()
        return None


def _count(raw: bytes) -> int:
    try:
        return int(raw)
    except ValueError:
        raise MirrorError(f"not a count: {raw[:20]!r}") from None


def lost_member(message: str) -> bool:
    """Whether a step failed because the group's `mx.distributed` link broke (a member
    died): MLX's backends raise "[ring] ..." / "[jaccl] ..." from the all-reduce."""
    return "[ring]" in message or "[jaccl]" in message


def check_event(frames: Sequence[bytes]) -> bytes:
    """The kind of a leader's message, or MirrorError for frames no leader sends."""
    if not frames or frames[0] not in KINDS:
        raise MirrorError(f"not a mirrored work item: {[bytes(f[:8]) for f in frames[:3]]}")
    want = {GRANT: 2, RING: 4, GENERATE: 3, CANCEL: 3}[frames[0]]
    if len(frames) != want:
        raise MirrorError(f"a {frames[0]!r} item has {len(frames)} frames, not {want}")
    return frames[0]


def join_group(backend: str, rank: int, size: int, env: Mapping[str, str] | None = None) -> Any:
    """Join the stage's `mx.distributed` group (the agent set the environment MLX reads)."""
    env = os.environ if env is None else env
    if backend not in ("ring", "jaccl"):
        raise GroupError(f"unknown backend {backend!r} for a tensor group")
    chosen: Backend = "ring" if backend == "ring" else "jaccl"
    group = join(chosen, env)
    if group.rank() != rank or group.size() != size:
        raise GroupError(
            f"joined as rank {group.rank()} of {group.size()}, expected {rank} of {size}"
        )
    # The first all-reduce sets the ring's connections up: do it now, not on the first
    # token, so a member that cannot reach the others fails the load, with its reason.
    mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group))
    return group
