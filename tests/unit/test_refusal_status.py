"""A request the head shard did not accept is answered with the HTTP status its code
says (studiotui.api.server.STATUS_OF), and blames the field its `param` names, whatever
its words: the head may reword a refusal without changing what clients see."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from studiotui.api.request import ApiError
from studiotui.api.server import _accepted, refused
from studiotui.cluster.errors import GenerationError
from tests.support.wire import arrived
from worker.sampling import ParamError, SamplingParams
from worker.shared.protocol import control
from worker.shared.protocol.messages import ERROR_CODES, ErrorCode

WORDS = [
    "the prompt is empty",  # a refusal's words today
    "busy: this placement serves 1 request(s) at once",
    "an empty prompt cannot be answered",  # the same refusal, reworded
    "tools must be a list, given with messages",
    "something no one has written yet",
]


@pytest.mark.parametrize("words", WORDS)
@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("bad_request", 400, "invalid_request_error"),
        ("busy", 429, "rate_limit_error"),
        ("failed", 503, "server_error"),
        ("internal", 503, "server_error"),
        ("out_of_memory", 503, "server_error"),
    ],
)
def test_the_status_follows_the_code_never_the_words(
    code: ErrorCode, status: int, kind: str, words: str
) -> None:
    answer = refused(code, words, "demo")
    assert (answer.status, answer.type) == (status, kind)
    assert words in answer.message  # the head's words reach the client as they are


def test_every_code_is_answered_with_a_client_or_a_cluster_status() -> None:
    for code in ERROR_CODES:
        assert refused(code, "x", "demo").status in (400, 429, 503), code


def test_the_blamed_field_is_the_one_given_never_read_from_the_words() -> None:
    # Words that begin with a parameter's name blame nothing by themselves...
    assert refused("bad_request", "top_p must be a number from 0 to 1", "d").param == "messages"
    # ...the head names the field (the `failed` message's param), however it words it.
    assert refused("bad_request", "the nucleus cannot be 2", "d", "top_p").param == "top_p"
    assert refused("bad_request", "the prompt is empty", "d", "prompt").param == "prompt"


@pytest.mark.parametrize("param", ["tools", "response_format", "draft", "prediction", "top_p"])
async def test_a_failed_messages_param_travels_to_the_api_error(param: str) -> None:
    """The head's `failed` as it arrives (decoded from the wire), through the
    controller's GenerationError, to the API's error: the field it blamed is named."""
    msg = arrived("failed", rid="r", seq=0, message="reworded", code="bad_request", param=param)
    assert isinstance(msg, control.Failed) and msg.param == param

    async def answer() -> AsyncIterator[dict[str, Any]]:
        assert isinstance(msg, control.Failed)
        raise GenerationError(msg.message, msg.code, msg.param)
        yield {}

    with pytest.raises(ApiError) as caught:
        await _accepted(answer(), "demo")
    assert (caught.value.status, caught.value.param) == (400, param)


async def test_a_refusal_blaming_no_field_blames_the_prompt() -> None:
    msg = arrived("failed", rid="r", seq=0, message="the prompt is empty", code="bad_request")
    assert isinstance(msg, control.Failed) and msg.param is None

    async def answer() -> AsyncIterator[dict[str, Any]]:
        raise GenerationError("the prompt is empty", "bad_request", None)
        yield {}

    with pytest.raises(ApiError) as caught:
        await _accepted(answer(), "demo", "prompt")
    assert caught.value.param == "prompt"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_p": 2.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logit_bias": [[5, 500]]}, "logit_bias"),
        ({"logit_bias": [[5, 1], [5, 2]]}, "logit_bias"),
        ({"recent": [-1]}, None),  # filled by the head, not the asker's field
        ({"stop": "x"}, None),
    ],
)
def test_the_head_blames_the_sampling_field_it_refuses(
    fields: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(ParamError) as caught:
        SamplingParams.from_dict(fields)
    assert caught.value.param == param
