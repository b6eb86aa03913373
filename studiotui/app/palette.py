"""Command palette entries: the app's actions and the theme choice, searchable by name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import cast

from textual.command import DiscoveryHit, Hit, Hits, Provider

from studiotui.app.host import Dashboard


class StudioCommands(Provider):
    def _commands(self) -> list[tuple[str, str, Callable[[], object]]]:
        app = cast(Dashboard, self.app)
        commands: list[tuple[str, str, Callable[[], object]]] = [
            (title, help_text, partial(app.run_action, action))
            for title, help_text, action in app.palette_actions()
        ]
        commands.append(
            ("Chat", "talk to a placement; conversations are kept", partial(app.run_action, "chat"))
        )
        for name in app.theme_names():
            commands.append(
                (f"Theme: {name}", "switch colours (remembered)", partial(app.use_theme, name))
            )
        return commands

    async def discover(self) -> Hits:
        for title, help_text, callback in self._commands():
            yield DiscoveryHit(title, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, callback in self._commands():
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), callback, help=help_text)
