"""`studiotui bench`'s time-to-first-token rows: a prompt of several prefill chunks on
two stages over the same prompt in one mlx-lm process, paired run by run.

- `ttft_pipe2_ratio`: the bench's dense model, a prompt longer than one of the
  placement's prefill chunks (the product's default, 512), so several chunks cross
  between the stages.
- `moe_ttft_ratio`: a 4-bit qwen3_moe demo as `studiotui demo-model --arch qwen3_moe
  --quantize 4` writes it (bfloat16 scales, mlx-lm keeping the router at 8 bits) and a
  ~600-token prompt: a new user's first long question to a mixture of experts.

Both are times (the pipeline's over mlx-lm's): below 1 the pipeline answers sooner.
mlx-lm runs `generate_step` with its own default prefill step, the time taken to its
first token; the pipeline's is the controller's, from the request to the first token
(`streams.stream`), with the placement's prefix cache emptied before each run so every
run prefills the whole prompt. Each side first answers a short prompt once (its first
run pays allocating), then the sides alternate (pipeline first, then mlx-lm first) and
a ratio is the median of the pairs' own ratios; both give the same first token.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

from studiotui.cluster.controller import Controller
from studiotui.cluster.streams import prompt_tokens, stream
from worker.shared.demo_model import DemoSpec

MOE_PROMPT = 600
DEFAULT_CHUNK = 512  # the chunk `studiotui place` uses unless told
CHUNKED_PROMPT = DEFAULT_CHUNK + 100
WARM_PROMPT = 64


def moe_ttft_spec(layers: int, hidden: int) -> DemoSpec:
    """The 4-bit MoE demo as `demo-model --arch qwen3_moe --quantize 4` writes it
    (bfloat16, as a quantized MoE's default)."""
    return DemoSpec(
        arch="qwen3_moe",
        layers=layers,
        hidden=hidden,
        heads=8,
        kv_heads=4,
        experts=8,
        quantize="4",
        dtype="bfloat16",
    )


class MlxTtft:
    """mlx-lm's loop on the whole model in this process, timed to its first token."""

    def __init__(self, model_dir: Path) -> None:
        self.model = mlx_lm.load(str(model_dir))[0]

    def first(self, prompt: list[int]) -> tuple[float, int]:
        """Milliseconds to the first token, and that token."""
        start = time.perf_counter()
        for token, _ in generate_step(mx.array(prompt), self.model, max_tokens=1):
            return (time.perf_counter() - start) * 1000, int(token)
        raise RuntimeError("mlx-lm gave no token")


async def paired_ttft(
    ctl: Controller, name: str, single: MlxTtft, prompt: list[int], rounds: int
) -> dict[str, Any]:
    """`rounds` pairs of a pipeline run and an mlx-lm run of `prompt`, the order
    alternating, after a short prompt on each side; the pairs' ratios, their median,
    and whether every first token agreed."""

    async def pipeline(tokens: list[int] = prompt) -> tuple[float, int]:
        await ctl.clear_cache(name)  # a full prefill every run, as a new prompt's
        run = await stream(ctl, name, tokens, 1)
        return run["ttft_ms"], run["tokens"][0]

    async def mlx(tokens: list[int] = prompt) -> tuple[float, int]:
        # In a thread, so the controller keeps hearing its nodes meanwhile.
        return await asyncio.to_thread(single.first, tokens)

    warm = prompt_tokens(WARM_PROMPT)
    await pipeline(warm)
    await mlx(warm)
    firsts: list[int] = []
    pipe_ms: list[float] = []
    mlx_ms: list[float] = []
    for r in range(rounds):
        sides = (pipeline, mlx) if r % 2 == 0 else (mlx, pipeline)
        for side in sides:
            ms, token = await side()
            (pipe_ms if side is pipeline else mlx_ms).append(ms)
            firsts.append(token)
    ratios = [p / s for p, s in zip(pipe_ms, mlx_ms, strict=True)]
    return {
        "ratio": round(statistics.median(ratios), 3),
        "pairs": [round(r, 3) for r in ratios],
        "pipe_ms": round(statistics.median(pipe_ms), 1),
        "mlx_ms": round(statistics.median(mlx_ms), 1),
        "prompt": len(prompt),
        "tokens_match": all(t == firsts[0] for t in firsts),
    }


async def ttft_figures(
    ctl: Controller, name: str, model_dir: Path, nodes: list[str], prompt_len: int, rounds: int
) -> dict[str, Any]:
    """Place `model_dir` on `nodes` as a user would (the default prefill chunk), pair its
    time to first token on a `prompt_len`-token prompt with mlx-lm's, unload."""
    single = await asyncio.to_thread(MlxTtft, model_dir)
    await ctl.place(model_dir, nodes, name, prefill_chunk=DEFAULT_CHUNK)
    try:
        return await paired_ttft(ctl, name, single, prompt_tokens(prompt_len), rounds)
    finally:
        await ctl.unload(name)
