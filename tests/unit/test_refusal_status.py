"""A request the head shard did not accept is answered with the HTTP status its code
says (studiotui.api.server.STATUS_OF), whatever its words: the head may reword a
refusal without changing what clients see."""

from __future__ import annotations

import pytest

from studiotui.api.server import refused
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


def test_a_refusal_naming_a_parameter_blames_it() -> None:
    assert refused("bad_request", "top_p must be a number from 0 to 1", "d").param == "top_p"
    assert refused("bad_request", "the prompt is empty", "d", "prompt").param == "prompt"
