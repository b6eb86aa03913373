"""The chat's status line on coming back to the chat. Found by hand: "no code block
in this answer", said minutes before, was still there after leaving the chat and
coming back."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import Static

from studiotui.app.app import StudioApp
from studiotui.app.screens.chat import ChatScreen
from tests.support.app_fixtures import fixed_state


async def test_a_notice_does_not_outlive_leaving_the_chat(tmp_path: Path) -> None:
    app = StudioApp(tmp_path, state=fixed_state())
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("c")
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        status = screen.query_one("#chat-status", Static)
        await pilot.press("ctrl+b")
        await pilot.pause(0.2)
        assert str(status.content) == "no code block in this answer"
        await pilot.press("escape")
        await pilot.pause(0.2)
        assert not isinstance(app.screen, ChatScreen)
        await pilot.press("c")
        await pilot.pause(0.2)
        assert app.screen is screen and str(status.content) == ""
