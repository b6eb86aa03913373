"""top_k, min_p and XTC, through mlx-lm's own `make_sampler` on the shard that samples:
a seeded answer equals mlx-lm's `generate_step` with the same sampler after
`mx.random.seed(seed)` on the same demo directory, over one stage and two; top_k=1 is
greedy; a request with them batched beside others (without them, with others) answers
as it does alone; the head refuses bad values before any work.

Real shards and real `Stage`s in one process (tests/support/ring_harness.py), the ring of
test_logits_processors.py. The API and the official client: tests/integration/test_api.py;
a tensor group: tests/integration/test_tensor_parallel.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from tests.integration.test_logits_processors import PROMPT, SPLITS, Ring, model
from tests.support.ring_harness import CHUNK
from worker.sampling import ParamError, SamplingParams

__all__ = ["model"]  # the module fixture, shared

N = 24
SEED = 11
# mlx-lm's make_sampler options, each sampled at a temperature; each changes the seeded
# answer of the demo model (checked below, so none passes idle).
SAMPLERS: dict[str, dict[str, Any]] = {
    "top_k": {"temp": 1.5, "top_k": 3},
    "min_p": {"temp": 0.8, "min_p": 0.1},
    "top_p, min_p and top_k in mlx-lm's order": {
        "temp": 1.5,
        "top_p": 0.9,
        "min_p": 0.05,
        "top_k": 5,
    },
    "xtc": {"temp": 0.8, "xtc_probability": 0.8, "xtc_threshold": 0.05},
}


@pytest.fixture(scope="module")
def reference(model: Path) -> Callable[..., list[int]]:
    """mlx-lm's seeded answer: `generate_step` with `make_sampler(**options)` (XTC's
    special tokens as mlx_lm.server names them, unless told) after
    `mx.random.seed(seed)`, and `make_logits_processors` for the penalties and bias."""
    loaded, tokenizer = mlx_lm.load(str(model))
    server_special = tokenizer.encode("\n") + list(tokenizer.eos_token_ids)

    def tokens(
        prompt: list[int],
        options: dict[str, Any],
        seed: int = SEED,
        special: list[int] | None = None,
    ) -> list[int]:
        processors = {k: options[k] for k in options if k.endswith("penalty") or k == "logit_bias"}
        sampler = make_sampler(
            **{k: v for k, v in options.items() if k not in processors},
            xtc_special_tokens=server_special if special is None else special,
        )
        mx.random.seed(seed)
        steps = generate_step(
            mx.array(prompt),
            loaded,
            max_tokens=N,
            prefill_step_size=CHUNK,
            sampler=sampler,
            logits_processors=make_logits_processors(**processors),
        )
        return [int(tok) for tok, _ in steps]

    return tokens


def wire(options: dict[str, Any], seed: int = SEED) -> dict[str, Any]:
    """make_sampler's options as a request names them (temperature, not temp)."""
    out = {("temperature" if k == "temp" else k): v for k, v in options.items()}
    if "logit_bias" in out:
        out["logit_bias"] = [[t, b] for t, b in out["logit_bias"].items()]
    return {"max_tokens": N, "ignore_eos": True, "seed": seed, **out}


@pytest.mark.parametrize("split", SPLITS)
def test_seeded_answers_with_samplers_equal_mlx_lm(
    model: Path, reference: Callable[..., list[int]], split: str
) -> None:
    ring = Ring(model, SPLITS[split])
    for name, options in SAMPLERS.items():
        want = reference(PROMPT, options)
        plain = reference(PROMPT, {"temp": options["temp"]})
        assert want != plain, f"{name} leaves the seeded answer as it is: it tests nothing"
        assert ring.answer(name, PROMPT, wire(options)) == want, name
    # Temperature alone, and with a penalty: the same keys as before samplers came in.
    for options in ({"temp": 0.9}, {"temp": 0.9, "top_k": 4, "repetition_penalty": 1.5}):
        assert ring.answer(f"{options}", PROMPT, wire(options)) == reference(PROMPT, options)


def test_top_k_of_one_is_greedy_and_past_the_vocabulary_is_none(
    model: Path, reference: Callable[..., list[int]]
) -> None:
    ring = Ring(model, SPLITS["two stages"])
    greedy = ring.answer("greedy", PROMPT, {"max_tokens": N, "ignore_eos": True})
    assert ring.answer("k1", PROMPT, wire({"temp": 1.5, "top_k": 1})) == greedy
    sampled = reference(PROMPT, {"temp": 1.5})
    assert sampled != greedy
    # mlx-lm's apply_top_k raises for k at or past the vocabulary; it keeps every token.
    vocab = ring.stages[-1].vocab
    for k in (vocab, vocab + 1, 2**31 - 1):
        assert ring.answer(f"k{k}", PROMPT, wire({"temp": 1.5, "top_k": k})) == sampled
    # At temperature 0 the samplers do nothing, as in mlx-lm's make_sampler.
    assert ring.answer("t0", PROMPT, wire({"temp": 0.0, "top_k": 2, "min_p": 0.5})) == greedy


def test_xtc_spares_a_newline_and_the_end_tokens_as_mlx_lm_server(
    model: Path, reference: Callable[..., list[int]]
) -> None:
    """XTC drops every token above its threshold but the least likely of them, except
    the ones mlx_lm.server spares (a newline's tokens, the end-of-sequence ones): with
    the newline pushed up by logit_bias, the answer is mlx-lm's with them spared."""
    ring = Ring(model, SPLITS["two stages"])
    newline = ring.stages[-1].tokenizer.encode("\n")[-1]
    assert newline in ring.stages[-1].xtc_special
    options = {
        "temp": 0.8,
        "xtc_probability": 1.0,
        "xtc_threshold": 0.05,
        "logit_bias": {newline: 15.0},
    }
    want = reference(PROMPT, options)
    assert want != reference(PROMPT, options, special=[]), "sparing changes nothing here"
    assert ring.answer("xtc", PROMPT, wire(options)) == want


@pytest.mark.parametrize("split", SPLITS)
def test_rows_of_a_batch_keep_their_own_samplers(model: Path, split: str) -> None:
    """Requests decoded together: greedy without samplers, and sampled with different
    samplers and seeds, one with log-probabilities; each answer is its answer alone."""
    jobs: list[tuple[list[int], dict[str, Any]]] = [
        (PROMPT, {"max_tokens": N, "ignore_eos": True}),
        (PROMPT, wire(SAMPLERS["top_k"])),
        (PROMPT[4:], wire(SAMPLERS["min_p"], seed=3)),
        (PROMPT[8:], wire(SAMPLERS["xtc"], seed=4)),
        (PROMPT, wire({"temp": 1.0}, seed=5)),
        (PROMPT, {**wire(SAMPLERS["top_p, min_p and top_k in mlx-lm's order"]), "logprobs": 2}),
    ]
    ring = Ring(model, SPLITS[split])
    alone = [ring.answer(f"alone{i}", p, q) for i, (p, q) in enumerate(jobs)]
    for i, (p, q) in enumerate(jobs):
        ring.submit(f"t{i}", p, q)
        ring.drain(3)  # each starts while those before it decode
    ring.drain()
    assert ring.stages[0].stats.batched > 0, "the requests never met in a batch"
    assert [ring.tokens(f"t{i}") for i in range(len(jobs))] == alone
    assert alone[1] != alone[4]


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"top_k": -1}, "top_k must be an integer from 0 to 2147483647"),
        ({"top_k": 2.5}, "bad sampling parameter: expected an integer, got 2.5"),
        ({"min_p": 1.5}, "min_p must be a number from 0 to 1"),
        ({"xtc_probability": -0.1}, "xtc_probability must be a number from 0 to 1"),
        ({"xtc_threshold": 0.6}, "xtc_threshold must be a number from 0 to 0.5"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty must be a number from 0.01 to 10"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a number from"),
    ],
)
def test_the_head_refuses_bad_sampler_options_before_any_work(
    model: Path, params: dict[str, Any], words: str
) -> None:
    ring = Ring(model, SPLITS["two stages"])
    ring.submit("bad", PROMPT, {"max_tokens": 4, "temperature": 1.0, **params})
    assert words in ring.failure("bad")
    assert not ring.work and not ring.stages[0].caches, "nothing may be queued for it"


def test_the_smallest_repetition_penalty_keeps_log_probabilities_finite(model: Path) -> None:
    """At the range's ends (0.01, 10) the penalised logits and the log-probabilities
    stay finite; 1e-40 made them inf and NaN, which JSON cannot carry."""
    ring = Ring(model, SPLITS["one stage"])
    for penalty in (0.01, 10.0):
        params = {"max_tokens": 8, "ignore_eos": True, "logprobs": 3}
        ring.answer(f"p{penalty}", PROMPT, {**params, "repetition_penalty": penalty})
        entries = [
            e
            for k, f in ring.client
            if k == "delta" and f["rid"] == f"p{penalty}"
            for e in f["logprobs"]
        ]
        values = [e["logprob"] for e in entries] + [t["logprob"] for e in entries for t in e["top"]]
        assert len(entries) == 8 and all(v == v and abs(v) < 1e30 for v in values), values


def test_sampler_params_travel_and_come_back_the_same() -> None:
    raw = {"temperature": 1.0, "top_k": 7, "min_p": 0.2, "xtc_probability": 0.5}
    params = SamplingParams.from_dict({**raw, "xtc_threshold": 0.3})
    assert (params.top_k, params.min_p, params.xtc_threshold) == (7, 0.2, 0.3)
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert SamplingParams.from_dict(raw).xtc_threshold == 0.1  # mlx-lm's default
    with pytest.raises(ParamError, match="expected an integer"):
        SamplingParams.from_dict({"top_k": True})
