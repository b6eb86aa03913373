"""Data-plane frames: `[header, raw payload]` between the shards of a ring.

The payload is the evaluated activation's bytes in its own dtype (bfloat16
travels as its 16-bit pattern). The header says how to view those bytes back, and
`decode_ring_header` checks the two agree before any shard touches them.

The header is a msgspec struct sent as a msgpack array of its fields in order, without
their names: a decode frame's header is some 60 bytes.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
# "reuse": the head names a prefix cache entry every stage copies for a request; the
# tail sends it back to the head saying whether every stage held it.
KINDS = ("prefill", "decode", "verify", "free", "error", "token", "reuse")
# Kinds that carry an activation (token ids on the head's own steps).
STEPS = ("prefill", "decode", "verify")
# Guesses one verify frame may carry (speculative decoding; worker/speculation.py).
MAX_DRAFT = 64
MAX_DIMS = 4
# Rows of one batched decode step: far more than a placement admits at once.
MAX_BATCH = 1024


class FrameError(ValueError):
    """A data-plane frame that cannot be used; `rid` is set when it is known."""

    def __init__(self, message: str, rid: str | None = None) -> None:
        super().__init__(message)
        self.rid = rid


class RingHeader(msgspec.Struct, frozen=True, array_like=True):
    """A ring frame's header (change a field with msgspec.structs.replace)."""

    rid: str
    kind: str
    offset: int = 0
    dtype: str = ""
    shape: tuple[int, ...] = ()
    params: dict[str, Any] | None = None
    token: int = -1
    finish: str = ""
    message: str = ""
    extra: dict[str, Any] = {}
    # A batched decode step (`rid` names the batch): per row, in order, (rid, offset) on
    # a decode frame, (rid, token, finish, logprobs or None) on the tokens coming back.
    batch: tuple[tuple[Any, ...], ...] = ()
    # Speculative decoding: on a "verify" frame, the guessed tokens after the step's
    # first (the frame holds 1 + len(draft) positions); on the "token" frame answering
    # it, the guesses kept, which come before `token` in the answer.
    draft: tuple[int, ...] = ()

    def expected_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype] if self.dtype else 0


_FIELDS = RingHeader.__struct_fields__
_encoder = msgspec.msgpack.Encoder()


def encode_ring_header(h: RingHeader) -> bytes:
    return _encoder.encode(h)


def decode_ring_header(data: bytes, payload_len: int) -> RingHeader:
    try:
        header = _typed.decode(data)
    except msgspec.DecodeError:  # not a header of the usual types: say what is wrong
        header = _decode_checked(data)
    else:
        if header.kind not in KINDS:
            raise FrameError(f"unknown ring message kind {header.kind!r}", header.rid)
        if header.batch:
            try:
                _batch([list(row) for row in header.batch])
            except TypeError as exc:
                raise FrameError(f"bad ring header field: {exc}", header.rid) from None
    if len(header.draft) > MAX_DRAFT or any(t < 0 for t in header.draft):
        raise FrameError(f"draft must be at most {MAX_DRAFT} token ids", header.rid)
    if header.kind in STEPS:
        _check_activation(header, payload_len)
    return header


# A stage decodes a header per frame, right after waking for it: msgspec decodes one
# straight into a RingHeader, checking each field's type (bool is no integer there
# either), in ~1 µs against ~6 µs for unpacking it and checking it field by field; a
# header it refuses is decoded that slower way, which names the fault.
_typed = msgspec.msgpack.Decoder(RingHeader)


def _decode_checked(data: bytes) -> RingHeader:
    try:
        fields = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as exc:
        raise FrameError(f"ring header is not msgpack: {exc}") from None
    if not isinstance(fields, list) or not fields or not isinstance(fields[0], str):
        raise FrameError("ring header must be an array starting with a string 'rid'")
    if len(fields) > len(_FIELDS):
        raise FrameError(f"ring header has {len(fields)} fields, not {len(_FIELDS)}", fields[0])
    raw = dict(zip(_FIELDS, fields, strict=False))
    rid = raw["rid"]
    kind = raw.get("kind")
    if kind not in KINDS:
        raise FrameError(f"unknown ring message kind {kind!r}", rid)
    try:
        header = RingHeader(
            rid=rid,
            kind=kind,
            offset=_int(raw.get("offset", 0)),
            dtype=str(raw.get("dtype", "")),
            shape=tuple(_int(d) for d in raw.get("shape", ())),
            params=raw.get("params"),
            token=_int(raw.get("token", -1)),
            finish=str(raw.get("finish", "")),
            message=str(raw.get("message", "")),
            extra=dict(raw.get("extra") or {}),
            batch=_batch(raw.get("batch")),
            draft=tuple(_int(t) for t in raw.get("draft") or ()),
        )
    except (TypeError, ValueError) as exc:
        raise FrameError(f"bad ring header field: {exc}", rid) from None
    return header


def _check_activation(h: RingHeader, payload_len: int) -> None:
    if h.dtype not in DTYPE_SIZES:
        raise FrameError(f"activation dtype {h.dtype!r} is not one of {sorted(DTYPE_SIZES)}", h.rid)
    if not 1 <= len(h.shape) <= MAX_DIMS or any(d <= 0 for d in h.shape):
        raise FrameError(f"activation shape {list(h.shape)} is not a valid shape", h.rid)
    if h.expected_bytes() != payload_len:
        raise FrameError(
            f"payload has {payload_len} bytes but header says {h.dtype}{list(h.shape)} "
            f"= {h.expected_bytes()} bytes",
            h.rid,
        )
    if h.params is not None and not isinstance(h.params, dict):
        raise FrameError("params must be a map", h.rid)
    if h.offset < 0:
        raise FrameError(f"negative cache offset {h.offset}", h.rid)


def _batch(raw: Any) -> tuple[tuple[Any, ...], ...]:
    """The rows of a batched step: each a list naming its request id first."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_BATCH:
        raise TypeError(f"batch must be a list of at most {MAX_BATCH} rows")
    rows = []
    for row in raw:
        if not isinstance(row, list) or not 2 <= len(row) <= 4 or not isinstance(row[0], str):
            raise TypeError(f"batch row {row!r} is not [rid, ...]")
        if isinstance(row[1], bool) or not isinstance(row[1], int):
            raise TypeError(f"batch row {row!r}: {row[1]!r} is not an offset or token")
        rows.append(tuple(row))
    if len({row[0] for row in rows}) != len(rows):
        raise TypeError("a request appears twice in one batch")
    return tuple(rows)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value
