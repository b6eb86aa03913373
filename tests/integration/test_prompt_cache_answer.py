"""Families whose caches cannot be cut back (linear attention's `ArraysCache`) keep a
snapshot at the end of each answer too, so the next turn of a conversation reuses its
history's prompt and answer, not only the prompt: on 1 and 2 stages, with the step
built ahead of a token that never came kept out of it, token for token as mlx-lm."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from tests.support.family_models import small_family_models
from tests.support.ring_harness import CHUNK, InProcessRing
from worker.prompt_cache import light_snapshot, trimmable_at
from worker.shared.demo_model import FAMILIES

N = 4
SPLITS = {1: [(0, 5)], 2: [(0, 2), (2, 5)]}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return small_family_models(tmp_path_factory.mktemp("prompt-cache-answer"), seed=13)


def _ask(ring: InProcessRing, rid: str, prompt: list[int], n: int) -> tuple[list[int], int]:
    params = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}
    ring.stages[0].submit(b"c", {"rid": rid, "params": params, "tokens": prompt})
    ring.drain()
    [done] = [f for k, f in ring.client if k == "done" and f["rid"] == rid]
    return ring.tokens(rid), done["usage"]["cached_tokens"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_next_turn_reuses_the_answer_where_caches_cannot_be_cut(
    models: Callable[[str], Path], arch: str
) -> None:
    model = models(arch)
    loaded, _ = mlx_lm.load(str(model))

    def ref(prompt: list[int], n: int) -> list[int]:
        steps = generate_step(mx.array(prompt), loaded, max_tokens=n, prefill_step_size=CHUNK)
        return [int(t) for t, _ in steps]

    for shards, split in SPLITS.items():
        ring = InProcessRing(model, split)
        stage = ring.stages[0]
        full = stage.shard.make_cache().full
        if trimmable_at(stage.kinds, 1 << 62):
            return  # cut back instead (test_prompt_cache.py): no snapshots
        answers = light_snapshot(full) is not None
        assert stage.answer_snap == answers
        prompt = list(range(40, 60))
        previous: list[int] = []
        ask: list[int] = []
        # Answers of several lengths: the last one ends where max_tokens says (no step
        # built ahead), the others with a step built ahead of a token never used.
        for turn, n in enumerate((N, 1, 2 * N, N)):
            got = _ask(ring, f"t{turn}", prompt, n)
            assert got[0] == ref(prompt, n), f"{arch}/{shards}: turn {turn}"
            if turn:
                want = len(prompt) - len(ask) - 1 if answers else len(previous) - 1
                assert got[1] == want, f"{arch}/{shards}: turn {turn} reused {got[1]}"
            previous, ask = prompt, [90 + turn, 91, 92]
            prompt = prompt + got[0] + ask
        # The same prompt again still reuses its prompt's snapshot.
        again = previous
        assert _ask(ring, "again", again, N)[1] == len(again) - 1, f"{arch}/{shards}"
        assert [len(s.answer_snaps) + len(s.snapshots) for s in ring.stages] == [0] * shards
