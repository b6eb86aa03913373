"""`studiotui bench`'s batching rows, and the floor under its hop figure.

- `batch8_ratio`: eight requests at once on two shards, aggregate tokens/s, over one
  request alone; beside it `mlx_batch8_ratio`, mlx-lm's own batched generation
  (`BatchGenerator`, what `mlx_lm.batch_generate` runs) of the same eight prompts in
  one process over its one-stream loop. Rounds alternate the two sides and a ratio is
  the median of the rounds' own ratios, as the pipeline figures are paired.
- `bare_hop_us`: one bare CURVE ZeroMQ message between two otherwise idle processes
  on this machine (PUSH/PULL like the ring, the ring's socket options, a decode frame's
  size), so `hop_us_p50` reads against its floor (`hop_over_bare`). Both measure the
  same span: from a send call (the ring header packed in it, as a stage's send packs
  it) to the receiver's recv returning; the poll the receiver slept in is inside it,
  what it does with the frame after the recv is not. Both are worked out alike: a
  round trip less what the far end spent between its recv and its send (which it
  says in its reply, as a ring stage does), halved; and in both, each message finds
  its receiver asleep for a decode step's time.

Run as `python -m studiotui.bench.batching echo|near ...`, this module is either end of
the bare hop.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from studiotui.bench.bare import BareEnd, pair_keys
from studiotui.cluster.controller import Controller
from studiotui.cluster.streams import stream
from studiotui.core.inventory import Inventory
from worker.shared.protocol import control
from worker.shared.protocol.frames import RingHeader, decode_ring_header, encode_ring_header

STREAMS = 8
PROMPT_LEN = 16


def prompts(n: int = STREAMS) -> list[list[int]]:
    """n different prompts of one length (mlx-lm's batch then needs no padding)."""
    return [[(7 * i + 13 * k) % 200 + 32 for i in range(PROMPT_LEN)] for k in range(n)]


# ---- mlx-lm in one process ------------------------------------------------------------


class MlxBatch:
    """mlx-lm's one-stream loop and its batched generation, on the whole model."""

    def __init__(self, model_dir: Path) -> None:
        import mlx_lm

        self.model = mlx_lm.load(str(model_dir))[0]

    def one(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        """Tokens/s of one answer, from the request to its last token (prefill counted,
        as the pipeline's streams count it)."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        start = time.perf_counter()
        tokens = [int(t) for t, _ in generate_step(mx.array(prompt), self.model, max_tokens=n)]
        return len(tokens) / (time.perf_counter() - start), tokens

    def batch(self, batch: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        """Aggregate tokens/s of `BatchGenerator` on all prompts at once (no stop tokens:
        every answer runs to n, as `ignore_eos` makes ours)."""
        from mlx_lm.generate import BatchGenerator

        start = time.perf_counter()
        gen = BatchGenerator(self.model, max_tokens=n, completion_batch_size=len(batch))
        uids = gen.insert(batch, [n] * len(batch))
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        while responses := gen.next_generated():
            for r in responses:
                out[r.uid].append(int(r.token))
        elapsed = time.perf_counter() - start
        gen.close()
        return sum(len(t) for t in out.values()) / elapsed, [out[uid] for uid in uids]


# ---- ours: eight streams on two shards ------------------------------------------------


async def _ours(ctl: Controller, name: str, n: int) -> tuple[float, float, list[list[int]]]:
    batch = prompts()
    one = await stream(ctl, name, batch[0], n)
    runs = await asyncio.gather(*(stream(ctl, name, p, n) for p in batch))
    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    eight = sum(len(r["tokens"]) for r in runs) / wall
    return len(one["tokens"]) / (one["end"] - one["start"]), eight, [r["tokens"] for r in runs]


async def batch_figures(
    home: Path, inv: Inventory, model_dir: Path, tokens: int, rounds: int, prefill_chunk: int
) -> dict[str, Any]:
    """Eight streams ÷ one on two shards, paired round by round with mlx-lm's batch, on
    a placement of its own that admits eight at once."""
    mlx = MlxBatch(model_dir)
    batch = prompts()
    ctl = Controller(home, inv)
    ours: list[tuple[float, float]] = []
    theirs: list[tuple[float, float]] = []
    got: list[list[int]] = []
    try:
        await ctl.refresh()
        names = list(inv.names)[:2]
        await ctl.place(model_dir, names, "batch2", prefill_chunk=prefill_chunk, streams=STREAMS)
        await stream(ctl, "batch2", batch[0], 8)  # warm up
        for r in range(rounds):
            for side in ("ours", "mlx") if r % 2 else ("mlx", "ours"):
                if side == "ours":
                    one, eight, got = await _ours(ctl, "batch2", tokens)
                    ours.append((one, eight))
                else:
                    one = (await asyncio.to_thread(mlx.one, batch[0], tokens))[0]
                    eight = (await asyncio.to_thread(mlx.batch, batch, tokens))[0]
                    theirs.append((one, eight))
        head = ctl.head_peer(ctl.pick_placement("batch2"))
        stats = (await head.ask("stats", control.StatsReply)).stats
        await ctl.unload("batch2")
    finally:
        await ctl.close()
    alone = [(await asyncio.to_thread(mlx.one, p, tokens))[1] for p in batch]
    steps = stats.batched_steps
    return {
        "batch8_tps": round(statistics.median(e for _, e in ours), 2),
        "batch8_ratio": round(statistics.median(e / o for o, e in ours), 3),
        "mlx_batch8_tps": round(statistics.median(e for _, e in theirs), 2),
        "mlx_batch8_ratio": round(statistics.median(e / o for o, e in theirs), 3),
        "batch8_mean_rows": round(stats.batched_rows / steps, 2) if steps else None,
        # Each of our eight answers, decoded in batches, is mlx-lm's greedy answer alone.
        "batch8_tokens_match": got == alone,
    }


# ---- one bare hop ---------------------------------------------------------------------


def _frame(hidden: int, payload: bytes) -> list[bytes]:
    """A decode frame as the ring sends it: its header packed at the send, as a stage's
    is, and one token's float32 activation."""
    header = RingHeader(rid="bare", kind="decode", offset=1, dtype="float32", shape=(1, 1, hidden))
    return [encode_ring_header(header), payload]


def _token(work_us: float) -> list[bytes]:
    """A token frame back, saying what the far end spent since its recv returned, as a
    ring stage's token frame says it (`extra["work_us"]`), packed at the send."""
    header = RingHeader(rid="bare", kind="token", token=1, extra={"work_us": work_us})
    return [encode_ring_header(header), b""]


# The near end's last frame: the far end leaves its loop (compared as bytes, so the echo
# does nothing per frame a stage's recv would not).
_STOP = encode_ring_header(RingHeader(rid="bare", kind="free"))


def _echo(home: Path, bind: str, peer: str, gap_s: float) -> None:
    """The far end: each frame answered `gap_s` after it came, so that the answer too
    finds its receiver asleep, as every hop of a ring does (its receiver waited through
    the other stage's step); the wait is inside the span the reply reports."""
    end = BareEnd(home, "b", bind, peer)
    try:
        while True:
            frames = end.pull.recv_multipart(copy=False)
            got = time.perf_counter()
            if frames[0].bytes == _STOP:
                return
            time.sleep(gap_s)
            end.push.send_multipart(_token((time.perf_counter() - got) * 1e6))
    finally:
        end.close()


def _round_trips(end: BareEnd, hidden: int, gap_s: float, rounds: int, warm: int) -> list[float]:
    """`rounds` round trips (after `warm` unrecorded ones), each a hop out and a hop back,
    as a decode step is on two stages: (round - far end's span) / 2 µs each,
    `Stage._ring_figures`'s hop. Raises TimeoutError if the far end stops answering."""
    poller = zmq.Poller()
    poller.register(end.pull, zmq.POLLIN)
    payload = bytes(4 * hidden)
    hops: list[float] = []
    for i in range(warm + rounds):
        time.sleep(gap_s)
        began = time.perf_counter()
        end.push.send_multipart(_frame(hidden, payload))
        if not poller.poll(10_000):
            raise TimeoutError("the bare hop's far end stopped answering")
        frames = end.pull.recv_multipart(copy=False)
        round_us = (time.perf_counter() - began) * 1e6
        if i >= warm:
            header = decode_ring_header(frames[0].bytes, len(frames[1]))
            hops.append((round_us - float(header.extra["work_us"])) / 2)
    return hops


def _near(home: Path, bind: str, peer: str, hidden: int, gap_s: float) -> None:
    """The near end, a process of its own: round trips when asked on stdin ("N WARM"),
    the hops back on stdout (a JSON list; null if the far end is gone); an empty line
    or end of input stops both ends."""
    end = BareEnd(home, "a", bind, peer)
    try:
        # The far end's first answer waits for its process to start (imports take
        # seconds on a loaded machine); the frame waits in ZeroMQ's queue meanwhile.
        end.push.send_multipart(_frame(hidden, bytes(4 * hidden)))
        started = bool(end.pull.poll(120_000))
        if started:
            end.pull.recv_multipart()
        for line in sys.stdin:
            if not line.strip():
                break
            rounds, warm = (int(x) for x in line.split())
            hops: list[float] | None = None
            if started:
                try:
                    hops = _round_trips(end, hidden, gap_s, rounds, warm)
                except TimeoutError:
                    started = False  # gone: every later request fails too
            print(json.dumps(hops), flush=True)
        end.push.send_multipart([_STOP, b""])
    finally:
        end.close()


class BareHop:
    """The bare hop's two ends: two fresh processes it starts, on keys of their own, so
    both are otherwise idle (this process may run a controller meanwhile). `measure`
    may be called between other work, so that the floor is taken under the same load
    as the hops it is the floor of; `close` stops both. Each end waits `gap_s` (a decode
    step's time) before it sends, so every message finds its receiver asleep, as a stage
    is when a frame reaches it."""

    def __init__(self, address: str, port: int, hidden: int, gap_s: float = 0.005) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="studiotui-bare-hop-")
        home = Path(self._tmp.name)
        pair_keys(home)
        here, there = f"tcp://{address}:{port}", f"tcp://{address}:{port + 1}"
        me = [sys.executable, "-m", "studiotui.bench.batching"]
        self.far = subprocess.Popen([*me, "echo", str(home), there, here, str(gap_s)])
        self.near = subprocess.Popen(
            [*me, "near", str(home), here, there, str(hidden), str(gap_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.hops: list[float] = []
        self.failed = False

    def measure(self, rounds: int, warm: int = 20) -> None:
        """`rounds` round trips after `warm` unrecorded ones (`_round_trips`)."""
        if self.failed:
            return
        assert self.near.stdin is not None and self.near.stdout is not None
        try:
            self.near.stdin.write(f"{rounds} {warm}\n")
            self.near.stdin.flush()
            hops = json.loads(self.near.stdout.readline() or "null")
        except (OSError, ValueError):
            hops = None
        if hops is None:
            self.failed = True  # an end is gone
            return
        self.hops += hops

    def hop_us(self, since: int = 0) -> float | None:
        """The median hop so far (of those from the `since`th on); None if an end
        failed."""
        if self.failed or not self.hops[since:]:
            return None
        return statistics.median(self.hops[since:])

    def close(self) -> None:
        try:
            if self.near.stdin is not None:
                self.near.stdin.close()  # the near end stops the far one, then itself
            for proc in (self.near, self.far):
                proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            for proc in (self.near, self.far):
                if proc.poll() is None:
                    proc.kill()  # a process this object started
                    proc.wait()
            if self.near.stdout is not None:
                self.near.stdout.close()
            self._tmp.cleanup()


def bare_hop_us(address: str, port: int, hidden: int, rounds: int = 300) -> float | None:
    """The median hop of a decode frame out and a token frame back between two fresh
    processes, both otherwise idle (`BareHop`); None if an end fails."""
    bare = BareHop(address, port, hidden)
    try:
        bare.measure(rounds)
    finally:
        bare.close()
    return bare.hop_us()


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[0] == "echo":
        _echo(Path(argv[1]), argv[2], argv[3], float(argv[4]))
        return 0
    if len(argv) == 6 and argv[0] == "near":
        _near(Path(argv[1]), argv[2], argv[3], int(argv[4]), float(argv[5]))
        return 0
    print(
        "usage: python -m studiotui.bench.batching echo HOME BIND PEER GAP_S\n"
        "       python -m studiotui.bench.batching near HOME BIND PEER HIDDEN GAP_S",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
