"""OpenAI's Responses API (`POST /v1/responses`), the API Codex CLI speaks.

Stateless: nothing is stored (`store` is answered false), so a conversation comes
whole in `input` each time, as Codex sends it; `previous_response_id` is refused in
words. The input items become the same turns the chat completions path builds
(function_call items an assistant turn's `tool_calls`, function_call_output items
`tool` turns), so the same conversation gets the same tokens and the same answer.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from studiotui.api.answer import Shape, cached_tokens, named_event
from studiotui.api.request import (
    ROLES,
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
from worker.shared.structured import FormatError, text_format_grammar

# Text parts of an input message: what a user wrote, what an assistant answered.
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# Tools that other servers run for the model (web search, a computer, a shell of
# OpenAI's): the placed model is offered only function tools, the rest are left out.
FUNCTION = "function"


def parse_responses_request(body: Any) -> tuple[ChatRequest, dict[str, Any]]:
    """The body as the cluster's chat request, and the request fields a response echoes."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    if body.get("previous_response_id") is not None:
        raise bad(
            "previous_response_id is not supported: this server stores no responses "
            "(store is false); send the whole conversation in input",
            "previous_response_id",
        )
    if body.get("conversation") is not None:
        raise bad(
            "conversation is not supported: this server stores no conversations; "
            "send the whole conversation in input",
            "conversation",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    grammar = _text_format(body.get("text"))
    cache_key = body.get("prompt_cache_key")
    if cache_key is not None and not isinstance(cache_key, str):
        raise bad("prompt_cache_key must be a string", "prompt_cache_key")
    openai_names = {
        "max_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "seed": body.get("seed"),
    }
    try:
        params = sampling_params({k: v for k, v in openai_names.items() if v is not None})
    except ApiError as exc:
        if exc.param == "max_tokens":
            raise bad(
                exc.message.replace("max_tokens", "max_output_tokens"), "max_output_tokens"
            ) from None
        raise
    if grammar:
        params = {**params, "grammar": grammar}
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions must be a string", "instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    messages.extend(conversation(body.get("input")))
    tools, offered = _tools(body.get("tools"), body.get("tool_choice"))
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": params["temperature"],
        "top_p": params["top_p"],
        "tools": offered,
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "metadata": body.get("metadata") or {},
        "prompt_cache_key": cache_key,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "store": False,
    }
    parsed = ChatRequest(
        model=model or None,
        messages=messages,
        params=params,
        stream=stream,
        include_usage=True,
        tools=tools,
    )
    return parsed, echo


def _text_format(text: Any) -> str:
    """`text.format` as the grammar the tail enforces (worker/shared/structured.py):
    "" for plain text; JSON mode or a JSON Schema; one that cannot be enforced is a 400
    naming its part."""
    if text is None:
        return ""
    if not isinstance(text, dict):
        raise bad("text must be an object such as {format: {type: text}}", "text")
    try:
        return text_format_grammar(text.get("format"))
    except FormatError as exc:
        raise bad(str(exc), exc.param) from None


def conversation(raw: Any) -> list[dict[str, Any]]:
    """`input` (a string, or items) as the chat template's turns."""
    if isinstance(raw, str):
        if not raw:
            raise bad("input is empty: give the text to answer", "input")
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad("input must be a string or a non-empty array of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _arguments(item.get("arguments"), where),
                },
            }
            last = out[-1] if out else None
            # Consecutive calls are one assistant turn, as the model made them.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _text(output, f"{where}.output")
            if not isinstance(output, str):
                raise bad(f"{where}.output must be a string", f"{where}.output")
            out.append(
                {"role": "tool", "content": output, "tool_call_id": _string(item, "call_id", where)}
            )
        elif kind == "reasoning":
            continue  # a model's own reasoning from before; none of it was ours to keep
        else:
            raise bad(
                f"{where}.type {shown(kind)} is not supported: send message, function_call "
                "and function_call_output items",
                f"{where}.type",
            )
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise bad(
            f"{where}.role must be one of {', '.join(ROLES)}; got {shown(role)}", f"{where}.role"
        )
    content = item.get("content")
    text = content if isinstance(content, str) else _text(content, f"{where}.content")
    return {"role": ROLES[role], "content": text}


def _text(content: Any, where: str) -> str:
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of input_text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in TEXT_PARTS or not isinstance(part.get(key), str):
            raise text_only(kind, f"{where}[{j}]")
        texts.append(part[key])
    return join_parts(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}") if isinstance(raw, str) else None
    except json.JSONDecodeError as exc:
        raise bad(f"{where}.arguments is not valid JSON: {exc}", f"{where}.arguments") from None
    if not isinstance(value, dict):
        raise bad(f"{where}.arguments must be a JSON object", f"{where}.arguments")
    return value


def _tools(raw: Any, choice: Any) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """The function tools as the template's tools (None: none to offer), and as the
    response echoes them. Tools that other servers run are left out: the model here
    can call only functions."""
    if raw is None or raw == []:
        return None, []
    if not isinstance(raw, list):
        raise bad("tools must be an array of {type: function, name, parameters}", "tools")
    tools, offered = [], []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"{where} must be an object", where)
        if tool.get("type") != FUNCTION:
            continue
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        tools.append(function_tool({"type": "function", "function": fn}, where))
        offered.append(tool)
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if choice is None or kind == "auto":
        return tools or None, offered
    if kind == "none":
        return None, offered
    if kind in ("required", "function", "allowed_tools"):
        raise bad(
            f"tool_choice {shown(kind)} cannot be enforced here: the model decides whether to "
            "call a tool; send tool_choice auto (or leave it out)",
            "tool_choice",
        )
    raise bad(f"tool_choice must be auto, none or required; got {shown(choice)}", "tool_choice")


class ResponseAnswer(Shape):
    """An answer as a Response object, or its stream of typed events."""

    id_prefix = "resp_"
    prompt_param = "input"

    def __init__(self, model: str, echo: dict[str, Any]) -> None:
        super().__init__(model)
        self.echo = echo
        self.seq = 0
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.items: list[dict[str, Any]] = []  # output items done, in order
        self.text_index = -1  # output index of the message being streamed, -1: none open
        self.text = ""

    def _event(self, kind: str, **fields: Any) -> bytes:
        out = named_event({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return out

    def _response(self, status: str, done: control.Done | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": self.items if done is not None else [],
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "usage": None,
            **self.echo,
        }
        if done is not None:
            got = done.usage
            prompt = int(got.get("prompt_tokens", self.prompt_tokens))
            completion = int(got.get("completion_tokens", 0))
            body["usage"] = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached_tokens(done)},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            }
            if status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body

    def _status(self, done: control.Done) -> str:
        return "incomplete" if self.reason(done) == "length" else "completed"

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content if status == "completed" or text else [],
        }

    def _call_item(self, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        arguments = call.get("arguments", {})
        return {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
            "name": call["name"],
            "arguments": arguments
            if isinstance(arguments, str)
            else json.dumps(arguments, ensure_ascii=False),
            "status": status,
        }

    def body(self, done: control.Done) -> dict[str, Any]:
        text = "".join(self.parts)
        if text:
            self.items.append(self._message_item(text, "completed"))
        self.items.extend(self._call_item(c) for c in self.calls)
        return self._response(self._status(done), done)

    def start(self) -> bytes:
        head = self._response("in_progress", None)
        return self._event("response.created", response=head) + self._event(
            "response.in_progress", response=head
        )

    def _open_text(self) -> bytes:
        self.text_index = len(self.items)
        self.text = ""
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return self._event(
            "response.output_item.added",
            output_index=self.text_index,
            item=self._message_item("", "in_progress"),
        ) + self._event(
            "response.content_part.added",
            item_id=self.message_id,
            output_index=self.text_index,
            content_index=0,
            part=part,
        )

    def _close_text(self) -> bytes:
        if self.text_index < 0:
            return b""
        index, text = self.text_index, self.text
        self.text_index = -1
        item = self._message_item(text, "completed")
        self.items.append(item)
        out = self._event(
            "response.output_text.done",
            item_id=self.message_id,
            output_index=index,
            content_index=0,
            text=text,
            logprobs=[],
        )
        out += self._event(
            "response.content_part.done",
            item_id=self.message_id,
            output_index=index,
            content_index=0,
            part=item["content"][0],
        )
        out += self._event("response.output_item.done", output_index=index, item=item)
        # A later message in the same answer gets an id of its own.
        self.message_id = f"msg_{uuid.uuid4().hex}"
        return out

    def chunk(self, msg: control.Delta) -> bytes:
        out = b""
        text = msg.text
        if text:
            self.parts.append(text)
            if self.text_index < 0:
                out += self._open_text()
            self.text += text
            out += self._event(
                "response.output_text.delta",
                item_id=self.message_id,
                output_index=self.text_index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        for call in msg.tool_calls or ():
            self.calls.append(call)
            out += self._close_text()
            item = self._call_item(call)
            index = len(self.items)
            self.items.append(item)
            # The head reads a call when it closes: its arguments come in one delta.
            out += self._event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            out += self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            )
            out += self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
            out += self._event("response.output_item.done", output_index=index, item=item)
        return out

    def end(self, done: control.Done) -> bytes:
        status = self._status(done)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out = self._close_text()
        return out + self._event(kind, response=self._response(status, done))

    def failed(self, err: ApiError) -> bytes:
        response = self._response("failed", None)
        response["error"] = {"code": "server_error", "message": err.message}
        return self._event("response.failed", response=response)
