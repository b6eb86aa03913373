"""Driving the command palette from a test without guessing how long a search takes."""

from __future__ import annotations

import time

from textual.app import App
from textual.command import CommandList, CommandPalette
from textual.pilot import Pilot


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
