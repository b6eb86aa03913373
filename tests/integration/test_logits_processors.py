"""logit_bias and the penalties, applied where each request is sampled: greedy answers
equal mlx-lm's `generate_step` with the same `make_logits_processors` on the same demo
directory, over one stage and two, and a request with processors batched beside others
(none, different ones, sampled) answers as it does alone.

Real shards and real `Stage`s in one process (tests/support/ring_harness.py): a difference is
the engine's. The API and the official client: tests/integration/test_api.py; a tensor
group: tests/integration/test_tensor_parallel.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from tests.support.ring_harness import CHUNK, InProcessRing
from worker.sampling import SamplingParams
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol.frames import RingHeader

PROMPT = list(range(40, 70))
N = 24
SPLITS = {"one stage": [(0, 4)], "two stages": [(0, 2), (2, 4)]}
# Each changes the greedy answer of the demo model (checked below, so none passes idle).
PROCESSORS: dict[str, dict[str, Any]] = {
    "repetition": {"repetition_penalty": 1.8},
    "presence and frequency, own windows": {
        "presence_penalty": 1.5,
        "presence_context_size": 40,
        "frequency_penalty": 0.7,
        "frequency_context_size": 6,
    },
    "negative penalties": {"presence_penalty": -2.0, "frequency_penalty": -0.5},
    "logit_bias": {"logit_bias": {116: -100.0, 113: 2.5}},  # 116 leads the plain answer
    "everything": {
        "logit_bias": {3: 4.0},
        "repetition_penalty": 1.3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
    },
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(
        tmp_path_factory.mktemp("processors") / "llama",
        DemoSpec(layers=4, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=3),
    )


@pytest.fixture(scope="module")
def reference(model: Path) -> Callable[[list[int], dict[str, Any]], list[int]]:
    loaded, _ = mlx_lm.load(str(model))

    def tokens(prompt: list[int], options: dict[str, Any]) -> list[int]:
        steps = generate_step(
            mx.array(prompt),
            loaded,
            max_tokens=N,
            prefill_step_size=CHUNK,
            logits_processors=make_logits_processors(**options),
        )
        return [int(tok) for tok, _ in steps]

    return tokens


class Ring(InProcessRing):
    def __init__(self, model: Path, ranges: list[tuple[int, int]]) -> None:
        super().__init__(model, ranges, streams=8)

    def answer(self, rid: str, prompt: list[int], params: dict[str, Any]) -> list[int]:
        self.submit(rid, prompt, params)
        self.drain()
        return self.tokens(rid)

    def submit(self, rid: str, prompt: list[int], params: dict[str, Any]) -> None:
        self.stages[0].submit(b"c", {"rid": rid, "params": params, "tokens": prompt})

    def failure(self, rid: str) -> str:
        return next(f["message"] for k, f in self.client if k == "failed" and f["rid"] == rid)


def wire(options: dict[str, Any]) -> dict[str, Any]:
    """Options as they reach the head: logit_bias as [token, bias] pairs (the API's form)."""
    out = dict(options)
    if "logit_bias" in out:
        out["logit_bias"] = [[t, b] for t, b in out["logit_bias"].items()]
    return out


@pytest.mark.parametrize("split", SPLITS)
def test_greedy_answers_with_processors_equal_mlx_lm(
    model: Path, reference: Callable[..., list[int]], split: str
) -> None:
    ring = Ring(model, SPLITS[split])
    plain = reference(PROMPT, {})
    assert ring.answer("plain", PROMPT, {"max_tokens": N, "ignore_eos": True}) == plain
    for name, options in PROCESSORS.items():
        want = reference(PROMPT, options)
        assert want != plain, f"{name} leaves the demo's answer as it is: it tests nothing"
        params = {"max_tokens": N, "ignore_eos": True, **wire(options)}
        assert ring.answer(name, PROMPT, params) == want, name
    # A bias of +100 forces its token, -100 forbids the one chosen before.
    forced = ring.answer("forced", PROMPT, {"max_tokens": 6, "logit_bias": [[5, 100.0]]})
    assert forced == [5] * 6
    banned = ring.answer("banned", PROMPT, {"max_tokens": N, "logit_bias": [[plain[0], -100]]})
    assert plain[0] not in banned


def test_log_probabilities_are_those_after_the_processors_as_mlx_lms(model: Path) -> None:
    options = PROCESSORS["everything"]
    loaded, _ = mlx_lm.load(str(model))
    steps = generate_step(
        mx.array(PROMPT),
        loaded,
        max_tokens=8,
        prefill_step_size=CHUNK,
        logits_processors=make_logits_processors(**options),
    )
    want = [float(logprobs[tok].item()) for tok, logprobs in steps]
    ring = Ring(model, SPLITS["two stages"])
    params = {"max_tokens": 8, "ignore_eos": True, "logprobs": 0, **wire(options)}
    ring.answer("lp", PROMPT, params)
    assert _logprobs(ring, "lp") == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("split", SPLITS)
def test_rows_of_a_batch_keep_their_own_processors(model: Path, split: str) -> None:
    """Requests decoded together: one without processors, others with different ones,
    greedy and sampled, with log-probabilities; each answer is its answer alone."""
    jobs: list[tuple[list[int], dict[str, Any]]] = [
        (PROMPT, {}),
        (PROMPT, {"repetition_penalty": 1.8}),
        (PROMPT[4:], wire(PROCESSORS["everything"])),
        (PROMPT[8:], {"frequency_penalty": 1.2, "temperature": 0.9, "seed": 5}),
        (PROMPT, {"presence_penalty": 1.5, "logprobs": 3}),
    ]
    jobs = [(p, {"max_tokens": N, "ignore_eos": True, **q}) for p, q in jobs]
    ring = Ring(model, SPLITS[split])
    alone = [ring.answer(f"alone{i}", p, q) for i, (p, q) in enumerate(jobs)]
    logprobs_alone = _logprobs(ring, "alone4")
    for i, (p, q) in enumerate(jobs):
        ring.submit(f"t{i}", p, q)
        ring.drain(3)  # each starts while those before it decode
    ring.drain()
    assert ring.stages[0].stats.batched > 0, "the requests never met in a batch"
    assert [ring.tokens(f"t{i}") for i in range(len(jobs))] == alone
    assert alone[0] != alone[1]
    assert _logprobs(ring, "t4") == pytest.approx(logprobs_alone, abs=1e-5)


def _logprobs(ring: Ring, rid: str) -> list[float]:
    return [
        e["logprob"]
        for k, f in ring.client
        if k == "delta" and f["rid"] == rid
        for e in f.get("logprobs", [])
    ]


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"logit_bias": [[999_999, 1.0]]}, "logit_bias token 999999 is not in this model's"),
        ({"logit_bias": [[-1, 1.0]]}, "logit_bias token -1"),
        ({"logit_bias": [[1, 101.0]]}, "logit_bias for token 1 must be a number from -100 to 100"),
        ({"presence_penalty": 2.5}, "presence_penalty must be a number from -2 to 2"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a number from 0.01 to 10"),
        ({"frequency_context_size": 0}, "frequency_context_size must be an integer from 1 to 2048"),
    ],
)
def test_the_head_refuses_bad_processor_options_before_any_work(
    model: Path, params: dict[str, Any], words: str
) -> None:
    ring = Ring(model, SPLITS["two stages"])
    ring.submit("bad", PROMPT, {"max_tokens": 4, **params})
    assert words in ring.failure("bad")
    assert not ring.work and not ring.stages[0].caches, "nothing may be queued for it"


def test_params_travel_and_come_back_the_same() -> None:
    params = SamplingParams.from_dict(
        {"logit_bias": {"5": 2}, "presence_penalty": 1, "presence_context_size": 3}
    )
    assert params.logit_bias == ((5, 2.0),) and params.window == 3
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert SamplingParams().processors() == [] and SamplingParams().window == 0


def test_a_tail_refuses_recent_tokens_outside_the_vocabulary(model: Path) -> None:
    """The head fills `recent` from the checked prompt; a frame that brings ids past the
    logits anyway fails that request on the tail (MLX would index past the logits)."""
    ring = Ring(model, SPLITS["two stages"])
    tail = ring.stages[1]
    params = {"max_tokens": 2, "repetition_penalty": 1.5, "recent": [3, 999_999]}
    header = RingHeader(
        rid="x", kind="decode", offset=0, dtype="float32", shape=(1, 1, 64), params=params
    )
    tail.on_frame(header, np.zeros(64, np.float32).tobytes())
    assert tail.stats.errors == 1 and "x" not in tail.caches and "x" not in tail.tail_requests
    assert len(ring.work) == 1  # the error on its way to the head, and no token
    fine = ring.answer("fine", PROMPT, {"max_tokens": 3, "repetition_penalty": 1.5})
    assert len(fine) == 3
