"""The wire between the operator and the nodes: the only module both sides import.

`messages` holds the control plane's version, error codes and errors, `control` every
control message as a struct tagged by its type, with the encoder and the decoder that
reads a message straight into its struct, `frames` the data-plane activation header,
`curve` the ZeroMQ CURVE key handling.
"""

from worker.shared.protocol.control import AnyMessage, Error, Message, build, decode, encode
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
    CodedError,
    ErrorCode,
    MessageError,
)

__all__ = [
    "DTYPE_SIZES",
    "PROTOCOL_VERSION",
    "AnyMessage",
    "CodedError",
    "CurveKeys",
    "Error",
    "ErrorCode",
    "FrameError",
    "Message",
    "MessageError",
    "RingHeader",
    "build",
    "decode",
    "decode_ring_header",
    "encode",
    "encode_ring_header",
    "ensure_keypair",
    "load_keypair",
    "load_public_keys",
]
