"""What each API's body becomes: the chat request the chat completions path makes."""

from __future__ import annotations

import pytest

from studiotui.api import anthropic, ollama, responses
from studiotui.api.request import ApiError, parse_chat_request

TOOL = {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}


def test_ollama_options_are_mlx_lm_s_sampling_fields_with_ollama_s_defaults() -> None:
    got = ollama.parse_chat(
        {
            "model": "demo:latest",
            "messages": [{"role": "user", "content": "hi"}],
            "options": {
                "num_predict": 9,
                "temperature": 0.5,
                "top_k": 3,
                "min_p": 0.1,
                "seed": 4,
                "stop": ["x"],
                "repeat_penalty": 1.2,
                "repeat_last_n": 32,
                "num_ctx": 4096,
                "num_thread": 8,  # Ollama's own machinery: no meaning here
            },
        }
    )
    params = got.parsed.params
    assert (params["max_tokens"], params["temperature"], params["top_k"]) == (9, 0.5, 3)
    assert (params["min_p"], params["seed"], params["stop"]) == (0.1, 4, ["x"])
    assert params["repetition_penalty"] == 1.2 and params["repetition_context_size"] == 32
    assert got.num_ctx == 4096 and ollama.model_name(got.parsed.model) == "demo"
    plain = ollama.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert (plain.parsed.params["temperature"], plain.parsed.params["top_p"]) == (0.8, 0.9)
    assert plain.parsed.stream  # Ollama streams unless told not to
    with pytest.raises(ApiError, match="larger --context"):
        ollama.check_context(got, 2048)


def test_every_api_s_turns_are_the_chat_completions_turns() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    chat = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "R"},
            ],
            "tools": [TOOL],
        }
    )
    claude = anthropic.parse_messages_request(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "S"}],
            "messages": [
                {"role": "user", "content": "Q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "A"},
                        {"type": "tool_use", "id": "c1", "name": "look", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "R"}],
                },
            ],
            "tools": [{"name": "look", "input_schema": {"type": "object"}}],
        }
    )
    codex, _ = responses.parse_responses_request(
        {
            "instructions": "S",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Q"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
                {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "R"},
            ],
            # Tools only OpenAI's servers run are left out; function tools are offered.
            "tools": [{"type": "web_search"}, {"type": "function", **TOOL["function"]}],
        }
    )
    want = [{k: v for k, v in m.items() if k != "name"} for m in chat.messages]
    for got in (claude, codex):
        assert [{k: v for k, v in m.items() if k != "name"} for m in got.messages] == want
        assert got.tools == chat.tools


def test_what_cannot_be_honoured_is_refused_in_words() -> None:
    base = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ApiError, match="tool_choice any cannot be enforced"):
        anthropic.parse_messages_request(
            {**base, "tools": [{"name": "t", "input_schema": {}}], "tool_choice": {"type": "any"}}
        )
    with pytest.raises(ApiError, match="server tool"):
        anthropic.parse_messages_request({**base, "tools": [{"type": "web_search_20250305"}]})
    with pytest.raises(ApiError, match="max_tokens is required"):
        anthropic.parse_messages_request({k: v for k, v in base.items() if k != "max_tokens"})
    with pytest.raises(ApiError, match=r"text\.format") as no_schema:
        responses.parse_responses_request(
            {"input": "x", "text": {"format": {"type": "json_schema"}}}
        )
    assert no_schema.value.status == 400
    with pytest.raises(ApiError, match=r"format\.properties\.when cannot be enforced"):
        ollama.parse_generate(
            {
                "model": "m",
                "prompt": "x",
                "format": {"type": "object", "properties": {"when": {"type": "date"}}},
            }
        )
    with pytest.raises(ApiError, match='format "yaml" is not known'):
        ollama.parse_generate({"model": "m", "prompt": "x", "format": "yaml"})
    with pytest.raises(ApiError, match="reads text only"):
        ollama.parse_chat(
            {"model": "m", "messages": [{"role": "user", "content": "x", "images": ["AA"]}]}
        )


@pytest.mark.parametrize("role", [["user"], {"a": 1}, 3, None])
def test_an_ollama_role_of_another_type_is_a_400_naming_it(role: object) -> None:
    # A list or a map is not hashable: looking it up in the roles once raised a TypeError,
    # a 500 to the client.
    with pytest.raises(ApiError) as err:
        ollama.parse_chat({"model": "m", "messages": [{"role": role, "content": "x"}]})
    assert err.value.status == 400 and err.value.param == "messages[0].role"
