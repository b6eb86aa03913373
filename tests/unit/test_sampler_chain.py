"""The tail's sampler (worker/sampling.py `sampler_chain`): mlx-lm's `make_sampler` with
the values as inputs of the compiled pieces, not constants.

`mx.compile` takes a Python number for a constant: mlx-lm's `make_sampler` traced and
compiled new kernels for every temperature, top_p, min_p and XTC value a client sent
(0.5-1 s each on a CPU, kept forever). Here a compiled piece's Python body runs only when
it is traced, so counting the MLX calls in each body counts the traces. The tokens stay
mlx-lm's: the same draws as `make_sampler` for the same seed, in every dtype a model
serves in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler

from worker.sampling import Sampler, SamplingParams, sampler_chain

# One MLX call in the body of each compiled piece, and the piece it stands for:
# mlx-lm's apply_top_p sorts, the min_p piece takes a max, XTC a softmax, and the last
# step draws from the categorical.
BODIES = {"sort": "top_p", "max": "min_p", "softmax": "xtc", "categorical": "temperature"}
# Five requests, each with values of its own.
VALUES: list[dict[str, Any]] = [
    {
        "temperature": 0.5 + i / 7,
        "top_p": 0.6 + i / 17,
        "min_p": 0.01 + i / 101,
        "xtc_probability": 0.3 + i / 13,
        "xtc_threshold": 0.05 + i / 53,
    }
    for i in range(5)
]


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """How often each compiled piece's Python body runs from here on."""
    counts: Counter[str] = Counter()

    def counting(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[BODIES[name]] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in ("sort", "max", "softmax"):
        counting(mx, name)
    counting(mx.random, "categorical")
    yield counts


def logprobs(vocab: int, dtype: mx.Dtype = mx.float32, seed: int = 0) -> mx.array:
    logits = (mx.random.normal((1, vocab), key=mx.random.key(seed)) * 3).astype(dtype)
    return logits - mx.logsumexp(logits, keepdims=True)


def test_distinct_values_are_traced_once(traces: Counter[str]) -> None:
    # A vocabulary no other test uses: the first request here is the first trace.
    vocab = 97
    logits = logprobs(vocab)[0]
    tokens: list[Any] = []
    for values in VALUES:
        sampler = Sampler(SamplingParams(**values, top_k=11, seed=3), special=(2,))
        tokens.append(sampler.draw(logits))
    mx.eval(tokens)
    assert all(0 <= int(t) < vocab for t in tokens)
    assert traces == dict.fromkeys(BODIES.values(), 1), traces


def test_the_counter_sees_make_sampler_retrace_each_value(traces: Counter[str]) -> None:
    """What the test above would see before: mlx-lm's `make_sampler` with Python
    numbers traces apply_top_p and the draw again for each new value."""
    lp = logprobs(89)
    mx.eval([make_sampler(v["temperature"], top_p=v["top_p"])(lp) for v in VALUES])
    assert traces["top_p"] == traces["temperature"] == len(VALUES), traces


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_draws_equal_make_sampler_for_the_same_seed(dtype: mx.Dtype) -> None:
    vocab = 211
    special = (3, 5)
    cases: list[dict[str, Any]] = [
        {"temperature": 0.7},
        {"temperature": 1.3, "top_p": 0.83, "min_p": 0.07, "top_k": 9},
        {"temperature": 0.3, "xtc_probability": 0.6, "xtc_threshold": 0.03},
        {**VALUES[2], "top_k": 40},
    ]
    for case in cases:
        params = SamplingParams(**case)

        def mlx_lm_sampler(p: SamplingParams = params) -> Callable[[mx.array], mx.array]:
            return make_sampler(
                p.temperature,
                top_p=p.top_p,
                min_p=p.min_p,
                top_k=p.top_k,
                xtc_probability=p.xtc_probability,
                xtc_threshold=p.xtc_threshold,
                xtc_special_tokens=list(special),
            )

        ours = sampler_chain(params, vocab, dtype, special)
        for seed in range(4):
            lp = logprobs(vocab, dtype, seed=100 + seed)
            mx.random.seed(seed)
            want = mlx_lm_sampler()(lp).item()
            mx.random.seed(seed)
            assert ours(lp).item() == want, (case, seed)
