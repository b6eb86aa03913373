"""Speculative decoding through real agents, runner processes and the OpenAI API.

Two agents on 127.0.0.97-98:58700 hold a reciting demo placed with a 2-layer reciting
draft of the same passage (`studiotui place MODEL --draft DRAFT_DIR`), and a noise demo
placed with `--draft lookup`; the real `openai` client asks them through the API server.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx_lm
import openai
import pytest
import pytest_asyncio
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_tokenizer
from textual.widgets import Input, Select, Static

from studiotui.api.server import ApiServer, start_server
from studiotui.app.app import StudioApp
from studiotui.app.screens.chat import AnswerView, ChatScreen
from studiotui.cli.status_cmd import status_json
from studiotui.cluster.controller import Controller
from studiotui.cluster.local_cluster import save_local_inventory
from studiotui.core.placement import Plan, Refusal
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from tests.support.pilot_helpers import until
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control

pytestmark = pytest.mark.asyncio(loop_scope="module")

MESSAGES = [{"role": "user", "content": "Say your passage."}]


@dataclass
class Served:
    ctl: Controller
    server: ApiServer
    models: dict[str, Path]

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.server.url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def spec_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("spec-home"), 2, 97, 58700)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec-models")
    small = {"hidden": 64, "heads": 4, "kv_heads": 2, "dtype": "float32"}
    return {
        "reciter": write_demo_model(
            root / "reciter", DemoSpec(layers=4, seed=3, recite=True, **small)
        ),
        "draft": write_demo_model(root / "draft", DemoSpec(layers=2, seed=9, recite=True, **small)),
        "noise": write_demo_model(root / "noise", DemoSpec(layers=4, seed=5, **small)),
        "linear": write_demo_model(
            root / "linear", DemoSpec(arch="qwen3_next", layers=3, seed=5, **small)
        ),
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(spec_cluster: LocalCluster, models: dict[str, Path]) -> AsyncIterator[Served]:
    ctl = spec_cluster.controller()
    server = None
    try:
        await ctl.start(telemetry=True)
        nodes = list(spec_cluster.inventory.names)
        await ctl.place(
            models["reciter"], nodes, "drafted", prefill_chunk=16, draft_dir=str(models["draft"])
        )
        await ctl.place(models["noise"], nodes, "lookup", prefill_chunk=16, draft="lookup")
        server = await start_server(ctl, "127.0.0.1", 0)
        yield Served(ctl, server, models)
    finally:
        if server is not None:
            await server.close()
        await ctl.close()


def reference(model: Path, n: int) -> str:
    loaded, tok = mlx_lm.load(str(model))
    prompt = load_tokenizer(model).apply_chat_template(MESSAGES, add_generation_prompt=True)
    tokens = [int(t) for t, _ in generate_step(mx.array(prompt), loaded, max_tokens=n)]
    eos = set(tok.eos_token_ids)
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return str(tok.decode(tokens[:cut]))


async def test_a_draft_model_on_the_head_gives_mlx_lm_answer(served: Served) -> None:
    expected = reference(served.models["reciter"], 48)
    reply = await served.client().chat.completions.create(
        model="drafted",
        messages=MESSAGES,
        max_tokens=48,
        temperature=0,  # type: ignore[arg-type]
    )
    assert reply.choices[0].message.content == expected
    usage = reply.usage
    assert usage is not None and usage.completion_tokens_details is not None
    kept = usage.completion_tokens_details.accepted_prediction_tokens or 0
    rejected = usage.completion_tokens_details.rejected_prediction_tokens or 0
    # The draft recites the same passage: nearly every guess is kept.
    assert kept > 3 * rejected and kept >= 24
    # The acceptance shows in status --json, per placement, once telemetry brings it.
    for _ in range(50):
        await served.ctl.refresh()
        row = next(p for p in status_json(served.ctl)["placements"] if p["name"] == "drafted")
        if row["drafted"]:
            break
        await asyncio.sleep(0.2)
    assert row["draft"] == "model" and row["acceptance"] > 0.7
    # Its head computed verify steps while the ones before were out, and sent them.
    assert row["verified_ahead"] > 0


async def test_predicted_outputs_feed_prompt_lookup(served: Served) -> None:
    expected = reference(served.models["noise"], 40)
    client = served.client()
    plain = await client.chat.completions.create(
        model="lookup",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
    )
    assert plain.choices[0].message.content == expected
    predicted = await client.chat.completions.create(
        model="lookup",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        prediction={"type": "content", "content": expected},
    )
    assert predicted.choices[0].message.content == expected
    details = predicted.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and (details.accepted_prediction_tokens or 0) >= 20
    stream = await client.chat.completions.create(
        model="lookup",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        prediction={"type": "content", "content": expected[: len(expected) // 2] + " nope"},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    last = chunks[-1].usage
    assert last is not None and last.completion_tokens_details is not None
    assert (last.completion_tokens_details.rejected_prediction_tokens or 0) > 0


async def test_bad_predictions_and_drafts_are_a_400(served: Served) -> None:
    client = served.client()
    for extra, words in (
        ({"prediction": {"type": "text", "content": "x"}}, "prediction must be"),
        ({"draft": "magic"}, 'draft "magic" is not one of'),
        ({"draft": "model"}, "no draft model"),
    ):
        with pytest.raises(openai.BadRequestError, match=words):
            await client.chat.completions.create(
                model="lookup",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=4,
                extra_body=extra,
            )


async def test_a_draft_of_another_tokenizer_is_refused_at_preview(served: Served) -> None:
    ctl, models = served.ctl, served.models
    nodes = [n.name for n in ctl.state.nodes]
    _, plan = ctl.preview(models["reciter"], nodes, draft="model", draft_dir=models["noise"])
    assert isinstance(plan, Refusal)
    assert "a draft must use the model's own tokenizer" in plan.reason
    _, plan = ctl.preview(models["linear"], nodes, draft="lookup")
    assert isinstance(plan, Refusal) and "cannot be cut back" in plan.reason
    # A fitting draft's weights are counted on the head node.
    _, plan = ctl.preview(models["noise"], nodes, draft="model", draft_dir=models["noise"])
    assert isinstance(plan, Plan) and plan.shards[0].draft_bytes > 0


async def test_the_chat_shows_the_share_of_guesses_kept_beside_tok_s(
    spec_cluster: LocalCluster, served: Served
) -> None:
    app = StudioApp(spec_cluster.home, spec_cluster.inventory)
    async with app.run_test(size=(160, 48)) as pilot:
        await until(
            pilot,
            lambda: (
                app.controller is not None
                and any(
                    p.name == "drafted" and p.state == "ready"
                    for p in app.controller.state.placements
                )
            ),
            20,
            "the drafted placement is known",
        )
        await pilot.press("c")
        await until(pilot, lambda: isinstance(app.screen, ChatScreen), 5, "chat screen")
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        screen.query_one("#chat-placement", Select).value = "drafted"
        await until(pilot, lambda: screen._chosen_name() == "drafted", 5, "drafted chosen")
        screen.query_one("#chat-temperature", Input).value = "0"
        screen.query_one("#chat-max-tokens", Input).value = "40"
        prompt = screen.query_one("#chat-prompt", Input)
        prompt.focus()
        prompt.value = "Say your passage."
        app.simulate_key("enter")
        await until(pilot, lambda: screen.turn is not None and screen.turn.finished, 60, "answer")
        await pilot.pause(0.2)
        note = str(screen.query(AnswerView).last().note.content)
        figures = str(screen.query_one("#chat-figures", Static).content)
        assert "tok/s" in note and "% of guesses kept" in note, note
        assert "guesses kept" in figures and "tok/s" in figures, figures


async def test_each_runner_warmed_its_stage_before_ready(served: Served) -> None:
    """The runners ran their stage's warm-up at load (`Stage.warm_up`, the draft model's
    guesses among it), before saying "ready"; the answers above came after it."""
    for name in ("drafted", "lookup"):
        head = served.ctl.head_peer(served.ctl.pick_placement(name))
        stats = (await head.ask("stats", control.StatsReply)).stats
        assert stats.warm_ms > 0, stats


async def test_the_cli_chat_says_the_share_of_guesses_kept(
    served: Served, spec_cluster: LocalCluster
) -> None:
    """`studiotui chat` against the placement with a draft model: after the answer, the
    share of guesses kept beside tok/s, as the dashboard's chat shows it."""
    save_local_inventory(spec_cluster.home, spec_cluster.inventory)  # as `up --local` does
    env = {**os.environ, "STUDIOTUI_HOME": str(spec_cluster.home)}
    chat = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "studiotui", "chat", "--placement", "drafted",
        "--max-tokens", "32", MESSAGES[0]["content"],
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(chat.communicate(), timeout=120)
    said = err.decode()
    assert chat.returncode == 0, said
    assert out.decode().strip() == reference(served.models["reciter"], 32), said
    assert re.search(r"tok/s, \d+% of guesses kept,\s+finish: length", said), said
