"""What every probe parser shares: the one exception callers catch, the decorator that
funnels every failure into it, JSON (and JSONC) reading, numbers, and the network
interface both platforms report."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class ProbeParseError(ValueError):
    """A probe printed something its parser cannot read."""

    def __init__(self, probe: str, detail: str) -> None:
        super().__init__(f"{probe}: {detail}")
        self.probe = probe


def probe_parser(
    name: str,
) -> Callable[[Callable[Concatenate[str, P], R]], Callable[Concatenate[str | bytes, P], R]]:
    """Normalise the input text and funnel every failure into ProbeParseError.

    Callers must be able to catch a single exception type; a stray KeyError from
    an odd JSON shape would otherwise crash the agent's telemetry loop.
    """

    def wrap(fn: Callable[Concatenate[str, P], R]) -> Callable[Concatenate[str | bytes, P], R]:
        @functools.wraps(fn)
        def inner(text: str | bytes, /, *args: P.args, **kwargs: P.kwargs) -> R:
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            if not isinstance(text, str):
                raise ProbeParseError(name, f"expected text, got {type(text).__name__}")
            try:
                return fn(text, *args, **kwargs)
            except ProbeParseError:
                raise
            except Exception as exc:  # the contract: one exception type for callers
                raise ProbeParseError(name, f"{type(exc).__name__}: {exc}") from exc

        return inner

    return wrap


def json_object(text: str, probe: str) -> Any:
    """json.loads, falling back to JSONC (comments, trailing commas) as in READMEs."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return json.loads(_strip_jsonc(text))
    except json.JSONDecodeError as exc:
        raise ProbeParseError(probe, f"not valid JSON ({exc.msg} at line {exc.lineno})") from None


# Strings are matched first so `//` or `,}` inside a string value survive. Two
# passes: a comment may sit between a trailing comma and its bracket.
_JSONC_COMMENT = re.compile(r'("(?:\\.|[^"\\])*")|//[^\n]*')
_JSONC_COMMA = re.compile(r'("(?:\\.|[^"\\])*")|,(\s*[}\]])')


def _strip_jsonc(text: str) -> str:
    text = _JSONC_COMMENT.sub(lambda m: m.group(1) or "", text)
    return _JSONC_COMMA.sub(lambda m: m.group(1) or m.group(2), text)


def json_number(value: Any) -> float | None:
    """A JSON number as float; None for missing or non-numbers (bool is not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def int_or_none(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


@dataclass(frozen=True)
class Interface:
    """A network interface from `ifconfig` (macOS) or `ip -j addr` (Linux).

    `ipv4`/`ipv6` are bare addresses (IPv6 without its %scope: the interface name
    is the scope); `ipv4_cidrs` has the same IPv4 addresses with their prefix.
    `status` is as printed: "active"/"inactive" on macOS, the operstate on Linux.
    `members` are the bridge's member interfaces.
    """

    name: str
    flags: tuple[str, ...] = ()
    mtu: int | None = None
    ether: str | None = None
    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()
    status: str | None = None
    members: tuple[str, ...] = ()
    ipv4_cidrs: tuple[str, ...] = ()

    @property
    def up(self) -> bool:
        return "UP" in self.flags

    @property
    def active(self) -> bool:
        return self.status in ("active", "up")
