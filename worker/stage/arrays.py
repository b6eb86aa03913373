"""Activations as bytes: how a ring frame's payload becomes an MLX array and back."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from worker.shared.protocol.frames import RingHeader
from worker.stage.records import RequestError

# How an activation of each dtype is read and written with numpy (bfloat16, which numpy
# lacks, as its uint16 bits).
NP_VIEW: dict[str, type[np.generic]] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
}

_MX_DTYPE = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

_DTYPE_NAME = {v: k for k, v in _MX_DTYPE.items()}

MX_OF = {np.int32: mx.int32, np.float32: mx.float32, np.float16: mx.float16, np.uint16: mx.uint16}


def to_array(header: RingHeader, payload: bytes | memoryview) -> mx.array:
    flat = np.frombuffer(payload, dtype=NP_VIEW[header.dtype])
    arr = mx.array(flat)
    if header.dtype == "bfloat16":
        arr = arr.view(mx.bfloat16)
    return arr.reshape(header.shape)


def dtype_name(arr: mx.array) -> str:
    if arr.dtype not in _DTYPE_NAME:
        raise RequestError(f"activation dtype {arr.dtype} cannot travel the ring")
    return _DTYPE_NAME[arr.dtype]


def hidden_size(config: dict[str, Any]) -> int:
    """The width of the activations between layers (0 if the config does not say)."""
    text = config.get("text_config")
    raw = config.get("hidden_size") or (text.get("hidden_size") if isinstance(text, dict) else 0)
    return int(raw or 0)


def fill_slot(slot: mx.array, values: np.ndarray) -> None:
    """Write an input into an evaluated placeholder, in place; MLX reads the bytes
    when the step built on it is evaluated. (copy=False fails rather than copies.)"""
    view = np.array(slot, copy=False)
    if values.dtype != view.dtype or values.size != view.size:
        # Assigning would convert the numbers, not copy the bits: refuse instead.
        raise RequestError(
            f"frame holds {values.dtype} x {values.size}, "
            f"the step expects {view.dtype} x {view.size}"
        )
    view[...] = values.reshape(view.shape)
