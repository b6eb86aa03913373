"""What the head shard sends about an answer, in OpenAI's shapes: tool calls and logprobs.

The head parses tool calls with mlx-lm's parser for the model's family and names
each token's log-probabilities (worker/stage.py); here they become the objects
OpenAI's clients read. Pure functions: the handlers in api.py call them per delta.
"""

from __future__ import annotations

import json
import uuid
from typing import Any


def tool_calls(calls: list[dict[str, Any]], first_index: int, streaming: bool) -> list[dict]:
    """Parsed calls ({name, arguments[, id]}) as OpenAI's `tool_calls`.

    Streaming, each call comes whole in one chunk with its `index`: the head reads a
    call when it closes, and OpenAI's clients accept the arguments in one piece.
    """
    out = []
    for i, call in enumerate(calls):
        arguments = call.get("arguments", {})
        item: dict[str, Any] = {
            "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": call["name"],
                # OpenAI's arguments are a JSON string; a parser may give one already.
                "arguments": arguments
                if isinstance(arguments, str)
                else json.dumps(arguments, ensure_ascii=False),
            },
        }
        if streaming:
            item = {"index": first_index + i, **item}
        out.append(item)
    return out


def _named(entry: dict[str, Any]) -> dict[str, Any]:
    token = entry["token"]
    return {"token": token, "logprob": entry["logprob"], "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[dict[str, Any]], top: int) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion (or of one chunk)."""
    return {
        "content": [
            {**_named(e), "top_logprobs": [_named(t) for t in e["top"][:top]]} for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[dict[str, Any]], top: int, offset: int) -> dict[str, Any]:
    """`choices[].logprobs` of a text completion: the legacy parallel lists.
    `offset` is where the first entry's token starts in the completion's text."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        # One {token: logprob} map per token; two ids can decode to one string, and
        # the likelier (first) one keeps the place.
        "top_logprobs": [
            {t["token"]: t["logprob"] for t in reversed(e["top"][:top])} for e in entries
        ]
        if top
        else None,
        "text_offset": offsets,
    }


def finish_reason(reason: str, called: bool) -> str:
    """OpenAI's finish_reason: "tool_calls" when the answer ended on its own after a call."""
    if reason == "length":
        return "length"
    return "tool_calls" if called else "stop"
