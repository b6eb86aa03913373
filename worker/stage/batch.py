"""Batched decode: the head's lanes of requests stepping together, and every stage's
groups (mlx-lm's batched caches) that run their rows in one forward."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, cast

import mlx.core as mx
import numpy as np

from worker import families, speculation
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
    row_guesses,
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
            replace(
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
                # Alone this step: its own step (built ahead, or with its guesses).
                req = self.head_requests[order[0]]
                return self._launch_next(order[0], req, tokens[0])
            guesses = self._batch_guesses(order, offsets)
            if guesses is None:
                header = RingHeader(
                    rid=lane.gid,
                    kind="decode",
                    batch=tuple(zip(order, offsets, strict=True)),
                )
                inputs = np.array(tokens, dtype=np.int32)
            else:
                # One verify step for them all: each row its token and its own guesses,
                # padded (with its token) to the row with the most.
                width = 1 + max(len(g) for g in guesses)
                rows = [
                    [t, *g, *[t] * (width - 1 - len(g))]
                    for t, g in zip(tokens, guesses, strict=True)
                ]
                header = RingHeader(
                    rid=lane.gid,
                    kind="verify",
                    shape=(len(order), width),
                    batch=tuple(
                        (rid, off, list(g))
                        for rid, off, g in zip(order, offsets, guesses, strict=True)
                    ),
                )
                inputs = np.array(rows, dtype=np.int32).reshape(-1)
            width = 1 if guesses is None else header.shape[1]
            self.lane_launched[lane.gid] = (len(order) * width, time.perf_counter())
            return self._launch_batch(header, inputs)
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
        launched = self.lane_launched.pop(header.rid, None)
        if launched is not None:
            self.lane_steps.append((launched[0], now - launched[1]))
        # A verify step's: per row, how many of its guesses were kept.
        kept = header.extra.get("kept")
        arrived: list[tuple[str, HeadRequest, RingHeader, list[int], bool]] = []
        for i, (rid, token, finish, drawn) in enumerate(header.batch):
            req = self.head_requests.get(rid)
            if req is None or rid not in lane.flying:
                continue  # cancelled, or failed, while the step computed
            if req.first_token_at is None:
                req.first_token_at = now
            guessed = bool(req.spec is not None and req.spec.in_flight)
            tokens = self._take_verified(req, int(kept[i]) if kept else 0, token)
            if not finish:
                lane.ready[rid] = token
            extra = {"logprobs": drawn} if drawn is not None else {}
            one = RingHeader(rid=rid, kind="token", token=token, finish=finish, extra=extra)
            arrived.append((rid, req, one, tokens, guessed))
        lane.flying = set()
        step = self._lane_launch(lane)
        for rid, req, one, tokens, guessed in arrived:
            if guessed:
                finish = self._deliver_all(rid, req, one, tokens)
            else:
                finish = self._deliver(rid, req, one)
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
        if header.kind not in ("decode", "verify"):
            return "only decode and verify steps are batched"
        wide = self.hidden or "hidden"
        steps = shape[1] if len(shape) == 3 else 0
        most = 1 if header.kind == "decode" else 1 + speculation.MAX_DRAFT_TOKENS
        if len(shape) != 3 or shape[0] != len(header.batch) or not 1 <= steps <= most:
            return (
                f"batch activation shape {list(shape)} is not [{len(header.batch)}, "
                f"{'1' if most == 1 else f'1..{most}'}, {wide}]"
            )
        if self.hidden and shape[2] != self.hidden:
            return f"batch activation shape {list(shape)} is not [{shape[0]}, {steps}, {wide}]"
        for row in header.batch:
            rid, offset = row[0], row[1]
            if offset + steps > self.context_tokens:
                return (
                    f"request {rid!r}: tokens {offset}..{offset + steps} are past the context "
                    f"of {self.context_tokens}"
                )
            if header.kind == "verify":
                guesses = row[2] if len(row) > 2 else None
                if not isinstance(guesses, list | tuple) or len(guesses) > steps - 1:
                    return f"request {rid!r}: a verify row needs its guesses (at most {steps - 1})"
                if not all(
                    isinstance(t, int)
                    and not isinstance(t, bool)
                    and 0 <= t < (self.vocab or 1 << 31)
                    for t in guesses
                ):
                    return f"request {rid!r}: guesses must be token ids"
        return None

    def _launch_batch(self, header: RingHeader, flat: np.ndarray) -> Launched | None:
        """Start one step for every row of a batched frame: the rows this stage already
        batches in one forward over their batched caches, and each request joining
        (decoded alone so far) on its own cache, with the step built ahead for it if
        there is one. The joiners' caches then join the batch (mlx-lm's `merge` and
        `extend`); rows the frame no longer names left it (finished) and are dropped."""
        gid, batch = header.rid, [(str(row[0]), int(row[1])) for row in header.batch]
        verify = header.kind == "verify"
        steps = header.shape[1] if len(header.shape) >= 2 else 1
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
        if group is not None:
            got = [off for _, off in batch[: len(kept)]]
            floors = group.floors or group.offsets
            if not all(f <= g <= o for f, g, o in zip(floors, got, group.offsets, strict=True)):
                raise RequestError(
                    f"batch {gid!r}: frame is for cache offsets {[off for _, off in batch]}, "
                    f"the shard is at {group.offsets}"
                )
            if got != group.offsets:
                # The last step's guesses past each row's offset were rejected: cut them
                # out, each row by its own amount.
                amounts = [o - g for o, g in zip(group.offsets, got, strict=True)]
                speculation.rewind_rows(group.caches, amounts)
                group.offsets = got
            group.floors = None
        width = flat.size // len(batch)
        rows = flat.reshape(len(batch), width)
        last = self.shard.is_last
        outs: list[Any] = []
        draws: dict[str, Any] = {}
        greedy: mx.array | None = None
        logits: list[mx.array] = []  # (tail) a verify step's, row by row
        if kept:
            assert group is not None
            h = self._input(header, rows[: len(kept)])
            out = self.shard.forward(h, group.caches)
            if last and verify:
                logits.append(out)
            elif last:
                greedy, more = self._draw_rows(kept, out[:, -1, :])
                draws.update(more)
            else:
                outs.append(out)
        done = list(kept)
        joined: list[str] = []
        for i, (rid, offset) in enumerate(batch[len(kept) :], start=len(kept)):
            one = RingHeader(
                rid=rid,
                kind=header.kind,
                offset=offset,
                dtype=header.dtype,
                shape=(1, *header.shape[1:]),
            )
            step: Any
            try:
                pre = None if verify else self._take_prebuilt(one)
                if verify and rid in self.prebuilt:
                    # The head verifies only rows without one (`_batch_guesses`).
                    raise RequestError(
                        f"request {rid!r}: its next step was built ahead, it cannot join "
                        "a verify step"
                    )
                if pre is not None:
                    if pre.slot is not None:
                        fill_slot(pre.slot, rows[i])
                    step = pre.out
                else:
                    step = self.shard.forward(
                        self._input(one, rows[i : i + 1]), self._cache_for(one)
                    )
                    if last and not verify:
                        step = self._tail(one).sampler.draw(self.shard.logits(step))
            except Exception as exc:  # this request alone fails; the others go on
                self._fail(rid, describe(exc))
                continue
            if last and verify:
                logits.append(step)
            elif last:
                draws[rid] = step
            else:
                outs.append(step)
            done.append(rid)
            joined.append(rid)
        if joined:
            self._join(gid, joined, [off for rid, off in batch if rid in joined])
        group = self.groups.get(gid)
        if group is not None:
            if verify:
                group.floors = [off + 1 for off in group.offsets]
            group.offsets = [off + steps for off in group.offsets]
        if not done:
            return None  # every row failed, each on its own: nothing goes on
        if len(done) > 1:
            self.stats.batched += 1
            self.stats.batched_rows += len(done)
            self.stats.verified_batches += verify
        row_of = {str(row[0]): row for row in header.batch}
        rows_done = tuple(row_of[rid] for rid in done)
        result: Any
        if last and verify:
            guesses = {rid: row_guesses(row_of[rid]) for rid in done}
            every = logits[0] if len(logits) == 1 else mx.concatenate(logits, axis=0)
            result = self._draw_verify_rows(done, every, guesses)
            pending = [result.greedy, *result.draws.values()]
            self._mlx(mx.async_eval, [x for x in pending if x is not None])
        elif last:
            result = BatchDraw(rows=tuple(done), greedy=greedy, draws=draws)
            self._mlx(mx.async_eval, [x for x in (greedy, *draws.values()) if x is not None])
        else:
            result = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
            self._mlx(mx.async_eval, result)
        return Launched(header=replace(header, batch=rows_done), out=result)

    def _input(self, header: RingHeader, rows: np.ndarray) -> mx.array:
        """A step's input from its rows' bytes: token ids on the head, else activations
        (bfloat16 travels as its bits)."""
        if self.shard.is_first:
            return self.shard.embed(mx.array(rows.reshape(len(rows), -1)))
        arr = mx.array(rows)
        if header.dtype == "bfloat16":
            arr = arr.view(mx.bfloat16)
        return arr.reshape(len(rows), header.shape[1], -1)

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
        if group.floors is not None:
            group.floors = [group.floors[i] for i in keep]

    def _extract(self, rid: str) -> None:
        group = self.groups[self.group_of[rid]]
        i = group.rows.index(rid)
        self.caches[rid] = families.extract_caches(group.caches, i, group.offsets[i])
        if group.floors is not None:
            # Its guesses of the last (verify) step may be cut back on its own cache.
            self.rewind_floor[rid] = group.floors[i]
        self._leave_group(rid)

    def _sample_batch(self, step: Launched) -> None:
        header, drawn = step.header, cast(BatchDraw, step.out)
        verify = header.kind == "verify"
        tokens: dict[str, Any] = {}  # per row its token (a verify step: one per position)
        if drawn.greedy is not None:
            greedy_rows = [rid for rid in drawn.rows if rid not in drawn.draws]
            values = cast(list[Any], self._mlx(drawn.greedy.tolist))
            tokens.update(zip(greedy_rows, values, strict=True))
        rows: list[tuple[Any, ...]] = []
        kept: list[int] = []  # a verify step's: per row, the guesses kept
        for rid in drawn.rows:
            req = self.tail_requests.get(rid)
            if req is None:
                continue  # (a lone stage) it ended after its row was started
            own = drawn.draws.get(rid)
            if isinstance(own, list):  # a row's draws at each verified position
                sampled = [d[0] if isinstance(d, tuple) else d for d in own]
                tokens[rid] = self._mlx(mx.stack(sampled).reshape(-1).tolist)
            elif own is not None:
                sampled_one = own[0] if isinstance(own, tuple) else own
                tokens[rid] = int(cast(int, self._mlx(sampled_one.item)))
            if verify:
                values = tokens[rid] if isinstance(tokens[rid], list) else [tokens[rid]]
                run, finish = self._verified(req, drawn.guesses.get(rid, ()), values, own)
                token = run[-1]
                kept.append(len(run) - 1)
                if isinstance(own, list):
                    logprobs: Any = None
                    if own and isinstance(own[0], tuple):
                        logprobs = [drawn_logprobs(d) for d in own[: len(run)]]
                    self._end_row(rid, finish)
                    rows.append((rid, token, finish, logprobs))
                    continue
            else:
                token = tokens[rid]
                req.generated += 1
                self.stats.tokens += 1
                try:
                    finish = req.finish_of(token)
                except ValueError as exc:
                    self._fail(rid, str(exc))
                    continue
            self._end_row(rid, finish)
            logprobs = drawn_logprobs(own) if isinstance(own, tuple) else None
            rows.append((rid, token, finish, logprobs))
        extra = self._carry(header.extra)
        if verify:
            extra["kept"] = kept
        self.links.to_head(RingHeader(rid=header.rid, kind="token", batch=tuple(rows), extra=extra))

    def _end_row(self, rid: str, finish: str) -> None:
        """(tail) A row whose answer ended: what the tail holds for it goes (its row kept
        until the head's "free" says whether the prefix cache keeps it)."""
        if not finish:
            return
        self.tail_requests.pop(rid, None)
        if self.store.budget and rid in self.group_of:
            self._extract(rid)
            self.finished[rid] = self.caches.pop(rid)
            self.rewind_floor.pop(rid, None)
        else:
            self._leave_group(rid)
