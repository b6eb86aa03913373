"""The prefix cache's bench rows: the last turn of a long conversation, paired.

`multiturn_ttft_ratio`: time to first token of the last turn of a conversation whose
history reaches ~4k tokens, when the turn before it is cached, over the same turn
prefilled in full (the cache emptied first, `cache clear`). Each pair runs back to
back and the ratio is the median of the pairs' own ratios (a shared machine slows
whole seconds down now and then).

`disk_hit_ttft_ratio`: the same turn after the placement is loaded again (unloaded
and placed, as after a restart: memory holds nothing, every stage reads its entry
from the node's disk) over the same full prefill.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from studiotui.cluster.controller import Controller
from studiotui.cluster.streams import prompt_tokens, stream

NAME = "bench-cache"
HISTORY = 3968  # the turn before the last: the history a client resends
NEW = 96  # what the last turn adds (the answer before it, and a question)
ANSWER = 8


def _turns() -> tuple[list[int], list[int]]:
    before = prompt_tokens(HISTORY)
    last = before + [(11 * i) % 150 + 40 for i in range(NEW)]
    return before, last


async def _ttft(ctl: Controller, tokens: list[int]) -> tuple[float, list[int]]:
    run = await stream(ctl, NAME, tokens, ANSWER)
    return run["ttft_ms"], run["tokens"]


async def cache_figures(
    ctl: Controller, model_dir: Path, nodes: list[str], prefill_chunk: int, rounds: int
) -> dict[str, Any]:
    """The two rows (and their pairs) on a 2-stage placement of `model_dir`."""
    before, last = _turns()

    async def place() -> None:
        await ctl.place(model_dir, nodes, NAME, prefill_chunk=prefill_chunk, context_tokens=8192)

    await place()
    hits: list[float] = []
    fulls: list[float] = []
    answers: list[list[int]] = []
    try:
        await _ttft(ctl, prompt_tokens(64))  # warm up
        for _ in range(rounds):
            await ctl.clear_cache(NAME)
            await _ttft(ctl, before)  # the turn before, stored
            hit, tokens = await _ttft(ctl, last)
            await ctl.clear_cache(NAME)
            full, cold = await _ttft(ctl, last)
            hits.append(hit / full)
            fulls.append(full)
            answers += [tokens, cold]
        # From disk: the turn before stored, the placement loaded again.
        disk: list[float] = []
        for _ in range(rounds):
            await ctl.clear_cache(NAME)
            await _ttft(ctl, before)
            await ctl.unload(NAME)
            await place()
            from_disk, tokens = await _ttft(ctl, last)
            await ctl.clear_cache(NAME)
            full, cold = await _ttft(ctl, last)
            disk.append(from_disk / full)
            answers += [tokens, cold]
    finally:
        await ctl.unload(NAME)
    return {
        "multiturn_ttft_ratio": round(statistics.median(hits), 3),
        "multiturn_ttft_pairs": [round(r, 3) for r in hits],
        "multiturn_full_ttft_ms": round(statistics.median(fulls), 1),
        "multiturn_history_tokens": len(last),
        "disk_hit_ttft_ratio": round(statistics.median(disk), 3),
        "disk_hit_ttft_pairs": [round(r, 3) for r in disk],
        # A hit answers as the full prefill does (greedy, the same tokens).
        "cache_tokens_match": all(a == answers[0] for a in answers),
    }
