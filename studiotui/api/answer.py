"""One answer in the making, whatever API asked for it: the base every API's shape
(OpenAI's chat and text, Anthropic's messages, OpenAI's responses, Ollama's) fills in.

The server drives a shape the same way for every API: `add` each delta and `body`
for a whole answer; `start`, `chunk` per delta, `end` and `failed` for a stream.
Each returns the bytes its API writes, so the server knows no API's wire format.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from studiotui.api import shapes
from studiotui.api.request import ApiError
from worker.shared.protocol import control

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}
SSE = "text/event-stream; charset=utf-8"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def event(obj: dict[str, Any]) -> bytes:
    """One server-sent event of OpenAI's chat and text streams: data only."""
    return f"data: {dumps(obj)}\n\n".encode()


def named_event(obj: dict[str, Any]) -> bytes:
    """One server-sent event named by its `type`, as Anthropic's and the Responses
    API's streams send them."""
    return f"event: {obj['type']}\ndata: {dumps(obj)}\n\n".encode()


def usage(done: control.Done) -> dict[str, int]:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens` when the head reported
    how much of the prompt its cache held."""
    got = done.usage
    prompt = int(got.get("prompt_tokens", 0))
    completion = int(got.get("completion_tokens", 0))
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # OpenAI's field for the prompt tokens served by the prefix cache.
        "prompt_tokens_details": {"cached_tokens": cached_tokens(done)},
    }
    details = got.get("completion_tokens_details")
    if isinstance(details, dict):
        # OpenAI's Predicted Outputs counts: guesses kept and rejected.
        out["completion_tokens_details"] = {
            key: int(details.get(key, 0))
            for key in ("accepted_prediction_tokens", "rejected_prediction_tokens")
        }
    return out


def cached_tokens(done: control.Done) -> int:
    """The prompt tokens the head's cache held (0 where it reports none)."""
    got = done.usage
    details = got.get("prompt_tokens_details") or {}
    return int(got.get("cached_tokens", details.get("cached_tokens", 0)) or 0)


def call_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed call's arguments as an object (a parser may give a JSON string)."""
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            return {"arguments": arguments}
    return arguments if isinstance(arguments, dict) else {"value": arguments}


class Shape:
    """One answer in the making, in one API's shape.

    Without streaming it gathers the deltas and gives the body; streaming it turns
    each delta into that API's chunks.
    """

    object = ""
    prompt_param = "messages"
    id_prefix = ""
    content_type = SSE

    def __init__(self, model: str, logprobs: int = -1, include_usage: bool = False) -> None:
        self.model = model
        self.wants_logprobs = logprobs >= 0
        self.top = max(logprobs, 0)
        self.include_usage = include_usage
        self.prompt_tokens = 0
        self.parts: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.entries: list[dict[str, Any]] = []
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())

    def accepted(self, msg: control.Accepted) -> None:
        """The head took the request: it counted the prompt."""
        self.prompt_tokens = msg.prompt_tokens

    def add(self, msg: control.Delta) -> None:
        self.parts.append(msg.text)
        self.calls.extend(msg.tool_calls or ())
        self.entries.extend(msg.logprobs or ())

    def reason(self, done: control.Done) -> str:
        """OpenAI's finish_reason: stop, length or tool_calls."""
        return shapes.finish_reason(FINISH.get(done.finish_reason, "stop"), bool(self.calls))

    def body(self, done: control.Done) -> dict[str, Any]:
        raise NotImplementedError

    def start(self) -> bytes:
        return b""

    def chunk(self, msg: control.Delta) -> bytes:
        raise NotImplementedError

    def end(self, done: control.Done) -> bytes:
        """All a stream sends once the answer is done."""
        raise NotImplementedError

    def failed(self, err: ApiError) -> bytes:
        """What a stream sends when the cluster fails mid-answer (the status is sent)."""
        return event(err.body())
