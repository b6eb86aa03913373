"""Speculative decoding across the ring, on real Stages over real shards (in process).

Every answer is compared with mlx-lm's `generate_step` and with the same request
decoded without guesses: speculation may change how many trips a token takes around
the ring, never which token it is.
"""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from tests.support.ring_harness import CHUNK, InProcessRing
from worker import speculation
from worker.cpu_fusion import DecodeRMSNorm
from worker.shared.demo_model import FAMILIES, DemoSpec, write_demo_model

LAYERS = 5
N = 24
# Repeats itself, so prompt lookup finds something to propose from the first step.
PROMPT = [40, 41, 42, 43, 44, 45] * 3 + [40, 41, 42]
SPLITS = {1: [(0, 5)], 2: [(0, 2), (2, 5)], 3: [(0, 1), (1, 4), (4, 5)]}
GREEDY = {"max_tokens": N, "temperature": 0.0, "ignore_eos": True}
SAMPLED = {"max_tokens": N, "temperature": 1.2, "top_p": 0.95, "seed": 7, "ignore_eos": True}
K = 4
# Families whose caches a rejected guess cannot be cut out of (linear attention).
UNTRIMMABLE = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# Families with a rotating (sliding window) cache: it can be cut back inside its window.
WINDOWED = ("gpt_oss", "gemma3_text")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    root = tmp_path_factory.mktemp("spec")
    made: dict[str, Path] = {}

    def get(arch: str, **kw: Any) -> Path:
        key = "-".join([arch, *(f"{k}{v}" for k, v in sorted(kw.items()))])
        if key not in made:
            base: dict[str, Any] = {"layers": LAYERS, "hidden": 64, "heads": 4, "kv_heads": 2}
            spec = DemoSpec(arch=arch, dtype="float32", seed=11, **{**base, **kw})
            made[key] = write_demo_model(root / key, spec)
        return made[key]

    return get


def reference(model: Path, n: int = N, prompt: list[int] = PROMPT, **kw: Any) -> list[int]:
    loaded, _ = mlx_lm.load(str(model))
    steps = generate_step(mx.array(prompt), loaded, max_tokens=n, prefill_step_size=CHUNK, **kw)
    return [int(tok) for tok, _ in steps]


class Ring(InProcessRing):
    def ask(self, rid: str, params: dict[str, Any], **msg: Any) -> None:
        body = {"rid": rid, "params": params, "tokens": msg.pop("tokens", PROMPT), **msg}
        self.stages[0].submit(b"c", body)

    def answer(self, params: dict[str, Any], rid: str = "r", **msg: Any) -> list[int]:
        self.ask(rid, params, **msg)
        self.drain()
        return self.tokens(rid)

    def done(self, rid: str) -> dict[str, Any]:
        return next(f for k, f in self.client if k in ("done", "failed") and f["rid"] == rid)

    def held(self) -> list[int]:
        return [
            len(s.caches)
            + len(s.prebuilt)
            + len(s.tail_requests)
            + len(s.rewind_floor)
            + len(s.verify_ahead)
            for s in self.stages
        ]


def _trimmable(arch: str) -> bool:
    return arch not in UNTRIMMABLE


@pytest.mark.parametrize("arch", [a for a in FAMILIES if _trimmable(a)])
def test_guesses_give_mlx_lm_greedy_answer_over_1_2_3_stages(
    models: Callable[..., Path], arch: str
) -> None:
    """Prompt lookup (a prompt that repeats) and a predicted output wrong at its 4th
    token, for every family whose caches can be cut back. Families with a rotating
    window (8 tokens in the demos) get a prompt short enough to guess inside it."""
    model = models(arch)
    windowed = arch in WINDOWED
    prompt = PROMPT[:2] if windowed else PROMPT
    expected = reference(model, prompt=prompt)
    prediction = [*expected[:3], (expected[3] + 1) % 256, *expected[4:]]
    for n in (1, 2, 3):
        ring = Ring(model, SPLITS[n], draft="lookup", draft_tokens=K)
        if not windowed:
            assert ring.answer(GREEDY, tokens=prompt) == expected, f"{arch} lookup, {n} stages"
            assert ring.stages[0].stats.drafted > 0, "prompt lookup should have guessed"
        got = ring.answer(GREEDY, rid="p", tokens=prompt, prediction=prediction)
        assert got == expected, f"{arch} predicted, {n} stages"
        assert ring.done("p")["usage"]["completion_tokens_details"]["rejected_prediction_tokens"]
        assert ring.answer(GREEDY, rid="plain", tokens=prompt, draft="") == expected
        assert ring.held() == [0] * n


@pytest.mark.parametrize("arch", UNTRIMMABLE)
def test_a_family_whose_caches_cannot_be_cut_back_is_refused(
    models: Callable[..., Path], arch: str
) -> None:
    model = models(arch)
    with pytest.raises(ValueError, match="cannot be cut back"):
        Ring(model, SPLITS[2], draft="lookup")
    ring = Ring(model, SPLITS[2])
    ring.answer(GREEDY, draft="lookup")
    assert "cannot be cut back" in ring.done("r")["message"]
    # A predicted output is a hint: the answer comes, decoded without guesses.
    assert ring.answer(GREEDY, rid="p", prediction=[1, 2, 3]) == reference(model)


# Prompt lookup's K doubles from 2 while every guess is kept: a perfect prediction's
# verify steps carry 2, 4, 8 guesses, the 8 at answer tokens 8..15 (the first step
# carries the prompt's last token, and each step's last token is the model's own).
WIDE_FRAME_AT = (2 + 1) + (4 + 1)
WIDE_FRAME = 8


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("kept", range(WIDE_FRAME + 1))
def test_rollback_after_a_rejection_at_every_position(
    models: Callable[..., Path], stages: int, kept: int
) -> None:
    """A predicted output right until its guess at position `kept` of the step that
    carries 8 guesses (K has grown 2, 4, 8 on it), then wrong: that step keeps exactly
    `kept` guesses and every stage cuts the rest out of its caches."""
    model = models("llama")
    expected = reference(model)
    at = WIDE_FRAME_AT + kept
    prediction = [*expected[:at], (expected[at] + 1) % 256, *expected[at + 1 :]]
    ring = Ring(model, SPLITS[stages], draft_tokens=K)
    assert ring.answer(GREEDY, prediction=prediction) == expected
    usage = ring.done("r")["usage"]["completion_tokens_details"]
    first = ring.stages[0].stats
    assert first.kept >= 2 + 4 + kept and usage["accepted_prediction_tokens"] == first.kept
    assert usage["rejected_prediction_tokens"] == first.drafted - first.kept
    if kept < WIDE_FRAME:
        assert usage["rejected_prediction_tokens"] >= 1
    # The steps' sizes as the client saw them: 3, 5, then the wide step's kept guesses
    # and the model's own token.
    sizes = [len(f["tokens"]) for k, f in ring.client if k == "delta" and f["rid"] == "r"]
    assert sizes[:3] == [3, 5, kept + 1]
    assert ring.held() == [0] * stages


@pytest.mark.parametrize("stages", [1, 2])
def test_a_perfect_prediction_is_kept_whole(models: Callable[..., Path], stages: int) -> None:
    model = models("llama")
    expected = reference(model)
    ring = Ring(model, SPLITS[stages], draft_tokens=K)
    assert ring.answer(GREEDY, prediction=expected) == expected
    usage = ring.done("r")["usage"]["completion_tokens_details"]
    # Each frame's last token is the big model's own; every guess before it is kept,
    # and K doubles while they are: steps of 2, 4, 8 guesses, then the rest.
    assert usage["rejected_prediction_tokens"] == 0
    assert usage["accepted_prediction_tokens"] == N - 4


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_seeded_sampling_with_guesses_draws_the_same_tokens(
    models: Callable[..., Path], stages: int
) -> None:
    """The tail draws the big model's token at every verified position with the key
    that position would have had, and gives back the keys of rejected positions: the
    seeded answer is token for token the one without guesses (so also its
    distribution)."""
    model = models("qwen3")
    plain = Ring(model, SPLITS[stages]).answer(SAMPLED)
    ring = Ring(model, SPLITS[stages], draft_tokens=K)
    # Right for a while, then wrong: both kept and rejected positions occur.
    prediction = [*plain[:10], (plain[10] + 1) % 256, *plain[11:]]
    assert ring.answer(SAMPLED, prediction=prediction) == plain
    assert 0 < ring.stages[0].stats.kept < ring.stages[0].stats.drafted


def test_logprobs_and_logits_processors_hold_at_every_verified_position(
    models: Callable[..., Path],
) -> None:
    model = models("llama")
    params = {
        **GREEDY,
        "logprobs": 3,
        "repetition_penalty": 1.3,
        "repetition_context_size": 6,
        "presence_penalty": 0.4,
        "logit_bias": [[118, 3.0]],
    }
    processors = make_logits_processors(
        logit_bias={118: 3.0},
        repetition_penalty=1.3,
        repetition_context_size=6,
        presence_penalty=0.4,
        presence_context_size=20,
    )
    expected = reference(model, logits_processors=processors)
    plain = Ring(model, SPLITS[2])
    assert plain.answer(params) == expected
    ring = Ring(model, SPLITS[2], draft_tokens=K)
    assert ring.answer(params, prediction=[*expected[:6], 7, *expected[7:]]) == expected
    assert ring.stages[0].stats.kept > 0

    def logprobs(r: Ring) -> list[Any]:
        return [e for k, f in r.client if k == "delta" for e in f.get("logprobs", [])]

    assert len(logprobs(ring)) == N
    for a, b in zip(logprobs(ring), logprobs(plain), strict=True):
        assert a["id"] == b["id"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
        assert [t["id"] for t in a["top"]] == [t["id"] for t in b["top"]]


def test_a_stop_string_inside_kept_guesses_ends_the_answer_there(
    models: Callable[..., Path],
) -> None:
    model = models("llama")
    expected = reference(model)
    tok = Ring(model, SPLITS[1]).stages[0].tokenizer
    text = tok.decode(expected)
    stop = tok.decode(expected[5:7])
    assert stop and stop in text
    params = {**GREEDY, "stop": [stop]}
    plain = Ring(model, SPLITS[2])
    plain.answer(params)
    ring = Ring(model, SPLITS[2], draft_tokens=K)
    ring.answer(params, prediction=expected)

    def text_of(r: Ring) -> str:
        return "".join(f["text"] for k, f in r.client if k == "delta")

    assert text_of(ring) == text_of(plain) == text[: text.index(stop)]
    assert ring.done("r")["finish_reason"] == "stop"
    assert (
        ring.done("r")["usage"]["completion_tokens"]
        == plain.done("r")["usage"]["completion_tokens"]
    )
    assert ring.held() == [0, 0]


def test_max_tokens_and_end_of_turn_cut_a_verified_run(models: Callable[..., Path]) -> None:
    model = models("llama")
    expected = reference(model)
    ring = Ring(model, SPLITS[2], draft_tokens=K)
    assert ring.answer({**GREEDY, "max_tokens": 7}, prediction=expected) == expected[:7]
    assert ring.done("r")["usage"]["completion_tokens"] == 7
    tok = ring.stages[0].tokenizer
    eos = sorted(tok.eos_token_ids)[0]
    # A bias makes the end of turn the 4th token; the guesses go past it.
    biased = {**GREEDY, "ignore_eos": False}
    plain = Ring(model, SPLITS[2]).answer(biased)
    assert ring.answer(biased, rid="e", prediction=[*plain, eos, 1, 2, 3]) == plain
    assert ring.held() == [0, 0]


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_cancel_while_a_verify_frame_is_out_frees_every_stage(
    models: Callable[..., Path], stages: int
) -> None:
    model = models("llama")
    ring = Ring(model, SPLITS[stages], draft="lookup", draft_tokens=K)
    expected = reference(model, n=200)
    ring.ask("c", {**GREEDY, "max_tokens": 200}, prediction=expected)
    while not any(f.get("tokens") for k, f in ring.client if k == "delta"):
        ring.drain(steps=1)
    spec = ring.stages[0].head_requests["c"].spec
    assert spec is not None and spec.in_flight is not None
    ring.drain(steps=stages)  # the verify frame is part way round
    ring.stages[0].cancel("c")
    ring.drain()
    assert ring.done("c")["finish_reason"] == "cancelled"
    assert ring.held() == [0] * stages
    assert ring.answer(GREEDY, rid="after") == expected[:N]


def test_a_rotating_window_stops_speculation_before_it_wraps(
    models: Callable[..., Path],
) -> None:
    # gpt-oss alternates sliding (a rotating cache of 8 tokens in the demo) and full
    # attention: guesses go out while the window holds them all, then stop.
    model = models("gpt_oss")
    expected = reference(model, n=20, prompt=PROMPT[:2])
    ring = Ring(model, SPLITS[2], draft_tokens=K)
    assert ring.stages[0].spec_window == 8
    got = ring.answer({**GREEDY, "max_tokens": 20}, tokens=PROMPT[:2], prediction=expected)
    assert got == expected
    assert ring.stages[0].stats.kept > 0
    assert "rotating window" in ring.done("r")["usage"]["speculation_off"]


def test_speculation_stands_aside_when_its_guesses_miss(models: Callable[..., Path]) -> None:
    model = models("llama")
    expected = reference(model, n=40)
    never = [(t + 1) % 256 for t in expected]
    ring = Ring(model, SPLITS[2], draft_tokens=K)
    assert ring.answer({**GREEDY, "max_tokens": 40}, prediction=never) == expected
    done = ring.done("r")["usage"]
    # It stops: its guesses were rejected.
    assert "lately" in done["speculation_off"]
    assert done["completion_tokens_details"]["rejected_prediction_tokens"] <= 2 * K + 4
    assert ring.stages[1].stats.prebuilt > 0, "decoding without guesses builds steps ahead"


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_lookup_step_without_guesses_decodes_built_ahead(
    models: Callable[..., Path], stages: int
) -> None:
    """Prompt lookup that finds nothing to propose sends plain decode steps, each built
    ahead while the one before computed (not one-token verify frames, which cannot be);
    a step that then finds guesses drops the step built ahead on every stage (never
    run, its draw given back), and the answer stays mlx-lm's, greedy and seeded."""
    model = models("llama")
    prompt = [50, 51, 52, 53, 54, 55, 56]
    expected = reference(model, prompt=prompt)
    # The answer up to its first token after which lookup has a guess: no match.
    silent = next(t for t in range(1, N) if speculation.lookup([], [*prompt, *expected[:t]], 1))
    assert silent >= 3
    ring = Ring(model, SPLITS[stages], draft="lookup", draft_tokens=K)
    assert ring.answer({**GREEDY, "max_tokens": silent}, tokens=prompt) == expected[:silent]
    assert ring.stages[0].stats.drafted == 0
    # Every step after the prompt's is built ahead, on every stage.
    assert [s.stats.prebuilt for s in ring.stages] == [silent - 1] * stages
    # The whole answer: guesses found after steps built ahead, which are dropped.
    ring = Ring(model, SPLITS[stages], draft="lookup", draft_tokens=K)
    assert ring.answer(GREEDY, tokens=prompt) == expected
    assert ring.stages[0].stats.kept > 0
    assert all(s.stats.dropped_ahead > 0 and s.stats.prebuilt > 0 for s in ring.stages)
    assert ring.held() == [0] * stages
    # Seeded: the draws of dropped steps are given back.
    plain = Ring(model, SPLITS[stages]).answer(SAMPLED, tokens=prompt)
    ring = Ring(model, SPLITS[stages], draft="lookup", draft_tokens=K)
    assert ring.answer(SAMPLED, tokens=prompt) == plain
    assert all(s.stats.dropped_ahead > 0 for s in ring.stages)
    assert ring.held() == [0] * stages


BATCH_PROMPTS = {
    "a": PROMPT,
    "b": [50, 51, 52, 53, 54, 55, 56],
    "c": [60, 61, 62, 63] * 4,
    "d": PROMPT[3:],
}


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_batch_mixing_requests_with_and_without_guesses_verifies_each_row(
    models: Callable[..., Path], stages: int
) -> None:
    """Requests in one lane's batch: one with a predicted output, one without guesses,
    one with prompt lookup, one sampled with a seed and a prediction that goes wrong.
    Each row's own guesses are verified in the batch's one pass and cut back by its own
    amount: every answer is mlx-lm's (greedy) or the one alone without guesses."""
    model = models("llama")
    n = 30
    greedy = {**GREEDY, "max_tokens": n}
    sampled = {**SAMPLED, "max_tokens": n}
    expected = {rid: reference(model, n=n, prompt=p) for rid, p in BATCH_PROMPTS.items()}
    alone = Ring(model, SPLITS[stages]).answer(sampled, rid="d", tokens=BATCH_PROMPTS["d"])
    # Two lanes a stage on a ring: enough requests that each lane batches several.
    ring = Ring(model, SPLITS[stages], draft_tokens=K, row_cost=speculation.ROW_COST)
    wrong = [*alone[:5], (alone[5] + 1) % 256, *alone[6:]]
    asks = {
        "a": (greedy, {"prediction": expected["a"]}),
        "b": (greedy, {"draft": ""}),
        "c": (greedy, {"draft": "lookup"}),
        "d": (sampled, {"prediction": wrong}),
    }
    for _ in range(stages):
        for rid, (params, more) in asks.items():
            ring.ask(f"{rid}{_}", params, tokens=BATCH_PROMPTS[rid], **more)
    ring.drain()
    for _ in range(stages):
        for rid in "abc":
            assert ring.tokens(f"{rid}{_}") == expected[rid], f"{rid}{_}, {stages} stages"
        assert ring.tokens(f"d{_}") == alone
        usage = ring.done(f"b{_}")["usage"]
        assert "completion_tokens_details" not in usage
    head = ring.stages[0].stats
    assert head.verified_batches > 0, "the batch should have verified its rows' guesses"
    assert head.kept > 0 and head.drafted > head.kept
    assert all(s.stats.verified_batches == head.verified_batches for s in ring.stages)
    assert ring.held() == [0] * stages
    assert not any(s.groups for s in ring.stages)


def test_a_batch_too_costly_to_guess_in_decodes_without_guesses(
    models: Callable[..., Path],
) -> None:
    """When a row-position costs as much as a step's fixed part (a batch that already
    fills the compute), guesses not yet known to be kept are left out of the batch's
    steps (all kept, they would still pay: no position is wasted); each answer is the
    same."""
    model = models("llama")
    n = 30
    expected = {rid: reference(model, n=n, prompt=p) for rid, p in BATCH_PROMPTS.items()}
    ring = Ring(model, SPLITS[1], draft="lookup", draft_tokens=K, row_cost=1.0)
    for rid, prompt in BATCH_PROMPTS.items():
        never = [(t + 1) % 256 for t in expected[rid]]
        ring.ask(rid, {**GREEDY, "max_tokens": n}, tokens=prompt, prediction=never)
    ring.drain()
    assert {rid: ring.tokens(rid) for rid in BATCH_PROMPTS} == expected
    stats = ring.stages[0].stats
    assert stats.batched > 0 and stats.verified_batches == 0 and stats.unguessed_batches > 0
    assert ring.held() == [0]


def test_guesses_in_a_batch_pay_only_while_the_batch_is_small() -> None:
    # Two rows, one guessing at the prior acceptance: worth a verify step of 5 positions.
    one = speculation.expected_tokens(speculation.PRIOR_ACCEPTANCE, 4)
    assert speculation.batch_pays([one, 1.0], 5, speculation.ROW_COST)
    # Sixteen rows, one guessing: the padding of the others costs more than it gains.
    assert not speculation.batch_pays([one, *[1.0] * 15], 5, speculation.ROW_COST)
    # Sixteen rows all kept 90% of the time still pay; at 20% they do not.
    good = speculation.expected_tokens(0.9, 4)
    poor = speculation.expected_tokens(0.2, 4)
    assert speculation.batch_pays([good] * 16, 5, speculation.ROW_COST)
    assert not speculation.batch_pays([poor] * 16, 5, speculation.ROW_COST)
    # Free positions: any expected gain pays; nothing to verify never does.
    assert speculation.batch_pays([1.2, 1.0], 5, 0.0)
    assert not speculation.batch_pays([1.0, 1.0], 1, 0.0)
    assert not speculation.batch_pays([], 5, 0.0)


def test_the_row_cost_is_fitted_to_timed_steps() -> None:
    # seconds = 0.010 + 0.001 x positions: a position costs a tenth of the fixed part.
    steps = [(n, 0.010 + 0.001 * n) for n in (2, 4, 10, 3, 8, 2, 12, 6)]
    fitted = speculation.row_cost(steps)
    assert fitted is not None and fitted == pytest.approx(0.1)
    assert speculation.row_cost(steps[:5]) is None  # too few steps
    assert speculation.row_cost([(4, 0.01 * i) for i in range(1, 10)]) is None  # one size


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_draft_model_gives_mlx_lm_greedy_answer(models: Callable[..., Path], stages: int) -> None:
    """A draft model on the head: itself (every guess kept, so each next step's guesses
    were made ahead while the step before was round the ring) and a 2-layer model of
    other weights (guesses kept and rejected, the guesses made ahead thrown away)."""
    model = models("llama")
    expected = reference(model, n=40)
    for draft in (model, models("llama", layers=2)):
        loaded = mlx_lm.load(str(draft))[0]
        ring = Ring(model, SPLITS[stages], draft="model", draft_model=loaded, draft_tokens=K)
        # The draft's steps take the CPU's fused ops, as a shard's do.
        assert any(isinstance(m, DecodeRMSNorm) for m in loaded.modules())
        assert ring.answer({**GREEDY, "max_tokens": 40}) == expected, f"{draft.name}"
        assert ring.stages[0].stats.kept > 0
        if draft == model and stages > 1:
            assert ring.stages[0].stats.drafted_ahead > 0
        assert ring.held() == [0] * stages


@pytest.mark.parametrize("stages", [2, 3])
def test_a_verify_step_computed_ahead_is_sent_or_cut_back(
    models: Callable[..., Path], stages: int
) -> None:
    """While a verify step is round the ring the head computes the next one as guessed
    (every guess kept, the model's token guessed too): sent as it is when the tokens
    come back so, cut back out of the head's caches when they do not. Either way the
    answer is mlx-lm's, greedy and seeded, and nothing is left held."""
    model = models("llama")
    expected = reference(model, n=40)
    many = {**GREEDY, "max_tokens": 40}
    # A draft that agrees: each step after the first was computed ahead.
    ring = Ring(model, SPLITS[stages], draft="model", draft_model=mlx_lm.load(str(model))[0],
                draft_tokens=K)  # fmt: skip
    assert ring.answer(many) == expected
    head = ring.stages[0].stats
    assert head.verified_ahead >= 3
    assert ring.held() == [0] * stages
    # The next turn reuses the answer's caches, cut back to its end.
    turn = [*PROMPT, *expected, 7, 8, 9]
    assert ring.answer(GREEDY, rid="next", tokens=turn, draft="") == reference(model, prompt=turn)
    assert ring.done("next")["usage"]["cached_tokens"] >= len(PROMPT) + 30
    # A draft of other weights: some steps computed ahead are dropped, some sent.
    other = mlx_lm.load(str(models("llama", layers=2)))[0]
    ring = Ring(model, SPLITS[stages], draft="model", draft_model=other, draft_tokens=K)
    assert ring.answer(many) == expected
    assert ring.stages[0].stats.dropped_verify_ahead > 0
    assert ring.held() == [0] * stages
    # Prompt lookup's prediction, right to its 14th token and from its 22nd: the step
    # computed ahead over the wrong token is cut back, the one after it is sent.
    wrong = [*expected[:14], *((t + 1) % 256 for t in expected[14:21]), *expected[21:]]
    ring = Ring(model, SPLITS[stages], draft_tokens=K)
    assert ring.answer(many, prediction=wrong) == expected
    head = ring.stages[0].stats
    assert head.verified_ahead > 0 and head.dropped_verify_ahead > 0
    assert ring.held() == [0] * stages
    # Seeded sampling: the same draws as without guesses.
    sampled = {**SAMPLED, "max_tokens": 40}
    plain = Ring(model, SPLITS[stages]).answer(sampled)
    ring = Ring(model, SPLITS[stages], draft_tokens=K)
    assert ring.answer(sampled, prediction=plain) == plain
    assert ring.stages[0].stats.verified_ahead > 0
    assert ring.held() == [0] * stages


@pytest.mark.parametrize("stages", [2, 3])
def test_a_request_joining_a_batch_drops_the_step_computed_ahead(
    models: Callable[..., Path], stages: int
) -> None:
    """A request decoding alone with a step computed ahead, then others arrive and one
    decodes in a batch with it: the step computed ahead is cut back out before the
    batch is built on its caches, and every answer is mlx-lm's."""
    model = models("llama")
    n = 60
    first = {**GREEDY, "max_tokens": n}
    second = BATCH_PROMPTS["b"]
    expected = reference(model, n=n)
    later = reference(model, n=n, prompt=second)
    itself = mlx_lm.load(str(model))[0]
    ring = Ring(model, SPLITS[stages], draft="model", draft_model=itself, draft_tokens=K,
                row_cost=speculation.ROW_COST)  # fmt: skip
    ring.ask("a", first)
    while ring.stages[0].stats.verified_ahead < 1:
        ring.drain(1)
    assert ring.stages[0].verify_ahead, "a step should be computed ahead now"
    # One lane a stage: enough requests that one joins the lane of "a".
    others = [f"b{i}" for i in range(stages + 1)]
    for rid in others:
        ring.ask(rid, first, tokens=second, draft="")
    ring.drain()
    assert ring.tokens("a") == expected
    assert all(ring.tokens(rid) == later for rid in others)
    head = ring.stages[0].stats
    assert head.batched > 0 and head.dropped_verify_ahead > 0
    assert ring.held() == [0] * stages


def test_a_step_ahead_that_fails_to_start_costs_nothing_but_itself(
    models: Callable[..., Path],
) -> None:
    """The head's layers raise on every step it computes ahead (an out-of-memory, say):
    the step is only a guess, so the answer goes on as without it, mlx-lm's."""
    model = models("llama")
    expected = reference(model, n=40)
    ring = Ring(model, SPLITS[2], draft_tokens=K)
    head = ring.stages[0]
    forward = head.shard.forward
    failed = []

    def fails_ahead(h: mx.array, cache: Any) -> mx.array:
        if any("_verify_ahead" in str(frame) for frame in traceback.extract_stack()):
            failed.append(h.shape)
            raise MemoryError("no memory for the step ahead")
        return forward(h, cache)

    head.shard.forward = fails_ahead  # type: ignore[method-assign,assignment]
    assert ring.answer({**GREEDY, "max_tokens": 40}, prediction=expected) == expected
    assert failed and head.stats.verified_ahead == 0
    assert ring.held() == [0, 0]


def test_a_lone_stage_computes_nothing_ahead_and_a_miss_sends_none(
    models: Callable[..., Path],
) -> None:
    """A lone stage has no ring to overlap the next step with; after a step whose
    guesses were not all kept the head computes nothing ahead, so guesses that never
    agree cost at most the first step computed ahead, cut back."""
    model = models("llama")
    expected = reference(model, n=40)
    ring = Ring(model, SPLITS[1], draft_tokens=K)
    assert ring.answer({**GREEDY, "max_tokens": 40}, prediction=expected) == expected
    assert ring.stages[0].stats.verified_ahead == ring.stages[0].stats.dropped_verify_ahead == 0
    never = [(t + 1) % 256 for t in expected]
    ring = Ring(model, SPLITS[2], draft_tokens=K)
    assert ring.answer({**GREEDY, "max_tokens": 40}, prediction=never) == expected
    assert ring.stages[0].stats.verified_ahead == 0
    assert ring.stages[0].stats.dropped_verify_ahead <= 1
    assert ring.done("r")["usage"]["speculation_off"]
    assert ring.held() == [0, 0]


def test_guesses_made_ahead_are_the_draft_s_own(tmp_path: Path) -> None:
    """`guess_ahead` while a step is out, then `propose`: the same guesses a draft that
    never guessed ahead makes, whether the step kept what was assumed or not."""
    draft = write_demo_model(tmp_path / "d", DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2))
    loaded = mlx_lm.load(str(draft))[0]
    context = [40, 41, 42, 43, 44, 45, 46]
    ahead = speculation.DraftSession(loaded)
    guesses = ahead.propose(context, 3)
    ahead.guess_ahead(context, guesses, 4)
    assert ahead.ahead is not None
    known, assumed, _ = ahead.ahead
    assert known == len(context)
    kept = [*context, *assumed]  # every guess kept, and the big model's token the draft's own
    assert ahead.propose(kept, 4) == speculation.DraftSession(loaded).propose(kept, 4)
    ahead.guess_ahead(kept, ahead.propose(kept, 2), 2)  # ... then one that is not kept
    other = [*kept, (kept[-1] + 7) % 256]
    assert ahead.propose(other, 3) == speculation.DraftSession(loaded).propose(other, 3)


def test_bad_draft_choices_are_refused_in_words(models: Callable[..., Path]) -> None:
    ring = Ring(models("llama"), SPLITS[1])
    ring.answer(GREEDY, rid="a", draft="magic")
    assert "draft 'magic' is not one of" in ring.done("a")["message"]
    ring.answer(GREEDY, rid="b", draft="model")
    assert "no draft model" in ring.done("b")["message"]
    ring.answer(GREEDY, rid="c", prediction={"type": "content"})
    assert "prediction must be" in ring.done("c")["message"]
    with pytest.raises(ValueError, match="not one of"):
        Ring(models("llama"), SPLITS[1], draft="magic")


def test_lookup_proposes_the_continuation_of_the_longest_latest_match() -> None:
    context = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" occurs at 1 and 6; the latest (6) is followed by 7 8 5.
    assert speculation.lookup([], context, 3) == [7, 8, 5]
    assert speculation.lookup([], [*context, 7], 2) == [8, 5]  # "2 3 7" beats "3 7"
    assert speculation.lookup([[4, 2, 3, 6, 6]], context, 2) == [6, 6]  # a prediction first
    assert speculation.lookup([], [1, 2, 3, 4], 3) == []
    assert speculation.lookup([], context, 0) == []


def test_k_adapts_to_acceptance_and_speculation_stands_aside() -> None:
    """K doubles after a step that kept every guess (up to its most), halves or falls
    to the kept plus one after one that did not; a request whose recent guesses are
    seldom kept stops; one that finds nothing to propose goes on looking."""
    spec = speculation.Speculation(mode="lookup", k=2, k_max=16)
    for want in (4, 8, 16, 16):
        spec.record(spec.k, spec.k)
        assert spec.k == want
    spec.record(16, 12)
    assert spec.k == 8  # halved: 12 kept of 16
    spec.record(8, 1)
    assert spec.k == 2 and not spec.off  # what was kept plus one
    spec.record(2, 2)
    assert spec.k == 4
    missing = speculation.Speculation(mode="lookup", k=2, k_max=16)
    for _ in range(speculation.JUDGE_ROUNDS - 1):
        missing.record(missing.k, 0)
        assert missing.k == 1 and not missing.off
    missing.record(1, 0)
    assert "lately" in missing.off and missing.budget(10) == 0
    # A step with nothing to propose decodes as without guesses: lookup keeps looking.
    idle = speculation.Speculation(mode="lookup")
    for _ in range(50):
        idle.record(0, 0)
    assert not idle.off and idle.k == speculation.DEFAULT_DRAFT_TOKENS
    assert speculation.expected_tokens(0.0, 4) == 1.0
    assert speculation.expected_tokens(1.0, 4) == 5.0


def test_the_lookup_index_proposes_what_a_full_scan_does() -> None:
    """`LookupIndex`, fed token by token, proposes at every length what `lookup`
    proposes scanning the whole context (and a prediction) again; and
    `Speculation.guesses`, fed the answer as it grows, what `lookup_guesses` gives."""
    rng = random.Random(5)
    for trial in range(40):
        vocab = rng.choice([3, 6, 20])
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        sources = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]][: trial % 2]
        index = speculation.LookupIndex(sources)
        for at, token in enumerate(context):
            index.extend([token])
            k = rng.randrange(0, 9)
            assert index.propose(k) == speculation.lookup(sources, context[: at + 1], k), (
                trial,
                at,
            )
        prompt, answer = context[:20], context[20:]
        prediction = [*answer[:15], vocab] if trial % 3 == 0 else []
        spec = speculation.Speculation(mode="lookup", prediction=tuple(prediction))
        for n in range(len(answer) + 1):
            if rng.random() < 0.3:
                continue  # a step may bring several tokens at once
            k = rng.randrange(1, 9)
            got = spec.guesses(prompt, answer[:n], k)
            assert got == speculation.lookup_guesses(prediction, prompt, answer[:n], k)


def test_a_lookup_proposal_costs_the_same_however_long_the_context() -> None:
    """The index makes a step's proposal a few dictionary reads: at 32k tokens it costs
    what it does at 1k (a full scan grows with the context)."""

    def per_step(length: int) -> float:
        rng = random.Random(length)
        index = speculation.LookupIndex()
        index.extend([rng.randrange(50_000) for _ in range(length)])
        began = time.perf_counter()
        for _ in range(500):
            index.extend([rng.randrange(50_000)])
            index.propose(8)
        return (time.perf_counter() - began) / 500

    short, long = min(per_step(1024) for _ in range(3)), min(per_step(32_768) for _ in range(3))
    assert long < 4 * short + 20e-6, (short, long)


class _Counted(Sequence[int]):
    """A context that counts the tokens read from it."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.reads = tokens, 0

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: Any) -> Any:
        got = self.tokens[i]
        self.reads += len(got) if isinstance(i, slice) else 1
        return got


def test_a_draft_step_reads_only_the_end_of_the_context(tmp_path: Path) -> None:
    """A draft model's session compares only what is new since its last proposal with
    what it has seen: a step reads as many context tokens at 8k tokens as at 100 (it
    once compared the whole context, O(context) Python a step), and its guesses are
    those of a session that proposes from scratch."""
    draft = write_demo_model(tmp_path / "d", DemoSpec(layers=1, hidden=32, heads=2, kv_heads=1))
    loaded = mlx_lm.load(str(draft))[0]

    def reads(length: int) -> list[int]:
        rng = random.Random(length)
        context = [rng.randrange(256) for _ in range(length)]
        session = speculation.DraftSession(loaded, prefill_chunk=4096)
        session.propose(context, 3)
        counts = []
        for step in range(6):
            guesses = session.propose(_Counted(context), 3)
            if step == 3:
                fresh = speculation.DraftSession(loaded, prefill_chunk=4096)
                assert guesses == fresh.propose(context, 3)
            session.guess_ahead(context, guesses, 3)  # made ahead, then not kept
            counted = _Counted(context)
            session.propose(counted, 3)
            counts.append(counted.reads)
            context += [guesses[0], (guesses[1] + 1) % 256]  # one kept, then another token
        return counts

    short, long = reads(100), reads(8192)
    assert max(long) <= 16 and long == short, (short, long)
