"""The floor under a two-shard pipeline: what two processes running a model's two shards
cost on this machine with nothing of the engine between them.

`studiotui bench` pairs it with mlx-lm's single process as it pairs the pipeline
(`moe_pipe2_floor_ratio`), so `moe_pipe2_over_floor` says what the engine adds to the
bare mechanism, in the same run and under the same load. Each process loads its shard
as a runner does (`shard.load_shard`: mlx-lm's own model classes, the CPU's fused ops
and compiled mixture-of-experts blocks), and they pass the hidden state and the token
over a bare CURVE ZeroMQ PUSH/PULL hop each way (`bench.bare.BareEnd`), a ring
header packed at each send as a stage packs it. Each builds its next decode step while
the current one computes, on a placeholder whose bytes are written in when the input
comes, as `worker.stage` does (the same pieces: `fill_slot`, `to_array`, the greedy
`Sampler`). Nothing else: no admission, requests, detokenising, client replies, lanes
or timing figures.

    python -m studiotui.bench.pipe_floor tail HOME MODEL_DIR SPLIT BIND PEER
    python -m studiotui.bench.pipe_floor head HOME MODEL_DIR SPLIT BIND PEER [CHUNK]

HOME holds the two ends' keys (`bench.bare.pair_keys`); the head is end "a" and runs
layers [0, SPLIT), the tail end "b" and [SPLIT, n). The head prints `{"ready": true}`
once loaded, then reads one JSON object a line on stdin, `{"prompt": [ids], "tokens":
n}`, and prints `{"tokens": [...], "tps": x, "ran_ahead": k}`: n greedy tokens after the
prompt, the decode tokens/s from the first token to the last (as the bench times
mlx-lm's loop), and how many of the head's steps ran the graph built ahead. An
empty line or the end of its input stops both processes.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import zmq

from studiotui.bench.bare import BareEnd
from worker.sampling import Sampler, SamplingParams
from worker.shard import Shard, load_shard, read_config
from worker.shared.model_support import decoder_config
from worker.shared.protocol.frames import RingHeader, decode_ring_header, encode_ring_header
from worker.stage import NP_VIEW, dtype_name, fill_slot, to_array

RID = "floor"
# How long an end waits for the other before calling the run failed: the first frame
# waits for the other process to load its shard.
WAIT_MS = 120_000
# A frame's largest activation: a prefill chunk of a wide model, with room to spare.
MAX_FRAME_BYTES = 256 << 20


class FloorError(RuntimeError):
    pass


@dataclass(frozen=True)
class Ahead:
    """The next decode step, built while the current one computes."""

    offset: int
    slot: mx.array  # its input's placeholder: token ids (head) or the activation's bits
    out: mx.array  # lazy: the activation to pass on, or the greedy token (tail)


class FloorStage:
    """One shard, one sequence at a time, and the bare end it talks through."""

    def __init__(self, shard: Shard, end: BareEnd) -> None:
        self.shard = shard
        self.end = end
        self.sampler = Sampler(SamplingParams())  # greedy: mlx-lm's argmax
        self.cache = shard.make_cache()
        self.ahead: Ahead | None = None
        self.slots: tuple[mx.array, mx.array] | None = None
        self.slots_of: tuple[tuple[int, ...], type[np.generic]] | None = None
        self.ran_ahead = 0  # decode steps of this sequence that ran the graph built ahead
        self.poller = zmq.Poller()
        self.poller.register(end.pull, zmq.POLLIN)

    def reset(self) -> None:
        """A new sequence: fresh caches, nothing built ahead."""
        self.cache = self.shard.make_cache()
        self.sampler = Sampler(SamplingParams())  # one per sequence, as per request
        self.ahead = None
        self.ran_ahead = 0

    def forward(self, h: mx.array) -> mx.array:
        """This shard's layers on `h`; on the tail, the greedy token they lead to."""
        out = self.shard.forward(h, self.cache)
        if self.shard.is_last:
            drawn = self.sampler.draw(self.shard.logits(out))
            assert isinstance(drawn, mx.array)  # no logprobs asked for
            return drawn
        return out

    def start(self, header: RingHeader, values: np.ndarray) -> mx.array:
        """Start the decode step `header` names on its input (token ids on the head, the
        activation's bits elsewhere): the one built ahead, or one built now."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            if ahead.offset != header.offset:
                raise FloorError(f"a step built for offset {ahead.offset} got {header.offset}")
            fill_slot(ahead.slot, values)
            out = ahead.out
            self.ran_ahead += 1
        elif self.shard.is_first:
            out = self.forward(self.shard.embed(mx.array(values)))
        else:
            out = self.forward(to_array(header, values.data))
        mx.async_eval(out)
        return out

    def build_ahead(self, offset: int, shape: tuple[int, ...], dtype: str) -> None:
        """Build the step at `offset` on a placeholder (two kept, alternating, so the
        step built never shares a buffer with the one computing)."""
        view = np.int32 if self.shard.is_first else NP_VIEW[dtype]
        if self.slots is None or self.slots_of != (shape, view):
            self.slots = (mx.array(np.zeros(shape, view)), mx.array(np.zeros(shape, view)))
            self.slots_of = (shape, view)
        slot = self.slots[offset % 2]
        h = slot.view(mx.bfloat16) if dtype == "bfloat16" else slot
        out = self.forward(self.shard.embed(h) if self.shard.is_first else h)
        self.ahead = Ahead(offset=offset, slot=slot, out=out)

    def send(self, header: RingHeader, activation: mx.array | None) -> None:
        # As a runner sends a ring frame: the header packed here, the activation's
        # buffer as it is (copied by ZeroMQ when small).
        view = memoryview(activation) if activation is not None else b""  # type: ignore[arg-type]
        copy = activation is None or activation.nbytes < 65536
        self.end.push.send_multipart([encode_ring_header(header), view], copy=copy)

    def recv(self) -> tuple[RingHeader, memoryview]:
        if not self.poller.poll(WAIT_MS):
            raise FloorError(f"the other end sent nothing for {WAIT_MS // 1000} s")
        parts = self.end.pull.recv_multipart(copy=False)
        payload = parts[1].buffer if len(parts) > 1 else memoryview(b"")
        return decode_ring_header(parts[0].bytes, len(payload)), payload


def run_head(stage: FloorStage, prompt: list[int], n: int, chunk: int) -> dict[str, Any]:
    """Decode `n` greedy tokens after `prompt` through both shards."""
    stage.reset()
    done = 0
    while len(prompt) - done > 1:  # all but the last token, a chunk at a time, as a stage
        k = min(chunk, len(prompt) - done - 1)
        h = stage.forward(stage.shard.embed(mx.array([prompt[done : done + k]])))
        mx.eval(h)
        stage.send(_activation("prefill", done, h, n), h)
        done += k
    tokens: list[int] = []
    stamps: list[float] = []
    token, offset = prompt[-1], len(prompt) - 1
    while True:
        out = stage.start(
            RingHeader(rid=RID, kind="decode", offset=offset), np.array([[token]], dtype=np.int32)
        )
        if len(tokens) + 1 < n:
            stage.build_ahead(offset + 1, (1, 1), "")
        mx.eval(out)
        stage.send(_activation("decode", offset, out, n), out)
        header, _ = stage.recv()
        if header.kind != "token":
            raise FloorError(f"the tail failed: {header.message}")
        tokens.append(header.token)
        stamps.append(time.perf_counter())
        if len(tokens) == n:
            break
        token, offset = header.token, offset + 1
    tps = (len(tokens) - 1) / (stamps[-1] - stamps[0]) if len(tokens) > 1 else 0.0
    return {"tokens": tokens, "tps": tps, "ran_ahead": stage.ran_ahead}


def serve_tail(stage: FloorStage) -> None:
    """Answer the head's frames until it says stop ("free"): a sequence starts at offset
    0 and asks for `max_tokens` (the step after the last is not built, as on a stage)."""
    generated, wanted = 0, 0
    while True:
        header, payload = stage.recv()
        if header.kind == "free":
            return
        if header.offset == 0:
            stage.reset()
            generated, wanted = 0, int((header.params or {}).get("max_tokens", 1))
        if header.kind == "prefill":
            stage.shard.forward(to_array(header, payload), stage.cache)
            mx.eval([c.state for c in stage.cache])  # a prefill chunk only fills the cache
            continue
        drawn = stage.start(header, np.frombuffer(payload, dtype=NP_VIEW[header.dtype]))
        generated += 1
        if generated < wanted:
            stage.build_ahead(header.offset + 1, header.shape, header.dtype)
        token = int(cast(int, drawn.item()))
        stage.send(RingHeader(rid=RID, kind="token", token=token), None)


def _activation(kind: str, offset: int, h: mx.array, n: int) -> RingHeader:
    return RingHeader(
        rid=RID,
        kind=kind,
        offset=offset,
        dtype=dtype_name(h),
        shape=tuple(h.shape),
        params={"max_tokens": n},
    )


def main(argv: list[str]) -> int:
    if len(argv) not in (6, 7) or argv[0] not in ("head", "tail"):
        print(
            "usage: python -m studiotui.bench.pipe_floor head|tail"
            " HOME MODEL_DIR SPLIT BIND PEER [CHUNK]",
            file=sys.stderr,
        )
        return 2
    role, home, model_dir, split = argv[0], Path(argv[1]), Path(argv[2]), int(argv[3])
    head = role == "head"
    shard = (
        load_shard(model_dir, 0, split)
        if head
        else load_shard(model_dir, split, _layers(model_dir))
    )
    end = BareEnd(home, "a" if head else "b", argv[4], argv[5], max_bytes=MAX_FRAME_BYTES)
    stage = FloorStage(shard, end)
    try:
        if not head:
            try:
                serve_tail(stage)
            except Exception as exc:  # the head would otherwise wait for a token
                stage.send(RingHeader(rid=RID, kind="error", message=_describe(exc)), None)
                raise
            return 0
        chunk = int(argv[6]) if len(argv) == 7 else 128
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if not line.strip():
                break
            ask = json.loads(line)
            try:
                answer = run_head(stage, list(ask["prompt"]), int(ask["tokens"]), chunk)
            except Exception as exc:
                print(json.dumps({"error": _describe(exc)}), flush=True)
                return 1
            print(json.dumps(answer), flush=True)
        stage.send(RingHeader(rid=RID, kind="free"), None)
        return 0
    finally:
        end.close()


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _layers(model_dir: Path) -> int:
    """The model's decoder layers, from its config (a nested text_config merged in)."""
    layers = decoder_config(read_config(model_dir)).get("num_hidden_layers")
    if not isinstance(layers, int):
        raise FloorError(f"{model_dir}/config.json does not say how many layers it has")
    return layers


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
