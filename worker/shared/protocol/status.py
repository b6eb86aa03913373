"""The statuses that travel or are shown, as `Literal` types mypy checks.

Both sides name a shard's, a node's and a placement's status with these strings:
a typo or a status one side does not know fails the type check, and a message
carrying an unknown one fails `control.parse` (a malformed message, counted or
answered with an error like any other).
"""

from __future__ import annotations

from typing import Literal

# A shard as its agent runs it: prepared (ports reserved), loading, ready, silent
# (loaded but its runner stopped beating), failed, stopped (unloaded on purpose).
# "unknown" is only the operator's default for a report that names none.
ShardStatus = Literal["prepared", "loading", "ready", "silent", "failed", "stopped", "unknown"]

# A node as the controller sees it: unknown (not asked yet), up (telemetry or a hello
# within DOWN_AFTER_S), down, provisioning (being installed or restarted).
NodeStatus = Literal["unknown", "up", "down", "provisioning"]

# A placement, derived from its shards (studiotui.core.state.PlacementState.state).
PlacementStatus = Literal["ready", "broken", "failed", "loading", "prepared"]

# A model file in a node's folder, against the model's (worker.files.status).
FileState = Literal["same", "differs", "missing"]

# The controller's event log.
LogLevel = Literal["info", "warning", "error"]
