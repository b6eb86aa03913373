"""Argument types the verbs share: a bad number is refused by argparse, naming its
option, before anything is written or asked of a node."""

from __future__ import annotations

import argparse
import math

MAX_PORT = 65535


def positive(text: str) -> int:
    """A whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"wants a whole number of at least 1, got {text!r}")
    return int(text)


def whole(text: str) -> int:
    """A whole number, 0 included (a seed, say)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"wants a whole number (0 or more), got {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    """A finite number above 0 (gigabytes, say)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"wants a number above 0, got {text!r}")
    return value


def gigabytes(text: str) -> float:
    """A finite number of gigabytes, 0 included (none)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"wants a number of GB (0 or more), got {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port to connect to or to give agents: 1-65535."""
    if not text.isdigit() or not 1 <= int(text) <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"wants a port 1-{MAX_PORT}, got {text!r}")
    return int(text)


def listen_port(text: str) -> int:
    """A port to listen on: 1-65535, or 0 for any free one."""
    if text == "0":
        return 0
    try:
        return port(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"wants a port 1-{MAX_PORT} (0: any free one), got {text!r}"
        ) from None
