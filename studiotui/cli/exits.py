"""The command line's exit statuses: one per kind of refusal, so a script can tell a
placement that does not fit from one the group cannot take or a model no shard runs
(docs/exit-codes.md lists them)."""

from __future__ import annotations

from studiotui.core.errors import UserError
from studiotui.core.placement import REFUSAL_KINDS, Refusal

OK = 0
ERROR = 2  # bad input or a missing prerequisite (and argparse's own refusals)
INTERRUPTED = 130
# A placement refused, by kind (core.placement.REFUSAL_KINDS): the same whether the
# preview refused it or the plan made again at placing did (another placement's
# promised memory, the cluster changed since the preview).
REFUSED = {"memory": 3, "shape": 4, "model": 5, "node": 6}
assert set(REFUSED) == set(REFUSAL_KINDS)


def refused(refusal: Refusal) -> int:
    """The exit status of a placement refused for this reason's kind."""
    return REFUSED.get(refusal.kind, ERROR)


class RefusedError(UserError):
    """A refusal raised to the command's top, exiting with its kind's status."""

    def __init__(self, message: str, refusal: Refusal) -> None:
        super().__init__(message)
        self.exit_code = refused(refusal)
