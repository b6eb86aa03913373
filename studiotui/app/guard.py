"""A safety net under every key: an action that raises is reported, not a traceback.

Textual ends the app on an exception escaping an action; for an operator watching a
cluster that is the worst outcome, so each `action_*` of a guarded class reports
the failure (notification + Log pane) and the dashboard keeps running.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


def report_failure(node: Any, action: str, exc: BaseException) -> None:
    app = node if hasattr(node, "report") else getattr(node, "app", None)
    text = f"{action.replace('_', ' ')} failed: {type(exc).__name__}: {exc}"
    report = getattr(app, "report", None)
    if callable(report):
        report(text, "error")
    elif app is not None:
        app.notify(text, severity="error")


def _guarded(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    action = name.removeprefix("action_")
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def run_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return await method(self, *args, **kwargs)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                report_failure(self, action, exc)
                return None

        return run_async

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            report_failure(self, action, exc)
            return None

    return run


def guard_actions(cls: T) -> T:
    """Wrap the `action_*` methods the class itself defines."""
    for name, member in list(vars(cls).items()):
        if name.startswith("action_") and inspect.isfunction(member):
            setattr(cls, name, _guarded(name, member))
    return cls
