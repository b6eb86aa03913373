"""The chat's conversation without a screen: budgeting and command parsing as pure
functions, the history's thread (order, off the event loop, nothing lost on close),
and a `ChatSession` answering from a real agent on 127.0.0.241:59700 (a whole demo
model on one node). No Textual here: the session is what the chat screen drives.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from studiotui.chat import conversation as conversation_module
from studiotui.chat.budget import (
    CALIBRATE_CHARS,
    CONTEXT_TOKENS,
    PASSAGE_SHARE,
    TEMPLATE_TOKENS,
    learned_ratio,
    passage_room,
    prompt_budget_chars,
)
from studiotui.chat.commands import COMMANDS, Command, parse_command, suggest
from studiotui.chat.conversation import NO_CLUSTER, ChatSession, Target, Turn
from studiotui.chat.history import History, HistoryError, Message, Settings
from studiotui.chat.store import HistoryStore
from studiotui.cluster.controller import Controller
from studiotui.cluster.session import wait_until_up
from studiotui.core.inventory import Inventory
from tests.support.cluster_fixture import placed_cluster
from worker.shared.demo_model import DemoSpec
from worker.shared.protocol import control

BASE, PORT = 241, 59700
LONG = "tell me a long story"

pytestmark = pytest.mark.timeout(120)


# ---- budgeting (pure) -------------------------------------------------------------


def test_passages_get_a_share_of_what_the_system_prompt_and_question_leave() -> None:
    budget = prompt_budget_chars(512, 1.0)
    assert passage_room(budget, "", "") == int(budget * PASSAGE_SHARE)
    assert passage_room(budget, "s" * 100, "q" * 50) == int((budget - 150) * PASSAGE_SHARE)
    # A question longer than the budget leaves no room, not a negative one.
    assert passage_room(100, "", "q" * 500) == 0


def test_the_ratio_is_learned_only_from_prompts_long_enough_and_kept_sane() -> None:
    # Mostly template: teaches nothing.
    assert learned_ratio(CALIBRATE_CHARS - 1, 5000) is None
    assert learned_ratio(CALIBRATE_CHARS, TEMPLATE_TOKENS) is None
    assert learned_ratio(CALIBRATE_CHARS, None) is None
    assert learned_ratio(4000, 1000 + TEMPLATE_TOKENS) == 4.0
    # A broken count cannot make the budget absurd either way.
    assert learned_ratio(100_000, TEMPLATE_TOKENS + 1) == 8.0
    assert learned_ratio(2000, 100_000) == 0.5


# ---- commands (pure) --------------------------------------------------------------


def test_a_line_is_a_command_only_when_it_names_one() -> None:
    assert parse_command("/help") == Command("/help", "")
    assert parse_command("  /rename  My notes  ") == Command("/rename", "My notes")
    assert parse_command("/rename\tTabbed title") == Command("/rename", "Tabbed title")
    assert parse_command("/attach ~/a file.pdf") == Command("/attach", "~/a file.pdf")
    # Not a command: asked as a question.
    assert parse_command("/usr/bin is where?") is None
    assert parse_command("what does /help do?") is None
    assert parse_command("") is None


def test_suggestions_complete_a_command_then_a_path(tmp_path: Path) -> None:
    assert suggest("/he") == "/help "
    assert suggest("/help") is None  # complete already
    assert suggest("/zz") is None
    assert suggest("hello") is None
    (tmp_path / "report.pdf").write_text("x")
    assert suggest(f"/attach {tmp_path}/rep") == f"/attach {tmp_path}/report.pdf"
    assert set(COMMANDS) >= {"/attach", "/detach", "/rename", "/system", "/new", "/export"}


def test_a_turn_ends_with_the_figures_the_history_keeps() -> None:
    user = Message(1, 1, 0.0, "user", "q")
    answer = Message(2, 1, 0.0, "assistant", "")
    turn = Turn(user, answer, "demo", {}, {}, {"seed": 3}, chars_sent=1, started=10.0)
    turn.first_at, turn.tokens = 10.5, 11
    stopped = Turn(user, answer, "demo", {}, {}, {}, chars_sent=1, stopped=True)
    assert stopped.final_meta(11.0)["stopped"] is True
    assert stopped.final_meta(11.0)["finish_reason"] == "stopped"
    turn.done = control.Done(
        rid="r",
        finish_reason="length",
        usage={"prompt_tokens": 40, "completion_tokens": 11},
        timings={"decode_tps": 25.0},
    )
    meta = turn.final_meta(11.5)
    assert meta["seed"] == 3 and meta["ttft_ms"] == 500.0 and meta["decode_tps"] == 25.0
    assert meta["finish_reason"] == "length" and meta["prompt_tokens"] == 40
    assert "stopped" not in meta and "error" not in meta
    # Without the tail's figure, the rate seen here: 10 tokens after the first in 1 s.
    turn.done = None
    turn.error = "the head went away"
    meta = turn.final_meta(11.5)
    assert meta["decode_tps"] == 10.0 and meta["error"] == "the head went away"
    assert meta["finish_reason"] == "error"


def test_the_rate_line_ends_with_the_stretch_after_its_last_sample() -> None:
    user = Message(1, 1, 0.0, "user", "q")
    answer = Message(2, 1, 0.0, "assistant", "")
    turn = Turn(user, answer, "demo", {}, {}, {}, chars_sent=1, started=10.0)
    turn.first_at, turn.tokens = 10.1, 20
    assert turn.sample_rate(10.5, 0.25, 120)  # 20 tokens in 0.5 s
    turn.tokens = 50  # the answer ended before the next sample was due
    assert turn.final_meta(10.6)["spark"] == [40.0, 300.0]
    # Read again, nothing is added twice.
    assert turn.final_meta(10.7)["spark"] == [40.0, 300.0]


# ---- the history's thread ---------------------------------------------------------


async def test_writes_run_in_order_on_the_history_thread_not_the_event_loop(
    tmp_path: Path,
) -> None:
    store, problem = await HistoryStore.open(tmp_path)
    assert problem is None
    conv = await store.call(History.create, "t")
    answer = await store.call(History.add_message, conv.id, "assistant", "")
    loop_thread = threading.get_ident()
    gate = threading.Event()
    seen: list[tuple[int, str]] = []

    def held(history: History) -> None:
        # Blocks the history's thread until the event loop opens the gate: were it
        # run on the loop, the loop could never open it.
        seen.append((threading.get_ident(), "held"))
        assert gate.wait(10), "the gate was never opened"

    def update(history: History, text: str) -> None:
        seen.append((threading.get_ident(), text))
        history.update_message(answer.id, text)

    store.write(held)
    for text in ("a", "ab", "abc"):
        store.write(update, text)
    final = store.write(History.update_message, answer.id, "abcd", {"finish_reason": "length"})
    await asyncio.sleep(0.05)
    assert not final.done(), "a write ran before the one queued ahead of it"
    gate.set()
    [message] = await store.call(History.messages, conv.id)
    assert final.done()
    assert message.content == "abcd" and message.meta == {"finish_reason": "length"}
    assert [text for _, text in seen] == ["held", "a", "ab", "abc"]
    assert all(thread != loop_thread for thread, _ in seen)
    store.close().result(timeout=10)
    with pytest.raises(HistoryError, match="closed"):
        store.write(History.latest)


async def test_a_failed_write_is_reported_on_the_event_loop(tmp_path: Path) -> None:
    problems: list[tuple[str, int]] = []
    store, _ = await HistoryStore.open(
        tmp_path, lambda text: problems.append((text, threading.get_ident()))
    )
    store.write(History.rename, 999, "no such conversation")
    await store.call(History.latest)  # after the failed write
    for _ in range(100):
        if problems:
            break
        await asyncio.sleep(0.01)
    assert problems == [("no conversation 999", threading.get_ident())]
    store.close()


async def test_an_unreadable_history_leaves_a_chat_kept_in_memory(tmp_path: Path) -> None:
    # (A file that is no database is kept aside and a new history started: see
    # test_history. What cannot be opened at all, like a folder in its place, leaves
    # this session's chat in memory.)
    (tmp_path / "chat.sqlite3").mkdir()
    store, problem = await HistoryStore.open(tmp_path)
    assert problem is not None and "cannot open the chat history" in problem
    conv = await store.call(History.create, "in memory")
    assert (await store.call(History.latest)) == conv
    store.close()


# ---- a session, no cluster --------------------------------------------------------


@contextlib.asynccontextmanager
async def session_in(home: Path) -> AsyncIterator[ChatSession]:
    store, problem = await HistoryStore.open(home)
    assert problem is None
    session = ChatSession(store, home / "exports")
    try:
        await session.open_latest()
        yield session
    finally:
        session.close()
        await asyncio.wrap_future(store.close())


@contextlib.contextmanager
def history_in(home: Path) -> Iterator[History]:
    """The history as another process would read it."""
    history = History.open(home)
    try:
        yield history
    finally:
        history.close()


async def test_commands_and_documents_without_a_cluster(tmp_path: Path) -> None:
    doc = tmp_path / "notes.md"
    doc.write_text("# Notes\n\nThe vault code is tangerine.\n")
    async with session_in(tmp_path) as session:
        reply = await session.command(Command("/attach", str(tmp_path / "missing.txt")))
        assert "missing.txt does not exist" in reply.report and reply.level == "warning"
        assert session.conversation is None, "a failed attach made a conversation"
        reply = await session.command(Command("/attach", str(doc)), placement="demo")
        assert "attached notes.md" in reply.notify and "documents" in reply.redraw
        assert (await session.command(Command("/attach", ""))).then == "pick-file"
        await session.command(Command("/rename", "  My   notes "))
        assert session.conversation is not None
        assert session.conversation.title == "My notes"
        assert session.conversation.placement == "demo"
        reply = await session.command(Command("/system", "Be terse."))
        assert reply.status == "system prompt set" and "system" in reply.redraw
        said = (await session.command(Command("/help", ""))).status
        assert "/attach PATH" in said
        # The answer's settings are named too (/help named none of them).
        assert all(word in said for word in ("temperature", "top-p", "max tokens")), said
        # A question goes with the document's passage, kept apart from what was typed.
        turn = await session.ask("What is the vault code?", Target("demo"))
        await session.run(turn, None)
        assert turn.finished and turn.error == NO_CLUSTER
        assert turn.request["messages"][0] == {"role": "system", "content": "Be terse."}
        assert "tangerine" in turn.request["messages"][-1]["content"]
        assert turn.answer.meta["passages"] == [{"document": "notes.md", "passages": [1]}]
        reply = await session.command(Command("/detach", "other.md"))
        assert reply.status == "no document named 'other.md' (attached: notes.md)"
        reply = await session.command(Command("/detach", ""))
        assert reply.status == "detached notes.md" and session.documents == []
        reply = await session.command(Command("/export", ""))
        assert "exported 'My notes' to" in reply.report
        conv_id = session.conversation.id

    with history_in(tmp_path) as history:
        conv = history.get(conv_id)
        assert conv.title == "My notes" and conv.settings.system_prompt == "Be terse."
        assert history.documents(conv_id) == []
        [question, answer] = history.messages(conv_id)
        assert question.content == "What is the vault code?"
        assert question.sent is not None and "tangerine" in question.sent
        assert answer.meta["error"] == NO_CLUSTER
        assert list((tmp_path / "exports").glob("*-my-notes.md"))


# ---- a session answering from a real agent ----------------------------------------


@pytest.fixture(scope="module")
def conv_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Inventory]]:
    spec = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32")
    home = tmp_path_factory.mktemp("conversation-home")
    for local in placed_cluster(home, 1, BASE, PORT, spec):
        yield local.home, local.inventory


@contextlib.asynccontextmanager
async def controller_of(home: Path, inv: Inventory) -> AsyncIterator[Controller]:
    ctl = Controller(home, inv)
    try:
        await wait_until_up(ctl, list(inv.names), timeout=30.0)
        for _ in range(100):
            state = await ctl.refresh()
            if any(p.state == "ready" for p in state.placements):
                break
            await asyncio.sleep(0.1)
        yield ctl
    finally:
        await ctl.close()


def target(ctl: Controller) -> Target:
    return Target("demo", ctl.state.placement("demo"))


async def long_answer_under_way(session: ChatSession, ctl: Controller) -> tuple[Turn, Any]:
    """An answer of up to 2000 tokens, some tokens in, and the task making it."""
    session.use_settings(Settings(temperature=0.0, max_tokens=2000))
    turn = await session.ask(LONG, target(ctl))
    task = asyncio.create_task(session.run(turn, ctl))
    for _ in range(400):
        if turn.tokens >= 8:
            break
        await asyncio.sleep(0.05)
    assert turn.tokens >= 8, "no tokens came"
    return turn, task


async def test_an_answer_is_streamed_and_kept_with_its_checkpoints_in_order(
    conv_cluster: tuple[Path, Inventory], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, inv = conv_cluster
    # Every token is checkpointed, so the final write races as many earlier ones as it can.
    monkeypatch.setattr(conversation_module, "CHECKPOINT_S", 0.0)
    writes: list[tuple[int, int, bool]] = []
    original = History.update_message

    def recording(self: History, message_id: int, content: str, meta: Any = None) -> None:
        writes.append((threading.get_ident(), len(content), meta is not None))
        original(self, message_id, content, meta)

    monkeypatch.setattr(History, "update_message", recording)
    async with controller_of(home, inv) as ctl, session_in(tmp_path) as session:
        session.use_settings(Settings(temperature=0.0, max_tokens=24))
        turn = await session.ask("hello", target(ctl))
        assert session.answering
        await session.run(turn, ctl)
        assert turn.finished and not session.answering
        assert turn.error is None and not turn.stopped, turn.error
        assert turn.tokens == 24 and turn.text
        assert turn.meta["finish_reason"] == "length" and turn.meta["completion_tokens"] == 24
        assert turn.meta["nodes"] == ["local-1"] and turn.take_pending() == turn.text
        conv_id = session.conversation.id  # type: ignore[union-attr]
    # The checkpoints grew with the text, on the history's thread; the final write (with
    # its meta) came last, so what is stored is the whole answer.
    loop_thread = threading.get_ident()
    assert len(writes) >= 3 and all(thread != loop_thread for thread, _, _ in writes)
    lengths = [n for _, n, _ in writes]
    assert lengths == sorted(lengths) and writes[-1][2] and not any(m for *_, m in writes[:-1])
    with history_in(tmp_path) as history:
        [question, answer] = history.messages(conv_id)
        assert question.content == "hello" and answer.content == turn.text
        assert answer.meta["completion_tokens"] == 24


async def test_closing_mid_answer_keeps_what_arrived(
    conv_cluster: tuple[Path, Inventory], tmp_path: Path
) -> None:
    home, inv = conv_cluster
    async with controller_of(home, inv) as ctl:
        store, _ = await HistoryStore.open(tmp_path)
        session = ChatSession(store, tmp_path / "exports")
        turn, task = await long_answer_under_way(session, ctl)
        # What the screen does when it goes away: close, then cancel the answer's task.
        session.close()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert turn.finished and turn.stopped and turn.error is None
        kept = turn.text
        assert kept and turn.tokens < 2000
        await asyncio.wrap_future(store.close())
        # The cancel reached the shard: its cache is freed.
        for _ in range(100):
            state = await ctl.refresh()
            if not any(s.in_flight for n in state.nodes for s in n.shards):
                break
            await asyncio.sleep(0.1)
        assert not any(s.in_flight for n in state.nodes for s in n.shards)
    with history_in(tmp_path) as history:
        [conv] = history.conversations()
        [question, answer] = history.messages(conv.id)
        assert question.content == LONG
        assert answer.content == kept and answer.meta["stopped"] is True
        assert answer.meta["finish_reason"] == "stopped"


async def test_stop_leaves_a_draft_that_asking_replaces_and_regenerate_remakes(
    conv_cluster: tuple[Path, Inventory], tmp_path: Path
) -> None:
    home, inv = conv_cluster
    async with controller_of(home, inv) as ctl, session_in(tmp_path) as session:
        turn, task = await long_answer_under_way(session, ctl)
        assert session.stop() is turn
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert session.draft == (turn.user.id, turn.answer.id)
        assert [m.role for m in session.messages] == ["user", "assistant"]

        session.use_settings(Settings(temperature=0.0, max_tokens=6))
        again = await session.ask(LONG, target(ctl))
        assert again.replaced == (turn.user.id, turn.answer.id) and session.draft is None
        await session.run(again, ctl)
        assert again.error is None and again.tokens == 6

        first_text = again.text
        remade = await session.regenerate(target(ctl))
        assert remade.user.id == again.user.id and remade.replaced == (again.answer.id,)
        await session.run(remade, ctl)
        # Greedy: the same question makes the same answer.
        assert remade.text == first_text
        assert [m.id for m in session.messages] == [again.user.id, remade.answer.id]
        conv_id = session.conversation.id  # type: ignore[union-attr]
    with history_in(tmp_path) as history:
        stored = history.messages(conv_id)
        assert [m.id for m in stored] == [again.user.id, remade.answer.id]
        assert stored[1].content == first_text and stored[1].meta["completion_tokens"] == 6


async def test_a_long_prompt_teaches_the_placement_its_characters_per_token(
    conv_cluster: tuple[Path, Inventory], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, inv = conv_cluster
    monkeypatch.setattr(ChatSession, "chars_per_token", {})
    async with controller_of(home, inv) as ctl, session_in(tmp_path) as session:
        session.use_settings(Settings(temperature=0.0, max_tokens=2))
        where = target(ctl)
        # The model is on this machine: its own tokenizer (byte-level: one character,
        # one token) is measured before any answer.
        assert await session.ratio(where) == 1.0
        question = " ".join(["word"] * 500)  # 2,499 characters
        turn = await session.ask(question, where)
        await session.run(turn, ctl)
        assert turn.error is None and turn.prompt_tokens is not None
        assert turn.chars_sent >= CALIBRATE_CHARS
        learned = ChatSession.chars_per_token["demo"]
        assert learned == turn.chars_sent / (turn.prompt_tokens - TEMPLATE_TOKENS)
        assert 0.9 < learned < 1.2
        assert await session.ratio(where) == learned
        # A budget from it still leaves room for the answer in the default context.
        assert prompt_budget_chars(2, learned) < CONTEXT_TOKENS * 1.2
