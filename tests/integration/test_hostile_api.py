"""Hostile bodies and clients against the real API on a real one-node cluster.

Hypothesis writes request bodies for every endpoint (chat and text completions, the
model list and one model): wrong types at every field and inside messages and tools,
huge strings and arrays, any Unicode, lone surrogates, NaN and Infinity, integers past
64 bits, duplicate keys, deep nesting, empty and non-JSON bodies, odd content types,
chunked uploads. Property: a 200, or a 4xx in OpenAI's error shape naming the field
that was wrong; never a 5xx; and afterwards the server still gives the reference
answer. Slow clients (half a body, a stream never read) hold up nobody else.

The agent listens on 127.0.0.151:58900.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from studiotui.api import server as api_server
from studiotui.api.server import ApiServer, start_server
from studiotui.cluster.controller import Controller
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

PLACEMENT = "hz"
EXAMPLES = 60  # per endpoint: the property fails in the first few dozen when it fails
MESSAGES = [{"role": "user", "content": "hello there"}]
CHAT = {"model": PLACEMENT, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
TEXT = {"model": PLACEMENT, "prompt": "once upon", "max_tokens": 2, "temperature": 0}
CHAT_FIELDS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "seed", "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "tools",
    "tool_choice", "parallel_tool_calls", "response_format", "logit_bias",
    "presence_penalty", "frequency_penalty", "repetition_penalty",
    "repetition_context_size", "top_k", "min_p", "xtc_probability", "xtc_threshold",
    "ignore_eos", "functions", "user",
]  # fmt: skip
TEXT_FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
    "stream_options", "n", "logprobs", "echo", "suffix", "best_of", "logit_bias",
    "presence_penalty", "top_k", "min_p", "ignore_eos", "user",
]  # fmt: skip
# The other APIs on the same port: Anthropic's, OpenAI's Responses, Ollama's.
ANTHROPIC = {"model": PLACEMENT, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
ANTHROPIC_FIELDS = [
    "model", "messages", "max_tokens", "system", "temperature", "top_p", "top_k",
    "stop_sequences", "stream", "tools", "tool_choice", "metadata", "thinking",
]  # fmt: skip
RESPONSES = {"model": PLACEMENT, "input": "hello there", "max_output_tokens": 2, "temperature": 0}
RESPONSES_FIELDS = [
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
    "tools", "tool_choice", "text", "previous_response_id", "prompt_cache_key", "store",
]  # fmt: skip
OPTIONS = {"num_predict": 2, "temperature": 0}
OLLAMA_CHAT = {"model": PLACEMENT, "messages": MESSAGES, "stream": False, "options": OPTIONS}
OLLAMA_CHAT_FIELDS = ["model", "messages", "stream", "options", "tools", "format", "keep_alive"]
OLLAMA_GENERATE = {"model": PLACEMENT, "prompt": "once upon", "stream": False, "options": OPTIONS}
OLLAMA_GENERATE_FIELDS = [
    "model", "prompt", "system", "raw", "options", "stream", "format", "suffix", "images",
]  # fmt: skip
# Fields whose legal values make long answers: kept to what the context (128) holds.
LENGTHS = {"max_tokens", "max_completion_tokens", "max_output_tokens"}

SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)

# ---- what is sent ------------------------------------------------------------------------

# JSON leaves, hostile ones included; Python's json writes NaN/Infinity and lone
# surrogates (as \ud800 escapes) when asked to, as careless clients do.
leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(st.characters(codec=None), max_size=12)  # surrogates included
    | st.sampled_from(["", "user", "assistant", "tool", "function", "text", "auto", "none"])
    | st.integers(0, 4).map(lambda n: "x" * 10 ** (n + 1))  # up to 100 k characters
)
values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["role", "content", "type", "text", "function", "name",
                             "arguments", "parameters", "tool_calls", "tool_call_id",
                             "include_usage", "id"]) | st.text(max_size=6),
            inner,
            max_size=4,
        )
    ),
    max_leaves=10,
)  # fmt: skip
nested = st.one_of(
    values,
    st.integers(1000, 20000).map(lambda n: [0] * n),  # arrays of thousands
    # Garbage one level inside the things that have insides.
    st.builds(lambda r, c: [{"role": r, "content": c}], values, values),
    st.builds(lambda c: [{"role": "assistant", "content": None, "tool_calls": c}], values),
    st.builds(lambda c: [{"role": "tool", "content": "r", "tool_call_id": c}], values),
    st.builds(lambda p: [{"type": "function", "function": {"name": "f", "parameters": p}}], values),
    st.builds(lambda f: [{"type": "function", "function": f}], values),
    st.builds(lambda v: {"include_usage": v}, values),
    st.builds(lambda k, v: {k: v}, st.text(max_size=5), values),
)


@dataclass(frozen=True)
class Attack:
    path: str
    body: bytes
    field: str | None  # the one field mutated: a 400 must name it
    content_type: str | None = "application/json"
    chunked: bool = False


def _dumps(body: Any) -> bytes:
    # allow_nan: NaN/Infinity as bare words; ensure_ascii: surrogates as \ud800 escapes.
    return json.dumps(body, allow_nan=True).encode()


def _mutated(path: str, base: dict[str, Any], fields: list[str]) -> st.SearchStrategy[Attack]:
    def build(field: str, value: Any, drop: bool) -> Attack:
        body = {k: v for k, v in base.items() if not (drop and k == field)}
        if not drop:
            if field in LENGTHS and isinstance(value, int) and not isinstance(value, bool):
                value = value if value < 1 else min(value, 8)
            body[field] = value
        return Attack(path, _dumps(body), field)

    # Mostly a wrong value; now and then the field left out (required ones must be named).
    return st.builds(
        build, st.sampled_from(fields), nested, st.integers(0, 9).map(lambda n: n == 0)
    )


def _raw(path: str, base: dict[str, Any]) -> st.SearchStrategy[Attack]:
    """Bodies that are wrong as text: not JSON, cut, duplicated keys, odd transports."""
    good = _dumps(base)
    return st.one_of(
        st.binary(max_size=64).map(lambda b: Attack(path, b, None)),
        st.integers(1, len(good) - 1).map(lambda n: Attack(path, good[:n], None)),
        st.just(Attack(path, b"", None)),
        st.just(Attack(path, b"   ", None)),
        st.just(Attack(path, b"null", None)),
        # Duplicate keys: the last one counts, as in every JSON parser clients use.
        st.just(Attack(path, good[:-1] + b', "max_tokens": 3, "max_tokens": 1}', None)),
        st.builds(
            lambda v: Attack(path, good[:-1] + b', "temperature": ' + v + b"}", "temperature"),
            st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"1" * 5000]),
        ),
        # Deep nesting (past what Python's parser and msgpack take), under some field.
        st.builds(
            lambda field, n: Attack(
                path, good[:-1] + f', "{field}": '.encode() + b"[" * n + b"]" * n + b"}", field
            ),
            st.sampled_from(["tools", "messages", "stop", "logit_bias"]),
            st.sampled_from([65, 600, 5000, 100_000]),
        ),
        st.builds(
            lambda ct, chunked: Attack(path, good, None, ct, chunked),
            st.sampled_from(
                [
                    None,
                    "text/plain",
                    "application/x-www-form-urlencoded",
                    "multipart/form-data; boundary=x",
                    "application/json; charset=latin-1",
                ]
            ),
            st.booleans(),
        ),
        st.builds(
            lambda b: Attack(path, good[:-1] + b"\xff\xfe" + b + b"}", None), st.binary(max_size=8)
        ),
    )


def attacks(path: str, base: dict[str, Any], fields: list[str]) -> st.SearchStrategy[Attack]:
    return st.one_of(_mutated(path, base, fields), _mutated(path, base, fields), _raw(path, base))


def draw(strategy: st.SearchStrategy[Attack]) -> list[Attack]:
    """Hypothesis's examples, drawn up front: the requests go out from the test's loop."""
    batch: list[Attack] = []

    @SETTINGS
    @given(strategy)
    def collect(attack: Attack) -> None:
        batch.append(attack)

    collect()
    return batch


# ---- the cluster -------------------------------------------------------------------------


@dataclass
class Served:
    ctl: Controller
    server: ApiServer
    want: str  # the reference answer to CHAT


@pytest.fixture(scope="module")
def hostile_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("hostile-home"), 1, 151, 58900)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(
    hostile_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    model = write_demo_model(
        tmp_path_factory.mktemp("hostile-model") / "tiny",
        DemoSpec(layers=2, hidden=32, heads=2, kv_heads=1, dtype="float32"),
    )
    ctl = hostile_cluster.controller()
    server = None
    try:
        await ctl.start(telemetry=False)
        await ctl.place(model, list(hostile_cluster.inventory.names), PLACEMENT, context_tokens=128)
        server = await start_server(ctl, "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            resp = await http.post("/chat/completions", json=CHAT)
        assert resp.status_code == 200, resp.text
        yield Served(ctl, server, resp.json()["choices"][0]["message"]["content"])
    finally:
        if server is not None:
            await server.close()
        await ctl.close()


async def send(http: httpx.AsyncClient, attack: Attack) -> httpx.Response:
    headers = {"Content-Type": attack.content_type} if attack.content_type else {}
    content: Any = attack.body
    if attack.chunked:

        async def pieces() -> AsyncIterator[bytes]:
            for i in range(0, len(attack.body), 7):
                yield attack.body[i : i + 7]

        content = pieces()
    return await http.post(attack.path, content=content, headers=headers)


def check(attack: Attack, resp: httpx.Response) -> None:
    what = (attack.path, attack.body[:300], resp.text[:500])
    assert resp.status_code < 500, what
    if resp.status_code == 200:
        return
    assert 400 <= resp.status_code < 500, what
    if "/v1/messages" in attack.path or "/api/" in attack.path:
        # Anthropic's shape ({"type": "error", "error": {type, message}}) or Ollama's
        # ({"error": "words"}): neither names a parameter.
        body = resp.json()
        words = body["error"] if "/api/" in attack.path else body["error"]["message"]
        assert words and "Traceback" not in words and len(words) < 2000, what
        return
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, what
    assert err["message"] and "Traceback" not in err["message"], what
    assert len(err["message"]) < 2000, what  # a value sent is not echoed back whole
    if attack.field and resp.status_code == 400:
        assert (err["param"] or "").startswith(attack.field), (err, what)


async def still_answers(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.server.url, timeout=60) as http:
        resp = await http.post("/chat/completions", json=CHAT)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == served.want
    assert served.server.stats.total == 0


@pytest.mark.parametrize(
    ("path", "base", "fields"),
    [
        ("/chat/completions", CHAT, CHAT_FIELDS),
        ("/completions", TEXT, TEXT_FIELDS),
        ("/messages", ANTHROPIC, ANTHROPIC_FIELDS),
        ("/responses", RESPONSES, RESPONSES_FIELDS),
        ("/api/chat", OLLAMA_CHAT, OLLAMA_CHAT_FIELDS),
        ("/api/generate", OLLAMA_GENERATE, OLLAMA_GENERATE_FIELDS),
    ],
    ids=["chat", "text", "anthropic", "responses", "ollama-chat", "ollama-generate"],
)
async def test_hostile_bodies_get_a_4xx_naming_the_field_never_a_5xx(
    served: Served, path: str, base: dict[str, Any], fields: list[str]
) -> None:
    statuses: list[int] = []
    # Ollama's API is at the root, the others under /v1.
    if path.startswith("/api/"):
        path = served.server.url.removesuffix("/v1") + path
    else:
        path = served.server.url + path
    async with httpx.AsyncClient(timeout=60) as http:
        for attack in draw(attacks(path, base, fields)):
            resp = await send(http, attack)
            check(attack, resp)
            statuses.append(resp.status_code)
    assert 200 in statuses and 400 in statuses, statuses
    await still_answers(served)


async def test_hostile_model_names_and_methods(served: Served) -> None:
    names = draw(
        st.text(st.characters(codec="utf-8"), min_size=1, max_size=40).map(
            lambda s: Attack(f"/models/{quote(s, safe='')}", b"", None)
        )
    )
    async with httpx.AsyncClient(base_url=served.server.url, timeout=60) as http:
        for attack in names:
            resp = await http.get(httpx.URL(served.server.url + attack.path))
            check(attack, resp)
        for method in ("PUT", "DELETE", "PATCH"):
            resp = await http.request(method, "/chat/completions", content=b"{}")
            check(Attack("/chat/completions", b"{}", None), resp)
            assert resp.status_code == 405
        resp = await http.post("/chat/completions", content=b"x" * (17 << 20))
        check(Attack("/chat/completions", b"x", None), resp)
        assert resp.status_code == 413
    await still_answers(served)


# ---- slow clients --------------------------------------------------------------------------


def _raw_request(server: ApiServer, path: str, body: bytes, length: int | None = None) -> bytes:
    head = (
        f"POST /v1{path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length or len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def test_half_a_body_gets_a_408_and_holds_up_nobody(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seconds, not the 30 s a real client is given: the same code path either way.
    monkeypatch.setattr(api_server, "BODY_TIMEOUT_S", 1.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", served.server.port)
    body = _dumps(CHAT)
    writer.write(_raw_request(served.server, "/chat/completions", body[:10], len(body)))
    await writer.drain()
    # Others are answered while it dawdles.
    await still_answers(served)
    async with asyncio.timeout(20):
        reply = await reader.read(4096)
    writer.close()
    status, _, rest = reply.partition(b"\r\n")
    assert b" 408 " in status, reply
    err = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert "Content-Length" in err["message"]


async def test_a_stream_never_read_holds_up_nobody_and_is_freed_when_it_goes(
    served: Served,
) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", served.server.port))
    body = _dumps({**CHAT, "stream": True, "max_tokens": 100, "ignore_eos": True})
    sock.send(_raw_request(served.server, "/chat/completions", body))
    for _ in range(100):
        if served.server.stats.total:
            break
        await asyncio.sleep(0.05)
    # Never read: others are answered alongside it.
    async with httpx.AsyncClient(base_url=served.server.url, timeout=60) as http:
        resp = await http.post("/chat/completions", json=CHAT)
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"] == served.want
    sock.close()
    for _ in range(200):
        if served.server.stats.total == 0:
            break
        await asyncio.sleep(0.05)
    await still_answers(served)


# All but two of these were a 500 (or an error megabytes long) before they were caught
# here; the surrogate model name and the megabyte of tools were 4xx already (the latter
# only after the head shard had tokenised it).
BROKE = [
    # Python's parser hits its recursion limit: a RecursionError.
    ("/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "messages"),
    # Past 4300 digits Python refuses to make an int, with a ValueError.
    ("/chat/completions", b'{"messages": [], "seed": ' + b"9" * 5000 + b"}", "seed"),
    # msgpack carries no integer past 64 bits: an OverflowError sending it to the head.
    ("/completions", _dumps({**TEXT, "prompt": [1, 2**70]}), "prompt"),
    (
        "/chat/completions",
        _dumps(
            {
                **CHAT,
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"maximum": 2**65}},
                    }
                ],
            }
        ),
        "tools",
    ),
    # A lone surrogate: no UTF-8 encodes it (UnicodeEncodeError on the way to the head).
    (
        "/chat/completions",
        _dumps({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}),
        "messages[0].content",
    ),
    ("/chat/completions", _dumps({**CHAT, "model": "\udfff"}), "model"),
    # Megabytes of tool schema: refused before the head tokenises them, as a long prompt.
    (
        "/chat/completions",
        _dumps(
            {
                **CHAT,
                "tools": [
                    {"type": "function", "function": {"name": "f", "description": "x" * (1 << 20)}}
                ],
            }
        ),
        "messages",
    ),
    # A 100 k character model name is not sent back whole in the 404.
    ("/chat/completions", _dumps({**CHAT, "model": "m" * 100_000}), "model"),
]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    BROKE,
    ids=["deep", "digits", "token-64bit", "schema-64bit", "surrogate", "surrogate-model",
         "tools-megabyte", "model-100k"],
)  # fmt: skip
async def test_bodies_that_broke_the_server_are_refused_naming_the_field(
    served: Served, path: str, body: bytes, field: str
) -> None:
    async with httpx.AsyncClient(base_url=served.server.url, timeout=60) as http:
        resp = await http.post(path, content=body)
    check(Attack(path, body, field), resp)
    assert 400 <= resp.status_code < 500, resp.text[:300]


async def test_a_client_that_stops_reading_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a client that kept its connection open but read nothing held its stream
    (a KV cache, one of the placement's streams) for as long as it stayed: the write
    waited for ever. A tiny model's answer fits the sockets' buffers, so a handler that
    writes without end stands in for a long answer; the writing is the server's own."""
    monkeypatch.setattr(api_server, "WRITE_STALL_S", 1.0)
    outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            while True:
                await api_server.write_or_give_up(request, resp, b"x" * (1 << 16))
        except ConnectionError as exc:
            outcome.set_result(str(exc))
        return resp

    app = web.Application()
    app.router.add_get("/", endless)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        sock.send(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        async with asyncio.timeout(30):
            assert await outcome == "the client stopped reading"
    finally:
        sock.close()
        await runner.cleanup()
