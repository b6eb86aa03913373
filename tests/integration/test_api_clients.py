"""Anthropic's Messages API, OpenAI's Responses API and Ollama's API, driven by their
real clients (`anthropic`, `openai`'s `client.responses`, `ollama`) against a real
cluster, each answering what the chat completions path answers for the same
conversation: the same template, the same tokens.

One real agent on 127.0.0.171:59300 holds two placements: a noise demo model
(greedy answers to compare) and the tool-calling demo (tests/tool_model.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import mlx.core as mx
import ollama
import openai
import pytest
import pytest_asyncio
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.server import process_message_content

from studiotui.api.server import ApiServer, start_server
from studiotui.cluster.controller import Controller
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from tests.support.tool_model import CALL, CONTENT, write_tool_model
from worker.shared.demo_model import DemoSpec, write_demo_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32")
SYSTEM = "You answer briefly."
ASK = "What runs on the cluster tonight?"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "forecast",
            "description": "The weather for the next days",
            "parameters": {
                "type": "object",
                "properties": {"days": {"type": "integer"}},
                "required": ["days"],
            },
        },
    }
]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
# The anthropic SDK sends no sampling fields of its own any more; the API takes them.
GREEDY = {"temperature": 0}
N = 12  # tokens per answer: enough to tell answers apart, cheap on a loaded machine


@dataclass
class Served:
    ctl: Controller
    server: ApiServer
    keyed: ApiServer
    key_file: Path
    models: dict[str, Path]

    @property
    def base(self) -> str:
        return self.server.url.removesuffix("/v1")

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.server.url, api_key="unused", max_retries=0, timeout=60.0
        )

    def anthropic(self, key: str = "unused", base: str | None = None) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(
            base_url=base or self.base, api_key=key, max_retries=0, timeout=60.0
        )

    def ollama(self) -> ollama.AsyncClient:
        return ollama.AsyncClient(host=self.base, timeout=60.0)


@pytest.fixture(scope="module")
def clients_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("clients-home"), 1, 171, 59300)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clients-models")
    return {
        "demo": write_demo_model(root / "demo", SPEC),
        "caller": write_tool_model(root / "caller", SPEC),
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(
    clients_cluster: LocalCluster, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    ctl = clients_cluster.controller()
    (node,) = clients_cluster.inventory.names
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# name key\nalice sk-alice\nbob sk-bob\n")
    servers: list[ApiServer] = []
    try:
        await ctl.start(telemetry=False)
        await ctl.place(models["demo"], [node], "demo", prefill_chunk=64)
        await ctl.place(models["caller"], [node], "caller", prefill_chunk=64)
        servers.append(await start_server(ctl, "127.0.0.1", 0))
        servers.append(await start_server(ctl, "127.0.0.1", 0, key_file=key_file))
        yield Served(ctl, servers[0], servers[1], key_file, models)
    finally:
        for server in servers:
            await server.close()
        await ctl.close()


async def chat_answer(served: Served, messages: list[dict[str, Any]], **kw: Any) -> str:
    reply = await served.openai().chat.completions.create(
        model="demo", messages=messages, max_tokens=N, temperature=0, **kw
    )
    return reply.choices[0].message.content or ""


CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": ASK},
]


# ---- the same answer through every API -----------------------------------------------


async def test_every_api_answers_the_chat_completions_greedy_answer(served: Served) -> None:
    want = await chat_answer(served, CONVERSATION)
    assert want
    claude = served.anthropic()
    message = await claude.messages.create(
        model="demo",
        system=SYSTEM,
        messages=[{"role": "user", "content": ASK}],
        max_tokens=N,
        extra_body=GREEDY,
    )
    assert message.content[0].type == "text" and message.content[0].text == want
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == N
    # The system as blocks, the question as blocks: the same conversation.
    async with claude.messages.stream(
        model="demo",
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}],
        max_tokens=N,
        extra_body=GREEDY,
    ) as stream:
        streamed = await stream.get_final_message()
    assert streamed.content[0].type == "text" and streamed.content[0].text == want

    def prompt(usage: Any) -> int:  # Anthropic counts the cache's tokens apart
        return int(usage.input_tokens) + int(usage.cache_read_input_tokens or 0)

    assert prompt(streamed.usage) == prompt(message.usage) > 0

    responses = served.openai().responses
    response = await responses.create(
        model="demo", instructions=SYSTEM, input=ASK, max_output_tokens=N, temperature=0
    )
    assert response.output_text == want and response.status == "incomplete"
    events = [
        e
        async for e in await responses.create(
            model="demo",
            instructions=SYSTEM,
            input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
            max_output_tokens=N,
            temperature=0,
            stream=True,
        )
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"

    local = served.ollama()
    options = {"temperature": 0, "num_predict": N}
    chat = await local.chat(model="demo", messages=CONVERSATION, options=options, stream=False)
    assert chat.message.content == want and chat.done and chat.eval_count == N
    parts = [
        part.message.content
        async for part in await local.chat(
            model="demo:latest", messages=CONVERSATION, options=options, stream=True
        )
    ]
    assert "".join(parts) == want
    generated = await local.generate(model="demo", system=SYSTEM, prompt=ASK, options=options)
    assert generated.response == want


async def test_text_parts_join_as_mlx_lm_server_joins_them(served: Served) -> None:
    """Issue 30 #14: parts side by side, as mlx_lm.server renders them: the greedy
    answer is mlx-lm's own for the prompt mlx_lm.server builds."""
    parts = [{"type": "text", "text": "What runs"}, {"type": "text", "text": " tonight?"}]
    messages = [{"role": "user", "content": parts}]
    got = await chat_answer(served, messages)
    rendered = [{"role": "user", "content": list(parts)}]
    process_message_content(rendered)
    assert rendered[0]["content"] == "What runs tonight?"
    model, tokenizer = load(str(served.models["demo"]))
    prompt = tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
    greedy = generate_step(mx.array(prompt), model, sampler=lambda x: mx.argmax(x, axis=-1))
    tokens = [int(t) for (t, _), _ in zip(greedy, range(N), strict=False)]
    assert got == tokenizer.decode(tokens)
    # The same parts through the other APIs give that answer too.
    message = await served.anthropic().messages.create(
        model="demo",
        messages=[{"role": "user", "content": [{**p} for p in parts]}],
        max_tokens=N,
        extra_body=GREEDY,
    )
    assert message.content[0].type == "text" and message.content[0].text == got


# ---- Anthropic's Messages API --------------------------------------------------------


async def test_anthropic_tools_round_trip(served: Served) -> None:
    claude = served.anthropic()
    ask = [{"role": "user", "content": "Will it rain this week?"}]
    first = await claude.messages.create(
        model="caller", messages=ask, tools=ANTHROPIC_TOOLS, max_tokens=64, extra_body=GREEDY
    )
    assert first.stop_reason == "tool_use"
    text, call = first.content
    assert text.type == "text" and text.text == CONTENT
    assert call.type == "tool_use" and call.name == CALL["name"] and call.input == CALL["arguments"]
    assert call.id
    # Streaming: the call's input arrives as input_json_delta, the SDK puts it together.
    async with claude.messages.stream(
        model="caller", messages=ask, tools=ANTHROPIC_TOOLS, max_tokens=64, extra_body=GREEDY
    ) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json" in kinds
    tool_use = streamed.content[-1]
    assert tool_use.type == "tool_use" and tool_use.input == CALL["arguments"]
    assert streamed.stop_reason == "tool_use"
    # The result goes back as a tool_result block; the prompt the model then reads is
    # the one the chat completions path renders for the same turns.
    then = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny."}],
        },
    ]
    counted = await claude.messages.count_tokens(model="demo", messages=then, tools=ANTHROPIC_TOOLS)
    reply = await claude.messages.create(
        model="demo", messages=then, tools=ANTHROPIC_TOOLS, max_tokens=N, extra_body=GREEDY
    )
    # Anthropic counts the prompt tokens the cache served apart from input_tokens.
    read = reply.usage.cache_read_input_tokens or 0
    assert reply.usage.input_tokens + read == counted.input_tokens
    openai_turns = [
        *ask,
        {
            "role": "assistant",
            "content": CONTENT,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny."},
    ]
    want = await served.openai().chat.completions.create(
        model="demo", messages=openai_turns, tools=TOOLS, max_tokens=N, temperature=0
    )
    assert reply.content and reply.content[0].type == "text"
    assert reply.content[0].text == want.choices[0].message.content
    assert want.usage is not None and want.usage.prompt_tokens == counted.input_tokens


async def test_anthropic_stop_sequence_and_claude_code_fields(served: Served) -> None:
    claude = served.anthropic()
    ask = [{"role": "user", "content": ASK}]
    full = await claude.messages.create(model="demo", messages=ask, max_tokens=N, extra_body=GREEDY)
    text = full.content[0].text  # type: ignore[union-attr]
    stop = text[3:6]
    cut = await claude.messages.create(
        model="demo",
        messages=ask,
        max_tokens=N,
        stop_sequences=[stop],
        metadata={"user_id": "someone"},
        # What Claude Code sends beside the rest: accepted, changing nothing here.
        extra_body={
            **GREEDY,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "context_management": {"edits": []},
            "output_config": {"effort": "low"},
        },
        extra_query={"beta": "true"},
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    # Claude Code asks for a Claude model unless told otherwise: with two models
    # served, the answer says how to name one (with one, it answers: test_claude_code).
    with pytest.raises(anthropic.NotFoundError) as which:
        await claude.messages.create(model="claude-sonnet-4-5", messages=ask, max_tokens=2)
    assert "ANTHROPIC_MODEL" in str(which.value) and "caller, demo" in str(which.value)


async def test_anthropic_errors_in_anthropic_shape(served: Served) -> None:
    claude = served.anthropic()
    with pytest.raises(anthropic.NotFoundError) as missing:
        await claude.messages.create(
            model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    assert missing.value.body["type"] == "error"  # type: ignore[index]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as image:
        await claude.messages.create(
            model="demo",
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA"},
                        }
                    ],
                }
            ],
        )
    assert "reads text only" in str(image.value)
    # Either header carries the key; a revoked or wrong key is Anthropic's 401.
    keyed = served.keyed.url.removesuffix("/v1")
    ok = await served.anthropic("sk-alice", keyed).messages.create(
        model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert ok.usage.output_tokens >= 1
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        await served.anthropic("sk-eve", keyed).messages.create(
            model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    assert wrong.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


# ---- OpenAI's Responses API ----------------------------------------------------------


async def test_responses_function_call_round_trip(served: Served) -> None:
    responses = served.openai().responses
    ask = "Will it rain this week?"
    first = await responses.create(
        model="caller", input=ask, tools=RESPONSES_TOOLS, temperature=0, store=False
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.output_text == CONTENT and len(calls) == 1
    call = calls[0]
    assert call.name == CALL["name"] and json.loads(call.arguments) == CALL["arguments"]
    events = [
        e
        async for e in await responses.create(
            model="caller",
            input=ask,
            tools=RESPONSES_TOOLS,
            temperature=0,
            stream=True,
            extra_body={"prompt_cache_key": "session-1"},
        )
    ]
    assert events[-1].type == "response.completed"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [CALL["arguments"]]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # The output goes back as a function_call_output item: the same turns as chat's.
    then = [
        {"role": "user", "content": ask},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."},
    ]
    reply = await responses.create(
        model="demo", input=then, tools=RESPONSES_TOOLS, max_output_tokens=N, temperature=0
    )
    want = await served.openai().chat.completions.create(
        model="demo",
        messages=[
            {"role": "user", "content": ask},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny."},
        ],
        tools=TOOLS,
        max_tokens=N,
        temperature=0,
    )
    assert reply.output_text == want.choices[0].message.content
    assert reply.usage is not None and want.usage is not None
    assert reply.usage.input_tokens == want.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as stateful:
        await responses.create(model="demo", input="x", previous_response_id="resp_1")
    assert "stores no responses" in str(stateful.value)


# ---- Ollama's API --------------------------------------------------------------------


async def test_ollama_client_lists_shows_and_chats_with_tools(served: Served) -> None:
    local = served.ollama()
    names = sorted(m.model or "" for m in (await local.list()).models)
    assert names == ["caller", "demo"]
    running = (await local.ps()).models
    assert sorted(m.model or "" for m in running) == ["caller", "demo"]
    shown = await local.show("demo")
    assert shown.modelinfo is not None and shown.modelinfo["context_length"] > 0
    context = shown.modelinfo["context_length"]
    version = (await httpx.AsyncClient().get(f"{served.base}/api/version")).json()
    assert version["version"]
    reply = await local.chat(
        model="caller",
        messages=[{"role": "user", "content": "Will it rain this week?"}],
        tools=TOOLS,
        options={"temperature": 0},
    )
    calls = reply.message.tool_calls or []
    assert reply.message.content == CONTENT
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        (CALL["name"], CALL["arguments"])
    ]
    with pytest.raises(ollama.ResponseError) as too_big:
        await local.chat(
            model="demo",
            messages=[{"role": "user", "content": "x"}],
            options={"num_ctx": context + 1},
        )
    assert too_big.value.status_code == 400 and "larger --context" in too_big.value.error
    with pytest.raises(ollama.ResponseError) as missing:
        await local.chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.status_code == 404
    # seed and top_k travel: the same seed samples the same answer.
    options = {"temperature": 1.0, "top_k": 5, "seed": 7, "num_predict": N}
    a = await local.generate(model="demo", prompt=ASK, options=options)
    b = await local.generate(model="demo", prompt=ASK, options=options)
    assert a.response == b.response and a.eval_count == N


# ---- OpenAI details, health and keys -------------------------------------------------


async def test_openai_details_clients_rely_on(served: Served) -> None:
    client = served.openai()
    with pytest.raises(openai.BadRequestError) as image:
        await client.chat.completions.create(
            model="demo",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                }
            ],
        )
    assert "reads text only" in str(image.value)
    with pytest.raises(openai.BadRequestError) as stops:
        await client.chat.completions.create(
            model="demo", messages=CONVERSATION, stop=["a", "b", "c", "d", "e"]
        )
    assert "at most 4" in str(stops.value)
    with pytest.raises(openai.BadRequestError) as several:
        await client.chat.completions.create(model="demo", messages=CONVERSATION, n=2)
    assert "only n=1" in str(several.value)
    async with httpx.AsyncClient() as http:
        health = await http.get(f"{served.keyed.url.removesuffix('/v1')}/health")
    assert health.status_code == 200 and sorted(health.json()["models"]) == ["caller", "demo"]


async def test_key_file_names_each_key_and_revokes_without_restart(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    def keyed(key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=served.keyed.url, api_key=key, max_retries=0)

    caplog.set_level(logging.INFO, logger="studiotui.api.server")
    for key in ("sk-alice", "sk-bob"):
        await keyed(key).chat.completions.create(model="demo", messages=CONVERSATION, max_tokens=1)
    logged = [r.getMessage() for r in caplog.records if "/v1/chat/completions" in r.getMessage()]
    assert any(" by alice " in line for line in logged)
    assert any(" by bob " in line for line in logged)
    await keyed("sk-bob").models.list()
    assert any("GET /v1/models by bob: 200" in r.getMessage() for r in caplog.records)
    served.key_file.write_text("alice sk-alice\n")  # bob's key is revoked
    with pytest.raises(openai.AuthenticationError):
        await keyed("sk-bob").models.list()
    assert (await keyed("sk-alice").models.list()).data
    served.key_file.write_text("alice sk-alice\ncarol sk-carol\n")
    assert (await keyed("sk-carol").models.list()).data
