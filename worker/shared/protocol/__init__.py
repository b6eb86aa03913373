"""The wire between the operator and the nodes: the only module both sides import.

`messages` holds the control-plane message types and their validation, `frames`
the data-plane activation header, `curve` the ZeroMQ CURVE key handling.
"""

from worker.shared.protocol.curve import (
    CurveKeys,
    ensure_keypair,
    load_keypair,
    load_public_keys,
)
from worker.shared.protocol.frames import (
    DTYPE_SIZES,
    FrameError,
    RingHeader,
    decode_ring_header,
    encode_ring_header,
)
from worker.shared.protocol.messages import (
    PROTOCOL_VERSION,
    MessageError,
    decode,
    encode,
    make,
)

__all__ = [
    "DTYPE_SIZES",
    "PROTOCOL_VERSION",
    "CurveKeys",
    "FrameError",
    "MessageError",
    "RingHeader",
    "decode",
    "decode_ring_header",
    "encode",
    "encode_ring_header",
    "ensure_keypair",
    "load_keypair",
    "load_public_keys",
    "make",
]
