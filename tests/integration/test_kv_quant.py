"""Quantized KV (`place --kv-bits`): every family split into 1 and 2 shards, token for
token against mlx-lm's `generate_step` holding the same quantized caches.

The reference is mlx-lm's own: `generate_step` with a prompt cache in which each plain
`KVCache` of `make_prompt_cache(model)` is a `QuantizedKVCache(group_size, bits)` (the
shard quantizes from the first token; `kv_bits` in generate_step would start at
`quantized_kv_start` and refuses the sliding windows of gemma3/gpt-oss outright). A family
whose attention cannot read quantized caches (shared.kv_quant) keeps every cache full and
so answers as the full-precision reference does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from tests.support.ring_harness import CHUNK, InProcessRing
from worker.shard import ShardLoadError, load_shard
from worker.shared.demo_model import FAMILIES, DemoSpec, write_demo_model
from worker.shared.kv_quant import family_reason

PROMPT = list(range(40, 62))  # 22 tokens: three prefill chunks, past the 8-token windows
N_TOKENS = 10
GREEDY = {"max_tokens": N_TOKENS, "temperature": 0.0, "ignore_eos": True}
SPLITS = {1: [(0, 5)], 2: [(0, 2), (2, 5)]}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    root = tmp_path_factory.mktemp("kvq")
    made: dict[str, Path] = {}

    def get(arch: str, hidden: int = 128) -> Path:
        key = f"{arch}-{hidden}"
        if key not in made:
            # head width hidden/4: 32 (groups of 32) or 64 (groups of 32 or 64).
            spec = DemoSpec(
                arch=arch, layers=5, hidden=hidden, heads=4, kv_heads=2, dtype="float32", seed=11
            )
            made[key] = write_demo_model(root / key, spec)
        return made[key]

    return get


def quantized_cache(model: Any, bits: int, group: int) -> list[Any]:
    return [
        QuantizedKVCache(group_size=group, bits=bits) if type(c) is KVCache else c
        for c in make_prompt_cache(model)
    ]


def reference(model_dir: Path, bits: int, group: int) -> list[int]:
    loaded, _ = mlx_lm.load(str(model_dir))
    config = mlx_lm.utils.load_config(model_dir)
    cache = (
        make_prompt_cache(loaded)
        if family_reason(config)
        else (quantized_cache(loaded, bits, group))
    )
    steps = generate_step(
        mx.array(PROMPT), loaded, max_tokens=N_TOKENS, prefill_step_size=CHUNK, prompt_cache=cache
    )
    return [int(tok) for tok, _ in steps]


def answer(ring: InProcessRing, rid: str = "r") -> list[int]:
    ring.stages[0].submit(b"c", {"rid": rid, "params": GREEDY, "tokens": PROMPT})
    ring.drain()
    return ring.tokens(rid)


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_with_8bit_kv_matches_mlx_lm(models: Callable[..., Path], arch: str) -> None:
    model = models(arch)
    expected = reference(model, 8, 32)
    config = mlx_lm.utils.load_config(model)
    for n in (1, 2):
        ring = InProcessRing(model, SPLITS[n], {"kv_bits": 8, "kv_group_size": 32})
        kinds = {type(c).__name__ for s in ring.stages for c in s.shard.make_cache()}
        if family_reason(config):
            assert "QuantizedKVCache" not in kinds, kinds
        else:
            assert "QuantizedKVCache" in kinds and "KVCache" not in kinds, kinds
        assert answer(ring) == expected, f"{arch} over {n} shards diverged"


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen3_next", "gemma3_text"])
@pytest.mark.parametrize(("bits", "group"), [(4, 64), (8, 64), (4, 32)])
def test_4bit_and_other_groups_match_mlx_lm(
    models: Callable[..., Path], arch: str, bits: int, group: int
) -> None:
    model = models(arch, hidden=256)
    expected = reference(model, bits, group)
    options = {"kv_bits": bits, "kv_group_size": group}
    assert answer(InProcessRing(model, SPLITS[2], options)) == expected


def test_quantized_kv_decodes_requests_one_by_one_and_says_why(
    models: Callable[..., Path],
) -> None:
    model = models("qwen3")
    ring = InProcessRing(model, SPLITS[2], {"kv_bits": 8, "kv_group_size": 32}, streams=4)
    assert all("QuantizedKVCache" in s.batch_reason for s in ring.stages)
    assert not ring.stages[0].lanes  # no batch lanes on the head
    for rid in ("a", "b", "c"):
        ring.stages[0].submit(b"c", {"rid": rid, "params": GREEDY, "tokens": PROMPT})
    ring.drain()
    alone = reference(model, 8, 32)
    assert [ring.tokens(rid) for rid in ("a", "b", "c")] == [alone] * 3
    assert all(s.stats.batched == 0 for s in ring.stages)


def test_a_group_that_does_not_divide_the_head_width_is_refused(
    models: Callable[..., Path],
) -> None:
    with pytest.raises(ShardLoadError, match=r"--kv-group-size 64 does not divide .* 32"):
        load_shard(models("llama"), 0, 5, kv_bits=8, kv_group_size=64)
