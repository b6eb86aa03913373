"""An OpenAI chat-completions body, checked and turned into the cluster's request.

Everything a client can get wrong is caught here and answered with a 400 that
names the parameter, so the head shard never sees a request it would refuse: a
refusal there costs a round trip and comes back as plain text.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

# The runners refuse more than this (worker/sampling.py); studiotui may not import it.
MAX_TOKENS_LIMIT = 1 << 20
# OpenAI means "until the context is full" when max_tokens is absent; a placement's
# context is not known here, so a long but finite answer stands in for it.
DEFAULT_MAX_TOKENS = 2048
# OpenAI's documented defaults, so clients that leave them out get what they expect.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
MAX_STOP_STRINGS = 16
# Chat templates know system/user/assistant; OpenAI's newer "developer" role means system.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
SEED_MASK = (1 << 64) - 1


class ApiError(Exception):
    """An answer in OpenAI's error shape, with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, str]]
    params: dict[str, Any]
    stream: bool
    include_usage: bool


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    _reject_unsupported(body)
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    include_usage = _boolean(options or {}, "include_usage", False, "stream_options.include_usage")
    return ChatRequest(
        model=model or None,
        messages=_messages(body.get("messages")),
        params=_params(body),
        stream=stream,
        include_usage=include_usage,
    )


def _reject_unsupported(body: dict[str, Any]) -> None:
    # Silently ignoring these would hand the client something other than it asked for.
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad("only n=1 is supported: ask several times for several answers", "n")
    if body.get("logprobs") is True:
        raise bad("logprobs are not supported", "logprobs")
    if body.get("tools"):
        raise bad("tools are not supported: the cluster serves plain chat", "tools")


def _messages(raw: Any) -> list[dict[str, str]]:
    if raw is None:
        raise bad("messages is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty array", "messages")
    out = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(f"{where} must be an object", where)
        role = msg.get("role")
        if role not in ROLES:
            if role in ("tool", "function"):
                raise bad(f"{where}: {role} messages are not supported", f"{where}.role")
            allowed = ", ".join(ROLES)
            raise bad(f"{where}.role must be one of {allowed}; got {role!r}", f"{where}.role")
        out.append({"role": ROLES[role], "content": _content(msg.get("content"), role, where)})
    return out


def _content(raw: Any, role: str, where: str) -> str:
    if isinstance(raw, str):
        return raw
    if raw is None and role == "assistant":
        return ""  # OpenAI allows an assistant turn without content (it had tool calls)
    if isinstance(raw, list):
        texts = []
        for j, part in enumerate(raw):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise bad(
                    f"{where}.content[{j}]: only text parts are supported, got {kind!r}",
                    f"{where}.content",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"{where}.content must be a string or an array of text parts", f"{where}.content")


def _params(body: dict[str, Any]) -> dict[str, Any]:
    temperature = _number(body, "temperature", 0.0, 2.0, DEFAULT_TEMPERATURE)
    top_p = _number(body, "top_p", 0.0, 1.0, DEFAULT_TOP_P)
    if top_p == 0.0:
        # Nucleus sampling over no mass keeps only the likeliest token: greedy. The
        # runners want top_p > 0, so say the same thing their way.
        temperature, top_p = 0.0, 1.0
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = _integer(body, name, 1, MAX_TOKENS_LIMIT)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad("seed must be an integer", "seed")
    return {
        "max_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        # Without a seed OpenAI samples afresh each time. Negative int64 seeds are
        # legal there; the runners' PRNG takes 0..2**64-1, so wrap instead of refusing.
        "seed": secrets.randbits(63) if seed is None else seed & SEED_MASK,
        "stop": _stop(body.get("stop")),
        # vLLM's extension, for benchmarks that need a fixed number of tokens.
        "ignore_eos": _boolean(body, "ignore_eos", False),
    }


def _stop(raw: Any) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise bad("stop must be a string or an array of strings", "stop")
    if len(raw) > MAX_STOP_STRINGS:
        raise bad(f"stop takes at most {MAX_STOP_STRINGS} strings", "stop")
    return [s for s in raw if s]


def _is_int(value: Any) -> bool:
    # JSON true/false arrive as bool, which Python counts as int.
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not (_is_int(value) or isinstance(value, float)) or not lo <= value <= hi:
        raise bad(f"{name} must be a number from {lo:g} to {hi:g}; got {value!r}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not lo <= value <= hi:
        raise bad(f"{name} must be an integer from {lo} to {hi}; got {value!r}", name)
    return int(value)


def _boolean(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{param or name} must be true or false", param or name)
    return value
