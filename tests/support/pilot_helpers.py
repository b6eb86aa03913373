"""Driving the real app under Pilot without guessing how long things take: waiting on a
condition, and the command palette (whose search runs in the background)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from textual.app import App
from textual.command import CommandList, CommandPalette
from textual.pilot import Pilot


async def until(
    pilot: Any, ok: Callable[[], bool], timeout: float, what: str, step: float = 0.1
) -> None:
    """Let the app run until `ok()` holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await pilot.pause(step)


async def run_from_palette(
    pilot: Pilot, app: App, query: str, expect: str, timeout: float = 10.0
) -> None:
    """Open the palette, type `query`, wait until the highlighted command's title holds
    `expect` (the search runs in the background), and run it."""
    await pilot.press("ctrl+p")
    await pilot.press(*query)
    start = time.monotonic()
    while not _highlighted(app, expect):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"the palette did not offer {expect!r} for {query!r}")
        await pilot.pause(0.05)
    await pilot.press("enter")


def _highlighted(app: App, expect: str) -> bool:
    if not isinstance(app.screen, CommandPalette):
        return False
    commands = app.screen.query_one(CommandList)
    index = commands.highlighted
    if index is None or commands.option_count == 0:
        return False
    return expect.lower() in str(commands.get_option_at_index(index).prompt).lower()
