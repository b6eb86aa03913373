"""One pipeline stage's request logic, apart from its sockets.

A stage is a shard plus the per-request state it keeps: a KV cache on every
stage, the client's request on the head, the sampler and text stream on the
tail. It reacts to three things: a client request (head), a ring frame, and a
cancel. What it sends goes through the `Links` it is given, so the same code runs
a one-stage pipeline in a single process and a ring spread over nodes.

The parts, by what they do: `admission` (requests in, prompts scheduled), `step`
(one request's frames and tokens), `batch` (lanes and batched caches), `verify`
(speculative decoding), `reuse` (the prefix cache), `release` (a request's end),
`figures` (the ring's timing), `warmup` (the pieces run once at load); `base` holds
the state they share, `records` and `arrays` the data they pass. `core.Stage` joins
them.
"""

from worker.stage.arrays import NP_VIEW, dtype_name, fill_slot, hidden_size, to_array
from worker.stage.core import Stage
from worker.stage.records import (
    RING_FIGURES,
    WAITING_PER_STREAM,
    BatchDraw,
    Group,
    HeadRequest,
    Lane,
    Launched,
    Links,
    Prebuilt,
    RequestError,
    Stats,
    TailRequest,
    Waiting,
)

__all__ = [
    "NP_VIEW",
    "RING_FIGURES",
    "WAITING_PER_STREAM",
    "BatchDraw",
    "Group",
    "HeadRequest",
    "Lane",
    "Launched",
    "Links",
    "Prebuilt",
    "RequestError",
    "Stage",
    "Stats",
    "TailRequest",
    "Waiting",
    "dtype_name",
    "fill_slot",
    "hidden_size",
    "to_array",
]
