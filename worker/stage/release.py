"""A request's end on this stage: done, freed, failed."""

from __future__ import annotations

import statistics
import time
from typing import Any

import msgspec

from worker.shared.protocol.frames import RingHeader
from worker.stage.base import StageBase


class Release(StageBase):
    """A request's end on this stage: done, freed, failed."""

    def _finish(self, rid: str, reason: str) -> None:
        req = self.head_requests.pop(rid)
        self.stats.finished += 1
        end = time.perf_counter()
        first = req.first_token_at or end
        decode_s = end - first
        usage: dict[str, Any] = {
            "prompt_tokens": len(req.prompt),
            "completion_tokens": req.generated,
            "cached_tokens": req.cached,
        }
        if req.spec is not None:
            # OpenAI's names (Predicted Outputs): guesses kept and rejected.
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": req.spec.kept,
                "rejected_prediction_tokens": req.spec.rejected,
            }
            if req.spec.off:
                usage["speculation_off"] = req.spec.off
        timings = {
            "ttft_ms": (first - req.started) * 1000,
            "total_ms": (end - req.started) * 1000,
            "decode_tps": (req.generated - 1) / decode_s if decode_s > 0 else 0.0,
        }
        if req.hops_us:
            # This answer's own hops, so a hop can be paired with what else was measured
            # in its minute (`studiotui bench` pairs it with the bare hop's).
            timings["hop_us_p50"] = statistics.median(req.hops_us)
        # Which stop string ended the answer: Anthropic's API names it (stop_sequence).
        matched = {"stop": req.stream.matched} if req.stream.matched else {}
        # A verify step computed ahead for a step that will not come: out of the caches
        # before they are kept.
        self._drop_verify_ahead(rid)
        extra = self._keep_plan(req)
        if extra.get("drop"):
            self._forget(extra["drop"])
        if extra.get("keep"):
            self._keep(rid, extra["keep"])
        self._free(rid, forward=True, extra=extra)
        # The answer is done for its client only once the ring has been told what to
        # keep of it: an unload the client sends on "done" reaches each stage after
        # that word (a stopping runner still runs the frees it heard: Runner.settle).
        self.links.to_client(
            req.client,
            "done",
            rid=rid,
            finish_reason=reason,
            usage=usage,
            timings=timings,
            **matched,
        )
        self._admit_waiting()

    def _free(self, rid: str, forward: bool, extra: dict[str, Any] | None = None) -> None:
        self._leave_group(rid)
        self.snapshots.pop(rid, None)
        self.answer_snaps.pop(rid, None)
        self.finished.pop(rid, None)
        if self.lanes:
            self._leave_lane(rid)
        self.caches.pop(rid, None)
        self.prebuilt.pop(rid, None)
        self.verify_ahead.pop(rid, None)
        self.slots.pop(rid, None)
        self.sent_at.pop(rid, None)
        self.tail_requests.pop(rid, None)
        self.rewind_floor.pop(rid, None)
        if forward and not self.shard.is_last:
            self.links.to_next(RingHeader(rid=rid, kind="free", extra=extra or {}), None)

    def _fail(self, rid: str, message: str) -> None:
        """This stage could not run `rid`: free it here and tell the head."""
        self.stats.errors += 1
        self._leave_group(rid)
        self.snapshots.pop(rid, None)
        self.answer_snaps.pop(rid, None)
        self.finished.pop(rid, None)
        self.caches.pop(rid, None)
        self.prebuilt.pop(rid, None)
        self.verify_ahead.pop(rid, None)
        self.slots.pop(rid, None)
        self.tail_requests.pop(rid, None)
        self.rewind_floor.pop(rid, None)
        header = RingHeader(rid=rid, kind="error", message=message)
        if self.shard.is_first:
            self._on_error(header)
        elif self.shard.is_last:
            self.links.to_head(header)
        else:
            self.links.to_next(header, None)

    def _on_error(self, header: RingHeader) -> None:
        rid = header.rid
        if self.shard.is_first:
            lane = next((each for each in self.lanes if each.gid == rid), None)
            if lane is not None and rid not in self.head_requests:
                # A batch's frame itself was unusable (a bad frame names the batch):
                # every request in that step fails, rather than waiting for ever.
                for member in sorted(lane.flying):
                    self._on_error(msgspec.structs.replace(header, rid=member))
                return
            req = self.head_requests.pop(rid, None)
            if req is not None:
                self.links.to_client(req.client, "failed", rid=rid, message=header.message)
                self._free(rid, forward=True)
                self._admit_waiting()
            return
        self._free(rid, forward=False)
        if self.shard.is_last:
            self.links.to_head(header)
        else:
            self.links.to_next(header, None)
