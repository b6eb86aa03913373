"""The records a stage keeps per request and per step, and small readers of them."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import mlx.core as mx

from worker.families import LayerCaches
from worker.sampling import (
    Sampler,
    SamplingParams,
    TextStream,
)
from worker.shared.protocol.frames import RingHeader
from worker.shared.protocol.messages import ErrorCode
from worker.speculation import DraftSession, Speculation
from worker.tool_calls import ToolCallStream

# Requests that may wait for a stream, per stream the placement serves: enough to
# smooth a burst, few enough that a client is told "busy" in time to go elsewhere.
WAITING_PER_STREAM = 4


# What the head measures of each decode step's round (`Figures._ring_figures`), in µs:
# a hop (a send call to the next stage's recv returning), a stage's own time with a
# frame less MLX's evaluation (its Python), the step's time less every stage's MLX
# evaluation (the ring's whole overhead), the step's time, and the MLX evaluation.
RING_FIGURES = ("hop", "frame", "overhead", "token", "mlx")


class Links(Protocol):
    def to_next(self, header: RingHeader, activation: mx.array | None) -> None: ...
    def to_head(self, header: RingHeader) -> None: ...
    def to_client(self, client: bytes, kind: str, **fields: Any) -> None: ...


class RequestError(ValueError):
    """A request the head refuses; `code` says which kind of refusal and `param` which
    field of the request it blames, if one (the `failed` message carries both: the
    operator decides on them, never on these words)."""

    def __init__(
        self, message: str, code: ErrorCode = "bad_request", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.param = param


@dataclass
class HeadRequest:
    client: bytes
    params: SamplingParams
    prompt: list[int]
    stream: TextStream
    tools: ToolCallStream | None = None  # the request gave tools: calls are parsed out
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    generated: int = 0
    cached: int = 0  # prompt tokens served by the prefix cache, not prefilled
    out: list[int] = field(default_factory=list)  # the tokens of the answer so far
    # Its decode steps' hops on a ring (the last 512, as the stage keeps its own).
    hops_us: deque[float] = field(default_factory=lambda: deque(maxlen=512))
    # Speculative decoding (None: it decodes a token a step): its guesses, what it kept,
    # the answer's tokens so far (prompt lookup reads them), its draft model's session.
    spec: Speculation | None = None
    answer: list[int] = field(default_factory=list)
    drafter: DraftSession | None = None


@dataclass(frozen=True)
class Waiting:
    """(head) A request waiting for a stream, as it will be admitted."""

    client: bytes
    params: SamplingParams
    prompt: list[int]
    tools: list[dict[str, Any]] | None
    spec: Speculation | None


@dataclass
class TailRequest:
    sampler: Sampler
    eos: frozenset[int]
    generated: int = 0

    def finish_of(self, token: int) -> str:
        """Why the answer ends at `token`, just drawn ("" if it goes on): end of turn
        (or of the grammar's answer), or max_tokens. A grammar advances past it."""
        grammar = self.sampler.grammar
        if grammar is not None and grammar.accept(token):
            return "stop"  # even with ignore_eos: the schema's answer is complete
        if token in self.eos:
            return "stop"
        return "length" if self.generated >= self.sampler.params.max_tokens else ""


@dataclass(frozen=True)
class Launched:
    """A step whose evaluation has begun (`mx.async_eval`); `_complete` waits for it
    and passes its result on. Between the two the stage does its bookkeeping, so
    that overlaps with the compute instead of delaying the next shard."""

    header: RingHeader
    out: Any  # the activation (or sampled token, or cache state) being evaluated


@dataclass(frozen=True)
class Prebuilt:
    """A request's next decode step, built while its input is still on the way.

    Building an MLX graph in Python costs about as much as a hop (1-2 ms for a
    few layers on a slow CPU). mlx-lm hides it by building step n+1 on the lazy
    token of step n; a pipeline stage cannot, its input comes from another
    process. So while each decode step computes, the stage builds the next one on
    `slot`, a placeholder holding bytes, and when the input arrives writes them
    into `slot` and evaluates `out`: the build happened while the stage waited.
    """

    offset: int  # the cache offset the step is for
    # Token ids (head) or the activation's bits (others), in place. None when the
    # step is built on the lazy token of the step before (a lone stage): no input to write.
    slot: mx.array | None
    # lazy; the activation to pass on, or what the tail's sampler drew
    out: mx.array | tuple[mx.array, ...] | None
    error: str = ""  # building it failed: the request ends when the step is due
    # What puts the caches back should the step not run after all (a verify frame comes
    # instead: `speculation.hold`); emptied when the step is taken, so the handles it
    # keeps do not stop the step's cache writes from reusing their buffers.
    undo: list[Any] = field(default_factory=list)
    mark: Any = None  # (the tail) what gives its draw back (`Sampler.undo`), likewise


@dataclass
class Group:
    """Requests this stage decodes together: one row each of mlx-lm's batched caches
    (`BatchKVCache` and kin), in `rows` order, which every stage of the ring keeps alike."""

    rows: list[str]
    offsets: list[int]  # per row, the cache offset of its next step
    caches: LayerCaches
    # After a verify step: per row, the least offset its next step may take (the step's
    # first token is always kept); a row's next offset below `offsets` cuts it back.
    floors: list[int] | None = None


@dataclass
class Lane:
    """(head) Requests that take their decode steps together. A placement has a lane
    per stage, so while one lane's batch computes on one shard another's can compute
    on the next; each decode-phase request belongs to the least-loaded lane."""

    gid: str  # names the lane's batch in the ring frames
    members: list[str] = field(default_factory=list)
    ready: dict[str, int] = field(default_factory=dict)  # a member's next input token
    flying: set[str] = field(default_factory=set)  # members of the step in flight


@dataclass(frozen=True)
class BatchDraw:
    """(tail) What a batched step sampled, per row of `rows`: either its own draw (in
    `draws`), or its place in `greedy`, one argmax over the rows without a draw."""

    rows: tuple[str, ...]
    greedy: mx.array | None
    draws: dict[str, Any]
    # A verify step's: each row's guesses (none for a row without), and `greedy` and a
    # row's draws then hold a token per position (`Sampler.draw_positions`).
    guesses: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class Stats:
    tokens: int = 0
    dropped: int = 0
    errors: int = 0
    finished: int = 0
    prebuilt: int = 0  # decode steps whose graph was built before their input came
    batched: int = 0  # decode steps that ran several requests as one batch
    batched_rows: int = 0  # the requests those steps ran, summed
    drafted: int = 0  # (head) guesses sent in verify frames
    kept: int = 0  # (head) ... of them kept
    dropped_ahead: int = 0  # decode steps built ahead, then not run: a verify frame came
    drafted_ahead: int = 0  # (head) a draft model's proposals made while the step before was out
    # (head) verify steps computed while the one before was out, then sent as they were
    # (every guess kept, as assumed) or cut back out of the caches (not).
    verified_ahead: int = 0
    dropped_verify_ahead: int = 0
    verified_batches: int = 0  # batched steps that verified some rows' guesses
    unguessed_batches: int = 0  # (head) batched steps left without guesses: no gain


def row_guesses(row: tuple[Any, ...]) -> tuple[int, ...]:
    """A batched verify frame's row (rid, offset, guesses): its guesses."""
    return tuple(int(t) for t in row[2]) if len(row) > 2 and row[2] else ()


def rows_of(header: RingHeader) -> list[str]:
    """The requests a step is for: the rows of a batch, or its one request."""
    return [str(row[0]) for row in header.batch] if header.batch else [header.rid]


def text_of(stream: TextStream, header: RingHeader) -> tuple[str, str]:
    """The text a token from the tail adds, and why the answer ends there ("" if not)."""
    if header.finish == "stop":  # end of turn: the token itself is not text
        return stream.finish(), "stop"
    text = stream.add(header.token)
    if stream.stopped:
        return text, "stop"
    if header.finish:
        return text + stream.finish(), header.finish
    return text, ""


def drawn_logprobs(drawn: tuple[mx.array, ...]) -> tuple[float, list[tuple[int, float]]]:
    """What the tail's sampler gave besides the token, as it travels to the head."""
    _, chosen, ids, values = drawn
    pairs = zip(cast(list[int], ids.tolist()), cast(list[float], values.tolist()), strict=True)
    return float(cast(float, chosen.item())), list(pairs)


def describe(exc: Exception) -> str:
    if isinstance(exc, RequestError | ValueError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
