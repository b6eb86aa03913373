"""Structured output enforced on the shard that samples: answers of a random-weight demo
model at temperature 1 parse and validate against their JSON Schema for every seed,
token for token as mlx-lm's `generate_step` draws them with llguidance's own mask as a
logits processor; in a batch, rows with a schema and rows without share steps, and the
rows without keep mlx-lm's greedy tokens.

Real shards and real `Stage`s in one process (tests/ring_harness.py), the ring of
test_logits_processors.py. Through the API with the `openai` SDK over real agents:
tests/integration/test_structured_api.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from llguidance import LLMatcher
from llguidance.numpy import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    fill_next_token_bitmask,
)
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from tests.integration.test_logits_processors import PROMPT, SPLITS, Ring, model
from tests.support.ring_harness import CHUNK
from worker.sampling import grammar_tokenizer
from worker.shared.structured import JSON_OBJECT, compile_grammar, schema_grammar

__all__ = ["model"]  # the module fixture, shared

SEEDS = range(8)
MOST = 400  # tokens an answer may take; every one here closes long before
# Strings are bounded (maxLength, enum, pattern): a random model writes a free string
# until it happens to draw the closing quote, one token in ~250.
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested objects": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Oslo", "Lima", "Pune"]},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "arrays with bounds": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 2,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "minLength": 1, "maxLength": 6},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        },
        "required": ["items", "flags"],
        "additionalProperties": False,
    },
    "enums, numbers and booleans": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "level": {"type": "integer", "enum": [1, 2, 3]},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "price": {"type": "number"},
            "paid": {"type": "boolean"},
            "note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
        },
        "required": ["color", "level", "ratio", "price", "paid", "note"],
        "additionalProperties": False,
    },
    "optional properties": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "tag": {"type": "string", "maxLength": 4},
            "ok": {"type": "boolean"},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "a top-level array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 5,
    },
}
GRAMMARS = {name: schema_grammar(schema, name) for name, schema in SCHEMAS.items()}


def sampled(grammar: str, seed: int, **more: Any) -> dict[str, Any]:
    return {"max_tokens": MOST, "temperature": 1.0, "seed": seed, "grammar": grammar, **more}


def texts(ring: Ring) -> dict[str, str]:
    out: dict[str, str] = {}
    for kind, fields in ring.client:
        if kind == "delta":
            out[fields["rid"]] = out.get(fields["rid"], "") + fields["text"]
    return out


def finishes(ring: Ring) -> dict[str, str]:
    return {f["rid"]: f["finish_reason"] for k, f in ring.client if k == "done"}


@pytest.fixture(scope="module")
def reference(model: Path) -> Callable[..., list[int]]:
    """mlx-lm's answer: `generate_step` after `mx.random.seed(seed)` with
    `make_sampler(temp)`, the schema's mask applied by a logits processor that is
    llguidance's own (its matcher fed the tokens drawn, its numpy masking), up to and
    with the end-of-sequence token."""
    loaded, tokenizer = mlx_lm.load(str(model))
    vocab = int(loaded.args.vocab_size)
    eos = set(tokenizer.eos_token_ids)

    def tokens(prompt: list[int], grammar: str = "", temp: float = 0.0, seed: int = 0) -> list[int]:
        processors = []
        if grammar:
            matcher = LLMatcher(grammar_tokenizer(tokenizer, vocab), compile_grammar(grammar))
            bits = allocate_token_bitmask(1, vocab)
            seen = [len(prompt)]

            def mask(drawn: mx.array, logits: mx.array) -> mx.array:
                matcher.consume_tokens(drawn[seen[0] :].tolist())
                seen[0] = drawn.size
                fill_next_token_bitmask(matcher, bits, 0)
                out = np.array(logits.astype(mx.float32))
                apply_token_bitmask_inplace(out, bits)
                return mx.array(out).astype(logits.dtype)

            processors.append(mask)
        mx.random.seed(seed)
        steps = generate_step(
            mx.array(prompt),
            loaded,
            max_tokens=1000,
            prefill_step_size=CHUNK,
            sampler=make_sampler(temp=temp),
            logits_processors=processors,
        )
        out = []
        for token, _ in steps:
            out.append(int(token))
            if grammar and token in eos:
                break
        return out

    return tokens


@pytest.mark.parametrize("split", SPLITS)
def test_every_answer_at_temperature_one_validates_against_its_schema(
    model: Path, split: str
) -> None:
    ring = Ring(model, SPLITS[split])
    for name, grammar in GRAMMARS.items():
        for seed in SEEDS:
            ring.submit(f"{name}/{seed}", PROMPT, sampled(grammar, seed))
    ring.drain()
    answers, ends = texts(ring), finishes(ring)
    for name, schema in SCHEMAS.items():
        seen = set()
        for seed in SEEDS:
            rid = f"{name}/{seed}"
            assert ends[rid] == "stop", rid  # the grammar's end, well before max_tokens
            jsonschema.validate(json.loads(answers[rid]), schema)
            seen.add(answers[rid])
        assert len(seen) > len(SEEDS) // 2, f"{name}: the seeds hardly differ: {seen}"
    # They were decoded together, and at temperature 1 as asked.
    assert ring.stages[-1].stats.batched > 0


@pytest.mark.parametrize("split", SPLITS)
def test_draws_equal_mlx_lm_with_llguidance_as_its_logits_processor(
    model: Path, reference: Callable[..., list[int]], split: str
) -> None:
    ring = Ring(model, SPLITS[split])
    for name in ("nested objects", "a top-level array"):
        for seed in (1, 2):
            want = reference(PROMPT, GRAMMARS[name], temp=1.0, seed=seed)
            assert ring.answer(f"{name}/{seed}", PROMPT, sampled(GRAMMARS[name], seed)) == want
    # Greedy under the mask: the likeliest allowed token each step (for the demo, the
    # most whitespace allowed wherever it is: 21 tokens a place; in JSON mode its
    # likeliest key never closes: tokens alike, up to max_tokens).
    for name, grammar, most in (
        ("greedy", GRAMMARS["nested objects"], 1000),
        ("json mode", JSON_OBJECT, 48),
    ):
        params = {"max_tokens": most, "grammar": grammar}
        assert ring.answer(name, PROMPT, params) == reference(PROMPT, grammar)[:most]
    jsonschema.validate(json.loads(texts(ring)["greedy"]), SCHEMAS["nested objects"])


@pytest.mark.parametrize("split", SPLITS)
def test_rows_with_and_without_a_schema_in_one_batch(
    model: Path, reference: Callable[..., list[int]], split: str
) -> None:
    ring = Ring(model, SPLITS[split])
    rows: list[set[str]] = []
    draw_rows = ring.stages[-1]._draw_rows

    def seen(rids: list[str], logits: mx.array) -> Any:
        rows.append(set(rids))  # which requests each batched step sampled
        return draw_rows(rids, logits)

    ring.stages[-1]._draw_rows = seen  # type: ignore[method-assign]
    prompts = {f"plain{i}": PROMPT[i:] for i in range(3)}
    schemas = {f"schema{seed}": ("arrays with bounds", seed) for seed in range(3)}
    for rid, prompt in prompts.items():
        ring.submit(rid, prompt, {"max_tokens": 24, "ignore_eos": True})
    for rid, (name, seed) in schemas.items():
        ring.submit(rid, PROMPT, sampled(GRAMMARS[name], seed))
    ring.drain()
    assert any(set(prompts) & step and set(schemas) & step for step in rows), rows
    for rid, prompt in prompts.items():
        assert ring.tokens(rid) == reference(prompt)[:24], rid
    answers = texts(ring)
    for rid, (name, _) in schemas.items():
        jsonschema.validate(json.loads(answers[rid]), SCHEMAS[name])
    # As it answers alone: the others in its batch change nothing.
    name, seed = schemas["schema1"]
    alone = Ring(model, SPLITS[split])
    assert ring.tokens("schema1") == alone.answer("alone", PROMPT, sampled(GRAMMARS[name], seed))


def test_max_tokens_cuts_the_answer_short_and_the_grammar_ends_it_despite_ignore_eos(
    model: Path,
) -> None:
    ring = Ring(model, SPLITS["two stages"])
    grammar = GRAMMARS["nested objects"]
    whole = ring.answer("whole", PROMPT, sampled(grammar, 4))
    cut = ring.answer("cut", PROMPT, sampled(grammar, 4, max_tokens=6))
    # The same answer, cut where max_tokens ran out: "length", and no JSON.
    assert cut == whole[:6]
    assert finishes(ring)["cut"] == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(texts(ring)["cut"])
    # ignore_eos does not run an answer past the end of its schema.
    assert ring.answer("on", PROMPT, sampled(grammar, 4, ignore_eos=True)) == whole
    assert finishes(ring)["on"] == "stop"
