"""The bench's floor under the MoE row (`studiotui.bench.pipe_floor`, driven by
`studiotui.bench.floor.PipeFloor`): two real processes running a model's two shards over
a bare CURVE ZeroMQ hop each way (127.0.0.78:58160-58161) give mlx-lm's greedy tokens,
run after run, with its steps built ahead as a stage builds them."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from studiotui.bench.floor import FloorFailed, PipeFloor
from worker.shared.demo_model import DemoSpec, write_demo_model

PROMPT = list(range(40, 62))  # 22 tokens: three prefill chunks of 8
CHUNK = 8


def reference(model: Path, prompt: list[int], n: int) -> list[int]:
    loaded, _ = mlx_lm.load(str(model))
    steps = generate_step(mx.array(prompt), loaded, max_tokens=n, prefill_step_size=CHUNK)
    return [int(tok) for tok, _ in steps]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("arch", "quantize", "dtype"),
    [("qwen3_moe", "4", "float32"), ("llama", None, "bfloat16")],  # the bench's; bf16 bits
)
def test_the_floor_gives_mlx_lms_tokens_run_after_run(
    tmp_path: Path, arch: str, quantize: str | None, dtype: str
) -> None:
    spec = DemoSpec(
        arch=arch, layers=3, hidden=64, heads=4, kv_heads=2, quantize=quantize, dtype=dtype
    )
    model = write_demo_model(tmp_path / arch, spec)
    floor = PipeFloor(model, 1, "127.0.0.78", 58160, CHUNK)  # layers [0, 1) and [1, 3)
    try:
        first = floor.decode(PROMPT, 12)
        again = floor.decode(PROMPT, 12)  # fresh caches for a new sequence
        lone = floor.decode(PROMPT[:1], 5)  # no prefill: the first step is at offset 0
    finally:
        floor.close()
    expected = reference(model, PROMPT, 12)
    assert first["tokens"] == expected and again["tokens"] == expected
    assert lone["tokens"] == reference(model, PROMPT[:1], 5)
    # Every step after the first ran the graph built while the one before computed.
    assert first["ran_ahead"] == again["ran_ahead"] == 11 and lone["ran_ahead"] == 4
    assert first["tps"] > 0
    assert floor.head.returncode == 0 and floor.tail.returncode == 0  # both stopped cleanly


def test_a_floor_that_cannot_load_says_so(tmp_path: Path) -> None:
    floor = PipeFloor(tmp_path / "absent", 1, "127.0.0.78", 58160, CHUNK)
    try:
        with pytest.raises(FloorFailed, match="exited"):
            floor.decode(PROMPT, 4)
    finally:
        floor.close()
