"""Ollama's API on the same port (`/api/chat`, `/api/generate`, `/api/tags`, ...), so
Ollama's own clients and the apps built on them list and use the placed models.

Chats become the same turns the chat completions path builds (the same template,
the same tokens, the same answer); `/api/generate` is a one-turn chat (with its
`system`), or with `raw` the prompt as written. Streaming is Ollama's: one JSON
object a line, the last with `done: true` and the counts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from studiotui.api.answer import Shape, call_arguments, dumps
from studiotui.api.request import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    bad,
    function_tool,
    sampling_params,
    shown,
)
from studiotui.core.state import PlacementState
from worker.shared.protocol import control
from worker.shared.protocol.limits import MAX_STOP_STRINGS
from worker.shared.structured import JSON_OBJECT, FormatError, schema_grammar

# The Ollama API version whose shapes this follows (clients gate features on it).
VERSION = "0.12.0"
NDJSON = "application/x-ndjson"
ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
# Ollama names a model NAME:TAG, and its clients add ":latest" to a bare name.
LATEST = ":latest"
# Ollama's options, in OpenAI's (and mlx_lm.server's) names where they mean the same.
OPTION_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "repeat_last_n": "repetition_context_size",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# Ollama's num_predict: -1 "until it stops", -2 "until the context is full".
DEFAULT_PREDICT = 2048


def error_body(exc: ApiError) -> dict[str, Any]:
    """Ollama's error shape: {"error": "words"}."""
    return {"error": exc.message}


def model_name(name: str | None) -> str | None:
    """A placement's name from an Ollama model name ("demo:latest" is "demo")."""
    if name and name.endswith(LATEST):
        return name[: -len(LATEST)]
    return name


@dataclass(frozen=True)
class OllamaRequest:
    parsed: ChatRequest | CompletionRequest
    chat: bool  # /api/chat (a message), else /api/generate (a response)
    num_ctx: int | None = None
    load_only: bool = False


def _options(body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    options = body.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise bad("options must be an object such as {temperature: 0, num_predict: 64}", "options")
    ours = {OPTION_NAMES[k]: v for k, v in options.items() if k in OPTION_NAMES and v is not None}
    predict = options.get("num_predict")
    if predict is not None:
        if not isinstance(predict, int) or isinstance(predict, bool) or predict < -2:
            raise bad("options.num_predict must be a whole number, -1 or more", "num_predict")
        ours["max_tokens"] = DEFAULT_PREDICT if predict < 0 else predict
    else:
        ours["max_tokens"] = DEFAULT_PREDICT
    if options.get("stop") is not None:
        ours["stop"] = options["stop"]
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and (not isinstance(num_ctx, int) or isinstance(num_ctx, bool)):
        raise bad("options.num_ctx must be a whole number of tokens", "num_ctx")
    # Ollama's temperature default is 0.8; OpenAI's 1.0 would answer otherwise.
    ours.setdefault("temperature", 0.8)
    ours.setdefault("top_p", 0.9)
    ours.setdefault("top_k", 40)
    if ours.get("max_tokens") == 0:
        raise bad("options.num_predict 0 asks for no answer: give 1 or more", "num_predict")
    try:
        params = sampling_params(ours, max_stop=MAX_STOP_STRINGS)
    except ApiError as exc:
        raise bad(f"options: {exc.message}", exc.param) from None
    return params, num_ctx


def _format(body: dict[str, Any]) -> dict[str, Any]:
    """Ollama's `format` ("json", or a JSON Schema) as the grammar the tail enforces
    (worker/shared/structured.py), to go beside the sampling params."""
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"grammar": JSON_OBJECT}
    if isinstance(fmt, str):
        raise bad(f'format {shown(fmt)} is not known: give "json" or a JSON Schema', "format")
    try:
        return {"grammar": schema_grammar(fmt, "format")}
    except FormatError as exc:
        raise bad(str(exc), exc.param) from None


def _stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream", True)  # Ollama streams unless told not to
    if not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    return stream


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required: a name from GET /api/tags", "model")
    return model


def _images(item: dict[str, Any], where: str) -> None:
    if item.get("images"):
        raise bad(f"{where}.images: the placed model reads text only; send text", f"{where}.images")


def parse_chat(body: Any) -> OllamaRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = _model(body)
    grammar = _format(body)
    params, num_ctx = _options(body)
    params = {**params, **grammar}
    raw = body.get("messages")
    if raw is None or raw == []:
        # An empty chat loads the model (ollama's clients use it to preload).
        chat = ChatRequest(model, [], params, _stream(body), False)
        return OllamaRequest(chat, True, num_ctx, load_only=True)
    if not isinstance(raw, list):
        raise bad("messages must be an array of {role, content}", "messages")
    messages = []
    calls = 0
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(f"{where} must be an object {{role, content}}", where)
        _images(msg, where)
        role, content = msg.get("role"), msg.get("content", "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string", f"{where}.content")
        if role == "tool":
            # Ollama's tool turns name the tool, not a call id; the template reads both.
            turn: dict[str, Any] = {
                "role": "tool",
                "content": content,
                "tool_call_id": f"call_{max(calls - 1, 0)}",
            }
            name = msg.get("tool_name") or msg.get("name")
            if isinstance(name, str):
                turn["name"] = name
            messages.append(turn)
            continue
        if not isinstance(role, str) or role not in ROLES:
            raise bad(
                f"{where}.role must be system, user, assistant or tool; got {shown(role)}",
                f"{where}.role",
            )
        turn = {"role": role, "content": content}
        if isinstance(msg.get("thinking"), str) and msg["thinking"]:
            turn["reasoning_content"] = msg["thinking"]
        if role == "assistant" and msg.get("tool_calls"):
            turn["tool_calls"] = []
            for j, call in enumerate(msg["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    at = f"{where}.tool_calls[{j}]"
                    raise bad(f"{at} must be {{function: {{name, arguments}}}}", at)
                arguments = fn.get("arguments") or {}
                if isinstance(arguments, str):
                    arguments = call_arguments({"arguments": arguments})
                turn["tool_calls"].append(
                    {
                        "id": f"call_{calls}",
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": arguments},
                    }
                )
                calls += 1
        messages.append(turn)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools must be an array of {type: function, function: {...}}", "tools")
    checked = [function_tool(t, f"tools[{i}]") for i, t in enumerate(tools or [])]
    chat = ChatRequest(model, messages, params, _stream(body), False, tools=checked or None)
    return OllamaRequest(chat, True, num_ctx)


def parse_generate(body: Any) -> OllamaRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = _model(body)
    grammar = _format(body)
    _images(body, "body")
    if body.get("suffix"):
        raise bad("suffix is not supported: no model here fills in the middle", "suffix")
    if body.get("template"):
        raise bad("template is not supported: the model's own chat template is used", "template")
    if body.get("context"):
        raise bad("context is not supported: send the conversation to /api/chat instead", "context")
    params, num_ctx = _options(body)
    params = {**params, **grammar}
    prompt = body.get("prompt", "")
    system = body.get("system")
    if not isinstance(prompt, str):
        raise bad("prompt must be a string", "prompt")
    if system is not None and not isinstance(system, str):
        raise bad("system must be a string", "system")
    stream = _stream(body)
    if not prompt:
        chat = ChatRequest(model, [], params, stream, False)
        return OllamaRequest(chat, False, num_ctx, load_only=True)
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise bad("raw must be true or false", "raw")
    if raw:
        return OllamaRequest(
            CompletionRequest(model, prompt, params, stream, False), False, num_ctx
        )
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return OllamaRequest(ChatRequest(model, messages, params, stream, False), False, num_ctx)


def check_context(req: OllamaRequest, context_tokens: int) -> None:
    """num_ctx asks for a context: more than the placement holds is refused (it was
    placed with its context; nothing here can grow it)."""
    if req.num_ctx is not None and context_tokens > 0 and req.num_ctx > context_tokens:
        raise bad(
            f"options.num_ctx {req.num_ctx} is more than this placement holds "
            f"({context_tokens} tokens): ask for {context_tokens} or less, or place the "
            "model with a larger --context",
            "num_ctx",
        )


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def loaded(model: str, chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model,
        "created_at": _now(),
        "done": True,
        "done_reason": "load",
    }
    out |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return out


def _details(p: PlacementState) -> dict[str, Any]:
    return {
        "parent_model": p.model if p.adapter else "",
        "format": "safetensors",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }


def _stamp(p: PlacementState, first_seen: dict[str, int]) -> str:
    seen = first_seen.get(p.name, int(time.time()))
    return datetime.fromtimestamp(seen, UTC).isoformat().replace("+00:00", "Z")


def _size(p: PlacementState) -> int:
    return sum(s.weight_bytes or s.param_bytes for s in p.shards)


def card(p: PlacementState, first_seen: dict[str, int]) -> dict[str, Any]:
    """A placement as /api/tags lists a model."""
    return {
        "name": p.name,
        "model": p.name,
        "modified_at": _stamp(p, first_seen),
        "size": _size(p),
        "digest": "",
        "details": _details(p),
    }


def running(p: PlacementState, first_seen: dict[str, int]) -> dict[str, Any]:
    """A placement as /api/ps lists a loaded model: loaded until it is unloaded."""
    return {
        "name": p.name,
        "model": p.name,
        "size": _size(p),
        "digest": "",
        "details": _details(p),
        "expires_at": "9999-12-31T23:59:59Z",
        "size_vram": 0,
        "context_length": p.context_tokens,
    }


def show(p: PlacementState) -> dict[str, Any]:
    return {
        "modelfile": "",
        "parameters": f"num_ctx {p.context_tokens}",
        "template": "",
        "details": _details(p),
        "model_info": {
            "general.architecture": "",
            "general.basename": p.model,
            "context_length": p.context_tokens,
        },
        "capabilities": ["completion"],
        "modified_at": _now(),
    }


class OllamaAnswer(Shape):
    """An answer as Ollama's objects: one a line while streaming, the last `done`."""

    content_type = NDJSON

    def __init__(self, model: str, chat: bool) -> None:
        super().__init__(model)
        self.chat = chat
        self.started = time.perf_counter_ns()

    def _calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"function": {"name": c["name"], "arguments": call_arguments(c)}} for c in calls]

    def _piece(self, text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = self._calls(calls)
            return {"message": message}
        return {"response": text}

    def _last(self, done: control.Done, text: str, calls: list[dict[str, Any]]) -> dict:
        got = done.usage
        timings = done.timings
        total = time.perf_counter_ns() - self.started
        ttft = int(float(timings.get("ttft_ms", 0)) * 1e6)
        return {
            "model": self.model,
            "created_at": _now(),
            **self._piece(text, calls),
            "done": True,
            "done_reason": "length" if self.reason(done) == "length" else "stop",
            "total_duration": total,
            "load_duration": 0,
            "prompt_eval_count": int(got.get("prompt_tokens", self.prompt_tokens)),
            "prompt_eval_duration": ttft,
            "eval_count": int(got.get("completion_tokens", 0)),
            "eval_duration": max(total - ttft, 0),
        }

    def body(self, done: control.Done) -> dict[str, Any]:
        return self._last(done, "".join(self.parts), self.calls)

    def chunk(self, msg: control.Delta) -> bytes:
        text, calls = msg.text, msg.tool_calls or []
        self.calls.extend(calls)
        if not text and not calls:
            return b""
        line = {"model": self.model, "created_at": _now(), **self._piece(text, calls)}
        return (dumps({**line, "done": False}) + "\n").encode()

    def end(self, done: control.Done) -> bytes:
        return (dumps(self._last(done, "", [])) + "\n").encode()

    def failed(self, err: ApiError) -> bytes:
        return (json.dumps(error_body(err)) + "\n").encode()
