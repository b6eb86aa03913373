"""The `Stage`: one pipeline stage's request logic, joined from its parts."""

from __future__ import annotations

from worker.stage.admission import Admission
from worker.stage.batch import Batches
from worker.stage.figures import Figures
from worker.stage.release import Release
from worker.stage.reuse import Reuse
from worker.stage.step import Steps
from worker.stage.verify import Verify
from worker.stage.warmup import WarmUp


class Stage(Admission, Reuse, Verify, Batches, Steps, Release, Figures, WarmUp):
    """A shard plus the per-request state it keeps (`StageBase`), reacting to a client
    request (head), a ring frame and a cancel; what it sends goes through its `Links`."""
