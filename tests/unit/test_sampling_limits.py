"""One table of sampling ranges (worker/shared/protocol/limits.py SAMPLING_LIMITS) for
the API, the head shard and the chat's settings: every limit in it is refused at the
API with a 400 naming the parameter, its range and what was sent, and by the head
shard's parser (`SamplingParams.from_dict`) with the same words; both take its ends."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from studiotui.api.request import ApiError, parse_chat_request
from studiotui.chat.history import Settings
from worker.sampling import ParamError, SamplingParams
from worker.shared.protocol.limits import MAX_TOP_K, SAMPLING_LIMITS, Limit, shown

MESSAGES = [{"role": "user", "content": "hi"}]
# The parameter as the API names it, and as the head shard's parameters carry it.
TRAVELS_AS = {"top_logprobs": "logprobs"}


def api_body(name: str, value: Any) -> dict[str, Any]:
    if name == "logit_bias":
        return {"messages": MESSAGES, "logit_bias": {"5": value}}
    extra = {"logprobs": True} if name == "top_logprobs" else {}
    return {"messages": MESSAGES, name: value, **extra}


def wire(name: str, value: Any) -> dict[str, Any]:
    if name == "logit_bias":
        return {"logit_bias": [[5, value]]}
    if name == "top_logprobs" and value < 0:
        value -= 1  # -1 travels as "no log-probabilities"
    return {TRAVELS_AS.get(name, name): value}


def label(name: str) -> str:
    return "logit_bias for token 5" if name == "logit_bias" else name


def outside(limit: Limit) -> list[float]:
    """Values just past each end (and NaN, for a number)."""
    step = 1 if limit.integer else max((limit.hi - limit.lo) / 100, 0.001)
    values: list[float] = [limit.lo - step, limit.hi + step]
    return values if limit.integer else [*values, math.nan]


CASES = [(name, value) for name, limit in SAMPLING_LIMITS.items() for value in outside(limit)]


@pytest.mark.parametrize(("name", "value"), CASES, ids=[f"{n}={v}" for n, v in CASES])
def test_api_and_head_refuse_alike(name: str, value: float) -> None:
    words = f"{SAMPLING_LIMITS[name].words()}; got"
    if name == "top_k" and value > MAX_TOP_K:
        # The API's one alias: a top_k past every vocabulary keeps every token, the
        # same as the largest that travels.
        assert parse_chat_request(api_body(name, value)).params["top_k"] == MAX_TOP_K
    else:
        with pytest.raises(ApiError) as api:
            parse_chat_request(api_body(name, value))
        assert api.value.status == 400 and api.value.param == name
        assert api.value.message.startswith(f"{label(name)} must be {words}")
        assert shown(value) in api.value.message
    with pytest.raises(ParamError) as head:
        SamplingParams.from_dict(wire(name, value))
    spoken = TRAVELS_AS.get(name, name)
    assert str(head.value).startswith(f"{label(spoken)} must be {words}")
    # The field travels beside the words (the API checked top_logprobs already).
    assert head.value.param == (None if name in TRAVELS_AS else name)


@pytest.mark.parametrize("name", list(SAMPLING_LIMITS))
def test_api_and_head_take_the_ends(name: str) -> None:
    limit = SAMPLING_LIMITS[name]
    for value in (limit.lo, limit.hi):
        value = int(value) if limit.integer else value
        parse_chat_request(api_body(name, value))
        SamplingParams.from_dict(wire(name, value))


def test_top_p_zero_is_greedy_on_both_sides() -> None:
    params = parse_chat_request(api_body("top_p", 0)).params
    assert params["temperature"] == 1.0  # OpenAI's default, sent along as asked
    sampled = SamplingParams.from_dict(params)
    assert (sampled.temperature, sampled.top_p) == (0.0, 1.0)


@pytest.mark.parametrize("name", ["temperature", "top_p", "max_tokens"])
def test_the_chat_settings_take_the_same_ranges(name: str) -> None:
    """The chat (studiotui/chat/history.py) sends these three: it refuses what the shards
    would, before a question is sent, and takes their ends."""
    limit = SAMPLING_LIMITS[name]
    span = f"{limit.number(limit.lo)}..{limit.number(limit.hi)}"
    for value in outside(limit):
        with pytest.raises(ValueError, match=f"must be {re.escape(span)}, got"):
            Settings(**{name: value}).validated()
    for value in (limit.lo, limit.hi):
        Settings(**{name: int(value) if limit.integer else value}).validated()


def test_a_refused_value_is_quoted_as_the_client_wrote_it_in_json() -> None:
    """The API's clients write JSON: `true`, `null` and `"hot"`, not Python's
    `True`, `None` and `'hot'`; a value past a few dozen characters is cut."""
    top_p = SAMPLING_LIMITS["top_p"]
    assert top_p.problem("top_p", True).endswith("got true")
    assert top_p.problem("top_p", "hot").endswith('got "hot"')
    assert top_p.problem("top_p", None).endswith("got null")
    assert top_p.problem("top_p", [1, "a"]).endswith('got [1, "a"]')
    assert len(top_p.problem("top_p", "x" * 10_000)) < 200
    assert shown(10**70) == "a huge integer"
    assert shown("\ud800") == '"\\ud800"'  # no UTF-8 for a lone surrogate: escaped
