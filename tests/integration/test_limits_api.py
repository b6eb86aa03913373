"""Bad API input is a fast 400, never a 503, against the real API on a real cluster.

Two agents on 127.0.0.121-122:58100 hold one placement of a demo model with a
small context; the official `openai` client and raw httpx drive the server.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import psutil
import pytest
import pytest_asyncio

from studiotui.api.server import ApiServer, start_server
from studiotui.cluster.controller import Controller
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control
from worker.shared.protocol.limits import MAX_CHARS_PER_TOKEN, MAX_SEED, MAX_STOP_CHARS

pytestmark = pytest.mark.asyncio(loop_scope="module")

PLACEMENT = "lim"
CONTEXT = 256
MESSAGES = [{"role": "user", "content": "Say something about limits."}]


@dataclass
class Served:
    ctl: Controller
    server: ApiServer

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.server.url, api_key="unused", max_retries=0, timeout=60.0
        )

    async def post(self, body: Any) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.server.url, timeout=60.0) as http:
            return await http.post("/chat/completions", json=body)

    async def head_pid(self) -> int:
        return await self.runner_pid(0)

    async def runner_pid(self, index: int) -> int:
        node = self.ctl.state.placement(PLACEMENT).nodes[index]
        reply = await self.ctl.peer(node).ask("list_shards", control.Shards)
        return int(next(s.pid or 0 for s in reply.shards if s.placement == PLACEMENT))

    async def head_stats(self) -> dict[str, Any]:
        head = self.ctl.head_peer(self.ctl.pick_placement(PLACEMENT))
        return control.to_wire((await head.ask("stats", control.StatsReply)).stats)


@pytest.fixture(scope="module")
def limits_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("limits-home"), 2, 121, 58100)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(
    limits_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    model_dir = write_demo_model(
        tmp_path_factory.mktemp("limits-models") / "tiny",
        DemoSpec(layers=2, hidden=32, heads=2, kv_heads=1, dtype="float32"),
    )
    ctl = limits_cluster.controller()
    server = None
    try:
        await ctl.start(telemetry=False)
        await ctl.place(
            model_dir,
            list(limits_cluster.inventory.names),
            PLACEMENT,
            context_tokens=CONTEXT,
            streams=1,
        )
        server = await start_server(ctl, "127.0.0.1", 0)
        yield Served(ctl, server)
    finally:
        if server is not None:
            await server.close()
        await ctl.close()


def body(**kw: Any) -> dict[str, Any]:
    return {"model": PLACEMENT, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, **kw}


def assert_400(resp: httpx.Response, param: str, *words: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    for word in words:
        assert word in err["message"], err["message"]


async def test_a_megabytes_prompt_is_refused_before_anyone_tokenises_it(served: Served) -> None:
    pid = await served.head_pid()
    before = psutil.Process(pid).memory_info().rss
    huge = "lorem ipsum " * (10_000_000 // 12)  # ~10 MB, under the 16 MiB body limit
    resp = await served.post(body(messages=[{"role": "user", "content": huge}]))
    assert_400(resp, "messages", "characters", f"{CONTEXT} tokens", "--context")
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    # The head shard never saw it: its memory is where it was.
    assert psutil.Process(pid).memory_info().rss - before < 32 << 20
    # Through the official client it is a BadRequestError (not retried like a 5xx).
    with pytest.raises(openai.BadRequestError):
        await served.client().chat.completions.create(
            model=PLACEMENT, messages=[{"role": "user", "content": huge}], max_tokens=2
        )


async def test_a_prompt_within_the_character_bound_but_over_the_context_is_400(
    served: Served,
) -> None:
    # Few enough characters to be tokenised, too many tokens for the context: the head
    # shard refuses it, and that refusal is the client's fault too.
    text = "word " * (CONTEXT * 2)
    assert len(text) < CONTEXT * MAX_CHARS_PER_TOKEN
    resp = await served.post(body(messages=[{"role": "user", "content": text}]))
    assert_400(resp, "messages", "tokens", "--context")


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"seed": -1}, "seed", ("seed", "0")),
        ({"seed": MAX_SEED + 1}, "seed", ("seed",)),
        ({"seed": 2**64}, "seed", ("seed",)),
        ({"seed": 1.5}, "seed", ("seed",)),
        ({"max_tokens": 0}, "max_tokens", ("max_tokens",)),
        ({"max_tokens": -5}, "max_tokens", ("max_tokens",)),
        ({"temperature": "hot"}, "temperature", ("temperature",)),
        ({"temperature": None, "top_p": "x"}, "top_p", ("top_p",)),
        ({"messages": []}, "messages", ("messages",)),
        ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop", ("stop", str(MAX_STOP_CHARS))),
        ({"stop": ["a"] * 17}, "stop", ("stop",)),
    ],
)
async def test_bad_parameters_are_400_with_their_name(
    served: Served, fields: dict[str, Any], param: str, words: tuple[str, ...]
) -> None:
    assert_400(await served.post(body(**fields)), param, *words)


async def test_the_largest_legal_seed_and_a_stop_string_answer(served: Served) -> None:
    client = served.client()
    reply = await client.chat.completions.create(
        model=PLACEMENT, messages=MESSAGES, max_tokens=6, seed=MAX_SEED, temperature=0.7
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    again = await client.chat.completions.create(
        model=PLACEMENT, messages=MESSAGES, max_tokens=6, seed=MAX_SEED, temperature=0.7
    )
    assert again.choices[0].message.content == reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=PLACEMENT, messages=MESSAGES, seed=-1)
    assert caught.value.status_code == 400


async def test_beyond_its_streams_a_placement_queues_then_says_busy_429(served: Served) -> None:
    """The placement was planned for one stream: one request runs, four wait, the next
    is a 429 at once; then every admitted one gets the answer it gets alone."""
    placement = served.ctl.state.placement(PLACEMENT)
    assert placement.streams == 1
    client = served.client()
    ask: dict[str, Any] = {"model": PLACEMENT, "max_tokens": 8, "temperature": 0}
    prompts = [f"Tell me about queue slot {i}." for i in range(5)]
    alone = []
    for prompt in prompts:
        reply = await client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], **ask
        )
        alone.append(reply.choices[0].message.content)

    async def streamed(prompt: str) -> str:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], stream=True, **ask
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    # The tail stopped: the first request is admitted and stays in flight, deterministically.
    tail = await served.runner_pid(1)
    os.kill(tail, signal.SIGSTOP)
    try:
        tasks = [asyncio.create_task(streamed(prompts[0]))]
        while (await served.head_stats())["in_flight"] < 1:
            await asyncio.sleep(0.05)
        tasks += [asyncio.create_task(streamed(p)) for p in prompts[1:]]
        while (await served.head_stats())["waiting"] < 4:
            await asyncio.sleep(0.05)
        resp = await served.post(body())
        assert resp.status_code == 429, resp.text
        assert resp.headers["Retry-After"] == "1"
        err = resp.json()["error"]
        assert err["code"] == "busy" and "--streams" in err["message"]
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(messages=MESSAGES, **ask)
    finally:
        os.kill(tail, signal.SIGCONT)
    assert await asyncio.gather(*tasks) == alone
    stats = await served.head_stats()
    assert stats["waiting"] == 0 and stats["in_flight"] == 0
