"""The chat screen driven by Textual's Pilot against a real local cluster.

Two agents on 127.0.0.221-222:59500 hold one placement of a tiny demo model. The
tests share it and run in file order; the last one breaks the placement on
purpose (it kills the head shard's runner mid-answer). Every agent is stopped by
the pid it was started with, failed or not.

The demo model has random weights: with temperature 0 "tell me a long story"
runs to max_tokens, which is what the stop and error tests need.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import DataTable, Input, Markdown, Select, Sparkline

from studiotui.app.app import StudioApp
from studiotui.app.dialogs import DeleteScreen
from studiotui.app.screens import chat
from studiotui.app.screens.chat import AnswerView, ChatScreen, UserView
from studiotui.app.screens.conversations import ConversationsScreen
from studiotui.chat.history import History, Settings
from studiotui.core.documents import split_passages
from studiotui.core.inventory import Inventory
from studiotui.core.state import ClusterState, ShardState, placements_from_shards
from tests.support.cluster_fixture import placed_cluster
from tests.support.pilot_helpers import run_from_palette
from tests.support.pilot_helpers import until as wait_until
from worker.shared.demo_model import DemoSpec
from worker.shared.protocol import control

# Polled finely: a coarser step let a fast answer finish before the keys were sent.
until = partial(wait_until, step=0.05)

BASE = 221
PORT = 59500
SIZE = (160, 48)
LONG = "tell me a long story"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Inventory]]:
    spec = DemoSpec(layers=4, hidden=64, heads=4, kv_heads=2, dtype="float32")
    home = tmp_path_factory.mktemp("chat-home")
    for local in placed_cluster(home, 2, BASE, PORT, spec):
        yield local.home, local.inventory


# --------------------------------------------------------------------------- helpers


async def open_chat(pilot: Any, app: StudioApp, via_palette: bool = False) -> ChatScreen:
    await until(
        pilot,
        lambda: (
            app.controller is not None
            and any(p.state == "ready" for p in app.controller.state.placements)
        ),
        15,
        "the placement is known",
    )
    if via_palette:
        await run_from_palette(pilot, app, "chat", "chat")
    else:
        await pilot.press("c")
    await until(pilot, lambda: isinstance(app.screen, ChatScreen), 5, "chat screen")
    screen = app.screen
    assert isinstance(screen, ChatScreen)
    # The only placement is chosen by itself.
    await until(pilot, lambda: screen._chosen_name() == "demo", 5, "placement chosen")
    return screen


def settings(screen: ChatScreen, temperature: str, max_tokens: str) -> None:
    screen.query_one("#chat-temperature", Input).value = temperature
    screen.query_one("#chat-max-tokens", Input).value = max_tokens


async def ask(pilot: Any, screen: ChatScreen, text: str) -> None:
    prompt = screen.query_one("#chat-prompt", Input)
    prompt.focus()
    prompt.value = text
    previous = screen.turn
    # Not pilot.press: it waits for every widget to be idle, which a streaming
    # answer never is. A terminal sends the key without waiting either.
    screen.app.simulate_key("enter")
    await until(pilot, lambda: screen.turn is not previous, 5, f"{text!r} is asked")


async def long_answer_under_way(pilot: Any, app: StudioApp) -> ChatScreen:
    """The chat, a new conversation, and an answer of up to 2000 tokens 8 tokens in."""
    screen = await open_chat(pilot, app)
    await pilot.press("ctrl+n")
    settings(screen, "0", "2000")
    await ask(pilot, screen, LONG)
    await until(pilot, lambda: screen.turn is not None and screen.turn.tokens >= 8, 20, "t")
    return screen


async def answered(pilot: Any, screen: ChatScreen, timeout: float = 30) -> AnswerView:
    await until(
        pilot,
        lambda: screen.turn is not None and screen.turn.finished,
        timeout,
        "the answer ends",
    )
    await pilot.pause(0.1)
    answers = screen.query(AnswerView)
    return answers.last()


def content(screen: ChatScreen, selector: str) -> str:
    return str(screen.query_one(selector).content)  # type: ignore[attr-defined]


def stored(home: Path, conversation_id: int) -> list[Any]:
    history = History.open(home)
    try:
        return history.messages(conversation_id)
    finally:
        history.close()


# --------------------------------------------------------------------------- tests


# Long enough (~3 s here) that keys typed early are echoed well before it ends, even
# when a cold first render stalls the loop for a moment.
ANSWER = 200


async def test_an_answer_streams_with_its_figures(
    cluster: tuple[Path, Inventory], monkeypatch: pytest.MonkeyPatch
) -> None:
    home, inv = cluster
    appends: list[float] = []
    original = Markdown.append

    def counting(self: Markdown, markdown: str) -> Any:
        appends.append(time.monotonic())
        return original(self, markdown)

    monkeypatch.setattr(Markdown, "append", counting)
    # A sample every few redraws, so a one-second answer draws a line even when a busy
    # machine slows the redraws down.
    monkeypatch.setattr(chat, "SPARK_S", 0.05)
    app = StudioApp(home, inv)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot, app)
        settings(screen, "0", str(ANSWER))
        screen.query_one("#chat-prompt", Input).focus()
        await pilot.press(*"hello", "space", *"there")
        # Pilot.press waits until every widget is idle, which is never while tokens
        # stream: the keys during the answer are sent as a terminal would send them.
        app.simulate_key("enter")
        await until(pilot, lambda: screen.turn is not None, 5, "streaming starts")
        # The live figures are redrawn FLUSH_HZ times a second while tokens come: polled
        # (not read once) so a redraw still pending on a busy machine is waited for.
        live = content(screen, "#chat-figures")
        while "answering" not in live and not screen.turn.finished:
            await asyncio.sleep(0.01)
            live = content(screen, "#chat-figures")
        assert "answering" in live and "tok/s" in live, live
        view = await answered(pilot, screen)
        turn = screen.turn
        assert turn is not None and turn.error is None and not turn.stopped

        assert [v.text for v in screen.query(UserView)] == ["hello there"]
        assert view.text and view.text == turn.text
        meta = stored(home, screen.conv.id)[-1].meta  # type: ignore[union-attr]
        assert meta["finish_reason"] == "length" and meta["completion_tokens"] == ANSWER
        assert meta["prompt_tokens"] > 2 and meta["decode_tps"] > 0 and meta["ttft_ms"] > 0
        # The ring's order follows the measured links, so either node may be the head.
        chosen = screen._chosen()
        assert chosen is not None
        ring = [hop.node for hop in chosen.ring]
        assert sorted(ring) == ["local-1", "local-2"] and meta["nodes"] == ring
        figures = content(screen, "#chat-figures")
        assert "first token" in figures and " ms" in figures and "tok/s" in figures
        assert f"{meta['prompt_tokens']}" in figures and str(ANSWER) in figures
        assert len(screen.query_one("#chat-spark", Sparkline).data or []) >= 2
        nodes = content(screen, "#chat-nodes")
        assert "local-1" in nodes and "head" in nodes and "local-2" in nodes and "tail" in nodes
        note = str(view.note.content)
        assert f"{ANSWER} tokens" in note and "tok/s" in note and " → ".join(ring) in note

        # Redraws are batched: ANSWER tokens arrived, far fewer (≤ 20 a second) were drawn.
        # The rate is intervals over time: n draws span n - 1 of them (counting draws gave
        # 6 / 0.29 s = 20.7 for a fast answer drawn at 15 Hz, its last draw at the finish).
        assert len(appends) >= 2, appends
        span = appends[-1] - appends[0]
        assert len(appends) < ANSWER and (len(appends) - 1) / span <= 20, (len(appends), span)

        await pilot.press("ctrl+y")
        assert app.clipboard == view.text
        # The dashboard underneath is not disturbed by the screen on top of it.
        assert not any("display error" in n.message for n in app._notifications)
        await pilot.press("escape", "escape")  # clear the focus path, then leave
        await until(pilot, lambda: not isinstance(app.screen, ChatScreen), 3, "back")


async def test_the_next_turn_says_how_many_prompt_tokens_were_reused(
    cluster: tuple[Path, Inventory],
) -> None:
    """The history a turn resends is prefilled once: the second answer's note says how
    many of its prompt tokens the placement's prefix cache served."""
    home, inv = cluster
    app = StudioApp(home, inv)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot, app)
        await pilot.press("ctrl+n")
        settings(screen, "0", "6")
        await ask(pilot, screen, "first question")
        await answered(pilot, screen)
        before = stored(home, screen.conv.id)[-1].meta  # type: ignore[union-attr]
        await ask(pilot, screen, "and a second one")
        await until(
            pilot,
            lambda: screen.turn is not None and screen.turn.user.content == "and a second one",
            10,
            "the second turn starts",
        )
        second = await answered(pilot, screen)
        meta = stored(home, screen.conv.id)[-1].meta  # type: ignore[union-attr]
        # All of the first turn's prompt (the second one's beginning) at least.
        assert before["prompt_tokens"] - 1 <= meta["cached_tokens"] < meta["prompt_tokens"]
        note = str(second.note.content)
        want = f"{meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens reused"
        assert want in note, note


async def test_escape_stops_at_once_and_frees_every_cache(
    cluster: tuple[Path, Inventory],
) -> None:
    home, inv = cluster
    app = StudioApp(home, inv)
    async with app.run_test(size=SIZE) as pilot:
        screen = await long_answer_under_way(pilot, app)
        # Keys are answered while tokens stream, not queued behind the answer (how
        # quickly is a figure for a benchmark, not a timed assertion). A 2000-token
        # answer outlasts three echoes on any machine; a short one may not. Polled with
        # plain sleeps: `pilot.pause` waits for every widget to take its queued
        # messages, which under a stream can outlast the answer.
        prompt = screen.query_one("#chat-prompt", Input)
        prompt.value = ""
        prompt.focus()
        await asyncio.sleep(0)
        echoed_while_streaming = []
        for key in "xyz":
            app.simulate_key(key)
            deadline = time.monotonic() + 15
            while not prompt.value.endswith(key):
                assert time.monotonic() < deadline, f"{key!r} was not echoed"
                await asyncio.sleep(0.005)
            echoed_while_streaming.append(screen.streaming)
        assert prompt.value == "xyz"
        assert all(echoed_while_streaming), "the keys waited for the whole answer"
        await pilot.press("escape")
        # The question is back to edit at once; the answer ends within a moment.
        assert screen.query_one("#chat-prompt", Input).value == LONG
        await until(pilot, lambda: not screen.streaming, 2, "the answer stops")
        turn = screen.turn
        assert turn is not None and turn.stopped and turn.error is None
        partial = turn.text
        assert partial and turn.tokens < 2000
        conv = screen.conv
        assert conv is not None
        [question, answer] = stored(home, conv.id)
        assert question.content == LONG
        assert answer.content == partial and answer.meta["stopped"] is True
        assert "stopped" in str(screen.query(AnswerView).last().note.content)

        # The cancel reached every shard: no KV cache is left held.
        ctl = app.controller
        assert ctl is not None

        async def held() -> list[int]:
            state = await ctl.refresh()
            return [s.in_flight for n in state.nodes for s in n.shards]

        deadline = time.monotonic() + 10
        while any(await held()):
            assert time.monotonic() < deadline, f"caches still held: {await held()}"
            await pilot.pause(0.2)

        # Asking again (edited or not) replaces the stopped turn.
        settings(screen, "0", "8")
        screen.query_one("#chat-prompt", Input).focus()
        stopped = screen.turn
        await pilot.press("enter")
        await until(pilot, lambda: screen.turn is not stopped, 5, "asked again")
        await answered(pilot, screen)
        again = stored(home, conv.id)
        assert [m.role for m in again] == ["user", "assistant"]
        assert again[0].content == LONG and again[0].id != question.id
        assert again[1].meta["finish_reason"] == "length"
        assert screen.query_one("#chat-prompt", Input).value == ""

        # Regenerate: the last answer is made again, the question stays.
        settings(screen, "0", "12")
        previous = screen.turn
        await pilot.press("ctrl+r")
        await until(pilot, lambda: screen.turn is not previous, 5, "regenerating")
        view = await answered(pilot, screen)
        after = stored(home, conv.id)
        assert [m.role for m in after] == ["user", "assistant"]
        assert after[0].id == again[0].id and after[1].id != again[1].id
        assert after[1].meta["completion_tokens"] == 12
        assert view.text == after[1].content
        assert len(screen.query(AnswerView)) == 1


async def test_conversations_persist_across_a_restart(cluster: tuple[Path, Inventory]) -> None:
    home, inv = cluster
    history = History.open(home)
    before = history.conversations()
    code = History.open(home)
    sample = code.create(settings=Settings(system_prompt="Answer in code.", temperature=0.3))
    code.add_message(sample.id, "user", "Show me code")
    code.add_message(
        sample.id,
        "assistant",
        "First:\n\n```python\nprint('one')\n```\n\nThen:\n\n```sh\necho two\n```\n",
        meta={"completion_tokens": 20},
    )
    code.close()
    long_conv = next(c for c in before if c.title == LONG)
    app = StudioApp(home, inv)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot, app)
        # The most recent conversation opens, with its settings.
        assert screen.conv is not None and screen.conv.id == sample.id
        assert screen.query_one("#chat-system").text == "Answer in code."  # type: ignore[attr-defined]
        assert screen.query_one("#chat-temperature", Input).value == "0.3"
        await pilot.press("ctrl+b")
        assert app.clipboard == "print('one')\n"
        await pilot.press("ctrl+b")
        assert app.clipboard == "echo two\n"
        await pilot.press("ctrl+y")
        assert app.clipboard.startswith("First:")
        # In the conversation the arrows pick a message: up from the answer is the question.
        screen.query_one("#chat-transcript").focus()
        await pilot.press("up", "up", "y")
        assert app.clipboard == "Show me code"
        await pilot.press("enter")  # back to the prompt
        assert screen.focused is screen.query_one("#chat-prompt")

        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, ConversationsScreen), 3, "list")
        dialog = app.screen
        assert isinstance(dialog, ConversationsScreen)
        table = dialog.query_one(DataTable)
        assert table.row_count == len(before) + 1
        # Export, rename and open the long story from the list.
        table.move_cursor(row=dialog.ids.index(long_conv.id))
        await pilot.press("e")
        exported = sorted((home / "exports").glob(f"{long_conv.id:04d}-*.md"))
        assert exported and f"## You\n\n{LONG}" in exported[0].read_text()
        await pilot.press("r")
        rename = dialog.query_one("#conv-rename", Input)
        rename.value = "The long story"
        await pilot.press("enter")
        assert history.get(long_conv.id).title == "The long story"
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is screen, 3, "back in the chat")
        assert screen.conv is not None and screen.conv.id == long_conv.id
        messages = history.messages(long_conv.id)
        shown = [v.text for v in screen.query(".msg")]  # type: ignore[attr-defined]
        assert shown == [m.content for m in messages]
        assert screen.query_one("#chat-max-tokens", Input).value == "12"
        assert "The long story" in content(screen, "#chat-title")

        # Delete the code sample from the list.
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, ConversationsScreen), 3, "list")
        dialog = app.screen
        assert isinstance(dialog, ConversationsScreen)
        dialog.query_one(DataTable).move_cursor(row=dialog.ids.index(sample.id))
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, DeleteScreen), 3, "confirm")
        await pilot.press("enter")  # enter, pressed out of habit, keeps it
        await until(pilot, lambda: app.screen is dialog, 3, "the question closed")
        await pilot.pause(0.2)
        assert sample.id in dialog.ids
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, DeleteScreen), 3, "confirm")
        await pilot.press("y")
        await until(pilot, lambda: sample.id not in dialog.ids, 3, "deleted")
        await pilot.press("escape")
    assert sample.id not in [c.id for c in history.conversations()]
    history.close()


async def test_a_question_about_a_document_uses_the_related_passages(
    cluster: tuple[Path, Inventory], tmp_path: Path
) -> None:
    home, inv = cluster
    filler = (
        "Minutes of the weekly meeting about parking, lunch rotations, printer toner and the "
        "coffee machine, with nothing decided and everything postponed to next week."
    )
    paragraphs = [
        f"{filler} Item {i}." + (" The vault code is tangerine." if i in (7, 19) else "")
        for i in range(1, 61)
    ]
    text = "\n\n".join(paragraphs)
    doc = tmp_path / "notes.txt"
    doc.write_text(text)
    expected = [p.number for p in split_passages("notes.txt", text) if "tangerine" in p.text]
    assert len(expected) == 2

    app = StudioApp(home, inv)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot, app, via_palette=True)
        await pilot.press("ctrl+n")
        settings(screen, "0", "8")
        sent_requests: list[dict[str, Any]] = []
        ctl = app.controller
        assert ctl is not None
        real = ctl.generate

        def spy(placement: Any, request: dict[str, Any], params: dict[str, Any]) -> Any:
            sent_requests.append(request)
            return real(placement, request, params)

        ctl.generate = spy  # type: ignore[method-assign]
        prompt = screen.query_one("#chat-prompt", Input)
        prompt.focus()
        prompt.value = f"/attach {doc}"
        await pilot.press("enter")
        await until(pilot, lambda: "notes.txt" in content(screen, "#chat-docs"), 5, "attached")

        await ask(pilot, screen, "What is the vault code?")
        view = await answered(pilot, screen, timeout=40)
        a, b = expected
        assert f"used passages {a}, {b} of notes.txt" in str(view.note.content)

        assert screen.conv is not None
        question, answer = stored(home, screen.conv.id)
        assert question.content == "What is the vault code?"
        assert question.sent is not None
        assert f"[notes.txt, passage {a}]" in question.sent
        assert f"[notes.txt, passage {b}]" in question.sent
        assert "passage 1]" not in question.sent and "Item 30." not in question.sent
        assert question.sent.count("tangerine") == 2
        assert answer.meta["passages"] == [{"document": "notes.txt", "passages": [a, b]}]
        # What went to the cluster is what the history says.
        assert sent_requests[-1]["messages"][-1] == {"role": "user", "content": question.sent}
        # The transcript shows the question as typed, not the passages.
        assert [v.text for v in screen.query(UserView)] == ["What is the vault code?"]


async def test_quitting_mid_answer_keeps_what_arrived(cluster: tuple[Path, Inventory]) -> None:
    home, inv = cluster
    app = StudioApp(home, inv)
    async with app.run_test(size=SIZE) as pilot:
        screen = await long_answer_under_way(pilot, app)
        turn = screen.turn
        assert turn is not None and not turn.finished
        session = screen.session
    # The app quit with the answer coming: the screen kept it as it was, then closed
    # the history once every write was done.
    session.store.close().result(timeout=10)
    assert turn.finished and turn.stopped and turn.text and turn.tokens < 2000
    assert session.conversation is not None
    [question, answer] = stored(home, session.conversation.id)
    assert question.content == LONG
    assert answer.content == turn.text and answer.meta["stopped"] is True


async def test_a_node_failing_mid_answer_keeps_the_partial_answer(
    cluster: tuple[Path, Inventory],
) -> None:
    home, inv = cluster
    app = StudioApp(home, inv)
    async with app.run_test(size=SIZE) as pilot:
        screen = await long_answer_under_way(pilot, app)
        ctl = app.controller
        assert ctl is not None
        placement = ctl.state.placement("demo")
        assert placement is not None
        head = placement.shards[0].node
        reply = await ctl.peer(head).ask("list_shards", control.Shards)
        [runner] = [s for s in reply.shards if s.placement == "demo"]
        assert runner.pid is not None
        os.kill(runner.pid, signal.SIGKILL)

        view = await answered(pilot, screen, timeout=20)
        turn = screen.turn
        assert turn is not None and turn.error and not turn.stopped
        # A killed runner is brought back by restart on the same layers (docs/reliability.md).
        assert f"studiotui restart {head}" in turn.error, "the error should say what to do"
        assert turn.text and view.text == turn.text
        assert screen.conv is not None
        [_, answer] = stored(home, screen.conv.id)
        assert answer.content == turn.text and answer.meta["error"] == turn.error
        note = str(view.note.content)
        assert turn.error in note and "the text above is what arrived before" in note
        assert turn.error in content(screen, "#chat-status")
        assert any(turn.error in n.message for n in app._notifications)

        # The placement has failed now: asking says so in the conversation, with the remedy.
        await ask(pilot, screen, "are you there?")
        view = await answered(pilot, screen, timeout=20)
        assert screen.turn is not None and screen.turn.error
        assert "demo" in screen.turn.error and "no text arrived" in str(view.note.content)
        assert f"studiotui restart {head}" in screen.turn.error


async def test_settings_fields_say_what_is_wrong_where_one_looks(tmp_path: Path) -> None:
    """No cluster needed: an emptied field keeps the value in force and says so; a
    value the shards would refuse is named under the conversation, in red."""
    from tests.support.app_fixtures import fixed_models, fixed_state

    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("c")
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        field = screen.query_one("#chat-temperature", Input)
        before = field.value
        field.focus()
        field.value = ""
        await pilot.press("enter")
        assert field.value == before
        assert f"temperature was empty: kept {before}" in content(screen, "#chat-status")
        assert app.focused is not None and app.focused.id == "chat-prompt"

        field.focus()
        field.value = "12"
        await pilot.press("enter")
        status = content(screen, "#chat-status")
        assert "temperature must be 0..10, got 12" in status and "press enter" in status
        assert app.focused is field, "the field keeps the keys until it is right"

        await pilot.press("ctrl+o")
        await pilot.pause()
        rename = app.screen.query_one("#conv-rename", Input)
        assert "Rename" in str(rename.border_title)


async def test_ctrl_t_attaches_a_document_from_its_dialog(tmp_path: Path) -> None:
    """README: `ctrl+t` attaches a text, Markdown or PDF document (no cluster needed to
    attach one; test_a_question_about_a_document_uses_the_related_passages asks it)."""
    from tests.support.app_fixtures import fixed_models, fixed_state

    doc = tmp_path / "handbook.md"
    doc.write_text("# Handbook\n\nThe vault code is tangerine.\n\nNothing else.\n")
    app = StudioApp(tmp_path / "home", state=fixed_state(), models=fixed_models())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("c")
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        await pilot.press("ctrl+t")
        await pilot.pause()
        field = app.screen.query_one("#attach-path", Input)
        field.value = str(doc)
        await pilot.press("enter")
        await until(pilot, lambda: "handbook.md" in content(screen, "#chat-docs"), 5, "attached")
        assert app.screen is screen


async def test_a_tensor_placement_picked_by_hand_shows_its_stages(tmp_path: Path) -> None:
    """Two stages × 2: each group's nodes are head or tail of the pipeline (the card
    counted four shards and called the second stage "middle"); after ctrl+l picks it,
    what one types goes to the prompt (the keys stayed on the menu)."""
    from tests.support.app_fixtures import fixed_models, fixed_state

    groups = (("studio-1", "studio-2"), ("studio-3", "studio-4"))
    spans = ((0, 31), (31, 61))

    def member(node: str) -> ShardState:
        stage = next(i for i, g in enumerate(groups) if node in g)
        start, end = spans[stage]
        group = groups[stage]
        return ShardState(
            "tp", node, stage, 2, start, end, "ready", "/m/tp", rank=group.index(node), group=group
        )

    nodes = tuple(
        replace(n, state="up", shards=(*n.shards, member(n.name))) for n in fixed_state().nodes
    )
    state = ClusterState(name="desk", nodes=nodes, placements=placements_from_shards(nodes))
    app = StudioApp(tmp_path, state=state, models=fixed_models())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("c")
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        select = screen.query_one("#chat-placement", Select)
        await pilot.pause(0.3)  # the placements are listed on the screen's first poll
        # The menu: the blank row, deepseek-v3, qwen3-32b, tp.
        for key in ("ctrl+l", "down", "down", "down", "down", "enter"):
            await pilot.press(key)
            await pilot.pause()
        assert select.selection == "tp"
        card = content(screen, "#chat-nodes")
        roles = {w[1]: w[2] for w in (line.split() for line in card.splitlines()[2:]) if w}
        assert roles == {
            "studio-1": "head",
            "studio-2": "head",
            "studio-3": "tail",
            "studio-4": "tail",
        }, card
        assert app.focused is not None and app.focused.id == "chat-prompt"
        await pilot.press("h", "i")
        assert screen.query_one("#chat-prompt", Input).value == "hi"


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_the_nodes_card_fits_the_side_panel(tmp_path: Path, size: tuple[int, int]) -> None:
    """At 80x24 the side panel is 30 cells (29 with its scrollbar): the card's rows
    (node, role, layers, reqs) folded there; now the role gives way, nothing folds."""
    from tests.support.app_fixtures import fixed_models, fixed_state

    app = StudioApp(tmp_path, state=fixed_state(), models=fixed_models())
    async with app.run_test(size=size) as pilot:
        await pilot.press("c")
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        await pilot.pause(0.3)  # the placements are listed on the screen's first poll
        screen.query_one("#chat-placement", Select).value = "deepseek-v3"
        await pilot.pause(0.2)
        card = screen.query_one("#chat-nodes", chat.Drawing)
        lines = content(screen, "#chat-nodes").splitlines()
        width = card.content_size.width
        # Every row within the width, and drawn on as many lines as there are rows.
        assert max(len(line) for line in lines) <= width, (width, lines)
        assert card.size.height == len(lines) == 4, (card.size, lines)
        assert lines[1].split()[-1] == "reqs" and lines[2].split()[-1] == "2", lines
        assert ("role" in lines[1]) == (size[0] >= 160), lines
