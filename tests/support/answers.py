"""One answer read off `Controller.generate`: its tokens and how many prompt tokens it reused."""

from typing import Any

from worker.shared.protocol import control


async def greedy_turn(ctl: Any, placement: str, prompt: list[int], n: int) -> tuple[list[int], int]:
    """`n` greedy tokens of `prompt` (end of text ignored) and the answer's cached tokens
    (-1 when no done came)."""
    tokens: list[int] = []
    cached = -1
    params = {"max_tokens": n, "ignore_eos": True}
    async for msg in ctl.generate(placement, {"tokens": prompt}, params):
        if isinstance(msg, control.Delta):
            tokens += msg.tokens
        elif isinstance(msg, control.Done):
            cached = msg.usage["cached_tokens"]
    return tokens, cached
