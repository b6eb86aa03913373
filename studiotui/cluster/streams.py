"""Timed decode streams against a placement: what `studiotui bench` and the cluster
benchmark both measure tok/s and time to first token with."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

from studiotui.cluster.controller import Controller
from worker.shared.protocol import control


def prompt_tokens(n: int) -> list[int]:
    """A fixed prompt of `n` token ids (the same every run, inside any demo vocabulary)."""
    return [(7 * i) % 200 + 32 for i in range(n)]


async def stream(
    ctl: Controller, name: str, tokens: list[int], n: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Decode `n` tokens (end of turn ignored) after `tokens`, with `extra` sampling
    parameters (a grammar, say); the tokens and their timing."""
    got: list[int] = []
    stamps: list[float] = []
    timings: dict[str, Any] = {}
    start = time.perf_counter()
    params = {"max_tokens": n, "ignore_eos": True, **(extra or {})}
    async for msg in ctl.generate(name, {"tokens": tokens}, params):
        match msg:
            case control.Delta():
                got += msg.tokens
                stamps.append(time.perf_counter())
            case control.Done():
                timings = msg.timings
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {
        "tokens": got,
        "tps": (len(got) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0,
        "gap_p50": statistics.median(gaps) if gaps else 0.0,
        "ttft_ms": (stamps[0] - start) * 1000 if stamps else 0.0,
        "start": start,
        "end": stamps[-1] if stamps else start,
        # The median hop of its decode steps, as its head measured them (a ring's only).
        "hop_us_p50": timings.get("hop_us_p50"),
    }
