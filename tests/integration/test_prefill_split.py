"""A prompt shorter than two of the placement's prefill chunks is cut smaller on a ring
(`worker.stage.admission.prefill_split`), so its stages compute side by side, and the
greedy tokens stay mlx-lm's own, run as a user runs it (its default prefill step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from tests.support.ring_harness import InProcessRing
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol.frames import RingHeader
from worker.stage.admission import MIN_SPLIT_CHUNK, prefill_split

PROMPT = [(7 * i) % 200 + 32 for i in range(300)]
N_TOKENS = 6
GREEDY = {"max_tokens": N_TOKENS, "temperature": 0.0, "ignore_eos": True}


def test_the_split_cuts_short_prompts_into_two_chunks_a_stage() -> None:
    assert prefill_split(599, 512, 2) == 150  # four chunks, not 512 + 87
    assert prefill_split(599, 512, 3) == 100
    assert prefill_split(599, 512, 1) == 512  # one process: nothing to overlap
    assert prefill_split(5000, 512, 2) == 512  # already two chunks a stage
    assert prefill_split(100, 512, 2) == MIN_SPLIT_CHUNK
    assert prefill_split(21, 8, 2) == 8  # never above the placement's chunk


def _reference(model: Path) -> list[int]:
    loaded, _ = mlx_lm.load(str(model))
    steps = generate_step(mx.array(PROMPT), loaded, max_tokens=N_TOKENS)
    return [int(tok) for tok, _ in steps]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "spec",
    [
        # The new user's kind of model: a 4-bit MoE as `demo-model --quantize 4` writes it.
        DemoSpec(arch="qwen3_moe", layers=4, hidden=128, heads=4, kv_heads=2, quantize="4"),
        DemoSpec(arch="llama", layers=4, hidden=128, heads=4, kv_heads=2, dtype="float32"),
    ],
    ids=["qwen3_moe-4bit", "llama-float32"],
)
@pytest.mark.parametrize("stages", [2, 3])
def test_a_split_prompt_gives_mlx_lms_tokens(tmp_path: Path, spec: DemoSpec, stages: int) -> None:
    model = write_demo_model(tmp_path / "m", spec)
    ranges = [(0, 2), (2, 4)] if stages == 2 else [(0, 1), (1, 3), (3, 4)]
    ring = InProcessRing(model, ranges)
    for stage in ring.stages:
        stage.prefill_chunk = 512  # the placement's default
    frames: list[tuple[str, int]] = []
    second = ring.stages[1]
    on_frame = second.on_frame

    def seen(header: RingHeader, payload: Any) -> None:
        if header.kind == "prefill":
            frames.append((header.kind, header.offset))
        on_frame(header, payload)

    second.on_frame = seen  # type: ignore[method-assign]
    ring.stages[0].submit(b"c", {"rid": "r", "params": GREEDY, "tokens": PROMPT})
    ring.drain()
    assert ring.tokens("r") == _reference(model)
    size = prefill_split(len(PROMPT) - 1, 512, stages)
    assert [offset for _, offset in frames] == list(range(0, len(PROMPT) - 1, size))
    assert len(frames) >= 2 * stages - 1  # the stages had chunks to overlap on
