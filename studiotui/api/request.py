"""An OpenAI chat-completions or completions body, checked and turned into the
cluster's request.

Everything a client can get wrong is caught here and answered with a 400 that
names the parameter, so the head shard never sees a request it would refuse: a
refusal there costs a round trip and comes back as plain text.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

# The runners refuse past these too (worker/sampling.py): one table, so both agree.
from worker.shared.protocol.limits import (
    DEFAULT_XTC_THRESHOLD,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_CHARS,
    MAX_TOP_K,
    Limit,
    limit_problem,
    prompt_chars,
    prompt_too_long,
    shown,
)
from worker.shared.structured import FormatError, response_format_grammar

# OpenAI means "until the context is full" when max_tokens is absent; a placement's
# context is not known here, so a long but finite answer stands in for it.
DEFAULT_MAX_TOKENS = 2048
# /v1/completions: OpenAI's default there is 16.
DEFAULT_COMPLETION_TOKENS = 16
# OpenAI's documented defaults, so clients that leave them out get what they expect.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
# Chat templates know system/user/assistant; OpenAI's newer "developer" role means system.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# OpenAI's ceiling for logprobs on completions (top_logprobs on chat: SAMPLING_LIMITS).
MAX_COMPLETION_LOGPROBS = 5
# OpenAI's own limits: a function name of letters, digits, _ and -, up to 64; 128 tools.
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
# A logit_bias key: a token id as OpenAI writes it, a decimal string ("50256").
TOKEN_ID = re.compile(r"^(0|[1-9][0-9]{0,9})$")
# OpenAI takes up to 4 stop strings; the other APIs up to the runners' own limit.
OPENAI_MAX_STOP = 4
# mlx_lm.server's window parameters for its penalties (mlx-lm's default is 20 tokens).
PENALTY_WINDOWS = ("repetition_context_size", "presence_context_size", "frequency_context_size")


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


# How deep a body may nest: Python's JSON parser stops at about 1000 levels (a
# RecursionError), and the msgpack the request travels in to the head shard has its
# own limit; no OpenAI body or tool schema comes near this.
MAX_DEPTH = 64
# The integers msgpack can carry; JSON has no bound of its own.
MIN_INT, MAX_INT = -(2**63), 2**64 - 1
# A lone UTF-16 surrogate ("\ud800" in JSON) is no character: no UTF-8 encodes it.
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Huge:
    """An integer literal too long to be any parameter's value: kept as this marker,
    so the check below names where it was (Python refuses to convert past 4300 digits,
    with no word of where)."""


def _parse_int(text: str) -> int | _Huge:
    return _Huge() if len(text.lstrip("-")) > 20 else int(text)


def parse_body(raw: bytes) -> Any:
    """A request body as JSON, or a 400 saying what is wrong with it and where: not
    JSON, NaN or Infinity (not JSON either, nor is 1e999's overflow), nested too deep,
    an integer no wire format carries, or text that is not Unicode."""
    if not raw.strip():
        raise bad("the request body is empty: send a JSON object")
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except RecursionError:
        where = _deep_field(raw)
        raise bad(
            f"{where or 'the request body'} nests deeper than {MAX_DEPTH} levels", where
        ) from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad(f"the request body is not valid JSON: {exc}") from None
    _check_value(body, "", 0)
    return body


_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _deep_field(raw: bytes) -> str | None:
    """The top-level field under which `raw` nests past MAX_DEPTH, found by the
    brackets outside strings (the parser that gave up says nowhere where)."""
    depth, key = 0, None
    for token in _TOKENS.finditer(raw):
        text = token.group()
        if text[:1] == b'"':
            if depth == 1:
                key = text
        elif text in (b"[", b"{"):
            depth += 1
            if depth > MAX_DEPTH:
                break
        else:
            depth -= 1
    try:
        return json.loads(key) if key else None
    except ValueError:
        return None


def _check_value(value: Any, where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise bad(f"the request body nests deeper than {MAX_DEPTH} levels (at {where})", where)
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise bad(
                f"{where or 'the body'} holds a lone UTF-16 surrogate (such as \\ud800), "
                "which is not a character: send valid Unicode",
                where or None,
            )
    elif isinstance(value, _Huge) or (
        isinstance(value, int) and not isinstance(value, bool) and not MIN_INT <= value <= MAX_INT
    ):
        raise bad(
            f"{where or 'the body'} is an integer beyond 64 bits: no parameter takes one",
            where or None,
        )
    elif isinstance(value, float) and not math.isfinite(value):
        # NaN and Infinity are not JSON, though Python's and JavaScript's writers emit them.
        raise bad(
            f"{where or 'the body'} is {value}: JSON has no such number; send a finite one",
            where or None,
        )
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_value(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            at = f"{where}.{key}" if where else key
            if _SURROGATE.search(key):
                raise bad(f"a key in {where or 'the body'} is not valid Unicode", where or None)
            _check_value(item, at, depth + 1)


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    params: dict[str, Any]
    stream: bool
    include_usage: bool
    tools: list[dict[str, Any]] | None = None
    # -1: none; else how many of the likeliest tokens to give with each chosen one.
    logprobs: int = -1
    # Speculative decoding: a predicted output's text (OpenAI's Predicted Outputs),
    # looked up for guesses; `draft` chooses the guesser (None: the placement's).
    prediction: str = ""
    draft: str | None = None

    def cluster_request(self) -> dict[str, Any]:
        out: dict[str, Any] = {"messages": self.messages}
        if self.tools:
            out["tools"] = self.tools
        return {**out, **_speculation(self.prediction, self.draft)}


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompt: str | list[int]
    params: dict[str, Any]
    stream: bool
    include_usage: bool
    logprobs: int = -1
    draft: str | None = None

    def cluster_request(self) -> dict[str, Any]:
        out = {"prompt": self.prompt} if isinstance(self.prompt, str) else {"tokens": self.prompt}
        return {**out, **_speculation("", self.draft)}


def _speculation(prediction: str, draft: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"prediction": prediction} if prediction else {}
    return out if draft is None else {**out, "draft": draft}


def parse_chat_request(body: Any) -> ChatRequest:
    model, stream, include_usage = _common(body)
    logprobs = _chat_logprobs(body)
    params = sampling_params(body)
    if logprobs >= 0:
        params["logprobs"] = logprobs
    return ChatRequest(
        model=model,
        messages=_messages(body.get("messages")),
        params=params,
        stream=stream,
        include_usage=include_usage,
        tools=_parse_tools(body),
        logprobs=logprobs,
        prediction=_prediction(body.get("prediction")),
        draft=_draft(body.get("draft")),
    )


def parse_completion_request(body: Any) -> CompletionRequest:
    model, stream, include_usage = _common(body)
    if body.get("echo") is not None and body.get("echo") is not False:
        raise bad("echo is not supported: the answer comes without its prompt", "echo")
    if body.get("suffix"):
        raise bad("suffix is not supported: no model here fills in the middle", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != 1):
        raise bad("only best_of=1 is supported", "best_of")
    logprobs = _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    params = sampling_params(body, DEFAULT_COMPLETION_TOKENS)
    if logprobs is not None:
        params["logprobs"] = logprobs
    return CompletionRequest(
        model=model,
        prompt=_prompt(body.get("prompt")),
        params=params,
        stream=stream,
        include_usage=include_usage,
        logprobs=-1 if logprobs is None else logprobs,
        draft=_draft(body.get("draft")),
    )


# The guessers a request may choose (worker/speculation.py MODES; "" for none).
DRAFTS = ("", "lookup", "model")


def _prediction(raw: Any) -> str:
    """OpenAI's Predicted Outputs: {"type": "content", "content": text or text parts}."""
    if raw is None:
        return ""
    if not isinstance(raw, dict) or raw.get("type") != "content":
        raise bad(
            'prediction must be {"type": "content", "content": "..."} (OpenAI\'s Predicted '
            "Outputs)",
            "prediction",
        )
    content = raw.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad(
        'prediction.content must be text, or a list of {"type": "text", "text": "..."} parts',
        "prediction.content",
    )


def _draft(raw: Any) -> str | None:
    """A request's own choice of guesser (studiotui's; None: the placement's)."""
    if raw is None:
        return None
    if raw not in DRAFTS:
        raise bad(
            f"draft {shown(raw)} is not one of 'lookup', 'model' or '' (none): speculative "
            "decoding's guesser for this request",
            "draft",
        )
    return str(raw)


def _common(body: Any) -> tuple[str | None, bool, bool]:
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
    return model or None, stream, include_usage


def _reject_unsupported(body: dict[str, Any]) -> None:
    # Silently ignoring these would hand the client something other than it asked for.
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad("only n=1 is supported: ask several times for several answers", "n")


def _chat_logprobs(body: dict[str, Any]) -> int:
    wanted = _boolean(body, "logprobs", False)
    top = _limited(body, "top_logprobs")
    if top is not None and not wanted:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else -1


def _prompt(raw: Any) -> str | list[int]:
    """A string or token ids; OpenAI's batch forms with one prompt in them too."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]
    if isinstance(raw, str):
        if not raw:
            raise bad("prompt is empty: give the text to continue", "prompt")
        return raw
    if isinstance(raw, list) and raw and all(_is_int(t) for t in raw):
        return list(raw)
    if isinstance(raw, list) and len(raw) > 1:
        raise bad("one prompt per request: send several requests for several prompts", "prompt")
    if raw is None:
        raise bad("prompt is required", "prompt")
    raise bad("prompt must be a string or an array of token ids", "prompt")


def _messages(raw: Any) -> list[dict[str, Any]]:
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
        if role == "function":
            raise bad(
                f"{where}: function messages are OpenAI's retired form: send role tool "
                "with the tool_call_id it answers",
                f"{where}.role",
            )
        if role == "tool":
            out.append(_tool_message(msg, _content(msg.get("content"), role, where), where))
            continue
        if role not in ROLES:
            allowed = ", ".join([*ROLES, "tool"])
            raise bad(f"{where}.role must be one of {allowed}; got {shown(role)}", f"{where}.role")
        turn: dict[str, Any] = {
            "role": ROLES[role],
            "content": _content(msg.get("content"), role, where),
        }
        if role == "assistant" and msg.get("tool_calls"):
            turn["tool_calls"] = _assistant_tool_calls(msg["tool_calls"], where)
        out.append(turn)
    return out


# Parts that carry no text: the placed models read text only.
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file", "input_file")


def text_only(kind: Any, where: str) -> ApiError:
    """The 400 for a part the model cannot read: an image, a sound, a file."""
    if kind in MEDIA_PARTS:
        return bad(
            f"{where} is a {kind} part, but the placed model reads text only: "
            "send the text (describe the image, transcribe the audio, paste the file)",
            where,
            "text_only",
        )
    return bad(f"{where}: only text parts are supported, got {shown(kind)}", where)


def join_parts(texts: list[str]) -> str:
    """Text parts as one message's text: side by side, as `mlx_lm.server` joins
    them (and OpenAI's own rendering does), so a conversation gets the same
    prompt, and the same greedy answer, as on mlx-lm."""
    return "".join(texts)


def _content(raw: Any, role: str, where: str) -> str:
    if isinstance(raw, str):
        return raw
    if raw is None and role == "assistant":
        return ""  # OpenAI allows an assistant turn without content (it had tool calls)
    if isinstance(raw, list):
        texts = []
        for j, part in enumerate(raw):
            kind = part.get("type") if isinstance(part, dict) else None
            # An assistant turn may hold a refusal part: its text is what was said.
            key = "refusal" if kind == "refusal" and role == "assistant" else "text"
            if kind not in ("text", key) or not isinstance(part.get(key), str):
                raise text_only(kind, f"{where}.content[{j}]")
            texts.append(part[key])
        return join_parts(texts)
    raise bad(f"{where}.content must be a string or an array of text parts", f"{where}.content")


def sampling_params(
    body: dict[str, Any],
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    max_stop: int = OPENAI_MAX_STOP,
    stop_param: str = "stop",
) -> dict[str, Any]:
    """The sampling parameters of a body written with OpenAI's names (the other APIs
    translate theirs into these first), checked against the runners' limits."""
    temperature = _limited(body, "temperature")
    top_p = _limited(body, "top_p")
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = _limited(body, name, "max_tokens")
    # The runners' PRNG takes 0..2**63-1. Wrapping other values silently made 2**64
    # the same answer as 0 and a negative seed a 503: refuse them instead.
    seed = _limited(body, "seed")
    return {
        "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "temperature": DEFAULT_TEMPERATURE if temperature is None else float(temperature),
        # 0 (greedy, as OpenAI means it) travels: the runners read it the same way.
        "top_p": DEFAULT_TOP_P if top_p is None else float(top_p),
        # Without a seed OpenAI samples afresh each time.
        "seed": secrets.randbits(63) if seed is None else seed,
        "stop": _stop(body.get("stop"), max_stop, stop_param),
        # vLLM's extension, for benchmarks that need a fixed number of tokens.
        "ignore_eos": _boolean(body, "ignore_eos", False),
        **_samplers(body),
        **_processors(body),
        **_response_format(body),
    }


def _response_format(body: dict[str, Any]) -> dict[str, Any]:
    """response_format as the grammar the tail enforces while it samples
    (worker/shared/structured.py; docs/structured-output.md): JSON mode or a JSON
    Schema. One the grammar library cannot compile is refused here, naming the part."""
    try:
        grammar = response_format_grammar(body.get("response_format"))
    except FormatError as exc:
        raise bad(str(exc), exc.param) from None
    return {"grammar": grammar} if grammar else {}


def _samplers(body: dict[str, Any]) -> dict[str, Any]:
    """mlx_lm.server's sampler fields beyond OpenAI's, as mlx-lm's `make_sampler` takes
    them (worker/sampling.py follows it): top_k (an integer, 0: off; mlx_lm.server's
    type and floor), min_p, xtc_probability and xtc_threshold, in the ranges of
    SAMPLING_LIMITS (xtc_threshold to 0.5, which mlx-lm's XTC checks when it draws;
    mlx_lm.server lets up to 1 through). Only what changes the sampler is passed on;
    each acts only when temperature > 0, as in mlx-lm."""
    out: dict[str, Any] = {}
    top_k: Any = body.get("top_k")
    if _is_int(top_k) and top_k > MAX_TOP_K:
        # Past any vocabulary, where it keeps every token: the same, and it travels.
        out["top_k"] = MAX_TOP_K
    elif top_k := _limited(body, "top_k"):
        out["top_k"] = top_k
    for name in ("min_p", "xtc_probability"):
        if value := _limited(body, name):
            out[name] = float(value)
    threshold = _limited(body, "xtc_threshold")
    if "xtc_probability" in out and threshold not in (None, DEFAULT_XTC_THRESHOLD):
        out["xtc_threshold"] = float(threshold)
    return out


def _processors(body: dict[str, Any]) -> dict[str, Any]:
    """The logits processors asked for, in mlx-lm's terms (worker/sampling.py applies
    them with `make_logits_processors`): OpenAI's logit_bias, presence_penalty and
    frequency_penalty, and repetition_penalty as vLLM, llama.cpp and mlx_lm.server take
    it, with mlx_lm.server's windows. Only what changes a logit is passed on."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if value := _limited(body, name):
            out[name] = float(value)
    # Past its range the penalised logits overflow float32 (limits.py).
    repetition = _limited(body, "repetition_penalty")
    if repetition is not None and repetition != 1:
        out["repetition_penalty"] = float(repetition)
    for name in PENALTY_WINDOWS:
        size = _limited(body, name)
        if size is not None:
            out[name] = size
    if bias := _logit_bias(body.get("logit_bias")):
        out["logit_bias"] = bias
    return out


def _logit_bias(raw: Any) -> list[list[int | float]]:
    """OpenAI's {"token id": bias} as [[token, bias], ...], the form that travels. The
    head shard checks the ids against the model's vocabulary, which it alone knows."""
    if raw is None:
        return []
    shape = 'an object of token ids to a bias from -100 to 100, such as {"50256": -100}'
    if not isinstance(raw, dict):
        raise bad(f"logit_bias must be {shape}", "logit_bias")
    if len(raw) > MAX_LOGIT_BIAS_TOKENS:
        raise bad(
            f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens; got {len(raw)}",
            "logit_bias",
        )
    pairs: list[list[int | float]] = []
    for key, value in raw.items():
        if not TOKEN_ID.match(key):
            raise bad(
                f"logit_bias key {shown(key)} is not a token id: the keys are the model's token "
                f"ids, written as strings without leading zeros; logit_bias must be {shape}",
                "logit_bias",
            )
        if problem := limit_problem("logit_bias", value, f"logit_bias for token {key}"):
            raise bad(problem, "logit_bias")
        pairs.append([int(key), float(value)])
    return pairs


def _stop(raw: Any, most: int = OPENAI_MAX_STOP, name: str = "stop") -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise bad(f"{name} must be a string or an array of strings", name)
    if len(raw) > most:
        whose = " (OpenAI's limit)" if most == OPENAI_MAX_STOP else ""
        raise bad(
            f"{name} takes at most {most} strings{whose}; got {len(raw)}: keep the {most} "
            "that matter, or cut the answer yourself",
            name,
        )
    if any(len(s) > MAX_STOP_CHARS for s in raw):
        longest = max(len(s) for s in raw)
        raise bad(
            f"a stop string may have at most {MAX_STOP_CHARS} characters; got {longest}", name
        )
    return [s for s in raw if s]


def check_prompt_size(parsed: ChatRequest | CompletionRequest, context_tokens: int) -> None:
    """Refuse a prompt that cannot fit the placement's context, by counting characters:
    tokenising megabytes would hold the head shard's serving thread for seconds."""
    if isinstance(parsed, ChatRequest):
        param, problem = "messages", prompt_too_long(_chat_chars(parsed), context_tokens)
    elif isinstance(parsed.prompt, str):
        param, problem = "prompt", prompt_too_long(len(parsed.prompt), context_tokens)
    else:
        param, problem = "prompt", None
        if context_tokens > 0 and len(parsed.prompt) >= context_tokens:
            problem = (
                f"the prompt has {len(parsed.prompt)} tokens but this placement holds a context "
                f"of {context_tokens}: shorten it, or place the model with a larger --context"
            )
    if problem:
        raise bad(problem, param, "context_length_exceeded")


def _chat_chars(parsed: ChatRequest) -> int:
    """The characters a chat prompt is made of: the messages' text, and the tools and
    earlier tool calls the template writes into the prompt as JSON too (megabytes of
    tool schema cost the head shard as much to tokenise as megabytes of message)."""
    extra = [parsed.tools or []] + [m["tool_calls"] for m in parsed.messages if "tool_calls" in m]
    return prompt_chars(parsed.messages) + sum(
        len(json.dumps(x, ensure_ascii=False)) for x in extra if x
    )


def _is_int(value: Any) -> bool:
    # JSON true/false arrive as bool, which Python counts as int.
    return isinstance(value, int) and not isinstance(value, bool)


def _limited(body: dict[str, Any], name: str, limit: str = "") -> Any:
    """body[name] (None if absent), refused with a 400 outside its range in
    SAMPLING_LIMITS (`limit`'s, if another name shares it), the table the runners
    check too."""
    value = body.get(name)
    if value is not None and (problem := limit_problem(limit or name, value, name)):
        raise bad(problem, name)  # the words quote the value as `shown` does
    return value


def _integer(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is not None and (problem := Limit(lo, hi, integer=True).problem(name, value)):
        raise bad(problem, name)
    return None if value is None else int(value)


def _boolean(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{param or name} must be true or false", param or name)
    return value


# ---- tools -------------------------------------------------------------------------
# The head shard passes `tools` to the model's own chat template
# (`apply_chat_template(messages, tools=...)`) and reads calls back with mlx-lm's
# parser for the family. A template reads the Hugging Face convention: tools as
# OpenAI writes them, and in an assistant turn `tool_calls` whose `arguments` are an
# object, not OpenAI's JSON string (mlx-lm's server converts them the same way).


def _parse_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools to lay before the model, or None: none given, or tool_choice "none"."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad(
            "functions and function_call are OpenAI's retired form: send tools and tool_choice",
            "functions",
        )
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice needs tools: give the tools it may call", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise bad("tools must be an array of {type: function, function: {...}}", "tools")
    if len(raw) > MAX_TOOLS:
        raise bad(f"tools takes at most {MAX_TOOLS} tools; got {len(raw)}", "tools")
    tools = [function_tool(t, f"tools[{i}]") for i, t in enumerate(raw)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise bad(f"tools: each function name once; repeated: {', '.join(twice)}", "tools")
    if choice is None or choice == "auto":
        return tools
    if choice == "none":
        # The model is not to call any: it does not see them.
        return None
    if choice == "required" or isinstance(choice, dict):
        # Honouring these takes constrained decoding, which the cluster does not do;
        # answering with a plain reply instead would break the caller's contract.
        raise bad(
            "tool_choice 'required' or a named function cannot be enforced here: the "
            "model decides whether to call a tool; send tool_choice 'auto' (or leave it out)",
            "tool_choice",
        )
    raise bad(
        f"tool_choice must be 'auto', 'none' or 'required'; got {shown(choice)}", "tool_choice"
    )


def function_tool(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise bad(f"{where} must be an object {{type: function, function: {{...}}}}", where)
    if raw.get("type") != "function":
        raise bad(
            f"{where}.type must be 'function' (the only kind of tool a model's template "
            f"knows); got {shown(raw.get('type'))}",
            f"{where}.type",
        )
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function must be an object with a name", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad(
            f"{where}.function.name must be 1-64 letters, digits, _ or -; got {shown(name)}",
            f"{where}.function.name",
        )
    out: dict[str, Any] = {"name": name}
    description = fn.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise bad(f"{where}.function.description must be a string", f"{where}.function")
        out["description"] = description
    parameters = fn.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise bad(
                f"{where}.function.parameters must be a JSON Schema object",
                f"{where}.function.parameters",
            )
        out["parameters"] = parameters
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{where}.function.strict must be true or false", f"{where}.function.strict")
    return {"type": "function", "function": out}


def _tool_message(msg: dict[str, Any], content: str, where: str) -> dict[str, Any]:
    """A tool's result, going back to the model."""
    call_id = msg.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad(
            f"{where}: a tool message needs tool_call_id, the id of the call it answers",
            f"{where}.tool_call_id",
        )
    out = {"role": "tool", "content": content, "tool_call_id": call_id}
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    return out


def _assistant_tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's calls, with their arguments as objects for the template."""
    if not isinstance(raw, list):
        raise bad(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{at} must be {{id, type: function, function: {{name, arguments}}}}", at)
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as exc:
                raise bad(
                    f"{at}.function.arguments is not valid JSON: {exc}", f"{at}.function.arguments"
                ) from None
        call_id = call.get("id")
        calls.append(
            {
                "id": call_id if isinstance(call_id, str) else f"call_{j}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": arguments},
            }
        )
    return calls
