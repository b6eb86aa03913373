"""A shard's process: loads its layers, binds its sockets, serves the ring.

Started by the agent (`python -m worker.runner SPEC.json`), one per loaded shard,
so an MLX crash or out-of-memory kills this process and not the agent. It talks
to the agent through JSON lines on stdout (progress, ready, stats) and is stopped
with SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
import zmq
from zmq.auth.thread import ThreadAuthenticator

from worker.shard import ShardLoadError, load_shard
from worker.shared.protocol import curve, messages
from worker.shared.protocol.frames import (
    FrameError,
    RingHeader,
    decode_ring_header,
    encode_ring_header,
)
from worker.stage import Stage

STATS_EVERY_S = 1.0


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
    kv_bytes: int = 0

    @classmethod
    def from_file(cls, path: Path) -> RunnerSpec:
        raw = json.loads(path.read_text())
        # The agent may know fields this runner has no use for (they describe the
        # shard to the controller); take only ours.
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
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
        self.runner.send_client(client, messages.encode(kind, **fields))


class Runner:
    def __init__(self, spec: RunnerSpec) -> None:
        self.spec = spec
        self.home = Path(spec.home)
        self.ctx = zmq.Context()
        self.auth: ThreadAuthenticator | None = None
        self.ring_in: zmq.Socket | None = None
        self.ring_out: zmq.Socket | None = None
        self.client: zmq.Socket | None = None
        self.work: deque[Callable[[], None]] = deque()
        self.stage: Stage | None = None
        self.running = True
        self.single = spec.count == 1
        self.busy_s = 0.0
        self._busy_reported = 0.0

    # ---- setup ----------------------------------------------------------------------

    def bind(self) -> None:
        keys = curve.load_keypair(curve.key_dir(self.home) / "self.key_secret")
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(curve.authorized_dir(self.home)))
        if not self.single:
            self.ring_in = self.ctx.socket(zmq.PULL)
            curve.make_server(self.ring_in, keys)
            self.ring_in.bind(f"tcp://{self.spec.address}:{self.spec.data_port}")
            self.ring_out = self.ctx.socket(zmq.PUSH)
            self.ring_out.setsockopt(zmq.LINGER, 0)
            curve.make_client(self.ring_out, keys, self.spec.next_key.encode())
            self.ring_out.connect(self.spec.next_endpoint)
        if self.spec.index == 0:
            self.client = self.ctx.socket(zmq.ROUTER)
            self.client.setsockopt(zmq.LINGER, 0)
            curve.make_server(self.client, keys)
            self.client.bind(f"tcp://{self.spec.address}:{self.spec.client_port}")

    def load(self) -> None:
        from mlx_lm.utils import load_tokenizer

        raise_wired_limit()

        def progress(done: int, total: int) -> None:
            emit("progress", done=done, total=total)

        model_dir = Path(self.spec.model_dir).expanduser()
        shard = load_shard(model_dir, self.spec.start, self.spec.end, progress)
        tokenizer = None
        if shard.is_first or shard.is_last:
            tokenizer = load_tokenizer(
                model_dir, eos_token_ids=shard.config.get("eos_token_id", None)
            )
        self.stage = Stage(
            shard,
            tokenizer,
            SocketLinks(self),
            prefill_chunk=self.spec.prefill_chunk,
            hops=self.spec.count,
            context_tokens=self.spec.context_tokens,
            schedule=self.work.append,
        )
        emit(
            "ready",
            param_bytes=shard.param_bytes,
            start=shard.start,
            end=shard.end,
            active_bytes=mx.get_active_memory(),
        )

    # ---- sending ----------------------------------------------------------------------

    def send_ring(self, header: RingHeader, activation: mx.array | None) -> None:
        if self.single:
            # A one-stage ring: the frame goes straight back to this stage.
            self.work.append(lambda: self._local_frame(header, activation))
            return
        assert self.ring_out is not None
        frames: list[Any] = [encode_ring_header(header)]
        frames.append(memoryview(activation) if activation is not None else b"")
        self.ring_out.send_multipart(frames, copy=activation is None or activation.nbytes < 65536)

    def _local_frame(self, header: RingHeader, activation: mx.array | None) -> None:
        assert self.stage is not None
        payload = bytes(memoryview(activation)) if activation is not None else b""
        self.stage.on_frame(header, payload)

    def send_client(self, client: bytes, data: bytes) -> None:
        if self.client is not None:
            self.client.send_multipart([client, data])

    # ---- serving ----------------------------------------------------------------------

    def serve(self) -> None:
        assert self.stage is not None
        poller = zmq.Poller()
        for sock in (self.ring_in, self.client):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        last_stats = time.monotonic()
        parent = os.getppid()
        while self.running:
            ready = dict(poller.poll(0 if self.work else 100))
            if self.ring_in is not None and self.ring_in in ready:
                self._drain(self.ring_in, self._on_ring)
            if self.client is not None and self.client in ready:
                self._drain(self.client, self._on_client)
            if self.work:
                began = time.perf_counter()
                self.work.popleft()()
                self.busy_s += time.perf_counter() - began
            now = time.monotonic()
            if now - last_stats >= STATS_EVERY_S:
                self._emit_stats(now - last_stats)
                last_stats = now
                if os.getppid() != parent:
                    # The agent is gone (killed hard): a shard without it serves no one.
                    self.running = False

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[bytes]], None]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle([f.buffer for f in frames])

    def _on_ring(self, frames: list[Any]) -> None:
        assert self.stage is not None
        if len(frames) != 2:
            self.stage.stats.dropped += 1
            return
        header_bytes, payload = frames
        try:
            header = decode_ring_header(bytes(header_bytes), len(payload))
        except FrameError as exc:
            self.stage.stats.dropped += 1
            print(f"dropped ring frame: {exc}", file=sys.stderr)
            if exc.rid is not None:
                bad = RingHeader(rid=exc.rid, kind="error", message=f"bad frame: {exc}")
                self.work.append(lambda: self.stage.on_frame(bad, b""))
            return
        self.work.append(lambda: self.stage.on_frame(header, payload))

    def _on_client(self, frames: list[Any]) -> None:
        assert self.stage is not None
        if len(frames) != 2:
            self.stage.stats.dropped += 1
            return
        client = bytes(frames[0])
        try:
            msg = messages.decode(bytes(frames[1]))
        except messages.MessageError as exc:
            self.stage.stats.dropped += 1
            self.send_client(client, messages.encode("error", message=str(exc)))
            return
        kind = msg["type"]
        if kind == "generate":
            self.work.append(lambda: self.stage.submit(client, msg))
        elif kind == "cancel":
            self.stage.cancel(msg["rid"])
        elif kind == "stats":
            reply = messages.encode("stats_reply", re=msg.get("id"), **self._stats())
            self.send_client(client, reply)
        else:
            self.send_client(client, messages.encode("error", message=f"{kind} is not for a shard"))

    def _stats(self) -> dict[str, Any]:
        assert self.stage is not None
        s = self.stage.stats
        return {
            "placement": self.spec.placement,
            "in_flight": len(self.stage.caches),
            "tokens": s.tokens,
            "finished": s.finished,
            "dropped": s.dropped,
            "errors": s.errors,
            "prebuilt_steps": s.prebuilt,
            "active_bytes": mx.get_active_memory(),
            "hop_us_p50": statistics.median(self.stage.hop_us) if self.stage.hop_us else None,
        }

    def _emit_stats(self, interval: float) -> None:
        busy = (self.busy_s - self._busy_reported) / interval if interval > 0 else 0.0
        self._busy_reported = self.busy_s
        emit("stats", busy=round(min(1.0, busy), 3), **self._stats())

    def close(self) -> None:
        for sock in (self.ring_in, self.ring_out, self.client):
            if sock is not None:
                sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


def raise_wired_limit() -> None:
    """As mlx-lm does for large models: let Metal keep the whole recommended working set
    wired, for the shard's life, so a 100+ GB shard is not paged out between tokens.
    A no-op where MLX has no Metal device (its device info has no recommended size)."""
    try:
        from mlx_lm.utils import maybe_set_recommended_wired_limit
    except ImportError:  # an mlx-lm older than the helper: the same two calls
        size = mx.device_info().get("max_recommended_working_set_size")
        if size:
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
    oom = isinstance(exc, MemoryError) or isinstance(exc.__context__, MemoryError)
    if oom or any(word in text.lower() for word in _OOM_WORDS):
        return f"out of memory {'while loading' if loading else 'while serving'}: {text}"
    return text


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
    try:
        runner.bind()
        runner.load()
        if profiler:
            profiler.enable()
        runner.serve()
    except (ShardLoadError, zmq.ZMQError, OSError, MemoryError) as exc:
        emit("fatal", message=fatal_message(exc, loading=runner.stage is None))
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
