"""Ring headers: decoded straight into a RingHeader when their fields have the usual
types, else field by field, which names the fault; both give the same header."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from worker.shared.protocol.frames import FrameError, RingHeader, decode_ring_header
from worker.shared.protocol.frames import encode_ring_header as encode

HEADERS = [
    RingHeader(
        rid="r1",
        kind="decode",
        offset=17,
        dtype="float32",
        shape=(1, 1, 4),
        params={"temperature": 0.0, "stop": ["\n"]},
        extra={"head_us": 812.5, "mlx_us": 2040.0},
    ),
    RingHeader(rid="r1", kind="prefill", dtype="bfloat16", shape=(1, 8, 4)),
    RingHeader(
        rid="r1", kind="token", token=42, finish="length", extra={"logprobs": [-0.1, [[42, -0.1]]]}
    ),
    RingHeader(
        rid="b0", kind="decode", dtype="float16", shape=(2, 1, 4), batch=(("a", 3), ("b", 9))
    ),
    RingHeader(rid="b0", kind="token", batch=(("a", 5, "", None), ("b", 6, "stop", [-0.5, []]))),
    RingHeader(rid="r1", kind="free"),
    RingHeader(rid="r1", kind="error", message="a bad frame reached stage 1"),
]


@pytest.mark.parametrize("header", HEADERS, ids=lambda h: f"{h.kind}{'-batch' if h.batch else ''}")
def test_every_kind_of_header_comes_back_as_it_was_sent(header: RingHeader) -> None:
    assert decode_ring_header(encode(header), header.expected_bytes()) == header


def _raw(**fields: Any) -> bytes:
    """A header as any sender may pack it: its fields in RingHeader's order, as an array."""
    base = {"rid": "r9", "kind": "decode", "offset": 3, "dtype": "float32", "shape": [1, 1, 4]}
    given = {**base, **fields}
    names = RingHeader.__struct_fields__
    last = max(names.index(name) for name in given)
    defaults = msgspec.msgpack.decode(encode(RingHeader(rid="", kind="")))
    return msgspec.msgpack.encode(
        [given.get(n, defaults[i]) for i, n in enumerate(names[: last + 1])]
    )


def test_a_header_is_an_array_of_its_fields_in_order() -> None:
    """Compact on the wire: no field names, every field in RingHeader's order."""
    h = RingHeader(rid="r1", kind="decode", offset=3, dtype="float16", shape=(1, 1, 8))
    sent = msgspec.msgpack.decode(encode(h))
    assert sent[:5] == ["r1", "decode", 3, "float16", [1, 1, 8]]
    assert len(sent) == len(RingHeader.__struct_fields__)


def test_unusual_fields_are_decoded_field_by_field_and_faults_named_with_the_request() -> None:
    # Types the direct decoding refuses still decode where the header means something:
    assert decode_ring_header(_raw(extra=None), 16).extra == {}
    # ... and a fault is named, with the request it belongs to, on either way.
    for fields, fault in (
        ({"offset": True}, "expected an integer"),
        ({"shape": [1, "x", 4]}, "expected an integer"),
        ({"kind": "explode"}, "unknown ring message kind"),
        ({"dtype": "int64"}, "dtype 'int64'"),
        ({"batch": [["a", 1], ["a", 2]]}, "twice in one batch"),
        ({"params": [1, 2]}, "params must be a map"),
    ):
        with pytest.raises(FrameError, match=fault) as caught:
            decode_ring_header(_raw(**fields), 16)
        assert caught.value.rid == "r9"
    with pytest.raises(FrameError, match="payload has 15 bytes"):
        decode_ring_header(_raw(), 15)
    with pytest.raises(FrameError, match="string 'rid'"):
        decode_ring_header(msgspec.msgpack.encode({"kind": "free"}), 0)
    with pytest.raises(FrameError, match="string 'rid'"):
        decode_ring_header(msgspec.msgpack.encode([7, "free"]), 0)
    with pytest.raises(FrameError, match="13 fields"):
        decode_ring_header(msgspec.msgpack.encode(["r", "free", *([0] * 11)]), 0)
