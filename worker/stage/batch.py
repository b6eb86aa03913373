"""Batched decode: the head's lanes of requests stepping together, and every stage's
groups (mlx-lm's batched caches) that run their rows in one forward."""

from __future__ import annotations

import time
from typing import Any, cast

import mlx.core as mx
import msgspec
import numpy as np

from worker import families
from worker.shared.protocol.frames import RingHeader
from worker.stage.arrays import (
    NP_VIEW,
    dtype_name,
    fill_slot,
)
from worker.stage.base import StageBase
from worker.stage.records import (
    BatchDraw,
    Group,
    HeadRequest,
    Lane,
    Launched,
    RequestError,
    describe,
    drawn_logprobs,
    rows_of,
)


class Batches(StageBase):
    """Lanes of requests stepping together, and the groups that batch them."""

    def _complete_batch(self, step: Launched) -> None:
        header, out = step.header, step.out
        if self.shard.is_last:
            self._sample_batch(step)
            return
        rows = header.batch
        if self.shard.is_first:
            # A request that ended after its row was started (a stop string, a cancel)
            # is left out of the frame: its "free" went down the ring first.
            keep = [i for i, row in enumerate(rows) if row[0] in self.head_requests]
            if not keep:
                return
            if len(keep) < len(rows):
                out, rows = out[mx.array(keep)], tuple(rows[i] for i in keep)
        self._mlx(mx.eval, out)
        extra = self._carry(header.extra)
        if self.shard.is_first:
            self.sent_at[header.rid] = time.perf_counter()
        self.links.to_next(
            msgspec.structs.replace(
                header,
                dtype=dtype_name(out),
                shape=tuple(out.shape),
                batch=rows,
                extra=extra,
            ),
            out,
        )

    def _lane(self, rid: str) -> Lane:
        lane = self.lane_of.get(rid)
        if lane is None:
            lane = min(self.lanes, key=lambda each: len(each.members))
            lane.members.append(rid)
            lane.flying.add(rid)
            self.lane_of[rid] = lane
        return lane

    def _leave_lane(self, rid: str) -> None:
        lane = self.lane_of.pop(rid, None)
        if lane is None:
            return
        lane.members.remove(rid)
        lane.ready.pop(rid, None)
        lane.flying.discard(rid)
        if not lane.flying and lane.ready:
            # The step the others waited for will not come back with this one: go on.
            # (Scheduled: this runs inside other bookkeeping.)
            self.schedule(lambda: self._lane_step(lane))

    def _lane_step(self, lane: Lane) -> None:
        self._start_frame()
        step = self._lane_launch(lane)
        if step is not None:
            self._complete_lane(step)

    def _lane_launch(self, lane: Lane) -> Launched | None:
        """Start the lane's next step for every member whose token has come, once none
        is in flight: the rows it already batches first, in their order, then those
        joining. One member goes alone (its own cache, its step built ahead)."""
        if lane.flying or not lane.ready:
            return None
        group = self.groups.get(lane.gid)
        order = [r for r in group.rows if r in lane.ready] if group else []
        order += [r for r in lane.members if r in lane.ready and r not in order]
        tokens = [lane.ready.pop(r) for r in order]
        lane.flying = set(order)
        offsets = [self._head_offset(r) for r in order]
        try:
            if len(order) == 1:
                return self._launch_head(order[0], tokens, "decode", offsets[0], None)
            header = RingHeader(
                rid=lane.gid,
                kind="decode",
                batch=tuple(zip(order, offsets, strict=True)),
            )
            return self._launch_batch(header, np.array(tokens, dtype=np.int32))
        except Exception as exc:
            for rid in order:
                self._fail(rid, describe(exc))
            return None

    def _head_offset(self, rid: str) -> int:
        req = self.head_requests[rid]
        return len(req.prompt) + req.generated - 1

    def _on_batch_tokens(self, header: RingHeader) -> None:
        """A lane's tokens: its next step starts first, then each becomes text."""
        lane = next((each for each in self.lanes if each.gid == header.rid), None)
        if lane is None:
            return
        now = time.perf_counter()
        sent = self.sent_at.pop(header.rid, None)
        if sent is not None and self.hops > 1:
            self._ring_figures(self.frame_began - sent, header.extra)
        arrived: list[tuple[str, HeadRequest, RingHeader]] = []
        for rid, token, finish, drawn in header.batch:
            req = self.head_requests.get(rid)
            if req is None or rid not in lane.flying:
                continue  # cancelled, or failed, while the step computed
            if req.first_token_at is None:
                req.first_token_at = now
            req.generated += 1
            req.out.append(token)
            if not finish:
                lane.ready[rid] = token
            extra = {"logprobs": drawn} if drawn is not None else {}
            arrived.append(
                (
                    rid,
                    req,
                    RingHeader(rid=rid, kind="token", token=token, finish=finish, extra=extra),
                )
            )
        lane.flying = set()
        step = self._lane_launch(lane)
        for rid, req, token in arrived:
            finish = self._deliver(rid, req, token)
            if finish:
                self._finish(rid, finish)
        if step is not None:
            self._complete_lane(step)

    def _complete_lane(self, step: Launched) -> None:
        """Send a lane's step on, unless it was one request's that has ended since it
        started (a batch leaves out the rows that ended, `_complete_batch`)."""
        if step.header.batch or step.header.rid in self.head_requests:
            self._complete_or_fail(step)

    def _on_batch_frame(self, header: RingHeader, payload: bytes | memoryview) -> None:
        rows = rows_of(header)
        if self.shard.is_first:
            self.stats.dropped += 1
            return
        if problem := self._batch_problem(header):
            self.stats.dropped += 1
            for rid in rows:
                self._fail(rid, problem)
            return
        try:
            flat = np.frombuffer(payload, dtype=NP_VIEW[header.dtype])
            step = self._launch_batch(header, flat)
        except Exception as exc:  # one bad batch must not take the stage down
            for rid in rows:
                self._fail(rid, describe(exc))
            return
        if step is not None:
            self._complete_or_fail(step)

    def _batch_problem(self, header: RingHeader) -> str | None:
        shape = header.shape
        if header.kind != "decode":
            return "only decode steps are batched"
        wide = self.hidden or "hidden"
        if len(shape) != 3 or shape[0] != len(header.batch) or shape[1] != 1:
            return f"batch activation shape {list(shape)} is not [{len(header.batch)}, 1, {wide}]"
        if self.hidden and shape[2] != self.hidden:
            return f"batch activation shape {list(shape)} is not [{shape[0]}, 1, {wide}]"
        for rid, offset, *_ in header.batch:
            if offset + 1 > self.context_tokens:
                return (
                    f"request {rid!r}: token {offset} is past the context of {self.context_tokens}"
                )
        return None

    def _launch_batch(self, header: RingHeader, flat: np.ndarray) -> Launched | None:
        """Start one step for every row of a batched frame: the rows this stage already
        batches in one forward over their batched caches, and each request joining
        (decoded alone so far) on its own cache, with the step built ahead for it if
        there is one. The joiners' caches then join the batch (mlx-lm's `merge` and
        `extend`); rows the frame no longer names left it (finished) and are dropped."""
        gid, batch = header.rid, [(str(row[0]), int(row[1])) for row in header.batch]
        named = {rid for rid, _ in batch}
        group = self.groups.get(gid)
        if group is not None:
            for rid in [r for r in group.rows if r not in named]:
                self._free(rid, forward=False)
            group = self.groups.get(gid)
        kept = list(group.rows) if group is not None else []
        if [rid for rid, _ in batch[: len(kept)]] != kept:
            raise RequestError(
                f"batch {gid!r} names rows {[rid for rid, _ in batch]}, "
                f"this shard batches {kept} first"
            )
        assert group is not None or not kept
        if group is not None and [off for _, off in batch[: len(kept)]] != group.offsets:
            raise RequestError(
                f"batch {gid!r}: frame is for cache offsets {[off for _, off in batch]}, "
                f"the shard is at {group.offsets}"
            )
        width = flat.size // len(batch)
        rows = flat.reshape(len(batch), width)
        last = self.shard.is_last
        outs: list[Any] = []
        draws: dict[str, Any] = {}
        greedy: mx.array | None = None
        if kept:
            assert group is not None
            h = self._input(header, rows[: len(kept)])
            out = self.shard.forward(h, group.caches)
            if last:
                greedy, more = self._draw_rows(kept, out[:, -1, :])
                draws.update(more)
            else:
                outs.append(out)
        done = list(kept)
        joined: list[str] = []
        for i, (rid, offset) in enumerate(batch[len(kept) :], start=len(kept)):
            one = RingHeader(
                rid=rid,
                kind="decode",
                offset=offset,
                dtype=header.dtype,
                shape=(1, *header.shape[1:]),
            )
            step: Any
            try:
                pre = self._take_prebuilt(one)
                if pre is not None:
                    if pre.slot is not None:
                        fill_slot(pre.slot, rows[i])
                    step = pre.out
                else:
                    step = self.shard.forward(
                        self._input(one, rows[i : i + 1]), self._cache_for(one)
                    )
                    if last:
                        step = self._tail(one).sampler.draw(self.shard.logits(step))
            except Exception as exc:  # this request alone fails; the others go on
                self._fail(rid, describe(exc))
                continue
            if last:
                draws[rid] = step
            else:
                outs.append(step)
            done.append(rid)
            joined.append(rid)
        if joined:
            self._join(gid, joined, [off for rid, off in batch if rid in joined])
        group = self.groups.get(gid)
        if group is not None:
            group.offsets = [off + 1 for off in group.offsets]
        if not done:
            return None  # every row failed, each on its own: nothing goes on
        if len(done) > 1:
            self.stats.batched += 1
            self.stats.batched_rows += len(done)
        offset_of = dict(batch)
        rows_done = tuple((rid, offset_of[rid]) for rid in done)
        result: Any
        if last:
            result = BatchDraw(rows=tuple(done), greedy=greedy, draws=draws)
            self._mlx(mx.async_eval, [x for x in (greedy, *draws.values()) if x is not None])
        else:
            result = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
            self._mlx(mx.async_eval, result)
        return Launched(header=msgspec.structs.replace(header, batch=rows_done), out=result)

    def _input(self, header: RingHeader, rows: np.ndarray) -> mx.array:
        """A step's input from its rows' bytes: token ids on the head, else activations
        (bfloat16 travels as its bits)."""
        if self.shard.is_first:
            return self.shard.embed(mx.array(rows.reshape(len(rows), 1)))
        arr = mx.array(rows)
        if header.dtype == "bfloat16":
            arr = arr.view(mx.bfloat16)
        return arr.reshape(len(rows), 1, -1)

    def _draw_rows(
        self, rids: list[str], logits: mx.array
    ) -> tuple[mx.array | None, dict[str, Any]]:
        """Each row's token by its own sampler (its own PRNG key, its own logits
        processors over its own recent tokens): rows that are greedy on the model's own
        logits and want no log-probabilities share one argmax, which is what each would
        take."""
        samplers = [self.tail_requests[rid].sampler for rid in rids]
        if all(s.plain for s in samplers):
            return mx.argmax(logits, axis=-1), {}
        return None, {
            rid: s.draw(logits[i]) for i, (rid, s) in enumerate(zip(rids, samplers, strict=True))
        }

    def _join(self, gid: str, rids: list[str], offsets: list[int]) -> None:
        """Requests that ran this step alone join batch `gid` for the next."""
        solos = [self.caches.pop(rid) for rid in rids]
        for rid in rids:
            self.slots.pop(rid, None)
            self.prebuilt.pop(rid, None)
            self.group_of[rid] = gid
        merged = families.merge_caches(solos)
        group = self.groups.get(gid)
        if group is None:
            self.groups[gid] = Group(rows=list(rids), offsets=list(offsets), caches=merged)
            return
        families.extend_caches(group.caches, merged)
        group.rows += rids
        group.offsets += offsets

    def _leave_group(self, rid: str) -> None:
        """Drop `rid`'s row from its batch (freed, failed, finished, or decoded alone)."""
        gid = self.group_of.pop(rid, None)
        if gid is None:
            return
        group = self.groups[gid]
        keep = [i for i, r in enumerate(group.rows) if r != rid]
        if not keep:
            del self.groups[gid]
            return
        families.filter_caches(group.caches, keep)
        group.rows = [group.rows[i] for i in keep]
        group.offsets = [group.offsets[i] for i in keep]

    def _extract(self, rid: str) -> None:
        group = self.groups[self.group_of[rid]]
        i = group.rows.index(rid)
        self.caches[rid] = families.extract_caches(group.caches, i, group.offsets[i])
        self._leave_group(rid)

    def _sample_batch(self, step: Launched) -> None:
        header, drawn = step.header, cast(BatchDraw, step.out)
        tokens: dict[str, int] = {}
        if drawn.greedy is not None:
            greedy_rows = [rid for rid in drawn.rows if rid not in drawn.draws]
            values = cast(list[int], self._mlx(drawn.greedy.tolist))
            tokens.update(zip(greedy_rows, values, strict=True))
        rows: list[tuple[Any, ...]] = []
        for rid in drawn.rows:
            req = self.tail_requests.get(rid)
            if req is None:
                continue  # (a lone stage) it ended after its row was started
            own = drawn.draws.get(rid)
            if own is not None:
                sampled = own[0] if isinstance(own, tuple) else own
                tokens[rid] = int(cast(int, self._mlx(sampled.item)))
            token = tokens[rid]
            req.generated += 1
            self.stats.tokens += 1
            try:
                finish = req.finish_of(token)
            except ValueError as exc:
                self._fail(rid, str(exc))
                continue
            if finish:  # what the tail holds for it; the head frees the rest
                self.tail_requests.pop(rid, None)
                if self.store.budget and rid in self.group_of:
                    self._extract(rid)  # its row, kept until the head's "free" says
                    self.finished[rid] = self.caches.pop(rid)
                else:
                    self._leave_group(rid)
            logprobs = drawn_logprobs(own) if isinstance(own, tuple) else None
            rows.append((rid, token, finish, logprobs))
        extra = self._carry(header.extra)
        self.links.to_head(RingHeader(rid=header.rid, kind="token", batch=tuple(rows), extra=extra))
