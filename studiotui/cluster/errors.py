"""What the controller's verbs raise: words for the operator, kinds for the callers."""

from __future__ import annotations

from studiotui.core.errors import StudioError
from studiotui.core.placement import Refusal
from worker.shared.protocol.messages import ErrorCode


class PlacementError(StudioError, RuntimeError):
    pass


class PlacementRefused(PlacementError):
    """The plan refused the placement (`refusal` says what kind) when it was placed: the
    cluster changed since the preview, or memory another placement holds a promise on."""

    def __init__(self, message: str, refusal: Refusal) -> None:
        super().__init__(message)
        self.refusal = refusal


class GenerationError(StudioError, RuntimeError):
    """A request that got no answer (or no whole one); `code` the head's reason
    (messages.ErrorCode: bad_request for a refused request, busy, ...); `param` the
    request's field the head blamed for a refusal (the `failed` message's), or None."""

    def __init__(self, message: str, code: ErrorCode = "failed", param: str | None = None) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.param = param
