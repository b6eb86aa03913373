"""The dashboard as the palette, the screens and the placing flow know it.

They sit below the app in the house plan (the app composes them), so they are typed
against this base rather than by importing `StudioApp`, its one implementation.
"""

from __future__ import annotations

from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from textual.app import App

from studiotui.cluster.controller import Controller
from studiotui.core.state import ClusterState, LogLevel


class Dashboard(App[None]):
    home: Path
    controller: Controller | None
    cluster: ClusterState

    def report(self, text: str, level: LogLevel = "info") -> None:
        raise NotImplementedError

    def background(self, work: Awaitable[Any], what: str) -> None:
        raise NotImplementedError

    def need_controller(self, what: str) -> Controller | None:
        raise NotImplementedError

    def palette_actions(self) -> list[tuple[str, str, str]]:
        raise NotImplementedError

    async def scan_models(self, settle: bool = False) -> None:
        raise NotImplementedError

    def action_rescan_models(self) -> None:
        raise NotImplementedError

    def theme_names(self) -> list[str]:
        raise NotImplementedError

    def use_theme(self, name: str) -> None:
        raise NotImplementedError
