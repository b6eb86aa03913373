"""The stage's warm-up at load (`Stage.warm_up`, which the runner runs before "ready"):
each piece a first answer needs runs once on throwaway state, and nothing of it shows
in the answers after (greedy: mlx-lm's; seeded: the same tokens as without a warm-up).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from tests.support.ring_harness import CHUNK, InProcessRing
from worker.shared.demo_model import DemoSpec, write_demo_model

PROMPT = list(range(40, 60))
N = 12
SPLITS = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}


class Ring(InProcessRing):
    def answer(self, rid: str, params: dict[str, object]) -> list[int]:
        self.stages[0].submit(b"c", {"rid": rid, "params": params, "tokens": PROMPT})
        self.drain()
        return self.tokens(rid)


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "float32"), ("qwen3", "bfloat16")])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_warmed_stage_answers_as_one_never_warmed(
    tmp_path: Path, arch: str, dtype: str, stages: int
) -> None:
    spec = DemoSpec(arch=arch, layers=4, hidden=64, heads=4, kv_heads=2, dtype=dtype, seed=3)
    model = write_demo_model(tmp_path / arch, spec)
    loaded, _ = mlx_lm.load(str(model))
    greedy = [
        int(t)
        for t, _ in generate_step(mx.array(PROMPT), loaded, max_tokens=N, prefill_step_size=CHUNK)
    ]
    sampled = {"max_tokens": N, "temperature": 1.1, "seed": 9, "ignore_eos": True}
    cold = Ring(model, SPLITS[stages], draft="lookup")
    want_sampled = cold.answer("s", sampled)

    ring = Ring(model, SPLITS[stages], draft="lookup")
    for stage in ring.stages:
        took = stage.warm_up()
        assert stage.warmed == took and took["total"] > 0
        # A verify step's shape too: the placement speculates.
        assert {"prefill", "decode", "verify"} <= set(took)
        assert ("sample" in took) == stage.shard.is_last
        assert ("tokenizer" in took) == stage.shard.is_first
        # Nothing of a request, the prefix cache or the figures is left.
        assert stage.held() == 0 and not stage.store.entries
        assert stage.stats.tokens == 0 and not any(stage.ring_us.values())
    assert ring.answer("g", {"max_tokens": N, "ignore_eos": True}) == greedy
    assert ring.answer("s", sampled) == want_sampled
