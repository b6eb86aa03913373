"""Tool calls, /v1/completions and logprobs, through the real cluster and the `openai` client.

Two real agents on 127.0.0.86-87:57700 serve three placements: a model that
answers every chat with one tool call (tests/support/tool_model.py) on one node, a noise
demo model as a two-shard ring, and a demo whose template knows no tool calls.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import openai
import pytest
import pytest_asyncio
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_tokenizer

from studiotui.api.server import ApiServer, start_server
from studiotui.cluster.controller import Controller
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from tests.support.tool_model import CALL, CONTENT, PASSAGE, write_tool_model
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control
from worker.tool_calls import ToolCallStream

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32")
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
ASK = [{"role": "user", "content": "Will it rain this week?"}]
PLAIN_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class Served:
    ctl: Controller
    server: ApiServer
    models: dict[str, Path]

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.server.url, api_key="unused", max_retries=0, timeout=60.0
        )


@pytest.fixture(scope="module")
def tools_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("tools-home"), 2, 86, 57700)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tools-models")
    plain = write_demo_model(root / "plain", DemoSpec(layers=1, hidden=32, heads=2, kv_heads=1))
    config = json.loads((plain / "tokenizer_config.json").read_text())
    (plain / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": PLAIN_CHATML})
    )
    return {
        "caller": write_tool_model(root / "caller", SPEC),
        "noise": write_demo_model(root / "noise", SPEC),
        "plain": plain,
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tools_cluster: LocalCluster, models: dict[str, Path]) -> AsyncIterator[Served]:
    ctl = tools_cluster.controller()
    first, second = tools_cluster.inventory.names
    server = None
    try:
        await ctl.start(telemetry=False)
        await ctl.place(models["caller"], [first], "caller", prefill_chunk=16)
        await ctl.place(models["noise"], [first, second], "noise", prefill_chunk=16)
        await ctl.place(models["plain"], [second], "plain", prefill_chunk=16)
        server = await start_server(ctl, "127.0.0.1", 0)
        yield Served(ctl, server, models)
    finally:
        if server is not None:
            await server.close()
        await ctl.close()


# ---- tool calls ------------------------------------------------------------------------


async def test_a_tool_call_comes_back_parsed(served: Served) -> None:
    reply = await served.client().chat.completions.create(
        model="caller", messages=ASK, tools=TOOLS, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CONTENT
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    assert calls[0].type == "function" and calls[0].id.startswith("call_")
    assert calls[0].function.name == CALL["name"]
    assert json.loads(calls[0].function.arguments) == CALL["arguments"]
    # Without tools the same answer is plain text, markers and all.
    plain = await served.client().chat.completions.create(
        model="caller", messages=ASK, temperature=0
    )
    assert plain.choices[0].message.content == PASSAGE
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls


async def test_a_tool_call_streams_in_openai_deltas(served: Served) -> None:
    stream = await served.client().chat.completions.create(
        model="caller",
        messages=ASK,
        tools=TOOLS,
        tool_choice="auto",
        temperature=0,
        stream=True,
    )
    chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == CONTENT
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(calls) == 1
    assert calls[0].index == 0 and calls[0].id and calls[0].type == "function"
    assert calls[0].function.name == CALL["name"]
    assert json.loads(calls[0].function.arguments) == CALL["arguments"]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "tool_calls" and not any(finish[:-1])
    # The client's own stream helper puts the pieces together into a completion.
    async with served.client().chat.completions.stream(
        model="caller", messages=ASK, tools=TOOLS, temperature=0
    ) as helper:
        final = await helper.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == CALL["arguments"]
    assert final.choices[0].finish_reason == "tool_calls"


async def test_a_tool_result_goes_back_through_the_template(served: Served) -> None:
    call_id = "call_forecast_1"
    turns = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "forecast", "arguments": '{"days": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 24 degrees"},
    ]
    reply = await served.client().chat.completions.create(
        model="caller", messages=turns, tools=TOOLS, temperature=0
    )
    # The head rendered exactly what the model's template makes of the transcript.
    tok = load_tokenizer(served.models["caller"])
    as_template_reads = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "forecast", "arguments": {"days": 3}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 24 degrees"},
    ]
    text = tok.apply_chat_template(
        as_template_reads, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert '"arguments": {"days": 3}' in text
    assert "<tool_response>\nsunny, 24 degrees\n</tool_response>" in text
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    first = await served.client().chat.completions.create(
        model="caller", messages=ASK, tools=TOOLS, temperature=0
    )
    assert first.usage is not None and first.usage.prompt_tokens < reply.usage.prompt_tokens
    # tool_choice "none": the model does not see the tools, the answer is text.
    none = await served.client().chat.completions.create(
        model="caller", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0
    )
    assert none.choices[0].message.content == PASSAGE and not none.choices[0].message.tool_calls
    assert none.usage is not None and none.usage.prompt_tokens < first.usage.prompt_tokens


async def test_a_call_cut_off_comes_back_as_text(served: Served) -> None:
    reply = await served.client().chat.completions.create(
        model="caller", messages=ASK, tools=TOOLS, temperature=0, max_tokens=6
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    content = choice.message.content or ""
    assert content.startswith(CONTENT + "<tool_call>{") and PASSAGE.startswith(content)


async def test_the_head_splits_calls_wherever_the_text_breaks(models: dict[str, Path]) -> None:
    tok = load_tokenizer(models["caller"])
    text = "Sure. " + PASSAGE[len(CONTENT) :] + " Then <tool_ca" + "ll>not json</tool_call> done"
    for size in (1, 3, 7, len(text)):
        stream = ToolCallStream(tok, TOOLS)
        content, calls = "", []
        for i in range(0, len(text), size):
            more, got = stream.add(text[i : i + size])
            content, calls = content + more, calls + got
        more, got = stream.finish()
        content, calls = content + more, calls + got
        assert calls == [CALL], size
        # What the parser cannot read stays in the answer, markers and all.
        assert content == "Sure.  Then <tool_call>not json</tool_call> done", size
    # An unclosed call at the end is parsed as it stands, or given back as text.
    stream = ToolCallStream(tok, TOOLS)
    assert stream.add('<tool_call>{"name":"forecast","argu') == ("", [])
    assert stream.finish() == ('<tool_call>{"name":"forecast","argu', [])


# ---- completions ---------------------------------------------------------------------------


async def direct(ctl: Controller, placement: str, request: dict[str, Any], **params: Any) -> str:
    text = ""
    async for msg in ctl.generate(placement, request, params):
        if isinstance(msg, control.Delta):
            text += msg.text
    return text


async def test_completions_continue_a_plain_prompt(served: Served) -> None:
    prompt = "The pipeline passes activations"
    want = await direct(
        served.ctl, "noise", {"prompt": prompt}, max_tokens=16, temperature=0.0, ignore_eos=True
    )
    client = served.client()
    reply = await client.completions.create(
        model="noise", prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.object == "text_completion"
    choice = reply.choices[0]
    assert choice.text == want and choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 16  # OpenAI's default
    ids = load_tokenizer(served.models["noise"]).encode(prompt)
    assert reply.usage.prompt_tokens == len(ids)
    by_ids = await client.completions.create(
        model="noise", prompt=ids, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == want
    stream = await client.completions.create(
        model="noise",
        prompt=prompt,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and not any(finish[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


# ---- logprobs ------------------------------------------------------------------------------


def reference(model_dir: Path, prompt: list[int], steps: int) -> list[tuple[int, mx.array]]:
    """mlx-lm's own greedy decode, with the log-probabilities it computes."""
    model, _ = load(str(model_dir))
    out = []
    for token, logprobs in generate_step(
        mx.array(prompt), model, max_tokens=steps, sampler=lambda lp: mx.argmax(lp, axis=-1)
    ):
        out.append((int(token), logprobs))
    return out


@pytest.mark.parametrize("placement", ["noise", "caller"])
async def test_chat_logprobs_are_mlx_lm_s(served: Served, placement: str) -> None:
    steps, top = 8, 3
    reply = await served.client().chat.completions.create(
        model=placement,
        messages=ASK,
        max_tokens=steps,
        temperature=0,
        logprobs=True,
        top_logprobs=top,
    )
    tok = load_tokenizer(served.models[placement])
    prompt = tok.apply_chat_template(ASK, add_generation_prompt=True)
    want = reference(served.models[placement], prompt, steps)
    assert reply.choices[0].logprobs is not None
    got = reply.choices[0].logprobs.content or []
    assert len(got) == steps
    for entry, (token, logprobs) in zip(got, want, strict=True):
        assert entry.token == tok.decode([token])
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(logprobs[token].item(), abs=1e-3)
        best = sorted(range(logprobs.shape[0]), key=lambda i: -logprobs[i].item())[:top]
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i in best]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [logprobs[i].item() for i in best], abs=1e-3
        )
    assert reply.choices[0].message.content == "".join(e.token for e in got)


async def test_logprobs_stream_and_come_with_completions(served: Served) -> None:
    client = served.client()
    stream = await client.chat.completions.create(
        model="noise", messages=ASK, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    chunks = [c async for c in stream]
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(entries) == 6 and all(e.top_logprobs == [] for e in entries)
    assert "".join(e.token for e in entries) == text

    reply = await client.completions.create(
        model="noise", prompt="Hello", max_tokens=5, temperature=0, logprobs=2
    )
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == reply.choices[0].text and len(lp.tokens) == 5
    assert lp.top_logprobs is not None and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    # Greedy: the chosen token is the likeliest, so it heads its own top list.
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(value) and top[token] == pytest.approx(value)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    stream = await client.completions.create(
        model="noise", prompt="Hello", max_tokens=5, temperature=0, logprobs=2, stream=True
    )
    streamed = [
        t
        for c in [c async for c in stream]
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens or []
    ]
    assert streamed == lp.tokens


# ---- refusals ------------------------------------------------------------------------------


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "caller", "messages": ASK, **extra}


FN = {"name": "forecast", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("chat", chat(tools={"forecast": FN}), "tools", "array"),
        ("chat", chat(tools=[{"type": "custom", "custom": FN}]), "tools[0].type", "function"),
        ("chat", chat(tools=[{"type": "function"}]), "tools[0].function", "name"),
        (
            "chat",
            chat(tools=[{"type": "function", "function": {"name": "get weather"}}]),
            "tools[0].function.name",
            "letters",
        ),
        (
            "chat",
            chat(tools=[{"type": "function", "function": {**FN, "parameters": "x"}}]),
            "tools[0].function.parameters",
            "JSON Schema",
        ),
        ("chat", chat(tools=[{"type": "function", "function": FN}] * 2), "tools", "repeated"),
        ("chat", chat(tools=TOOLS, tool_choice="required"), "tool_choice", "auto"),
        (
            "chat",
            chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "forecast"}}),
            "tool_choice",
            "enforced",
        ),
        ("chat", chat(tool_choice="required"), "tool_choice", "needs tools"),
        ("chat", chat(functions=[FN]), "functions", "tools"),
        (
            "chat",
            {"model": "caller", "messages": [*ASK, {"role": "tool", "content": "x"}]},
            "messages[1].tool_call_id",
            "tool_call_id",
        ),
        (
            "chat",
            {"model": "caller", "messages": [*ASK, {"role": "function", "content": "x"}]},
            "messages[1].role",
            "role tool",
        ),
        (
            "chat",
            {
                "model": "caller",
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{oops"},
                            }
                        ],
                    },
                ],
            },
            "messages[1].tool_calls[0].function.arguments",
            "JSON",
        ),
        ("chat", chat(top_logprobs=2), "top_logprobs", "logprobs: true"),
        ("chat", chat(logprobs=True, top_logprobs=21), "top_logprobs", "0 to 20"),
        ("chat", chat(logprobs="yes"), "logprobs", "true or false"),
        ("completions", {"model": "noise", "prompt": "x", "logprobs": 6}, "logprobs", "0 to 5"),
        ("completions", {"model": "noise", "prompt": "x", "echo": True}, "echo", "echo"),
        ("completions", {"model": "noise", "prompt": ["a", "b"]}, "prompt", "one prompt"),
        ("completions", {"model": "noise", "prompt": ""}, "prompt", "empty"),
        ("completions", {"model": "noise"}, "prompt", "required"),
        # The head refuses what it cannot do, before any prefill.
        ("chat", {**chat(tools=TOOLS), "model": "plain"}, "tools", "no tool-call format"),
        ("completions", {"model": "noise", "prompt": [1, 10**7]}, "prompt", "prompt tokens"),
    ],
)
async def test_bad_tool_and_logprob_requests_are_400(
    served: Served, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    async with httpx.AsyncClient(base_url=served.server.url) as http:
        resp = await http.post(f"/{path.replace('chat', 'chat/completions')}", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"], err
    assert "Traceback" not in err["message"]


async def test_a_bad_tool_through_the_client(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await served.client().chat.completions.create(
            model="caller",
            messages=ASK,
            tools=[{"type": "function", "function": {"name": "no spaces allowed"}}],
        )
    assert "tools[0].function.name" in caught.value.message
