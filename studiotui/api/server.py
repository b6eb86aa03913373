"""The HTTP API (OpenAI, Anthropic, Ollama): every client other than the TUI talks here.

One aiohttp server in the controller's own event loop. Each request is one
`Controller.generate()` call and nothing else is shared between requests, so as
many requests as clients send are in flight across the shards at once. A client
that goes away cancels its handler (aiohttp's handler cancellation), which closes
the generate() iterator, which sends the cancel that frees every shard's KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from studiotui.api import anthropic, ollama, responses, shapes
from studiotui.api.answer import Shape
from studiotui.api.answer import dumps as _dumps
from studiotui.api.answer import event as _event
from studiotui.api.answer import usage as _usage
from studiotui.api.defaults import DEFAULT_HOST, DEFAULT_PORT
from studiotui.api.keys import Keys
from studiotui.api.request import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    bad,
    check_prompt_size,
    parse_body,
    parse_chat_request,
    parse_completion_request,
    shown,
)
from studiotui.cluster.controller import Controller, GenerationError
from studiotui.core.state import ClusterState, PlacementState
from worker.shared.protocol import control
from worker.shared.protocol.messages import ErrorCode

__all__ = ["ApiServer", "build_app", "serve", "start_server"]

log = logging.getLogger("studiotui.api.server")
# Quiet unless the host program configures logging: inside the TUI, Python's
# last-resort stderr handler would write over the screen.
log.addHandler(logging.NullHandler())

# Long documents go into prompts; aiohttp's 1 MiB default would cut them off.
MAX_BODY_BYTES = 16 << 20
SHUTDOWN_GRACE_S = 2.0
# Seconds a client has to send its whole body once it has sent the headers.
BODY_TIMEOUT_S = 30.0
# Seconds a streaming client may go without reading before its stream is given up.
WRITE_STALL_S = 60.0
# How long a request that found its model not ready waits for the nodes' word of now.
REFRESH_S = 1.0
# A request the head shard did not accept says why with a code (worker.shared.protocol
# .messages.ErrorCode, set where the refusal is raised: worker/stage, worker/sampling):
# its HTTP status follows from the code alone, so rewording a message changes no status.
# bad_request is the client's mistake (400); busy, every stream taken and the queue
# full (429, what OpenAI's clients back off and retry on); any other code is the
# cluster's (503).
STATUS_OF: dict[ErrorCode, int] = {"bad_request": 400, "busy": 429}
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    # Proxies such as nginx would otherwise hold tokens back until their buffer fills.
    "X-Accel-Buffering": "no",
}


# ---- placements as models ------------------------------------------------------------


@dataclass
class ApiStats:
    """What the server is doing, for tests and the bench: requests in flight now and at most."""

    in_flight: Counter[str] = field(default_factory=Counter)
    peak: int = 0
    served: int = 0

    @property
    def total(self) -> int:
        return sum(self.in_flight.values())


class Models:
    """Maps a request's `model` onto a placement of the controller."""

    def __init__(self, controller: Controller) -> None:
        self.ctl = controller
        # Placements ever seen: asking for one that was unloaded or lost its nodes is
        # "the service is down" (503), not "no such model" (404).
        self.first_seen: dict[str, int] = {}
        self.stats = ApiStats()
        self._refresh: asyncio.Future[Any] | None = None
        self._seen(controller.state)
        controller.subscribe(self._seen)

    def _seen(self, state: ClusterState) -> None:
        for p in state.placements:
            if p.name not in self.first_seen:
                self.first_seen[p.name] = int(time.time())

    def ready(self) -> list[PlacementState]:
        return [p for p in self.ctl.state.placements if p.state == "ready"]

    def card(self, p: PlacementState) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": p.name,
            "object": "model",
            # When it was placed: a placement unloaded and placed again is a new model.
            "created": p.placed_at or self.first_seen.get(p.name, int(time.time())),
            "owned_by": "studiotui",
        }
        if p.adapter:
            # As vLLM lists a LoRA adapter: its base model as `parent`.
            card |= {"parent": p.model, "adapter": p.adapter}
        return card

    async def resolve_now(self, model: str | None) -> PlacementState:
        """`resolve`, against the nodes' word of now when the view held refuses: the
        view follows the agents' telemetry (once a second) and the plans other
        processes save, so a placement just made elsewhere (`studiotui place` said
        "ready") is served at once rather than refused until the next report."""
        try:
            return self.resolve(model)
        except ApiError as exc:
            if exc.status not in (404, 503):
                raise
        await self._refreshed()
        return self.resolve(model)

    async def _refreshed(self) -> None:
        """One refresh at a time, shared by the requests that want it meanwhile."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self.ctl.refresh(timeout=REFRESH_S))
        with contextlib.suppress(Exception):
            await asyncio.shield(self._refresh)

    def resolve(self, model: str | None) -> PlacementState:
        placements = self.ctl.state.placements
        if model is None:
            ready = self.ready()
            if len(ready) == 1:
                return ready[0]
            if ready:
                names = ", ".join(p.name for p in ready)
                raise bad(f"model is required: several are served ({names})", "model")
            raise _unavailable("no model is ready: place one first (studiotui place)")
        named = [p for p in placements if p.name == model]
        # The model directory's name works too, so a client configured with the
        # model's own name finds it whatever the placement was called; a placement
        # with an adapter answers otherwise, so it is found by its own name, or by
        # MODEL+ADAPTER, never by the base's.
        matches = named or [
            p for p in placements if model == (f"{p.model}+{p.adapter}" if p.adapter else p.model)
        ]
        ready = [p for p in matches if p.state == "ready"]
        if ready:
            # Two placements of one model on disjoint groups: send each request to
            # the one with the fewest requests of ours in flight.
            return min(ready, key=lambda p: self.stats.in_flight[p.name])
        if matches:
            # Where and what to do, as the stream's own error says (node, stage, remedy).
            states = "; ".join(
                f"{p.name} is {p.state}: {self.ctl.not_ready_hint(p)}" for p in matches
            )
            raise _unavailable(f"model {shown(model)} is not ready ({states})")
        if model in self.first_seen:
            raise _unavailable(
                f"model {shown(model)} is no longer loaded (unloaded, or its nodes went down)"
            )
        known = ", ".join(p.name for p in self.ready()) or "none"
        raise ApiError(
            404,
            f"The model {shown(model)} does not exist; ready models: {known}",
            param="model",
            code="model_not_found",
        )


def _unavailable(message: str, code: str = "model_not_ready") -> ApiError:
    return ApiError(503, message, type_="server_error", code=code)


# ---- the app -------------------------------------------------------------------------

CONTROLLER = web.AppKey("controller", Controller)
MODELS = web.AppKey("models", Models)
KEYS = web.AppKey("keys", Keys)
# The name of the key a request came with, for the log line of its answer.
KEY_NAME = web.RequestKey("key_name", str)
# Set by a request that logs its own line (an answer, with its time taken).
LOGGED = web.RequestKey("logged", bool)
# Paths every client may ask without a key: a load balancer's health check, and the
# root that Claude Code and Ollama's clients probe first (it says what is served).
OPEN_PATHS = ("/health", "/")


def build_app(
    controller: Controller, api_key: str | None = None, key_file: Path | None = None
) -> web.Application:
    app = web.Application(middlewares=[_guard], client_max_size=MAX_BODY_BYTES)
    app[CONTROLLER] = controller
    app[MODELS] = Models(controller)
    app[KEYS] = Keys(api_key or "", key_file)
    app.router.add_get("/v1/models", _list_models)
    app.router.add_get("/v1/models/{model:.+}", _get_model)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/messages", _messages)
    app.router.add_post("/v1/messages/count_tokens", _count_tokens)
    app.router.add_post("/v1/responses", _responses)
    app.router.add_post("/api/chat", _ollama_chat)
    app.router.add_post("/api/generate", _ollama_generate)
    app.router.add_get("/api/tags", _ollama_tags)
    app.router.add_post("/api/show", _ollama_show)
    app.router.add_get("/api/ps", _ollama_ps)
    app.router.add_get("/api/version", _ollama_version)
    app.router.add_get("/health", _health)
    app.router.add_get("/", _root)
    return app


SERVED = (
    "GET /v1/models",
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/responses",
    "POST /api/chat",
    "POST /api/generate",
    "GET /api/tags",
    "POST /api/show",
    "GET /api/ps",
    "GET /api/version",
    "GET /health",
)


def route_error(status: int, method: str, path: str) -> str:
    """What to say for a request no route takes: aiohttp's "Not Found" does not say
    what is served, nor that the usual mistake is a base_url without /v1."""
    if status == 405:
        wanted = next((r.split()[0] for r in SERVED if r.split()[1] == path), "POST")
        return f"{method} is not allowed on {path}: use {wanted}"
    served = f"this server answers {', '.join(SERVED)}"
    if any(r.split()[1] == f"/v1{path}" for r in SERVED) or path.startswith("/models/"):
        return f"no endpoint {path}: {served}; give your client a base_url ending in /v1"
    return f"no endpoint {method} {path}: {served}"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_Parsed = TypeVar("_Parsed", ChatRequest, CompletionRequest)


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Checks every request, and turns every failure into its API's error shape."""
    try:
        _check_origin(request)
        if request.path not in OPEN_PATHS:
            request[KEY_NAME] = _check_key(request, request.app[KEYS])
        resp = await handler(request)
        if not request.get(LOGGED):
            # Every request's line names its key: who listed models, who counted tokens.
            log.info(
                "%s %s by %s: %d",
                request.method,
                request.path,
                request.get(KEY_NAME, "-"),
                resp.status,
            )
        return resp
    except ApiError as exc:
        return _error_response(request, exc)
    except web.HTTPException as exc:
        # aiohttp's own: unknown route, wrong method, body too large.
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        words = exc.reason
        if exc.status in (404, 405):
            words = route_error(exc.status, request.method, request.path)
        return _error_response(request, ApiError(exc.status, words, type_=kind))
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return _error_response(
            request,
            ApiError(500, "internal error in studiotui (see its log)", type_="server_error"),
        )


def _error_response(request: web.Request, exc: ApiError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    if exc.status == 429:
        headers = {"Retry-After": "1"}
    # Each API's clients read their own error shape.
    if request.path.startswith("/v1/messages"):
        body = anthropic.error_body(exc)
    elif request.path.startswith("/api/"):
        body = ollama.error_body(exc)
    else:
        body = exc.body()
    return web.json_response(body, status=exc.status, headers=headers, dumps=_dumps)


def _check_key(request: web.Request, keys: Keys) -> str:
    """The name of the key the request came with ("-" when none is needed).

    OpenAI's and Ollama's clients send `Authorization: Bearer KEY`, Anthropic's
    `x-api-key: KEY`: either is taken on every path."""
    if not keys.required:
        return "-"
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer":
        token = ""
    token = token.strip() or request.headers.get("x-api-key", "").strip()
    name = keys.name_of(token) if token else None
    if name is None:
        what = "missing" if not token else "incorrect"
        log.info("%s %s refused: API key %s", request.method, request.path, what)
        raise ApiError(
            401,
            f"API key {what}: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>') "
            "with a key given to serve",
            code="invalid_api_key",
        )
    return name


def _check_origin(request: web.Request) -> None:
    """Keep web pages in the operator's browser from driving the cluster.

    A page can POST to localhost without a CORS preflight (a "simple" request), and
    a DNS-rebound name can make that same-origin; browsers always name the origin
    of such requests, while API clients send no Origin header at all.
    """
    origin = request.headers.get("Origin")
    if origin is not None and origin != f"{request.scheme}://{request.host}":
        raise ApiError(403, f"requests from web pages ({origin}) are refused", code="origin")
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    if sock and is_loopback(sock[0]) and not is_loopback(_hostname(request.host)):
        raise ApiError(403, f"host {request.host!r} is not this machine", code="host")


def _hostname(host: str) -> str:
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _list_models(request: web.Request) -> web.Response:
    models = request.app[MODELS]
    data = [models.card(p) for p in models.ready()]
    return web.json_response({"object": "list", "data": data}, dumps=_dumps)


async def _get_model(request: web.Request) -> web.Response:
    models = request.app[MODELS]
    return web.json_response(models.card(await models.resolve_now(request.match_info["model"])))


async def _read_json(request: web.Request) -> Any:
    try:
        # A client that sends half a body and stops would hold its handler (and
        # connection) for ever: it gets a 408 instead.
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {BODY_TIMEOUT_S:g} s: send the whole "
            "body (its Content-Length) at once",
            code="timeout",
        ) from None
    return parse_body(raw)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    chat = await _parsed(parse_chat_request, await _read_json(request))
    return await _answer(
        request, chat, lambda name: _ChatAnswer(name, chat.logprobs, chat.include_usage)
    )


async def _completions(request: web.Request) -> web.StreamResponse:
    plain = await _parsed(parse_completion_request, await _read_json(request))
    return await _answer(
        request, plain, lambda name: _TextAnswer(name, plain.logprobs, plain.include_usage)
    )


def _claude_model(models: Models, name: str | None) -> PlacementState:
    """The placement an Anthropic request names. Claude Code asks for Claude models by
    name (and for a small one for its background work) unless told otherwise: such a
    name, when no placement has it, means the one model served here."""
    try:
        return models.resolve(name)
    except ApiError as exc:
        ready = models.ready()
        if exc.status != 404 or not (name or "").startswith(anthropic.CLAUDE_PREFIX):
            raise
        if len(ready) == 1:
            return ready[0]
        names = ", ".join(sorted(p.name for p in ready)) or "none is ready"
        raise ApiError(
            404,
            f"{exc.message}. Claude Code asks for Claude models unless told which to use: set "
            f"ANTHROPIC_MODEL and ANTHROPIC_SMALL_FAST_MODEL to a placement ({names})",
            param="model",
            code="model_not_found",
        ) from None


async def _messages(request: web.Request) -> web.StreamResponse:
    parsed = anthropic.parse_messages_request(await _read_json(request))
    placement = _claude_model(request.app[MODELS], parsed.model)
    stops = list(parsed.params["stop"])
    return await _answer(
        request, parsed, lambda name: anthropic.MessageAnswer(name, stops), placement
    )


async def _count_tokens(request: web.Request) -> web.Response:
    """Anthropic's count_tokens: the head counts the prompt (template, tools and all)
    when it accepts a request; the request is then cancelled before it costs more."""
    parsed = anthropic.count_request(await _read_json(request))
    models = request.app[MODELS]
    placement = _claude_model(models, parsed.model)
    check_prompt_size(parsed, placement.context_tokens)
    params = {**parsed.params, "max_tokens": 1}
    gen = request.app[CONTROLLER].generate(placement.name, parsed.cluster_request(), params)
    try:
        accepted = await _accepted(gen, placement.name)
    finally:
        await gen.aclose()
    return web.json_response({"input_tokens": accepted.prompt_tokens})


async def _responses(request: web.Request) -> web.StreamResponse:
    parsed, echo = responses.parse_responses_request(await _read_json(request))
    return await _answer(request, parsed, lambda name: responses.ResponseAnswer(name, echo))


async def _ollama_chat(request: web.Request) -> web.StreamResponse:
    return await _ollama(request, ollama.parse_chat)


async def _ollama_generate(request: web.Request) -> web.StreamResponse:
    return await _ollama(request, ollama.parse_generate)


async def _ollama(
    request: web.Request, parse: Callable[[Any], ollama.OllamaRequest]
) -> web.StreamResponse:
    got = parse(await _read_json(request))
    models = request.app[MODELS]
    placement = models.resolve(ollama.model_name(got.parsed.model))
    ollama.check_context(got, placement.context_tokens)
    if got.load_only:
        # Ollama's clients load a model with an empty prompt: it is loaded already.
        return web.json_response(ollama.loaded(placement.name, got.chat), dumps=_dumps)
    return await _answer(
        request, got.parsed, lambda name: ollama.OllamaAnswer(name, got.chat), placement
    )


async def _ollama_tags(request: web.Request) -> web.Response:
    models = request.app[MODELS]
    return web.json_response(
        {"models": [ollama.card(p, models.first_seen) for p in models.ready()]}, dumps=_dumps
    )


async def _ollama_ps(request: web.Request) -> web.Response:
    models = request.app[MODELS]
    return web.json_response(
        {"models": [ollama.running(p, models.first_seen) for p in models.ready()]}, dumps=_dumps
    )


async def _ollama_show(request: web.Request) -> web.Response:
    body = await _read_json(request)
    name = body.get("model") or body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise bad("model is required: the name of a placement (GET /api/tags)", "model")
    placement = request.app[MODELS].resolve(ollama.model_name(name))
    return web.json_response(ollama.show(placement), dumps=_dumps)


async def _ollama_version(request: web.Request) -> web.Response:
    return web.json_response({"version": ollama.VERSION})


async def _health(request: web.Request) -> web.Response:
    """200 while a model can answer, 503 while none is ready: what a load balancer or
    a client's health check reads."""
    ready = [p.name for p in request.app[MODELS].ready()]
    status = "ok" if ready else "no model is ready: place one (studiotui place)"
    return web.json_response({"status": status, "models": ready}, status=200 if ready else 503)


async def _root(request: web.Request) -> web.Response:
    # Ollama's clients probe GET / before anything else.
    return web.Response(text=f"studiotui is running: {', '.join(SERVED)}\n")


async def _parsed(parse: Callable[[Any], _Parsed], body: Any) -> _Parsed:
    """`parse(body)`; in a thread when it compiles a JSON Schema (up to ~0.1 s for a
    64 KiB one, ~0.3 s to find the fault in one that fails), which would otherwise
    hold every other stream this loop serves."""
    fmt = body.get("response_format") if isinstance(body, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return await asyncio.to_thread(parse, body)
    return parse(body)


async def _answer(
    request: web.Request,
    parsed: ChatRequest | CompletionRequest,
    make: Callable[[str], Shape],
    placement: PlacementState | None = None,
) -> web.StreamResponse:
    """Serve one parsed request, in any API's shape: the same generation whichever
    API asked (the same messages through the same chat template, the same tokens)."""
    models = request.app[MODELS]
    if placement is None:
        placement = await models.resolve_now(parsed.model)
    check_prompt_size(parsed, placement.context_tokens)
    ctl = request.app[CONTROLLER]
    stats = models.stats
    stats.in_flight[placement.name] += 1
    stats.peak = max(stats.peak, stats.total)
    started = time.perf_counter()
    answer = make(placement.name)
    request[LOGGED] = True
    gen = ctl.generate(placement.name, parsed.cluster_request(), parsed.params)
    try:
        answer.accepted(await _accepted(gen, placement.name, answer.prompt_param))
        if parsed.stream:
            return await _stream(request, gen, answer)
        return await _complete(gen, answer)
    finally:
        # Closing before "done" is what sends the cancel that frees the KV caches.
        await gen.aclose()
        stats.in_flight[placement.name] -= 1
        stats.served += 1
        log.info(
            "%s %s %s %s by %s %.2f s",
            request.method,
            request.path,
            placement.name,
            "stream" if parsed.stream else "complete",
            request.get(KEY_NAME, "-"),
            time.perf_counter() - started,
        )


async def _accepted(
    gen: AsyncIterator[control.Answer], name: str, param: str = "messages"
) -> control.Accepted:
    """Wait for the head shard to take the request, before any status is sent."""
    try:
        match await anext(gen):
            case control.Accepted() as accepted:
                return accepted
            case other:
                raise _unavailable(
                    f"placement {name!r} answered with a {other.kind} before taking the request",
                    "cluster_error",
                )
    except GenerationError as exc:
        # The head names the field it blames (tools, a sampling parameter, ...) in the
        # `failed` message; a refusal of no one field blames the prompt.
        raise refused(exc.code, str(exc), name, exc.param or param) from None
    except StopAsyncIteration:
        raise _unavailable(f"placement {name!r} closed the request", "cluster_error") from None


def refused(code: ErrorCode, text: str, name: str, param: str = "messages") -> ApiError:
    """The API's answer to a request placement `name` did not accept: its status from
    the refusal's `code` (STATUS_OF), its words the head's, the field it blames `param`."""
    status = STATUS_OF.get(code, 503)
    if status == 429:
        return ApiError(429, f"placement {name!r} is {text}", type_="rate_limit_error", code="busy")
    if status == 400:
        return bad(f"the model refused the request: {text}", param)
    return _unavailable(f"placement {name!r} cannot answer: {text}", "cluster_error")


class _OpenAIShape(Shape):
    """OpenAI's chat and text answers: one token is one chunk, so the common chunk
    (text only) is the parts shared by every chunk, encoded once, around its text."""

    def __init__(self, model: str, logprobs: int, include_usage: bool) -> None:
        super().__init__(model, logprobs, include_usage)
        self.head: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": model,
            "system_fingerprint": None,
        }

    def finish_reason(self, done: control.Done) -> str:
        return self.reason(done)

    def finish(self, done: control.Done) -> bytes:
        raise NotImplementedError

    def end(self, done: control.Done) -> bytes:
        out = self.finish(done)
        if self.include_usage:
            out += _event({**self.head, "choices": [], "usage": _usage(done)})
        return out + b"data: [DONE]\n\n"


class _ChatAnswer(_OpenAIShape):
    object = "chat.completion.chunk"
    prompt_param = "messages"
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, logprobs: int, include_usage: bool) -> None:
        super().__init__(model, logprobs, include_usage)
        if include_usage:
            self.head["usage"] = None  # OpenAI: null on every chunk but the last
        self._prefix = "data: " + _dumps(self.head)[:-1] + ',"choices":[{"index":0,"delta":'
        self._suffix = ',"logprobs":null,"finish_reason":null}]}\n\n'
        self.sent_calls = 0

    def _logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        return shapes.chat_logprobs(entries, self.top) if self.wants_logprobs else None

    def body(self, done: control.Done) -> dict[str, Any]:
        text = "".join(self.parts)
        message: dict[str, Any] = {
            "role": "assistant",
            # OpenAI: null content beside tool calls when the model wrote nothing else.
            "content": text if text or not self.calls else None,
            "refusal": None,
        }
        if self.calls:
            message["tool_calls"] = shapes.tool_calls(self.calls, 0, streaming=False)
        choice = {
            "index": 0,
            "message": message,
            "logprobs": self._logprobs(self.entries),
            "finish_reason": self.finish_reason(done),
        }
        head = {k: v for k, v in self.head.items() if k != "usage"}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": _usage(done)}

    def start(self) -> bytes:
        return (self._prefix + '{"role":"assistant","content":""}' + self._suffix).encode()

    def chunk(self, msg: control.Delta) -> bytes:
        text, calls, entries = msg.text, msg.tool_calls, msg.logprobs
        self.calls.extend(calls or ())
        if not calls and not (entries and self.wants_logprobs):
            if not text:
                return b""
            return (self._prefix + '{"content":' + _dumps(text) + "}" + self._suffix).encode()
        delta: dict[str, Any] = {"content": text} if text or not calls else {}
        if calls:
            delta["tool_calls"] = shapes.tool_calls(calls, self.sent_calls, streaming=True)
            self.sent_calls += len(calls)
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": self._logprobs(entries or []),
            "finish_reason": None,
        }
        return _event({**self.head, "choices": [choice]})

    def finish(self, done: control.Done) -> bytes:
        reason = self.finish_reason(done)
        choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
        return _event({**self.head, "choices": [choice]})


class _TextAnswer(_OpenAIShape):
    object = "text_completion"
    prompt_param = "prompt"
    id_prefix = "cmpl-"

    def __init__(self, model: str, logprobs: int, include_usage: bool) -> None:
        super().__init__(model, logprobs, include_usage)
        self.offset = 0  # characters of text already streamed, for text_offset

    def _logprobs(self, entries: list[dict[str, Any]], offset: int) -> dict[str, Any] | None:
        if not self.wants_logprobs:
            return None
        return shapes.completion_logprobs(entries, self.top, offset)

    def body(self, done: control.Done) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": "".join(self.parts),
            "logprobs": self._logprobs(self.entries, 0),
            "finish_reason": self.finish_reason(done),
        }
        return {**self.head, "choices": [choice], "usage": _usage(done)}

    def chunk(self, msg: control.Delta) -> bytes:
        text, entries = msg.text, msg.logprobs or []
        if not text and not (entries and self.wants_logprobs):
            return b""
        choice = {
            "index": 0,
            "text": text,
            "logprobs": self._logprobs(entries, self.offset),
            "finish_reason": None,
        }
        self.offset += sum(len(e["token"]) for e in entries)
        return _event({**self.head, "choices": [choice]})

    def finish(self, done: control.Done) -> bytes:
        choice = {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": self.finish_reason(done),
        }
        return _event({**self.head, "choices": [choice]})


async def _complete(gen: AsyncIterator[control.Answer], answer: Shape) -> web.Response:
    done: control.Done | None = None
    try:
        async for msg in gen:
            match msg:
                case control.Delta():
                    answer.add(msg)
                case control.Done():
                    done = msg
    except GenerationError as exc:
        raise _unavailable(
            f"placement {answer.model!r} failed mid-answer: {exc}", "cluster_error"
        ) from None
    if done is None:  # generate ends with a done or raises; said rather than assumed
        raise _unavailable(f"placement {answer.model!r} ended without a done", "cluster_error")
    return web.json_response(answer.body(done), dumps=_dumps)


async def write_or_give_up(request: web.Request, resp: web.StreamResponse, data: bytes) -> None:
    """Write to a client that reads: one that stops reading fills its socket and
    would hold its stream on the cluster (a KV cache, one of the placement's
    streams) for as long as it keeps the connection open. Past WRITE_STALL_S it is
    treated as gone: ConnectionError, as when it hangs up."""
    try:
        async with asyncio.timeout(WRITE_STALL_S):
            await resp.write(data)
    except TimeoutError:
        log.warning("a client read nothing for %g s: its stream is given up", WRITE_STALL_S)
        if request.transport is not None:
            request.transport.close()  # aiohttp would wait on its buffer otherwise
        raise ConnectionResetError("the client stopped reading") from None


async def _stream(
    request: web.Request, gen: AsyncIterator[control.Answer], answer: Shape
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={**SSE_HEADERS, "Content-Type": answer.content_type})
    await resp.prepare(request)
    try:
        if first := answer.start():
            await write_or_give_up(request, resp, first)
        async for msg in gen:
            match msg:
                case control.Delta():
                    if chunk := answer.chunk(msg):
                        await write_or_give_up(request, resp, chunk)
                case control.Done():
                    await write_or_give_up(request, resp, answer.end(msg))
    except GenerationError as exc:
        # The status line is long gone; OpenAI's clients raise on an error event.
        # No [DONE] after it, so no client mistakes the cut answer for a whole one.
        err = _unavailable(f"placement {answer.model!r} failed mid-answer: {exc}", "cluster_error")
        log.warning("%s", err.message)
        with contextlib.suppress(ConnectionError):
            await write_or_give_up(request, resp, answer.failed(err))
    except ConnectionError:
        return resp  # the client left; the caller's aclose() cancels on the cluster
    with contextlib.suppress(ConnectionError):
        await resp.write_eof()
    return resp


# ---- running it ----------------------------------------------------------------------


@dataclass
class ApiServer:
    runner: web.AppRunner
    app: web.Application
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def stats(self) -> ApiStats:
        return self.app[MODELS].stats

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_server(
    controller: Controller,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    key_file: Path | None = None,
) -> ApiServer:
    """Listen in the running loop; port 0 takes a free port (see `.port`)."""
    app = build_app(controller, api_key, key_file)
    # handler_cancellation: a client that hangs up cancels its handler at once,
    # not at the next token written, so a stalled generation is cancelled too.
    # shutdown_timeout: an answer can run for minutes; stopping the server must not
    # wait for it. Cancelled handlers still send their cancels to the cluster.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    return ApiServer(runner=runner, app=app, host=host, port=int(bound))


async def serve(
    controller: Controller,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    key_file: Path | None = None,
) -> None:
    """Serve until cancelled."""
    server = await start_server(controller, host, port, api_key, key_file)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()
