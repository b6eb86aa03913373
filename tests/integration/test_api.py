"""The OpenAI-compatible API, driven by the real `openai` client against a real cluster.

Two real agents on 127.0.0.81-82:57500 hold one placement of a demo model; the
server runs in this test's event loop on a free localhost port.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import mlx_lm
import openai
import pytest
import pytest_asyncio
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.utils import load_tokenizer

from studiotui.api.request import parse_chat_request
from studiotui.api.server import ApiServer, build_app, start_server
from studiotui.bench.api_bench import bench_api
from studiotui.cluster.controller import Controller, GenerationError
from studiotui.core.state import ClusterState, NodeState, ShardState, placements_from_shards
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.sampling import SamplingParams
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control
from worker.shared.protocol.messages import ErrorCode

pytestmark = pytest.mark.asyncio(loop_scope="module")

PLACEMENT = "demo"
MODEL_DIR_NAME = "tiny-llama"
KEY = "sk-test-studiotui"
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What runs on the cluster tonight?"},
]


@dataclass
class Served:
    ctl: Controller
    server: ApiServer
    keyed: ApiServer
    model_dir: Path

    def client(self, **kw: Any) -> openai.AsyncOpenAI:
        # No retries: a 503 must reach the test, not be retried away.
        kw = {"timeout": 60.0, **kw}
        return openai.AsyncOpenAI(base_url=self.server.url, api_key="unused", max_retries=0, **kw)


@pytest.fixture(scope="module")
def api_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("api-home"), 2, 81, 57500)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(
        tmp_path_factory.mktemp("api-models") / MODEL_DIR_NAME,
        DemoSpec(layers=4, hidden=64, heads=4, kv_heads=2, dtype="float32"),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(api_cluster: LocalCluster, model_dir: Path) -> AsyncIterator[Served]:
    ctl = api_cluster.controller()
    servers: list[ApiServer] = []
    try:
        await ctl.start(telemetry=True)
        await ctl.place(model_dir, list(api_cluster.inventory.names), PLACEMENT, prefill_chunk=16)
        servers.append(await start_server(ctl, "127.0.0.1", 0))
        servers.append(await start_server(ctl, "127.0.0.1", 0, api_key=KEY))
        yield Served(ctl, servers[0], servers[1], model_dir)
    finally:
        for server in servers:
            await server.close()
        await ctl.close()


async def direct(ctl: Controller, messages: list[dict[str, str]], **params: Any) -> dict[str, Any]:
    """The same request straight through the engine: what the API must give back."""
    text, tokens, done = "", 0, None
    async for msg in ctl.generate(PLACEMENT, {"messages": messages}, params):
        if isinstance(msg, control.Delta):
            text += msg.text
            tokens += len(msg.tokens)
        elif isinstance(msg, control.Done):
            done = msg
    assert done is not None
    return {"text": text, "tokens": tokens, "usage": done.usage, "finish": done.finish_reason}


async def stream_text(client: openai.AsyncOpenAI, **kw: Any) -> tuple[str, list[Any]]:
    stream = await client.chat.completions.create(stream=True, **kw)
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# ---- answers -------------------------------------------------------------------------


async def test_models_lists_ready_placements_and_accepts_the_directory_name(
    served: Served,
) -> None:
    client = served.client()
    models = await client.models.list()
    assert [m.id for m in models.data] == [PLACEMENT]
    assert (await client.models.retrieve(PLACEMENT)).id == PLACEMENT
    reply = await client.chat.completions.create(
        model=MODEL_DIR_NAME, messages=MESSAGES, max_tokens=4, temperature=0
    )
    assert reply.model == PLACEMENT


async def test_completion_equals_the_engine(served: Served) -> None:
    want = await direct(served.ctl, MESSAGES, max_tokens=24, temperature=0.0, seed=0)
    reply = await served.client().chat.completions.create(
        model=PLACEMENT, messages=MESSAGES, max_tokens=24, temperature=0
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == want["text"]
    assert choice.finish_reason == want["finish"]
    assert reply.usage is not None
    assert reply.usage.completion_tokens == want["usage"]["completion_tokens"] == want["tokens"]
    assert reply.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


async def test_stream_equals_the_engine(served: Served) -> None:
    want = await direct(served.ctl, MESSAGES, max_tokens=24, temperature=0.0)
    text, chunks = await stream_text(
        served.client(),
        model=PLACEMENT,
        messages=MESSAGES,
        max_completion_tokens=24,
        temperature=0,
        stream_options={"include_usage": True},
    )
    assert text == want["text"]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == want["finish"] and not any(finish[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == want["tokens"]
    assert all(c.usage is None for c in chunks[:-1])


async def test_the_next_turn_says_how_many_prompt_tokens_the_cache_served(
    served: Served,
) -> None:
    """OpenAI's `usage.prompt_tokens_details.cached_tokens`: the history of a chat is
    prefilled once; its next turn (chat, streamed or not) and the same completion
    prompt again report the tokens they reused."""
    client = served.client()
    first = await client.chat.completions.create(
        model=PLACEMENT, messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    turn2 = [
        *MESSAGES,
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And tomorrow?"},
    ]
    second = await client.chat.completions.create(
        model=PLACEMENT, messages=turn2, max_tokens=6, temperature=0
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    # Streamed: the usage chunk carries it too.
    turn3 = [*turn2, {"role": "assistant", "content": "x"}, {"role": "user", "content": "Why?"}]
    _, chunks = await stream_text(
        client,
        model=PLACEMENT,
        messages=turn3,
        max_tokens=4,
        temperature=0,
        stream_options={"include_usage": True},
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - 1
    # Completions: the same prompt again reuses all of it but its last token.
    prompt = "The cluster's prefix cache holds this sentence for the second request."
    texts = []
    for _ in range(2):
        done = await client.completions.create(
            model=PLACEMENT, prompt=prompt, max_tokens=4, temperature=0
        )
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        texts.append((done.choices[0].text, done.usage.prompt_tokens_details.cached_tokens))
    assert texts[1] == (texts[0][0], done.usage.prompt_tokens - 1)


async def test_stream_without_usage_ends_with_done(served: Served) -> None:
    body = {"model": PLACEMENT, "messages": MESSAGES, "max_tokens": 6, "stream": True}
    async with httpx.AsyncClient(base_url=served.server.url) as http:
        resp = await http.post("/chat/completions", json=body)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [e for e in resp.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert '"usage"' not in resp.text


async def test_sampling_parameters_are_honoured(served: Served) -> None:
    client = served.client()
    free = await direct(served.ctl, MESSAGES, max_tokens=40, temperature=0.0, ignore_eos=True)
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text[: text.index(stop)]
    for given in (stop, [stop, "\x00never"]):
        reply = await client.chat.completions.create(
            model=PLACEMENT,
            messages=MESSAGES,
            max_tokens=40,
            temperature=0,
            stop=given,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].message.content == cut
        assert reply.choices[0].finish_reason == "stop"

    async def sample(seed: int, top_p: float = 1.0) -> str:
        reply = await client.chat.completions.create(
            model=PLACEMENT,
            messages=MESSAGES,
            max_tokens=24,
            temperature=1.3,
            top_p=top_p,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and reply.usage.completion_tokens == 24
        return reply.choices[0].message.content or ""

    want = await direct(
        served.ctl, MESSAGES, max_tokens=24, temperature=1.3, top_p=0.5, seed=3, ignore_eos=True
    )
    assert await sample(3, 0.5) == want["text"]
    assert await sample(5) == await sample(5)
    assert await sample(5) != await sample(6)
    # A transcript with an assistant turn goes through the chat template as given.
    turns = [
        *MESSAGES,
        {"role": "assistant", "content": "Nothing."},
        {"role": "user", "content": "Sure?"},
    ]
    want = await direct(served.ctl, turns, max_tokens=8, temperature=0.0)
    reply = await client.chat.completions.create(
        model=PLACEMENT, messages=turns, max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content == want["text"]


async def test_eight_clients_at_once_get_their_answers_alone(served: Served) -> None:
    prompts = [f"request {i}: " + "tell the layers apart " * (1 + i % 3) for i in range(8)]

    # Made beforehand: building a client takes long enough to stagger the starts.
    clients = [served.client() for _ in range(8)]

    async def ask(i: int) -> str:
        reply = await clients[i].chat.completions.create(
            model=PLACEMENT,
            messages=[{"role": "user", "content": prompts[i]}],
            max_tokens=20,
            temperature=0.7,
            seed=i,
        )
        return reply.choices[0].message.content or ""

    try:
        alone = [await ask(i) for i in range(8)]
        served.server.stats.peak = 0
        start = time.perf_counter()
        together = await asyncio.gather(*(ask(i) for i in range(8)))
        took = time.perf_counter() - start
    finally:
        for client in clients:
            await client.close()
    assert together == alone
    # The demo model falls into one loop ("jhjh...") on some prompts at any seed (as
    # mlx-lm's sampler draws it), so not all eight differ; most must.
    assert len(set(alone)) >= 6, "different prompts and seeds should answer differently"
    # One generate() per request and no lock: all eight were in the pipeline together.
    assert served.server.stats.peak == 8, (
        f"peak in flight {served.server.stats.peak} ({took:.1f} s)"
    )


async def test_bench_hook_measures_both_sides(served: Served) -> None:
    result = await bench_api(served.ctl, PLACEMENT, clients=2, max_tokens=4, rounds=1)
    assert result["api_tps"] > 0 and result["direct_tps"] > 0
    assert result["api_overhead_ratio"] == result["api_tps"] / result["direct_tps"]


async def test_openai_parameters_map_onto_the_cluster() -> None:
    chat = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
            "top_p": 0,
            "seed": 7,
            "stop": "END",
            "max_tokens": 5,
            "max_completion_tokens": 7,
        }
    )
    assert chat.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},  # joined as mlx_lm.server joins them
        {"role": "assistant", "content": ""},
    ]
    # top_p 0 keeps only the likeliest token: greedy, as the runners read it.
    assert chat.params["top_p"] == 0.0
    greedy = SamplingParams.from_dict(chat.params)
    assert (greedy.temperature, greedy.top_p) == (0.0, 1.0)
    assert chat.params["seed"] == 7
    assert chat.params["stop"] == ["END"]
    assert chat.params["max_tokens"] == 7
    assert not chat.stream
    free = parse_chat_request({"messages": [{"role": "user", "content": "x"}]})
    assert free.model is None and free.params["temperature"] == 1.0
    assert free.params["seed"] != parse_chat_request({"messages": free.messages}).params["seed"]
    # Logits processors in mlx-lm's terms (mlx_lm.server's names); what changes no logit
    # is left out, and the shards read the rest as given.
    tuned = parse_chat_request(
        {
            "messages": free.messages,
            "logit_bias": {"5": -100, "7": 2.5},
            "presence_penalty": 0.5,
            "frequency_penalty": 0,
            "repetition_penalty": 1.1,
            "repetition_context_size": 64,
        }
    )
    processors = {k: v for k, v in tuned.params.items() if k not in free.params}
    assert processors == {
        "logit_bias": [[5, -100.0], [7, 2.5]],
        "presence_penalty": 0.5,
        "repetition_penalty": 1.1,
        "repetition_context_size": 64,
    }
    params = SamplingParams.from_dict(tuned.params)
    assert params.logit_bias == ((5, -100.0), (7, 2.5)) and params.window == 64
    neutral = {"messages": free.messages, "repetition_penalty": 1, "presence_penalty": 0}
    assert parse_chat_request(neutral).params.keys() == free.params.keys()
    # mlx_lm.server's sampler fields, as make_sampler takes them; what changes nothing
    # (top_k 0, min_p 0, no XTC) is left out, a top_k past any vocabulary is kept small
    # enough to travel. Other unknown fields are ignored, as they always were.
    sampled = parse_chat_request(
        {
            "messages": free.messages,
            "top_k": 40,
            "min_p": 0.05,
            "xtc_probability": 0.5,
            "xtc_threshold": 0.2,
            "typical_p": 0.5,
        }
    )
    samplers = {k: v for k, v in sampled.params.items() if k not in free.params}
    assert samplers == {"top_k": 40, "min_p": 0.05, "xtc_probability": 0.5, "xtc_threshold": 0.2}
    assert SamplingParams.from_dict(sampled.params).top_k == 40
    off = {"messages": free.messages, "top_k": 0, "min_p": 0, "xtc_threshold": 0.3}
    assert parse_chat_request(off).params.keys() == free.params.keys()
    huge = parse_chat_request({"messages": free.messages, "top_k": 10**30})
    assert huge.params["top_k"] == 2**31 - 1


# ---- errors --------------------------------------------------------------------------


async def raw_post(server: ApiServer, body: Any, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.url) as http:
        if isinstance(body, bytes):
            return await http.post("/chat/completions", content=body, **kw)
        return await http.post("/chat/completions", json=body, **kw)


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"\xff\xfe", None),
        ([1, 2], None),
        ({"model": PLACEMENT}, "messages"),
        ({"model": PLACEMENT, "messages": []}, "messages"),
        ({"model": PLACEMENT, "messages": "hi"}, "messages"),
        (
            {"model": PLACEMENT, "messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
        ),
        ({"model": PLACEMENT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": PLACEMENT, "messages": MESSAGES, "temperature": 11}, "temperature"),
        ({"model": PLACEMENT, "messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ({"model": PLACEMENT, "messages": MESSAGES, "top_p": 1.5}, "top_p"),
        ({"model": PLACEMENT, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"model": PLACEMENT, "messages": MESSAGES, "max_tokens": 2.5}, "max_tokens"),
        ({"model": PLACEMENT, "messages": MESSAGES, "seed": "x"}, "seed"),
        ({"model": PLACEMENT, "messages": MESSAGES, "stop": [1]}, "stop"),
        ({"model": PLACEMENT, "messages": MESSAGES, "stream": "yes"}, "stream"),
        ({"model": PLACEMENT, "messages": MESSAGES, "n": 2}, "n"),
        ({"model": 7, "messages": MESSAGES}, "model"),
        ({"model": PLACEMENT, "messages": MESSAGES, "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": PLACEMENT, "messages": MESSAGES, "frequency_penalty": -3}, "frequency_penalty"),
        ({"model": PLACEMENT, "messages": MESSAGES, "frequency_penalty": "x"}, "frequency_penalty"),
        ({"model": PLACEMENT, "messages": MESSAGES, "repetition_penalty": 0}, "repetition_penalty"),
        (
            {"model": PLACEMENT, "messages": MESSAGES, "repetition_penalty": -1.2},
            "repetition_penalty",
        ),
        (
            {"model": PLACEMENT, "messages": MESSAGES, "repetition_penalty": 1e-40},
            "repetition_penalty",
        ),
        (
            {"model": PLACEMENT, "messages": MESSAGES, "repetition_penalty": 11},
            "repetition_penalty",
        ),
        (
            {"model": PLACEMENT, "messages": MESSAGES, "repetition_context_size": 0},
            "repetition_context_size",
        ),
        ({"model": PLACEMENT, "messages": MESSAGES, "top_k": -1}, "top_k"),
        ({"model": PLACEMENT, "messages": MESSAGES, "top_k": 2.5}, "top_k"),
        ({"model": PLACEMENT, "messages": MESSAGES, "top_k": "40"}, "top_k"),
        ({"model": PLACEMENT, "messages": MESSAGES, "top_k": True}, "top_k"),
        ({"model": PLACEMENT, "messages": MESSAGES, "min_p": 1.5}, "min_p"),
        ({"model": PLACEMENT, "messages": MESSAGES, "min_p": -0.1}, "min_p"),
        ({"model": PLACEMENT, "messages": MESSAGES, "xtc_probability": 2}, "xtc_probability"),
        ({"model": PLACEMENT, "messages": MESSAGES, "xtc_threshold": 0.6}, "xtc_threshold"),
        (
            {"model": PLACEMENT, "messages": MESSAGES, "presence_context_size": 2049},
            "presence_context_size",
        ),
        ({"model": PLACEMENT, "messages": MESSAGES, "logit_bias": [5]}, "logit_bias"),
        ({"model": PLACEMENT, "messages": MESSAGES, "logit_bias": {"5": 101}}, "logit_bias"),
        ({"model": PLACEMENT, "messages": MESSAGES, "logit_bias": {"5": "x"}}, "logit_bias"),
        ({"model": PLACEMENT, "messages": MESSAGES, "logit_bias": {"-1": 1}}, "logit_bias"),
        ({"model": PLACEMENT, "messages": MESSAGES, "logit_bias": {"a": 1}}, "logit_bias"),
        (
            {
                "model": PLACEMENT,
                "messages": MESSAGES,
                "logit_bias": {str(i): 1 for i in range(301)},
            },
            "logit_bias",
        ),
    ],
)
async def test_bad_bodies_are_400(served: Served, body: Any, param: str | None) -> None:
    assert_openai_error(await raw_post(served.server, body), 400, param)


async def test_a_request_the_head_refuses_carries_its_code_to_a_400(served: Served) -> None:
    """Token ids past the model's vocabulary pass the API's checks (it knows no vocabulary)
    and are refused by the head shard, with code bad_request: the controller raises it
    with that code and the API answers 400, from the code, not from the words."""
    with pytest.raises(GenerationError) as caught:
        async for _ in served.ctl.generate(PLACEMENT, {"tokens": [10**6]}, {"max_tokens": 2}):
            pass
    assert (caught.value.code, caught.value.param) == ("bad_request", None)
    assert "prompt tokens must be integers" in str(caught.value)
    async with httpx.AsyncClient(base_url=served.server.url) as http:
        body = {"model": PLACEMENT, "prompt": [10**6], "max_tokens": 2}
        resp = await http.post("/completions", json=body)
    assert_openai_error(resp, 400, "prompt")
    assert "prompt tokens must be integers" in resp.json()["error"]["message"]


async def test_the_heads_refusal_names_the_field_it_blames_on_the_wire(served: Served) -> None:
    """A token past the vocabulary in logit_bias is refused by the head alone: its
    `failed` message names the field (param), the controller's error carries it and
    the API blames it, whatever the refusal's words."""
    with pytest.raises(GenerationError) as caught:
        params = {"max_tokens": 2, "logit_bias": [[10**6, 1.0]]}
        async for _ in served.ctl.generate(PLACEMENT, {"prompt": "hi"}, params):
            pass
    assert (caught.value.code, caught.value.param) == ("bad_request", "logit_bias")
    async with httpx.AsyncClient(base_url=served.server.url) as http:
        body = {"model": PLACEMENT, "prompt": "hi", "max_tokens": 2, "logit_bias": {"1000000": 1}}
        resp = await http.post("/completions", json=body)
    assert_openai_error(resp, 400, "logit_bias")


async def test_bad_request_through_the_client(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await served.client().chat.completions.create(
            model=PLACEMENT, messages=MESSAGES, temperature=11
        )
    assert caught.value.status_code == 400
    # The range the runners and the chat take (SAMPLING_LIMITS), wider than OpenAI's 0-2
    # as vLLM's and mlx_lm.server's are.
    assert "temperature must be a number from 0 to 10" in caught.value.message


async def test_what_asks_for_nothing_different_still_answers(served: Served) -> None:
    """Plain text, zero penalties, no bias: accepted as the defaults they are. (JSON
    mode and schemas are enforced: tests/integration/test_structured_api.py.)"""
    reply = await served.client().chat.completions.create(
        model=PLACEMENT,
        messages=MESSAGES,
        max_tokens=2,
        response_format={"type": "text"},
        frequency_penalty=0,
        presence_penalty=0.0,
        logit_bias={},
    )
    assert reply.choices[0].message.content


async def engine_tokens(ctl: Controller, **params: Any) -> tuple[list[int], str]:
    """The placement's tokens and text for MESSAGES, straight through the engine."""
    tokens: list[int] = []
    text = ""
    async for msg in ctl.generate(PLACEMENT, {"messages": MESSAGES}, params):
        if isinstance(msg, control.Delta):
            tokens += msg.tokens
            text += msg.text
    return tokens, text


async def test_penalties_and_logit_bias_are_honoured_as_mlx_lm_applies_them(
    served: Served,
) -> None:
    """Over the placement's two shards (real agents, ZeroMQ): greedy tokens with the
    penalties equal mlx-lm's `generate_step` with `make_logits_processors` on the same
    directory, and the official client, sending them, gets that answer."""
    assert len(served.ctl.state.placement(PLACEMENT).shards) == 2
    tokenizer = load_tokenizer(served.model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    loaded, _ = mlx_lm.load(str(served.model_dir))

    def mlx(n: int, **options: Any) -> list[int]:
        steps = generate_step(
            mx.array(prompt),
            loaded,
            max_tokens=n,
            prefill_step_size=16,
            logits_processors=make_logits_processors(**options),
        )
        return [int(tok) for tok, _ in steps]

    client = served.client()
    plain = mlx(16)
    options = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}
    want = mlx(16, **options)
    assert want != plain, "the penalties leave the demo's answer as it is: they test nothing"
    tokens, text = await engine_tokens(
        served.ctl, max_tokens=16, temperature=0.0, ignore_eos=True, **options
    )
    assert tokens == want
    reply = await client.chat.completions.create(
        model=PLACEMENT,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
    )
    assert reply.choices[0].message.content == text
    # Beside a request without processors, at once: each answers as alone.
    greedy = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    both = await asyncio.gather(
        engine_tokens(served.ctl, **greedy, **options), engine_tokens(served.ctl, **greedy)
    )
    assert [tokens for tokens, _ in both] == [want, plain]
    # logit_bias, as the client sends it (string keys): +100 forces a token, -100 bans one.
    forced = next(t for t in range(97, 123) if tokenizer.decode([t]) == chr(t))  # a letter
    reply = await client.chat.completions.create(
        model=PLACEMENT,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logit_bias={str(forced): 100},
    )
    assert plain[:5] != [forced] * 5
    assert reply.choices[0].message.content == tokenizer.decode([forced] * 5)
    banned = plain[0]
    want = mlx(16, logit_bias={banned: -100.0})
    assert banned not in want
    tokens, text = await engine_tokens(
        served.ctl, max_tokens=16, temperature=0.0, ignore_eos=True, logit_bias=[[banned, -100]]
    )
    assert tokens == want
    reply = await client.chat.completions.create(
        model=PLACEMENT,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        logit_bias={str(banned): -100},
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].message.content == text
    # An id past the vocabulary, which only the head shard knows: a 400 naming logit_bias.
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=PLACEMENT, messages=MESSAGES, max_tokens=2, logit_bias={"9999999": 5}
        )
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "logit_bias"
    assert "not in this model's vocabulary" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(
            model=PLACEMENT, prompt="Once", max_tokens=2, frequency_penalty=2.5
        )
    assert "frequency_penalty must be a number from -2 to 2" in caught.value.message


async def test_top_k_and_min_p_are_honoured_as_mlx_lm_samples(served: Served) -> None:
    """Over the placement's two shards: the official client sending mlx_lm.server's
    top_k and min_p (extra_body) gets mlx-lm's `generate_step` with the same
    `make_sampler` after `mx.random.seed(seed)`; top_k=1 is greedy; beside a request
    without them each answers as alone; bad values are a 400 naming the field."""
    tokenizer = load_tokenizer(served.model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    loaded, _ = mlx_lm.load(str(served.model_dir))

    def mlx(seed: int, **options: Any) -> list[int]:
        mx.random.seed(seed)
        steps = generate_step(
            mx.array(prompt),
            loaded,
            max_tokens=16,
            prefill_step_size=16,
            sampler=make_sampler(**options),
        )
        return [int(tok) for tok, _ in steps]

    client = served.client()
    want = mlx(4, temp=1.5, top_k=3, min_p=0.1)
    assert want != mlx(4, temp=1.5), "top_k and min_p change nothing here: they test nothing"
    sampled = {"max_tokens": 16, "temperature": 1.5, "seed": 4, "ignore_eos": True}
    tokens, text = await engine_tokens(served.ctl, **sampled, top_k=3, min_p=0.1)
    assert tokens == want
    reply = await client.chat.completions.create(
        model=PLACEMENT,
        messages=MESSAGES,
        max_tokens=16,
        temperature=1.5,
        seed=4,
        extra_body={"ignore_eos": True, "top_k": 3, "min_p": 0.1},
    )
    assert reply.choices[0].message.content == text
    greedy = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    plain, plain_text = await engine_tokens(served.ctl, **greedy)
    reply = await client.chat.completions.create(
        model=PLACEMENT,
        messages=MESSAGES,
        max_tokens=16,
        temperature=1.5,
        seed=4,
        extra_body={"ignore_eos": True, "top_k": 1},
    )
    assert reply.choices[0].message.content == plain_text
    assert plain != mlx(4, temp=1.5)
    both = await asyncio.gather(
        engine_tokens(served.ctl, **sampled, top_k=3, min_p=0.1),
        engine_tokens(served.ctl, **greedy),
    )
    assert [tokens for tokens, _ in both] == [want, plain]
    for extra, words in (
        ({"top_k": -1}, "top_k must be an integer from 0 to"),
        ({"min_p": 2}, "min_p must be a number from 0 to 1"),
        ({"xtc_threshold": 0.9}, "xtc_threshold must be a number from 0 to 0.5"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty must be a number from 0.01 to 10"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=PLACEMENT, messages=MESSAGES, max_tokens=2, extra_body=extra
            )
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == next(
            iter(extra)
        )
        assert words in caught.value.message


async def test_each_new_top_p_and_temperature_answers_as_mlx_lm(served: Served) -> None:
    """Clients vary temperature and top_p freely: through the official client, four
    requests with values of their own (sent at once, so they share the tail's batch)
    each answer as mlx-lm's `generate_step` with `make_sampler` after
    `mx.random.seed(seed)`. The values enter the tail's compiled sampler as arrays
    (tests/unit/test_sampler_chain.py counts its traces), so none waits for new kernels."""
    tokenizer = load_tokenizer(served.model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    loaded, _ = mlx_lm.load(str(served.model_dir))
    values = [(1.31, 0.95), (1.57, 0.9), (1.83, 0.97), (1.97, 0.86)]

    def mlx(temp: float, top_p: float) -> str:
        mx.random.seed(1)
        sampler = make_sampler(temp, top_p=top_p)
        steps = generate_step(
            mx.array(prompt), loaded, max_tokens=12, prefill_step_size=16, sampler=sampler
        )
        return str(tokenizer.decode([int(tok) for tok, _ in steps]))

    want = [mlx(temp, top_p) for temp, top_p in values]
    # The demo model loops on a few syllables: at this seed they still tell values apart.
    assert len(set(want)) > 1 and want[0] != mlx(values[0][0], 1.0), "values change nothing"
    client = served.client()
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(
                model=PLACEMENT,
                messages=MESSAGES,
                max_tokens=12,
                temperature=temp,
                top_p=top_p,
                seed=1,
                extra_body={"ignore_eos": True},
            )
            for temp, top_p in values
        )
    )
    assert [r.choices[0].message.content for r in replies] == want


async def test_a_base_url_without_v1_is_told_where_the_api_is(served: Served) -> None:
    """The commonest client mistake: base_url without /v1. aiohttp's bare "Not Found"
    did not say what is served."""
    root = served.server.url.removesuffix("/v1")
    client = openai.AsyncOpenAI(base_url=root, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model=PLACEMENT, messages=MESSAGES, max_tokens=2)
    message = caught.value.message
    assert "/chat/completions" in message and "base_url ending in /v1" in message, message
    assert "POST /v1/chat/completions" in message
    async with httpx.AsyncClient(base_url=served.server.url) as http:
        wrong = await http.get("/chat/completions")
        assert_openai_error(wrong, 405)
        assert "use POST" in wrong.json()["error"]["message"]
        other = await http.post("/embeddings", json={"model": PLACEMENT, "input": "x"})
        assert_openai_error(other, 404)
        assert "GET /v1/models" in other.json()["error"]["message"]


async def test_api_key_is_required_when_given(served: Served) -> None:
    def keyed(key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=served.keyed.url, api_key=key, max_retries=0)

    with pytest.raises(openai.AuthenticationError):
        await keyed("sk-wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        await keyed("sk-wrong").chat.completions.create(
            model=PLACEMENT, messages=MESSAGES, max_tokens=2
        )
    async with httpx.AsyncClient(base_url=served.keyed.url) as http:
        missing = await http.get("/models")
    assert_openai_error(missing, 401)
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert [m.id for m in (await keyed(KEY).models.list()).data] == [PLACEMENT]
    reply = await keyed(KEY).chat.completions.create(
        model=PLACEMENT, messages=MESSAGES, max_tokens=2
    )
    assert reply.usage is not None and reply.usage.completion_tokens >= 1


async def test_unknown_model_is_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await served.client().chat.completions.create(
            model="gpt-17", messages=MESSAGES, max_tokens=2
        )
    assert caught.value.status_code == 404
    assert "gpt-17" in caught.value.message and PLACEMENT in caught.value.message
    with pytest.raises(openai.NotFoundError):
        await served.client().models.retrieve("gpt-17")
    async with httpx.AsyncClient(base_url=served.server.url) as http:
        assert_openai_error(await http.get("/no/such/route"), 404)
        assert_openai_error(await http.get("/chat/completions"), 405)


async def test_placement_not_ready_or_unloaded_is_503(
    served: Served, api_cluster: LocalCluster
) -> None:
    ctl, client = served.ctl, served.client()
    node = api_cluster.inventory.names[0]
    # A shard prepared but never loaded: the placement exists and is not ready.
    await ctl.peer(node).request("prepare_shard", placement="half")
    await ctl.refresh()
    assert ctl.state.placement("half").state != "ready"
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="half", messages=MESSAGES, max_tokens=2)
        assert caught.value.status_code == 503 and "not ready" in caught.value.message
    finally:
        await ctl.unload("half")
    # A placement that was served and then unloaded: down, not unknown.
    await ctl.place(served.model_dir, [node], "brief", prefill_chunk=16)
    assert await client.chat.completions.create(model="brief", messages=MESSAGES, max_tokens=2)
    await ctl.unload("brief")
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(model="brief", messages=MESSAGES, max_tokens=2)
    assert caught.value.status_code == 503
    assert "no longer loaded" in caught.value.message
    assert [m.id for m in (await client.models.list()).data] == [PLACEMENT]


async def test_web_pages_cannot_drive_the_cluster(served: Served) -> None:
    body = {"model": PLACEMENT, "messages": MESSAGES, "max_tokens": 2}
    evil = await raw_post(served.server, body, headers={"Origin": "http://evil.example"})
    assert_openai_error(evil, 403)
    rebound = await raw_post(served.server, body, headers={"Host": "evil.example"})
    assert_openai_error(rebound, 403)
    assert (await raw_post(served.server, body)).status_code == 200


# ---- cancel --------------------------------------------------------------------------


async def test_disconnect_mid_stream_frees_every_shard(served: Served) -> None:
    ctl = served.ctl
    stream = await served.client().chat.completions.create(
        model=PLACEMENT,
        messages=MESSAGES,
        max_tokens=100_000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = 0
    held: list[int] = []
    deadline = time.monotonic() + 10
    # Read until every shard's stats (sent once a second) show the request's KV cache.
    async for _ in stream:
        chunks += 1
        if chunks % 20 == 0:
            await ctl.refresh()
            held = [s.in_flight for s in ctl.state.placement(PLACEMENT).shards]
            if all(held) or time.monotonic() > deadline:
                break
    assert all(held), f"the shards never showed the request in flight: {held}"
    await stream.close()
    counts = await wait_caches_freed(ctl)
    assert counts == [0, 0], f"KV caches still held after the client left: {counts}"
    assert served.server.stats.total == 0


async def test_client_giving_up_on_a_completion_frees_every_shard(served: Served) -> None:
    ctl = served.ctl
    client = served.client(timeout=2.5)
    ask = asyncio.ensure_future(
        client.chat.completions.create(
            model=PLACEMENT,
            messages=MESSAGES,
            max_tokens=100_000,
            extra_body={"ignore_eos": True},
        )
    )
    held: list[int] = []
    while not ask.done() and not all(held):
        await asyncio.sleep(0.25)
        await ctl.refresh()
        held = [s.in_flight for s in ctl.state.placement(PLACEMENT).shards]
    with pytest.raises(openai.APITimeoutError):
        await ask
    assert all(held), f"the shards never showed the request in flight: {held}"
    counts = await wait_caches_freed(ctl)
    assert counts == [0, 0], f"KV caches still held after the client left: {counts}"


async def wait_caches_freed(ctl: Controller, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        await ctl.refresh()
        counts = [s.in_flight for s in ctl.state.placement(PLACEMENT).shards]
        if not any(counts) or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.25)


# ---- failures the real cluster cannot be made to produce on cue -----------------------


class FailingController:
    """Just enough of a Controller, whose generate() fails the way a cluster does."""

    def __init__(self, fail_after: int, message: str, code: ErrorCode = "failed") -> None:
        shard = ShardState("flaky", "n1", 0, 1, 0, 4, "ready", model_dir="/m/flaky")
        self.state = ClusterState(
            nodes=(node := NodeState("n1", "127.0.0.1", 1, "local", state="up", shards=(shard,)),),
            placements=placements_from_shards((node,)),
        )
        self.fail_after = fail_after
        self.message = message
        self.code: ErrorCode = code
        self.closed = False

    def subscribe(self, listener: Any) -> None:
        pass

    async def generate(
        self, placement: str, request: dict[str, Any], params: dict[str, Any]
    ) -> AsyncIterator[control.Answer]:
        try:
            if self.fail_after < 0:
                raise GenerationError(self.message, self.code)
            yield control.Accepted(rid="r", prompt_tokens=3)
            for _ in range(self.fail_after):
                yield control.Delta(rid="r", text="ok ", tokens=[1])
            raise GenerationError(self.message, self.code)
        finally:
            self.closed = True


async def serve_fake(fake: FailingController) -> tuple[Any, str]:
    from aiohttp import web

    runner = web.AppRunner(build_app(fake, None))  # type: ignore[arg-type]
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/v1"


@pytest.mark.parametrize(
    ("fail_after", "message", "code", "status"),
    [
        (-1, "cannot apply the chat template: roles must alternate", "bad_request", 400),
        # The same refusal reworded: the same status, from its code.
        (-1, "the chat template wants roles to alternate", "bad_request", 400),
        # Words that once meant a refusal, with a cluster's code: the cluster's status.
        (-1, "tools must be a list, given with messages", "failed", 503),
        (-1, "busy: every stream of 'flaky' is taken", "busy", 429),
        (-1, "every stream of 'flaky' is taken, reworded", "busy", 429),
        (-1, "node n2 of placement 'flaky' is down", "failed", 503),
        (2, "placement 'flaky' sent nothing for 30 s", "failed", 503),
    ],
)
async def test_cluster_failures_map_to_statuses(
    fail_after: int, message: str, code: ErrorCode, status: int
) -> None:
    fake = FailingController(fail_after, message, code)
    runner, url = await serve_fake(fake)
    try:
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="flaky", messages=MESSAGES)
        assert caught.value.status_code == status
        assert message in caught.value.message
        if fail_after >= 0:
            # Mid-stream the status is already 200: the failure comes as an error event.
            with pytest.raises(openai.APIError, match="sent nothing"):
                await stream_text(client, model="flaky", messages=MESSAGES)
        assert fake.closed
    finally:
        await runner.cleanup()
