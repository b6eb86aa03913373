"""The chat screen's pure parts: what is sent, what is copied, what is completed."""

from __future__ import annotations

from pathlib import Path

from studiotui.app.screens.chat import code_blocks, shard_role
from studiotui.chat.budget import CONTEXT_TOKENS, prompt_budget_chars, request_messages
from studiotui.chat.commands import complete_path
from studiotui.chat.documents import local_chars_per_token
from studiotui.chat.history import Message
from worker.shared.demo_model import DemoSpec, write_demo_model


def msg(i: int, role: str, content: str, sent: str | None = None) -> Message:
    return Message(i, 1, float(i), role, content, sent)


def test_request_carries_the_system_prompt_history_and_the_passages_of_the_last_question():
    history = [
        msg(1, "user", "first question"),
        msg(2, "assistant", "first answer"),
        msg(3, "user", "second", sent="[doc, passage 2]\n…\n\nQuestion: second"),
        msg(4, "assistant", ""),  # failed before any text: not sent
        msg(5, "user", "third", sent="[doc, passage 9]\n…\n\nQuestion: third"),
    ]
    messages, dropped = request_messages("Be brief.", history, budget_chars=10_000)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        # Earlier questions go as typed: their passages would only crowd the context.
        {"role": "user", "content": "second"},
        {"role": "user", "content": "[doc, passage 9]\n…\n\nQuestion: third"},
    ]
    assert dropped == 0


def test_request_drops_the_oldest_turns_to_fit_and_never_starts_with_the_assistant():
    history = [
        msg(1, "user", "q" * 500),
        msg(2, "assistant", "a" * 100),
        msg(3, "user", "now"),
    ]
    messages, dropped = request_messages("", history, budget_chars=200)
    assert messages == [{"role": "user", "content": "now"}]
    assert dropped == 2
    # Room for the answer but not its question: the lone answer goes too.
    messages, dropped = request_messages("", history, budget_chars=150)
    assert [m["role"] for m in messages] == ["user"] and dropped == 2


def test_budget_leaves_room_for_the_answer() -> None:
    assert prompt_budget_chars(512, 1.0) == CONTEXT_TOKENS - 512 - 64
    assert prompt_budget_chars(512, 4.0) == 4 * (CONTEXT_TOKENS - 512 - 64)
    # Asking for more tokens than the context still leaves a floor for the question.
    assert prompt_budget_chars(10_000, 1.0) == CONTEXT_TOKENS // 8
    # A placement made with a smaller context gets prompts that fit it, not the default.
    assert prompt_budget_chars(512, 1.0, 1024) == 1024 - 512 - 64
    assert prompt_budget_chars(512, 1.0, 0) == prompt_budget_chars(512, 1.0)


def test_code_blocks_fenced_and_indented() -> None:
    text = "Run:\n\n```python\nprint(1)\n```\n\nor\n\n    echo hi\n\nand `inline` is not one."
    assert code_blocks(text) == ["print(1)\n", "echo hi\n"]
    assert code_blocks("no code") == []


def test_complete_path(tmp_path: Path) -> None:
    (tmp_path / "report.pdf").write_text("x")
    (tmp_path / "reports").mkdir()
    (tmp_path / "notes.md").write_text("x")
    (tmp_path / ".hidden").write_text("x")
    assert complete_path(f"{tmp_path}/no") == f"{tmp_path}/notes.md"
    assert complete_path(f"{tmp_path}/rep") == f"{tmp_path}/report"  # two candidates
    assert complete_path(f"{tmp_path}/reports") == f"{tmp_path}/reports/"
    assert complete_path(f"{tmp_path}/x") is None
    assert complete_path(f"{tmp_path}/.h") == f"{tmp_path}/.hidden"
    assert complete_path("") is None


def test_roles_and_the_local_tokenizer(tmp_path: Path) -> None:
    assert [shard_role(i, 3) for i in range(3)] == ["head", "middle", "tail"]
    assert shard_role(0, 1) == "whole"
    model = write_demo_model(tmp_path / "demo", DemoSpec(layers=1, hidden=16, heads=2, kv_heads=1))
    # The demo tokenizer is byte-level: one character, one token.
    assert local_chars_per_token(str(model)) == 1.0
    assert local_chars_per_token(str(tmp_path / "missing")) is None


async def test_without_a_cluster_the_chat_says_so_and_commands_work(tmp_path: Path) -> None:
    from textual.widgets import Input, TextArea

    from studiotui.app.app import StudioApp
    from studiotui.app.screens.chat import AnswerView, ChatScreen
    from studiotui.chat.history import History
    from tests.support.app_fixtures import fixed_state

    doc = tmp_path / "notes.md"
    doc.write_text("# Notes\n\nThe vault code is tangerine.\n")
    app = StudioApp(tmp_path, state=fixed_state())
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("c")
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        prompt = screen.query_one("#chat-prompt", Input)

        async def enter(text: str) -> None:
            prompt.value = text
            await pilot.press("enter")
            await pilot.pause(0.2)

        # Of the fixed state's placements only one is ready (qwen3-32b lacks a shard).
        assert screen._chosen_name() == "deepseek-v3"
        assert "studio-2" in str(screen.query_one("#chat-nodes").content)
        await enter("hello")
        await pilot.pause(0.3)
        view = screen.query(AnswerView).last()
        assert "no cluster is connected" in str(view.note.content)

        await enter(f"/attach {tmp_path / 'missing.txt'}")
        assert any("missing.txt does not exist" in n.message for n in app._notifications)
        await enter(f"/attach {doc}")
        await pilot.pause(0.3)
        assert "notes.md" in str(screen.query_one("#chat-docs").content)
        await enter("/rename  My notes ")
        await enter("/system Be terse.")
        assert screen.query_one("#chat-system", TextArea).text == "Be terse."
        await enter("/help")
        said = str(screen.query_one("#chat-status").content)
        assert "/attach PATH" in said
        assert "temperature, top-p and max tokens" in said  # the editable settings
        await enter("/detach notes.md")
        assert "detached notes.md" in str(screen.query_one("#chat-status").content)
        await enter("/export")
        assert screen.conv is not None
        assert list((tmp_path / "exports").glob("*-my-notes.md"))

    history = History.open(tmp_path)
    [conv] = history.conversations()
    assert conv.title == "My notes" and conv.settings.system_prompt == "Be terse."
    assert conv.placement == "deepseek-v3"
    assert history.documents(conv.id) == []
    [question, answer] = history.messages(conv.id)
    assert question.content == "hello" and "no cluster" in answer.meta["error"]


async def test_with_several_placements_the_chat_asks_which(tmp_path: Path) -> None:
    from dataclasses import replace

    from textual.widgets import Input

    from studiotui.app.app import StudioApp
    from studiotui.app.screens.chat import ChatScreen
    from studiotui.core.state import placements_from_shards
    from tests.support.app_fixtures import fixed_state

    state = fixed_state()
    nodes = tuple(
        replace(
            n,
            shards=tuple(
                replace(s, count=1) if s.placement == "qwen3-32b" else s for s in n.shards
            ),
        )
        for n in state.nodes
    )
    state = replace(state, nodes=nodes, placements=placements_from_shards(nodes))
    app = StudioApp(tmp_path, state=state)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("c")
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        assert screen._chosen_name() is None
        prompt = screen.query_one("#chat-prompt", Input)
        prompt.value = "hello"
        await pilot.press("enter")
        status = str(screen.query_one("#chat-status").content)
        assert "several placements are ready (deepseek-v3, qwen3-32b)" in status
        assert prompt.value == "hello" and screen.conv is None


async def test_the_conversations_dialog_keeps_its_keys_whole_at_80_by_24(tmp_path: Path) -> None:
    """The Conversations dialog's line of keys was cut after "esc" at 80x24."""
    from studiotui.app.app import StudioApp
    from studiotui.app.screens.conversations import ConversationsScreen
    from tests.support.app_fixtures import fixed_state
    from tests.support.pilot_helpers import until

    app = StudioApp(tmp_path, state=fixed_state())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("c")
        await pilot.pause(0.3)
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, ConversationsScreen), 5, "the dialog")
        await pilot.pause(0.3)
        dialog = app.screen.query_one("#conv-dialog")
        keys = str(dialog.border_subtitle)
        assert keys.endswith("esc closes"), keys
        # The border's corners and a cell either side of the words take four cells.
        assert len(keys) + 4 <= dialog.outer_size.width, (keys, dialog.outer_size)
