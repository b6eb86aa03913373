"""Structured output through the API: `response_format` with the real `openai` SDK against
a two-shard ring of real agents, a random-weight demo model sampling at temperature 1.
Every answer parses and validates against its schema (`jsonschema`), streamed or not,
on /v1/chat/completions and /v1/completions, and through the SDK's own
`chat.completions.parse` with a Pydantic model; a schema the grammar library cannot
compile is a 400 naming the part, decided before the cluster hears of the request.

Two real agents on 127.0.0.246-247:59620. The engine's side (batches, mlx-lm's tokens):
tests/integration/test_structured.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
import ollama
import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel, Field

from studiotui.api.server import ApiServer, start_server
from studiotui.cluster.controller import Controller
from tests.integration.test_structured import SCHEMAS
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

PLACEMENT = "json"
SEEDS = range(6)
MOST = 400  # every schema here closes long before
ASK = [{"role": "user", "content": "Describe an order as JSON."}]


@dataclass
class Served:
    ctl: Controller
    server: ApiServer

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.server.url, api_key="unused", max_retries=0, timeout=120.0
        )


@pytest.fixture(scope="module")
def json_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("structured-home"), 2, 246, 59620)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(
    json_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    model = write_demo_model(
        tmp_path_factory.mktemp("structured-models") / "demo",
        DemoSpec(layers=4, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=3),
    )
    ctl = json_cluster.controller()
    server = None
    try:
        await ctl.start(telemetry=False)
        await ctl.place(
            model,
            list(json_cluster.inventory.names),
            PLACEMENT,
            prefill_chunk=16,
            context_tokens=1024,
            streams=8,
        )
        server = await start_server(ctl, "127.0.0.1", 0)
        yield Served(ctl, server)
    finally:
        if server is not None:
            await server.close()
        await ctl.close()


def json_schema(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    words = "".join(c if c.isalnum() else "_" for c in name)
    return {"type": "json_schema", "json_schema": {"name": words, "schema": schema, "strict": True}}


async def chat(client: openai.AsyncOpenAI, fmt: dict[str, Any], seed: int, stream: bool) -> Any:
    """(text, finish_reason) of one chat answer, streamed or not."""
    kw: dict[str, Any] = {
        "model": PLACEMENT,
        "messages": ASK,
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": MOST,
        "response_format": fmt,
    }
    if not stream:
        reply = await client.chat.completions.create(**kw)
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    chunks = [c async for c in await client.chat.completions.create(stream=True, **kw)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)


async def test_every_answer_validates_against_its_schema(served: Served) -> None:
    client = served.client()
    asks = [(name, seed) for name in SCHEMAS for seed in SEEDS]
    room = asyncio.Semaphore(8)  # the placement's streams: they are decoded together

    async def one(name: str, seed: int) -> Any:
        async with room:
            return await chat(client, json_schema(name, SCHEMAS[name]), seed, seed % 2 == 1)

    answers = await asyncio.gather(*(one(name, seed) for name, seed in asks))
    for (name, seed), (text, finish) in zip(asks, answers, strict=True):
        assert finish == "stop", (name, seed, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    for name in SCHEMAS:
        mine = {text for (n, _), (text, _) in zip(asks, answers, strict=True) if n == name}
        assert len(mine) > len(SEEDS) // 2, f"{name}: the seeds hardly differ"


async def test_completions_take_response_format_too(served: Served) -> None:
    client = served.client()
    schema = SCHEMAS["enums, numbers and booleans"]
    for seed in SEEDS:
        reply = await client.completions.create(
            model=PLACEMENT,
            prompt="The order, as JSON:",
            max_tokens=MOST,
            temperature=1.0,
            seed=seed,
            extra_body={"response_format": json_schema("order", schema)},
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].text), schema)


class Address(BaseModel):
    city: Literal["Oslo", "Lima", "Pune"]
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    address: Address
    tags: list[Literal["a", "b"]] = Field(min_length=1, max_length=3)


async def test_the_sdks_parse_with_a_pydantic_model(served: Served) -> None:
    """The SDK writes the model's strict schema ($defs and $ref for the nested model)
    and parses the answer back into it."""
    client = served.client()
    for seed in SEEDS:
        reply = await client.chat.completions.parse(
            model=PLACEMENT,
            messages=ASK,
            temperature=1.0,
            seed=seed,
            max_tokens=MOST,
            response_format=Person,
        )
        person = reply.choices[0].message.parsed
        assert isinstance(person, Person), reply.choices[0].message.content
        assert 1 <= len(person.tags) <= 3


async def test_json_mode_answers_an_object(served: Served) -> None:
    """JSON mode: any object. A random model's free keys may run past max_tokens (its
    closing quote is one token in ~250): then the answer is cut ("length"), as without a
    format; every answer that ends is an object."""
    client = served.client()
    answers = await asyncio.gather(
        *(chat(client, {"type": "json_object"}, seed, stream=False) for seed in range(8))
    )
    ended = [text for text, finish in answers if finish == "stop"]
    assert ended, answers
    for text in ended:
        assert isinstance(json.loads(text), dict)
    for text, finish in answers:
        assert text.lstrip().startswith("{") and finish in ("stop", "length")


async def test_running_out_of_max_tokens_ends_with_length(served: Served) -> None:
    reply = await served.client().chat.completions.create(
        model=PLACEMENT,
        messages=ASK,
        temperature=1.0,
        seed=1,
        max_tokens=5,
        response_format=json_schema("person", SCHEMAS["nested objects"]),
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content and choice.message.content.lstrip().startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


@pytest.mark.parametrize(
    ("fmt", "param", "words"),
    [
        (
            json_schema("bad", {"type": "object", "properties": {"when": {"type": "date"}}}),
            "response_format.json_schema.schema.properties.when",
            "Invalid type: date",
        ),
        (
            json_schema("bad", {"type": "array", "items": {"type": "string", "pattern": "[a-"}}),
            "response_format.json_schema.schema.items",
            "regex parse error",
        ),
        (
            json_schema("bad", {"type": "array", "uniqueItems": True}),
            "response_format.json_schema.schema",
            "Unimplemented keys",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
            "response_format.json_schema.name",
            "1-64 letters",
        ),
        ({"type": "yaml"}, "response_format.type", "text, json_object or json_schema"),
    ],
)
async def test_a_format_that_cannot_be_enforced_is_a_400_naming_the_part(
    served: Served, fmt: dict[str, Any], param: str, words: str
) -> None:
    stats = served.server.stats
    before = stats.served
    with pytest.raises(openai.BadRequestError) as caught:
        await served.client().chat.completions.create(
            model=PLACEMENT,
            messages=ASK,
            max_tokens=4,
            response_format=fmt,  # type: ignore[arg-type]
        )
    assert caught.value.status_code == 400
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param
    assert words in caught.value.message
    assert stats.served == before  # refused in the API: the cluster never saw it


async def test_responses_text_format_and_ollamas_format_are_enforced_too(served: Served) -> None:
    """The same grammar behind the Responses API's `text.format` (the `openai` SDK's
    `client.responses`) and Ollama's `format` (the `ollama` client): a schema, and
    Ollama's "json"."""
    schema = next(iter(SCHEMAS.values()))
    client = served.client()
    for seed in range(3):
        reply = await client.responses.create(
            model=PLACEMENT,
            input="Describe an order as JSON.",
            temperature=1.0,
            max_output_tokens=MOST,
            text={"format": {"type": "json_schema", "name": "order", "schema": schema}},
            extra_body={"seed": seed},
        )
        assert reply.status == "completed", reply
        jsonschema.validate(json.loads(reply.output_text), schema)

    local = ollama.AsyncClient(host=served.server.url.removesuffix("/v1"), timeout=120.0)
    for seed in range(3):
        got = await local.chat(
            model=PLACEMENT,
            messages=ASK,
            format=schema,
            options={"seed": seed, "temperature": 1.0, "num_predict": MOST},
        )
        jsonschema.validate(json.loads(got.message.content or ""), schema)
    as_object = await local.generate(
        model=PLACEMENT, prompt="JSON:", format="json", options={"seed": 1, "num_predict": MOST}
    )
    if as_object.done_reason == "stop":  # a free key closes rarely on a random model
        assert isinstance(json.loads(as_object.response), dict)

    with pytest.raises(ollama.ResponseError) as refused:
        await local.chat(
            model=PLACEMENT,
            messages=ASK,
            format={"type": "object", "properties": {"when": {"type": "date"}}},
        )
    assert refused.value.status_code == 400 and "format.properties.when" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as bad_format:
        await client.responses.create(
            model=PLACEMENT,
            input="x",
            text={
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {"type": "object", "properties": {"when": {"type": "date"}}},
                }
            },
        )
    assert bad_format.value.status_code == 400
    assert "text.format.schema.properties.when" in str(bad_format.value)
