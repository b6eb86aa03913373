"""One answer read off `Controller.generate`: its tokens and how many prompt tokens it reused."""

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

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


def greedy_with_margins(
    model: Path, prompt: list[int], n: int, processors: list[Any] | None = None
) -> tuple[list[int], list[float]]:
    """mlx-lm's greedy tokens of `prompt` (8-token prefill chunks) and, per step, its
    top-1 minus top-2 log-probability: a tensor group's sums, added in another order,
    can be held to the tokens only up to the first step whose top two are close."""
    loaded, _ = mlx_lm.load(str(model))
    tokens, margins = [], []
    steps = generate_step(
        mx.array(prompt), loaded, max_tokens=n, prefill_step_size=8, logits_processors=processors
    )
    for tok, logprobs in steps:
        top2 = mx.sort(logprobs)[-2:]
        tokens.append(int(tok))
        margins.append(float((top2[1] - top2[0]).item()))
    return tokens, margins
