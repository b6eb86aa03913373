"""A shard's process: loads its layers, binds its sockets, serves the ring.

Started by the agent (`python -m worker.runner SPEC.json`), one per loaded shard,
so an MLX crash or out-of-memory kills this process and not the agent. It talks
to the agent through JSON lines on stdout (progress, ready, stats) and is stopped
with SIGTERM.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from worker import speculation
from worker.group import GroupError
from worker.shard import ShardLoadError, load_shard, read_config
from worker.shared.manifest import model_digest, unhashed_bytes
from worker.shared.protocol import control, curve, events
from worker.shared.protocol.control import Error, encode
from worker.shared.protocol.frames import (
    FrameError,
    RingHeader,
    decode_ring_header,
    encode_ring_header,
)
from worker.shared.protocol.limits import DEFAULT_STREAMS, MAX_QUEUED_WORK, ring_frame_limit
from worker.shared.protocol.messages import MessageError
from worker.stage import Stage, hidden_size
from worker.tensor import (
    CANCEL,
    GENERATE,
    RING,
    FollowerQueue,
    LeaderQueue,
    Mirror,
    MirrorError,
    Outside,
    join_group,
    lost_member,
)

STATS_EVERY_S = 1.0
# How long the serving loop waits for a message before it looks at its clock (stats,
# keys, a parent that is gone) and at `running` again.
IDLE_WAIT_MS = 100
# The agent declares a runner silent when it hears nothing for a few of these: a
# thread beats (SIGSTOP stops it too), and says how long the serving loop has been
# inside one step, so a hang inside MLX shows as well (MLX releases the GIL).
BEAT_EVERY_S = 0.5
# Replies to a controller that is reconnecting wait this long for it, then its
# requests are cancelled; a session keeps one routing identity, so it comes back.
CLIENT_GONE_S = 30.0
# A stopping runner keeps what the requests that ended before the stop asked it to
# keep (their "free" frames, whose entries the prefix cache writes to disk): it reads
# what reaches it until the ring is quiet this long, never longer than STOP_SETTLE_S.
STOP_QUIET_MS = 100
STOP_SETTLE_S = 1.5
CLIENT_PENDING_MAX = 4096
_emit_lock = threading.Lock()
# Under the node's home (its workdir): each shard's prefix cache entries on disk.
PROMPT_CACHE_DIR = "prompt-cache"


@dataclass(frozen=True)
class RunnerSpec:
    home: str
    placement: str
    model_dir: str
    start: int
    end: int
    index: int
    count: int
    address: str
    data_port: int
    client_port: int
    next_endpoint: str
    next_key: str
    prefill_chunk: int = 512
    context_tokens: int = 4096
    streams: int = DEFAULT_STREAMS  # requests run at once; the plan reserved KV for them
    kv_bytes: int = 0
    kv_bits: int = 0  # quantized KV: 8 or 4 bits (0: full precision), see shared.kv_quant
    kv_group_size: int = 64
    prompt_cache_bytes: int = 0  # the prompt cache's budget in memory and on disk
    prompt_cache_disk_bytes: int = 0
    model_digest: str = ""  # the model's content digest ("": the node's files, _files_key)
    adapter: str = ""  # the placement's adapter by name ("" none), every shard's
    # A tensor-parallel stage (worker.tensor): this process is `rank` of `group_size`,
    # joined over `backend`; the leader (rank 0) mirrors its work to `followers`
    # ([endpoint, public key] each), a follower takes it only from `leader_key`.
    adapter_dir: str = ""  # an mlx-lm adapter for this shard's layers ("" none)
    # Speculative decoding on the head (worker/speculation.py): "", "lookup" or "model"
    # (the draft model in `draft_dir`, loaded whole here), guesses per frame (0: default).
    draft: str = ""
    draft_dir: str = ""
    draft_tokens: int = 0
    rank: int = 0
    group_size: int = 1
    backend: str = ""
    group: tuple[str, ...] = ()
    followers: tuple[tuple[str, str], ...] = ()
    leader_key: str = ""

    @property
    def follower(self) -> bool:
        return self.rank > 0

    @classmethod
    def from_file(cls, path: Path) -> RunnerSpec:
        # Every field checked against its type; fields the agent knows and this runner
        # has no use for (they describe the shard to the controller) are ignored.
        return msgspec.json.decode(path.read_bytes(), type=cls)


def emit(event: events.RunnerEvent) -> None:
    """Tell the agent, one JSON line on stdout (protocol/events.py)."""
    line = events.encode(event).decode()
    with _emit_lock:  # the beat thread writes too: lines must not interleave
        sys.stdout.write(line)
        sys.stdout.flush()


class SocketLinks:
    """The stage's way out: the ring PUSH, the client ROUTER, or itself."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def to_next(self, header: RingHeader, activation: mx.array | None) -> None:
        self.runner.send_ring(header, activation)

    def to_head(self, header: RingHeader) -> None:
        self.runner.send_ring(header, None)

    def to_client(self, client: bytes, kind: str, **fields: Any) -> None:
        rid = fields.get("rid")
        if isinstance(rid, str):
            # Numbered per request, so a controller that reconnected can tell a resumed
            # stream from one that lost messages in between.
            seq = self.runner.seqs.pop(rid, 0)
            if kind not in ("done", "failed"):
                self.runner.seqs[rid] = seq + 1
            fields["seq"] = seq
        if kind == "failed" and self.runner.spec.group and lost_member(fields.get("message", "")):
            # The controller then asks the group's agents which member is gone.
            fields["group_lost"] = list(self.runner.spec.group)
        self.runner.send_client(client, encode(control.build(kind, **fields)))


class Runner:
    def __init__(self, spec: RunnerSpec) -> None:
        self.spec = spec
        self.home = Path(spec.home)
        self.ctx = zmq.Context()
        self.auth: ThreadAuthenticator | None = None
        self.ring_in: zmq.Socket | None = None
        self.ring_out: zmq.Socket | None = None
        self.client: zmq.Socket | None = None
        # A tensor group's members order their work with their leader (worker.tensor).
        self.work: deque[Callable[[], None]] | LeaderQueue | FollowerQueue = deque()
        self.stage: Stage | None = None
        self.running = True
        self.single = spec.count == 1
        self.busy_s = 0.0
        self._busy_reported = 0.0
        self.step_began = 0.0  # when the step now running began (0: between steps)
        self.seqs: dict[str, int] = {}
        # Replies for a client whose connection is down, in order, until it is back.
        self.pending: dict[bytes, deque[bytes]] = {}
        self.gone_since: dict[bytes, float] = {}
        self.abandoned: set[bytes] = set()
        self.controller_key: str | None = None
        self.ring_keys: frozenset[str] = frozenset()
        self._keys_seen: tuple[tuple[str, int, int], ...] = ()
        self.refused = 0
        self.mirror: Mirror | None = None  # a tensor group's leader tells its followers
        self.group: mx.distributed.Group | None = None

    # ---- setup ----------------------------------------------------------------------

    def bind(self) -> None:
        keys = curve.load_keypair(curve.key_dir(self.home) / "self.key_secret")
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.reload_keys()
        if self.spec.follower:
            self.work = FollowerQueue()  # before the stage is made: it schedules into it
            # A follower's only socket: the work its leader mirrors to it.
            self.ring_in = self.ctx.socket(zmq.PULL)
            curve.make_server(self.ring_in, keys, max_bytes=self._frame_limit() + 4096)
            self.ring_in.bind(f"tcp://{self.spec.address}:{self.spec.data_port}")
            return
        if self.spec.followers:
            self.mirror = Mirror(self.ctx, keys, self.spec.followers)
            self.work = LeaderQueue(self.mirror)
        if not self.single:
            # A frame bigger than this model's prefill chunk can be is refused by
            # ZeroMQ before it is buffered (the sender is disconnected).
            self.ring_in = self.ctx.socket(zmq.PULL)
            curve.make_server(self.ring_in, keys, max_bytes=self._frame_limit())
            self.ring_in.bind(f"tcp://{self.spec.address}:{self.spec.data_port}")
            self.ring_out = self.ctx.socket(zmq.PUSH)
            self.ring_out.setsockopt(zmq.LINGER, 0)
            curve.make_client(self.ring_out, keys, self.spec.next_key.encode())
            self.ring_out.connect(self.spec.next_endpoint)
        if self.spec.index == 0:
            self.client = self.ctx.socket(zmq.ROUTER)
            self.client.setsockopt(zmq.LINGER, 0)
            # A controller keeps one routing identity per session: when it reconnects
            # (network blip, laptop sleep) the new connection takes that identity over,
            # and a send to an identity that is away fails instead of vanishing, so the
            # reply waits for it (`send_client`).
            self.client.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self.client.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.client.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            self.client.setsockopt(zmq.HEARTBEAT_TIMEOUT, 4000)
            curve.make_server(self.client, keys)
            self.client.bind(f"tcp://{self.spec.address}:{self.spec.client_port}")

    def _frame_limit(self) -> int:
        config = read_config(Path(self.spec.model_dir).expanduser())
        return ring_frame_limit(hidden_size(config), self.spec.prefill_chunk)

    def reload_keys(self) -> None:
        """As the agent does: keys provision added or removed count without a restart."""
        seen = curve.keys_signature(self.home)
        if seen == self._keys_seen and self.controller_key is not None:
            return
        assert self.auth is not None
        self.auth.configure_curve(domain="*", location=str(curve.authorized_dir(self.home)))
        self.controller_key = curve.controller_key(self.home)
        # The ring is the nodes': the controller never sends activations.
        self.ring_keys = curve.authorized_z85(self.home) - {self.controller_key}
        self._keys_seen = seen

    def load(self) -> None:
        from mlx_lm.utils import load_tokenizer

        raise_wired_limit()

        def progress(done: int, total: int) -> None:
            emit(events.Loading(done=done, total=total))

        model_dir = Path(self.spec.model_dir).expanduser()
        if self.spec.group_size > 1:
            self.group = join_group(self.spec.backend, self.spec.rank, self.spec.group_size)
        adapter = Path(self.spec.adapter_dir).expanduser() if self.spec.adapter_dir else None
        shard = load_shard(
            model_dir,
            self.spec.start,
            self.spec.end,
            progress,
            group=self.group,
            adapter_dir=adapter,
            kv_bits=self.spec.kv_bits,
            kv_group_size=self.spec.kv_group_size,
        )
        tokenizer = None
        if shard.is_first or shard.is_last:
            tokenizer = load_tokenizer(
                model_dir, eos_token_ids=shard.config.get("eos_token_id", None)
            )
        draft = self.spec.draft if shard.is_first else ""
        draft_model = None
        if draft == "model":
            vocab = int(shard.config.get("vocab_size", 0) or 0)
            draft_model = load_draft(Path(self.spec.draft_dir).expanduser(), vocab)
        self.stage = Stage(
            shard,
            tokenizer,
            SocketLinks(self),
            prefill_chunk=self.spec.prefill_chunk,
            hops=self.spec.count,
            context_tokens=self.spec.context_tokens,
            streams=self.spec.streams,
            schedule=self.work.append,
            prompt_cache_bytes=self.spec.prompt_cache_bytes,
            prompt_cache_disk_bytes=self.spec.prompt_cache_disk_bytes,
            cache_dir=Path(self.spec.home) / PROMPT_CACHE_DIR,
            cache_key=self._cache_key(),
            draft=draft,
            draft_tokens=self.spec.draft_tokens,
            draft_model=draft_model,
            # A tensor group's ranks must decide alike: timed steps differ between them.
            row_cost=speculation.ROW_COST if self.spec.group_size > 1 else None,
            tensor_group=self.group,
        )
        # The first answer would otherwise pay for MLX's kernels and compiled functions
        # and the chat template's compile (seconds to its first token, not the second's).
        self.stage.warm_up()
        emit(
            events.Ready(
                param_bytes=shard.param_bytes,
                start=shard.start,
                end=shard.end,
                active_bytes=mx.get_active_memory(),
            )
        )

    # ---- sending ----------------------------------------------------------------------

    def send_ring(self, header: RingHeader, activation: mx.array | None) -> None:
        if self.single:
            # A one-stage ring: the frame goes straight back to this stage.
            self.work.append(lambda: self._local_frame(header, activation))
            return
        if self.ring_out is None:
            return  # a tensor group's follower: its leader sends the stage's frames

        frames: list[Any] = [encode_ring_header(header)]
        # mx.array has the buffer protocol; its stub does not declare it.
        view = memoryview(activation) if activation is not None else b""  # type: ignore[arg-type]
        frames.append(view)
        self.ring_out.send_multipart(frames, copy=activation is None or activation.nbytes < 65536)

    def _local_frame(self, header: RingHeader, activation: mx.array | None) -> None:
        assert self.stage is not None
        payload = bytes(memoryview(activation)) if activation is not None else b""  # type: ignore[arg-type]
        self.stage.on_frame(header, payload)

    def send_client(self, client: bytes, data: bytes) -> None:
        if self.client is None:
            return
        waiting = self.pending.get(client)
        if waiting is not None:
            waiting.append(data)  # behind what already waits, to keep the order
            if len(waiting) > CLIENT_PENDING_MAX:
                self._abandon(client)
            return
        if self._try_send(client, data):
            self.abandoned.discard(client)
        elif client not in self.abandoned:
            self.pending[client] = deque([data])
            self.gone_since[client] = time.monotonic()

    def _try_send(self, client: bytes, data: bytes) -> bool:
        assert self.client is not None
        try:
            self.client.send_multipart([client, data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise
        return True

    def _flush_pending(self) -> None:
        """Send what waits for clients that are back; give up on those gone too long."""
        now = time.monotonic()
        for client in list(self.pending):
            waiting = self.pending[client]
            while waiting and self._try_send(client, waiting[0]):
                waiting.popleft()
            if not waiting:
                del self.pending[client]
                self.gone_since.pop(client, None)
            elif now - self.gone_since.get(client, now) > CLIENT_GONE_S:
                self._abandon(client)

    def _abandon(self, client: bytes) -> None:
        """The client is gone: drop its replies and free its requests on every stage."""
        self.pending.pop(client, None)
        self.gone_since.pop(client, None)
        if len(self.abandoned) > 1024:  # identities of long-gone sessions: keep it bounded
            self.abandoned.clear()
        self.abandoned.add(client)
        assert self.stage is not None
        for rid, req in list(self.stage.head_requests.items()):
            if req.client == client:
                # Queued like a client's cancel, not run inside the step that found the
                # client gone: a tensor group's followers must cancel at the same point.
                self.work.append(self._cancel_job(rid))
        print(
            f"client {client.hex()} gone for {CLIENT_GONE_S:g} s: its requests cancelled",
            file=sys.stderr,
        )

    # ---- serving ----------------------------------------------------------------------

    def serve(self) -> None:
        assert self.stage is not None
        poller = zmq.Poller()
        for sock in (self.ring_in, self.client):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        # A stage without a client socket (every stage but the head) hears only the
        # ring: with nothing to do it waits in the ring socket's recv, which returns with
        # the frame, rather than in a poll it must leave for a recv. A hop ends when
        # that recv returns, so the steps between the two are the hop's.
        only_ring = self.ring_in if self.client is None else None
        if only_ring is not None:
            only_ring.setsockopt(zmq.RCVTIMEO, IDLE_WAIT_MS)
        last_stats = time.monotonic()
        parent = os.getppid()
        while self.running:
            if only_ring is not None and not self.work:
                self._wait(only_ring, self._on_ring)
            else:
                for sock, _ in poller.poll(0 if self.work else IDLE_WAIT_MS):
                    # (in the order registered: the ring first)
                    self._drain(sock, self._on_ring if sock is self.ring_in else self._on_client)
            if self.work:
                assert not isinstance(self.work, FollowerQueue)
                self._timed(self.work.popleft())
            if self.pending:
                self._flush_pending()
            now = time.monotonic()
            if now - last_stats >= STATS_EVERY_S:
                self._emit_stats(now - last_stats)
                last_stats = now
                self.reload_keys()
                if os.getppid() != parent:
                    # The agent is gone (killed hard): a shard without it serves no one.
                    self.running = False

    def serve_follower(self) -> None:
        """A tensor group's follower: run exactly the items the leader runs, in its
        order (worker.tensor): the ones its own stage scheduled as far as the leader's
        grant allows, each outside item where the leader ran it."""
        assert self.ring_in is not None and isinstance(self.work, FollowerQueue)
        queue = self.work
        last_stats = time.monotonic()
        parent = os.getppid()
        while self.running:
            self._hear_leader(queue, wait=0)
            step = queue.next()
            if step is None:
                self._hear_leader(queue, wait=100)
            elif step[0] == "inside":
                self._timed(step[1])
            else:
                self._timed(self._mirrored(step[1]))
            now = time.monotonic()
            if now - last_stats >= STATS_EVERY_S:
                self._emit_stats(now - last_stats)
                last_stats = now
                self.reload_keys()
                if os.getppid() != parent:
                    self.running = False

    def settle(self) -> None:
        """After a stop, run the "free" frames that reached this stage before it and
        nothing else: a request that ended just before an unload keeps its prefix-cache
        entries on every stage (written to disk as the stage closes), while a step's
        all-reduce would wait for a partner that is stopping too. A follower takes them
        from its leader, which mirrors them here as it runs them."""
        if self.stage is None or self.ring_in is None:
            return
        deadline = time.monotonic() + STOP_SETTLE_S
        if isinstance(self.work, FollowerQueue):
            queue = self.work
            while time.monotonic() < deadline and self.ring_in.poll(STOP_QUIET_MS):
                with contextlib.suppress(MirrorError):
                    self._hear_leader(queue, wait=0)
            for _, frames in queue.outside:
                if _is_free(frames):
                    self._run(self._mirrored(frames))
            return
        queued = self.work.outside if isinstance(self.work, LeaderQueue) else self.work
        items = list(queued)
        queued.clear()
        while time.monotonic() < deadline and self.ring_in.poll(STOP_QUIET_MS):
            self._drain(self.ring_in, self._on_ring)
            items += queued
            queued.clear()
        for item in items:
            if isinstance(item, Outside) and _is_free(item.event):
                if isinstance(self.work, LeaderQueue):
                    kind, *rest = item.event
                    self.work.mirror.send([kind, str(self.work.ran).encode(), *rest])
                self._run(item.job)

    def _hear_leader(self, queue: FollowerQueue, wait: int) -> None:
        assert self.ring_in is not None
        if wait and not self.ring_in.poll(wait):
            return
        while True:
            try:
                parts = self.ring_in.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if curve.sender(parts[0]) != self.spec.leader_key:
                # Only the group's leader decides what this rank computes.
                self.refused += 1
                continue
            queue.hear([part.bytes for part in parts])

    def _mirrored(self, frames: list[bytes]) -> Callable[[], None]:
        """The job an outside item the leader ran stands for."""
        kind = frames[0]
        if kind == RING:
            return self._ring_job(frames[1], frames[2])
        if kind == GENERATE:
            msg = control.decode(frames[1])
            if isinstance(msg, control.CacheClear):
                return self._clear_job(b"", msg)
            if isinstance(msg, control.Generate):
                return self._generate_job(b"", msg)
            raise MessageError(f"a mirrored {msg.kind} is not a client's request")
        return self._cancel_job(frames[1].decode())

    def _timed(self, job: Callable[[], None]) -> None:
        began = time.perf_counter()
        self.step_began = time.monotonic()
        self._run(job)
        self.step_began = 0.0
        self.busy_s += time.perf_counter() - began

    def _run(self, job: Callable[[], None]) -> None:
        """One step; whatever it raises is that step's failure, never the runner's."""
        try:
            job()
        except Exception:
            assert self.stage is not None
            self.stage.stats.errors += 1
            print(f"a step failed:\n{traceback.format_exc()}", file=sys.stderr)

    def _for_request(
        self, rid: str, job: Callable[[], None], client: bytes | None = None
    ) -> Callable[[], None]:
        """A step on behalf of one request: if it raises, only that request fails."""

        def run() -> None:
            try:
                job()
            except Exception as exc:
                assert self.stage is not None
                self.stage.stats.errors += 1
                print(f"request {rid} failed on a bad frame: {exc!r}", file=sys.stderr)
                message = (
                    f"a bad frame reached stage {self.spec.index}: {type(exc).__name__}: {exc}"
                )
                if client is not None and rid not in self.stage.head_requests:
                    SocketLinks(self).to_client(client, "failed", rid=rid, message=message)
                    return
                bad = RingHeader(rid=rid, kind="error", message=message)
                self.stage.on_frame(bad, b"")

        return run

    def beat(self) -> None:
        """Tell the agent this process lives, and how long the current step has run."""
        while self.running:
            began = self.step_began
            emit(events.Beat(step_s=round(time.monotonic() - began, 3) if began else 0.0))
            time.sleep(BEAT_EVERY_S)

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], None]) -> None:
        # Bounded: past MAX_QUEUED_WORK what is unread waits in ZeroMQ's queue, whose
        # high-water mark pushes back on the sender, instead of in this process.
        # The poll said a message is there; after it, the socket's events say whether
        # another is, cheaper than a recv failing with an exception.
        while len(self.work) < MAX_QUEUED_WORK:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames, handle)
            if not cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
                return

    def _wait(self, sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], None]) -> None:
        """Wait in `sock`'s recv (its RCVTIMEO at most) for a message, then take what
        else is there as `_drain` does."""
        try:
            frames = sock.recv_multipart(copy=False)
        except zmq.Again:
            return  # nothing for IDLE_WAIT_MS: the loop's own checks run
        self._handle(frames, handle)
        if cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
            self._drain(sock, handle)

    def _handle(self, frames: list[zmq.Frame], handle: Callable[[list[zmq.Frame]], None]) -> None:
        try:
            handle(frames)
        except Exception:  # one bad message must not end the runner
            assert self.stage is not None
            self.stage.stats.dropped += 1
            print(f"dropped a message:\n{traceback.format_exc()}", file=sys.stderr)

    def _on_ring(self, frames: list[zmq.Frame]) -> None:
        arrived = time.perf_counter()  # the recv has just returned: where a hop ends
        assert self.stage is not None
        if len(frames) != 2 or curve.sender(frames[0]) not in self.ring_keys:
            # Malformed, or from a key revoked since its connection was made.
            self.stage.stats.dropped += 1
            return
        header_bytes, payload = frames[0].bytes, frames[1].buffer
        self.work.append(
            Outside(self._ring_job(header_bytes, payload, arrived), [RING, header_bytes, payload])
        )

    def _ring_job(
        self, header_bytes: bytes, payload: bytes | memoryview, arrived: float | None = None
    ) -> Callable[[], None]:
        assert self.stage is not None
        stage = self.stage
        try:
            header = decode_ring_header(header_bytes, len(payload))
        except FrameError as exc:
            stage.stats.dropped += 1
            print(f"dropped ring frame: {exc}", file=sys.stderr)
            if exc.rid is not None:
                bad = RingHeader(rid=exc.rid, kind="error", message=f"bad frame: {exc}")
                return lambda: stage.on_frame(bad, b"")
            return lambda: None
        return self._for_request(header.rid, lambda: stage.on_frame(header, payload, arrived))

    def _generate_job(self, client: bytes, msg: control.Generate) -> Callable[[], None]:
        assert self.stage is not None
        stage = self.stage
        # The Stage reads a request as a map (its fields checked there, in its words).
        request = msgspec.structs.asdict(msg)
        return self._for_request(msg.rid, lambda: stage.submit(client, request), client)

    def _clear_job(self, client: bytes, msg: control.CacheClear) -> Callable[[], None]:
        assert self.stage is not None
        stage = self.stage

        def job() -> None:
            entries, size = stage.clear_cache()
            if client:  # a follower answers no one
                done = control.CacheCleared(re=msg.id, entries=entries, bytes=size)
                self.send_client(client, encode(done))

        return job

    def _cancel_job(self, rid: str) -> Outside:
        assert self.stage is not None
        stage = self.stage
        return Outside(lambda: stage.cancel(rid), [CANCEL, rid.encode()])

    def _on_client(self, frames: list[zmq.Frame]) -> None:
        assert self.stage is not None
        if len(frames) != 2:
            self.stage.stats.dropped += 1
            return
        client = frames[0].bytes
        if self.controller_key is None or curve.sender(frames[1]) != self.controller_key:
            # Requests are the controller's to make: a node's key (or a stolen one of a
            # removed node) gets nothing out of a head shard.
            self.refused += 1
            refusal = Error(code="not_authorized", message="only the controller")
            self.send_client(client, encode(refusal))
            return
        try:
            msg = control.decode(frames[1].bytes)
        except MessageError as exc:
            self.stage.stats.dropped += 1
            self.send_client(client, encode(Error(re=exc.re, code="bad_request", message=str(exc))))
            return
        match msg:
            case control.Generate():
                job = self._generate_job(client, msg)
                self.work.append(Outside(job, [GENERATE, frames[1].bytes]))
            case control.Cancel():
                # Queued behind the request's own submit: a cancel that overtook it would
                # find nothing to cancel and the request would run (and hold caches) on.
                self.work.append(self._cancel_job(msg.rid))
            case control.StatsAsk():
                stats = control.ShardStats(**self._stats())
                self.send_client(client, encode(control.StatsReply(re=msg.id, stats=stats)))
            case control.CacheClear():
                # Every rank of a tensor group clears too (mirrored as a client's item):
                # their decisions must stay the leader's.
                job = self._clear_job(client, msg)
                self.work.append(Outside(job, [GENERATE, frames[1].bytes]))
            case _:
                unknown = f"{msg.kind} is not for a shard"
                self.send_client(client, encode(Error(code="unknown_request", message=unknown)))

    def _stats(self) -> dict[str, Any]:
        """The fields of control.ShardStats (the stats event is built from them)."""
        assert self.stage is not None
        s = self.stage.stats
        return {
            "placement": self.spec.placement,
            "in_flight": self.stage.held(),
            "waiting": len(self.stage.waiting),
            "tokens": s.tokens,
            "finished": s.finished,
            "dropped": s.dropped,
            "errors": s.errors,
            "refused": self.refused,
            "prebuilt_steps": s.prebuilt,
            "batched_steps": s.batched,
            "batched_rows": s.batched_rows,
            "drafted": s.drafted,
            "kept": s.kept,
            "verified_ahead": s.verified_ahead,
            "warm_ms": self.stage.warmed.get("total", 0.0),
            "active_bytes": mx.get_active_memory(),
            **self.stage.cache_stats(),
            **{
                f"{name}_us_p50": statistics.median(values) if values else None
                for name, values in self.stage.ring_us.items()
            },
        }

    def _emit_stats(self, interval: float) -> None:
        busy = (self.busy_s - self._busy_reported) / interval if interval > 0 else 0.0
        self._busy_reported = self.busy_s
        emit(events.Stats(busy=round(min(1.0, busy), 3), **self._stats()))

    def _cache_key(self) -> str:
        """Whose prefix cache entries this shard's are, as their folder on disk says:
        the placement, the model's bytes, the adapter's, the rank, the format (the
        stage adds its layers). Entries of other weights or another split are never
        read; two placements of one model keep their own folders (a folder has one
        writer, which counts its bytes against its own budget), and placing the same
        model again under the same name finds its entries."""
        spec = self.spec
        model = spec.model_digest or _files_key(Path(spec.model_dir))
        adapter = ""
        if spec.adapter_dir:
            adapter = model_digest(Path(spec.adapter_dir), write_cache=False)
        return (
            f"placement={spec.placement} model={model} adapter={spec.adapter}:{adapter} "
            f"rank={spec.rank}/{spec.group_size} kv={spec.kv_bits}/{spec.kv_group_size} format=1"
        )

    def close(self) -> None:
        if self.stage is not None:
            self.stage.close()
        if self.mirror is not None:
            self.mirror.close()
        for sock in (self.ring_in, self.ring_out, self.client):
            if sock is not None:
                sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


def _is_free(event: Sequence[bytes | memoryview]) -> bool:
    """Whether a work item's frames are a ring frame that ends a request ("free")."""
    if len(event) != 3 or event[0] != RING:
        return False
    try:
        return decode_ring_header(bytes(event[1]), len(event[2])).kind == "free"
    except FrameError:
        return False


def _files_key(directory: Path) -> str:
    """The model's content digest when its files' hashes are known (cached beside them:
    a copy by studiotui verified them), without hashing anything at load time (hundreds
    of GB take minutes); else its files by name, size and modification time, which a
    change of weights changes too."""
    names = sorted(
        p.name for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")
    )
    if not unhashed_bytes(directory, names):
        return model_digest(directory)
    stats = [(n, (directory / n).stat()) for n in names]
    lines = "".join(f"{n}\t{st.st_size}\t{st.st_mtime_ns}\n" for n, st in stats)
    return "stat:" + hashlib.sha256(lines.encode()).hexdigest()


def load_draft(draft_dir: Path, vocab: int) -> Any:
    """The draft model, whole (mlx-lm's `load`): its logits must index the same
    vocabulary as the big model's (the operator compared the tokenizers already)."""
    from mlx_lm.utils import load_model

    model, config = load_model(draft_dir)
    if int(config.get("vocab_size", 0) or 0) not in (0, vocab):
        raise ShardLoadError(
            f"the draft model in {draft_dir} has a vocabulary of {config.get('vocab_size')} "
            f"tokens, the model {vocab}: a draft must share the model's tokenizer"
        )
    mx.eval(model.parameters())
    return model


def raise_wired_limit() -> None:
    """As mlx-lm does for large models: let Metal keep the whole recommended working set
    wired, for the shard's life, so a 100+ GB shard is not paged out between tokens.
    A no-op where MLX has no Metal device (its device info has no recommended size)."""
    try:
        from mlx_lm.utils import maybe_set_recommended_wired_limit
    except ImportError:  # an mlx-lm older than the helper: the same two calls
        size = mx.device_info().get("max_recommended_working_set_size")
        if isinstance(size, int) and size:
            mx.set_wired_limit(size)
        return
    maybe_set_recommended_wired_limit()


# What MLX and Python say when an allocation fails (CPU: std::bad_alloc → MemoryError;
# Metal: "[metal::malloc] Attempting to allocate …" / "Unable to allocate").
_OOM_WORDS = ("bad_alloc", "allocate", "out of memory")


def fatal_message(exc: BaseException, *, loading: bool) -> str:
    """The runner's last word; running out of memory is named as such. A failure while
    reading weights arrives wrapped in ShardLoadError, the MemoryError as its context."""
    text = str(exc) or type(exc).__name__
    if out_of_memory(exc):
        return f"out of memory {'while loading' if loading else 'while serving'}: {text}"
    return text


def out_of_memory(exc: BaseException) -> bool:
    text = (str(exc) or type(exc).__name__).lower()
    oom = isinstance(exc, MemoryError) or isinstance(exc.__context__, MemoryError)
    return oom or any(word in text for word in _OOM_WORDS)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = RunnerSpec.from_file(Path(argv[0]))
    runner = Runner(spec)

    def stop(_signum: int, _frame: Any) -> None:
        runner.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    profile_to = os.environ.get("STUDIOTUI_PROFILE_DIR")
    profiler = None
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()
    threading.Thread(target=runner.beat, name="beat", daemon=True).start()
    try:
        runner.bind()
        runner.load()
        if profiler:
            profiler.enable()
        if spec.follower:
            runner.serve_follower()
        else:
            runner.serve()
        runner.settle()
    except (ShardLoadError, GroupError, MirrorError, zmq.ZMQError, OSError, MemoryError) as exc:
        message = fatal_message(exc, loading=runner.stage is None)
        emit(events.Fatal(message=message, out_of_memory=out_of_memory(exc)))
        return 1
    finally:
        runner.close()
        if profiler and profile_to:
            profiler.disable()
            profiler.dump_stats(
                str(Path(profile_to) / f"runner-{spec.placement}-{spec.index}.prof")
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
