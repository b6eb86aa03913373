"""Anthropic's Messages API (`POST /v1/messages`), the API Claude Code speaks.

A request is translated into the same conversation the chat completions path
builds (system, user, assistant turns with `tool_calls`, `tool` turns with their
results), so it goes through the model's own chat template into the same tokens:
the answer through either API is the same. Thinking blocks travel as the
assistant turn's `reasoning_content`, the field chat templates that know thinking
read. The answer comes back as Anthropic's content blocks and events.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from studiotui.api.answer import Shape, cached_tokens, call_arguments, named_event
from studiotui.api.request import (
    ApiError,
    ChatRequest,
    bad,
    function_tool,
    join_parts,
    sampling_params,
    shown,
    text_only,
)
from worker.shared.protocol import control
from worker.shared.protocol.limits import MAX_STOP_STRINGS

# Claude Code names the model it wants (claude-sonnet-…, claude-haiku-… for its
# background work); a placement of that name is served, else the one model served.
CLAUDE_PREFIX = "claude-"
# Claude Code puts system turns among its messages too (reminders mid-conversation):
# they stay where they are, as system turns, as on chat completions.
ROLES = ("user", "assistant", "system")
# Anthropic's error type for each status its clients tell apart.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


def error_body(exc: ApiError) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(
        exc.status, "api_error" if exc.status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def parse_messages_request(body: Any) -> ChatRequest:
    """A Messages API body as the cluster's chat request. Fields Claude Code sends that
    change nothing here (metadata, thinking, context_management, output_config,
    cache_control on blocks, anthropic-beta headers) are accepted and left aside."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required: the name of a placement (GET /v1/models)", "model")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise bad("max_tokens is required: the most tokens the answer may have", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("metadata must be an object", "metadata")
    openai_names = {
        "max_tokens": max_tokens,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "stop": body.get("stop_sequences"),
    }
    params = sampling_params(
        {k: v for k, v in openai_names.items() if v is not None},
        max_stop=MAX_STOP_STRINGS,
        stop_param="stop_sequences",
    )
    return ChatRequest(
        model=model,
        messages=conversation(body.get("system"), body.get("messages")),
        params=params,
        stream=stream,
        include_usage=True,
        tools=_tools(body.get("tools"), body.get("tool_choice")),
    )


def count_request(body: Any) -> ChatRequest:
    """A count_tokens body: a Messages body without max_tokens."""
    if isinstance(body, dict) and body.get("max_tokens") is None:
        body = {**body, "max_tokens": 1}
    return parse_messages_request(body)


def conversation(system: Any, raw: Any) -> list[dict[str, Any]]:
    """Anthropic's system and messages as the chat template's turns."""
    out: list[dict[str, Any]] = []
    if system is not None and system != "" and system != []:
        out.append({"role": "system", "content": _text(system, "system", blocks=("text",))})
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty array of {role, content}", "messages")
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results' turns
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(f"{where} must be an object {{role, content}}", where)
        role = msg.get("role")
        if role not in ROLES:
            raise bad(
                f"{where}.role must be user, assistant or system; got {shown(role)}",
                f"{where}.role",
            )
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif role == "system":
            out.append({"role": role, "content": _text(content, f"{where}.content")})
        elif isinstance(content, list):
            if role == "assistant":
                out.append(_assistant_turn(content, where, names))
            else:
                out.extend(_user_turns(content, where, names))
        else:
            raise bad(
                f"{where}.content must be a string or an array of content blocks",
                f"{where}.content",
            )
    return out


def _blocks(content: list[Any], where: str) -> list[tuple[str, dict[str, Any], str]]:
    out = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad(f"{at} must be a content block {{type, ...}}", at)
        out.append((block["type"], block, at))
    return out


def _text(raw: Any, where: str, blocks: tuple[str, ...] = ("text",)) -> str:
    """A string, or text blocks joined as the OpenAI paths join text parts."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise bad(f"{where} must be a string or an array of text blocks", where)
    texts = []
    for j, block in enumerate(raw):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in blocks or not isinstance(block.get("text"), str):
            raise _unreadable(kind, f"{where}[{j}]")
        texts.append(block["text"])
    return join_parts(texts)


def _unreadable(kind: Any, where: str) -> ApiError:
    if kind in ("image", "document", "search_result"):
        return bad(
            f"{where} is a {kind} block, but the placed model reads text only: "
            "send its text instead",
            where,
            "text_only",
        )
    return text_only(kind, where)


def _assistant_turn(content: list[Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for kind, block, at in _blocks(content, where):
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "thinking":
            thinking.append(_string(block, "thinking", at))
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a template could show
        elif kind == "tool_use":
            call_id, name = _string(block, "id", at), _string(block, "name", at)
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad(f"{at}.input must be an object", f"{at}.input")
            names[call_id] = name
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        else:
            raise _unreadable(kind, at)
    turn: dict[str, Any] = {"role": "assistant", "content": join_parts(texts)}
    if thinking:
        turn["reasoning_content"] = join_parts(thinking)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _user_turns(content: list[Any], where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    """A user message: its tool results become `tool` turns (first, as they answer
    the calls before them), its text one user turn."""
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for kind, block, at in _blocks(content, where):
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "tool_result":
            call_id = _string(block, "tool_use_id", at)
            raw = block.get("content", "")
            text = _text(raw, f"{at}.content") if raw is not None else ""
            turn = {"role": "tool", "content": text, "tool_call_id": call_id}
            if call_id in names:
                turn["name"] = names[call_id]
            results.append(turn)
        else:
            raise _unreadable(kind, at)
    if texts:
        results.append({"role": "user", "content": join_parts(texts)})
    return results


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _tools(raw: Any, choice: Any) -> list[dict[str, Any]] | None:
    """Anthropic's tools ({name, description, input_schema}) as function tools; None
    when there are none or tool_choice is none."""
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if choice is not None and kind not in ("auto", "none", "any", "tool"):
        raise bad(
            f"tool_choice.type must be auto, none, any or tool; got {shown(kind)}", "tool_choice"
        )
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad("tools must be an array of {name, description, input_schema}", "tools")
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"{where} must be an object {{name, description, input_schema}}", where)
        if tool.get("type") not in (None, "custom"):
            raise bad(
                f"{where} is Anthropic's server tool {shown(tool.get('type'))}, which only "
                "Anthropic runs: give tools with a name and an input_schema",
                f"{where}.type",
            )
        fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        tools.append(function_tool({"type": "function", "function": fn}, where))
    if kind == "none":
        return None  # the model is not to call any: it does not see them
    if kind in ("any", "tool"):
        # As on chat completions: making the model call takes constrained decoding.
        raise bad(
            f"tool_choice {kind} cannot be enforced here: the model decides whether to call "
            "a tool; send tool_choice auto (or leave it out)",
            "tool_choice",
        )
    return tools


class MessageAnswer(Shape):
    """An answer as Anthropic's message, or its stream of events."""

    id_prefix = "msg_"

    def __init__(self, model: str, stops: list[str]) -> None:
        super().__init__(model)
        self.stops = stops
        self.index = -1  # the content block being streamed
        self.open_text = False
        self.text = ""  # the streamed answer so far, to tell which stop sequence ended it

    def _input(self, call: dict[str, Any]) -> dict[str, Any]:
        return call_arguments(call)

    def _tool_block(self, call: dict[str, Any]) -> dict[str, Any]:
        call_id = call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"
        return {"type": "tool_use", "id": call_id, "name": call["name"], "input": {}}

    def _stop(self, done: control.Done, text: str) -> tuple[str, str | None]:
        reason = STOP_REASONS[self.reason(done)]
        matched = done.stop  # "" when no stop string ended it
        if reason == "end_turn" and matched and matched in self.stops:
            return "stop_sequence", matched
        return reason, None

    def _usage(self, done: control.Done) -> dict[str, int]:
        got = done.usage
        cached = cached_tokens(done)
        prompt = int(got.get("prompt_tokens", self.prompt_tokens))
        return {
            # Anthropic counts the cached part of the prompt apart from input_tokens.
            "input_tokens": prompt - cached,
            "output_tokens": int(got.get("completion_tokens", 0)),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def _message(self, content: list[dict[str, Any]], done: control.Done | None) -> dict:
        reason, sequence = (
            self._stop(done, "".join(self.parts)) if done is not None else (None, None)
        )
        usage = (
            self._usage(done)
            if done is not None
            else {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        )
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

    def body(self, done: control.Done) -> dict[str, Any]:
        text = "".join(self.parts)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        for call in self.calls:
            content.append({**self._tool_block(call), "input": self._input(call)})
        return self._message(content, done)

    def start(self) -> bytes:
        return named_event(
            {"type": "message_start", "message": self._message([], None)}
        ) + named_event({"type": "ping"})

    def _close(self) -> bytes:
        if self.index < 0 or not self.open_text:
            return b""
        self.open_text = False
        return named_event({"type": "content_block_stop", "index": self.index})

    def chunk(self, msg: control.Delta) -> bytes:
        out = b""
        text = msg.text
        if text:
            self.parts.append(text)
            if not self.open_text:
                self.index += 1
                self.open_text = True
                out += named_event(
                    {
                        "type": "content_block_start",
                        "index": self.index,
                        "content_block": {"type": "text", "text": ""},
                    }
                )
            out += named_event(
                {
                    "type": "content_block_delta",
                    "index": self.index,
                    "delta": {"type": "text_delta", "text": text},
                }
            )
        for call in msg.tool_calls or ():
            self.calls.append(call)
            out += self._close()
            self.index += 1
            # The head reads a call when it closes: its input comes in one delta.
            arguments = json.dumps(self._input(call), ensure_ascii=False)
            for ev in (
                {
                    "type": "content_block_start",
                    "index": self.index,
                    "content_block": self._tool_block(call),
                },
                {
                    "type": "content_block_delta",
                    "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": arguments},
                },
                {"type": "content_block_stop", "index": self.index},
            ):
                out += named_event(ev)
        return out

    def end(self, done: control.Done) -> bytes:
        reason, sequence = self._stop(done, "".join(self.parts))
        usage = self._usage(done)
        return (
            self._close()
            + named_event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage,
                }
            )
            + named_event({"type": "message_stop"})
        )

    def failed(self, err: ApiError) -> bytes:
        return named_event(error_body(err))
