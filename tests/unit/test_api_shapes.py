"""OpenAI's shapes for what the head sends about an answer (pure functions)."""

from __future__ import annotations

import json

from studiotui.api.shapes import chat_logprobs, completion_logprobs, finish_reason, tool_calls


def entry(token: str, logprob: float, *top: tuple[str, float]) -> dict:
    return {
        "id": 0,
        "token": token,
        "logprob": logprob,
        "top": [{"id": i, "token": t, "logprob": lp} for i, (t, lp) in enumerate(top)],
    }


def test_tool_calls_carry_json_string_arguments_and_stream_with_an_index() -> None:
    calls = [
        {"name": "forecast", "arguments": {"city": "Zürich"}},
        {"name": "raw", "arguments": '{"a": 1}', "id": "model-id"},
    ]
    whole = tool_calls(calls, 0, streaming=False)
    assert [c["function"]["name"] for c in whole] == ["forecast", "raw"]
    assert json.loads(whole[0]["function"]["arguments"]) == {"city": "Zürich"}
    assert "Zürich" in whole[0]["function"]["arguments"]  # not \u-escaped
    assert whole[1]["function"]["arguments"] == '{"a": 1}' and whole[1]["id"] == "model-id"
    assert whole[0]["id"].startswith("call_") and "index" not in whole[0]
    streamed = tool_calls(calls, 3, streaming=True)
    assert [c["index"] for c in streamed] == [3, 4]


def test_logprobs_in_chat_and_completion_shapes() -> None:
    entries = [entry("He", -0.5, ("He", -0.5), ("She", -1.5)), entry("llo", -0.1, ("llo", -0.1))]
    chat = chat_logprobs(entries, 1)
    assert chat["content"][0] == {
        "token": "He",
        "logprob": -0.5,
        "bytes": [72, 101],
        "top_logprobs": [{"token": "He", "logprob": -0.5, "bytes": [72, 101]}],
    }
    plain = completion_logprobs(entries, 2, offset=4)
    assert plain["tokens"] == ["He", "llo"] and plain["token_logprobs"] == [-0.5, -0.1]
    assert plain["top_logprobs"] == [{"He": -0.5, "She": -1.5}, {"llo": -0.1}]
    assert plain["text_offset"] == [4, 6]
    assert completion_logprobs(entries, 0, 0)["top_logprobs"] is None
    # Two ids that decode alike: the likelier keeps the place in the map.
    twice = completion_logprobs([entry("a", -0.2, ("a", -0.2), ("a", -3.0))], 2, 0)
    assert twice["top_logprobs"] == [{"a": -0.2}]


def test_finish_reason_says_tool_calls_only_when_the_answer_ended_on_its_own() -> None:
    assert finish_reason("stop", called=True) == "tool_calls"
    assert finish_reason("stop", called=False) == "stop"
    assert finish_reason("length", called=True) == "length"
