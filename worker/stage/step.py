"""One request's steps: a frame through this shard's layers, the decode step built
ahead while the one before computes, the tail's sampling, the head's tokens back."""

from __future__ import annotations

import time
from typing import Any, cast

import mlx.core as mx
import numpy as np

from worker import speculation
from worker.families import LayerCaches
from worker.prompt_cache import snapshot as snapshot_of
from worker.sampling import (
    Grammar,
    Sampler,
    SamplingParams,
    processor_problem,
)
from worker.shared.protocol.frames import STEPS, RingHeader
from worker.stage.arrays import (
    MX_OF,
    NP_VIEW,
    dtype_name,
    fill_slot,
    to_array,
)
from worker.stage.base import StageBase
from worker.stage.records import (
    HeadRequest,
    Launched,
    Prebuilt,
    RequestError,
    TailRequest,
    describe,
    drawn_logprobs,
    rows_of,
    text_of,
)


class Steps(StageBase):
    """One request's frames through this shard, its sampling and its tokens."""

    def _launch_head(
        self, rid: str, tokens: list[int], kind: str, offset: int, params: SamplingParams | None
    ) -> Launched:
        header = RingHeader(
            rid=rid,
            kind=kind,
            offset=offset,
            params=params.to_dict() if params else None,
            draft=tuple(tokens[1:]) if kind == "verify" else (),
        )
        pre = self._take_prebuilt(header) if kind == "decode" else None
        if pre is not None:
            if pre.slot is not None:
                fill_slot(pre.slot, np.array([tokens], dtype=np.int32))
            return self._launch(header, pre=pre)
        return self._launch(header, self.shard.embed(mx.array([tokens])))

    def on_frame(
        self, header: RingHeader, payload: bytes | memoryview, arrived: float | None = None
    ) -> None:
        """A ring frame; `arrived` is when its socket's recv returned (default: now)."""
        self._start_frame(arrived)
        kind = header.kind
        if kind in STEPS:
            if self.shard.is_first:
                # The head makes activations from tokens; one arriving here is misrouted.
                self.stats.dropped += 1
                return
            if header.batch:
                self._on_batch_frame(header, payload)
                return
            if problem := self._frame_problem(header):
                self.stats.dropped += 1
                self._fail(header.rid, problem)
                return
            try:
                if kind == "verify":
                    self._drop_prebuilt(header.rid)
                pre = self._take_prebuilt(header) if kind == "decode" else None
                if pre is not None and pre.slot is not None:
                    fill_slot(pre.slot, np.frombuffer(payload, dtype=NP_VIEW[header.dtype]))
                    self._complete(self._launch(header, pre=pre))
                else:
                    self._complete(self._launch(header, to_array(header, payload)))
            except Exception as exc:  # one bad request must not take the stage down
                self._fail(header.rid, describe(exc))
        elif kind == "token":
            if header.batch:
                self._on_batch_tokens(header)
            else:
                self._on_token(header)
        elif kind == "free" and header.extra.get("clear") is True:
            self.clear_cache()  # and on down the ring
        elif kind == "free":
            keep, drop = header.extra.get("keep"), header.extra.get("drop")
            if isinstance(drop, list):
                self._forget([str(d) for d in drop])
            if isinstance(keep, list) and keep:
                self._keep(header.rid, keep)
            self._free(header.rid, forward=not self.shard.is_last, extra=header.extra)
        elif kind == "reuse":
            self._on_reuse(header)
        elif kind == "error":
            self._on_error(header)

    def _frame_problem(self, header: RingHeader) -> str | None:
        """Why an activation cannot be this model's for this request, checked before
        anything is allocated for it: (1, tokens, hidden), at most a prefill chunk
        (one token to decode), inside the context the KV cache was planned for."""
        shape = header.shape
        if len(shape) != 3 or shape[0] != 1 or (self.hidden and shape[2] != self.hidden):
            return f"activation shape {list(shape)} is not [1, tokens, {self.hidden or 'hidden'}]"
        most = 1 if header.kind == "decode" else self.prefill_chunk
        if header.kind == "verify":
            most = 1 + len(header.draft)
            if shape[1] != most:
                return f"a verify frame of {shape[1]} tokens for {len(header.draft)} guesses"
        if not 1 <= shape[1] <= most:
            return f"a {header.kind} frame of {shape[1]} tokens (at most {most})"
        if header.offset + shape[1] > self.context_tokens:
            return (
                f"a frame for tokens {header.offset}..{header.offset + shape[1]} is past the "
                f"context of {self.context_tokens}"
            )
        return None

    def _launch(
        self, header: RingHeader, h: mx.array | None = None, pre: Prebuilt | None = None
    ) -> Launched:
        """Start this shard's layers on `h`, or the step prebuilt for this frame."""
        if pre is not None:
            out: Any = pre.out
        else:
            assert h is not None
            cache = self._cache_for(header)
            if self.snapshot and header.kind == "decode" and header.params and header.offset:
                # The prompt's first decode step: the caches hold the prompt but its last
                # token, a point a later prompt can start from without cutting back.
                self.snapshots[header.rid] = (header.offset, snapshot_of(cache))
            out = self.shard.forward(h, cache)
            if header.kind == "verify":
                self.rewind_floor[header.rid] = header.offset + 1
            if self.shard.is_last:
                if header.kind == "decode":
                    out = self._tail(header).sampler.draw(self.shard.logits(out))
                elif header.kind == "verify":
                    # The target's own token at each position (mlx-lm's rule): one
                    # argmax over them all when that is what each draw would take.
                    sampler = self._tail(header).sampler
                    if sampler.plain:
                        out = mx.argmax(out[0], axis=-1)
                    else:
                        out = sampler.draw_positions(out[0])
                else:
                    if header.params is not None:
                        # Its sampler (and grammar, compiled while the prompt fills in).
                        self._tail(header)
                    out = [c.state for c in cache]  # a prefill chunk only fills the cache
        self._mlx(mx.async_eval, out)
        return Launched(header=header, out=out)

    def _complete(self, step: Launched) -> None:
        header, out, rid = step.header, step.out, step.header.rid
        if header.batch:
            self._complete_batch(step)
            return
        if self.shard.is_last:
            if header.kind == "decode":
                self._sample(header, out)
            elif header.kind == "verify":
                self._sample_verify(header, out)
            else:
                self._mlx(mx.eval, out)
            return
        if header.kind == "decode" and self.prebuild:
            self._build_ahead(header)
        self._mlx(mx.eval, out)
        extra = self._carry(header.extra)
        if self.shard.is_first and header.kind in ("decode", "verify"):
            self.sent_at[rid] = time.perf_counter()
        self.links.to_next(
            RingHeader(
                rid=rid,
                kind=header.kind,
                offset=header.offset,
                dtype=dtype_name(out),
                shape=tuple(out.shape),
                params=header.params,
                extra=extra,
                draft=header.draft,
            ),
            out,
        )
        if self.shard.is_first and header.kind == "verify" and header.draft:
            self._guess_ahead(rid, header.draft)  # while the step is round the ring

    def _take_prebuilt(self, header: RingHeader) -> Prebuilt | None:
        pre = self.prebuilt.pop(header.rid, None)
        if pre is None:
            return None
        if pre.error:
            raise RequestError(pre.error)
        if pre.offset != header.offset or (
            pre.slot is not None
            and not self.shard.is_first
            and tuple(pre.slot.shape) != header.shape
        ):
            raise RequestError(
                f"request {header.rid!r}: frame is for cache offset {header.offset} "
                f"shape {list(header.shape)}, the shard expected offset {pre.offset}"
            )
        pre.undo.clear()
        self.stats.prebuilt += 1
        return pre

    def _drop_prebuilt(self, rid: str) -> None:
        """A verify frame comes where a decode step was built ahead (prompt lookup found
        guesses after a step that had none): the caches go back to before it. A step
        built on a stage's own lazy token (a lone stage) is computing already: it is
        cut back out of the caches."""
        pre = self.prebuilt.pop(rid, None)
        cache = self.caches.get(rid)
        if pre is None or cache is None or pre.error:
            return
        if pre.undo:
            speculation.put_back(pre.undo)
        elif self.shard.cache_offset(cache) == pre.offset + 1:
            speculation.rewind(cache, 1)
        cache.offset = pre.offset
        req = self.tail_requests.get(rid)
        if pre.mark is not None and req is not None:
            req.sampler.undo(pre.mark)  # the draw it made is given back
        self.stats.dropped_ahead += 1

    def _build_ahead(self, done: RingHeader) -> None:
        """Build the step after `done`, a decode step whose evaluation has begun, while
        it computes: the stage's thread would otherwise wait for it idle, and after
        sending the frame the CPU is better left to ZeroMQ's I/O threads (building
        there delayed each frame by ~0.7 ms on two cores). If building fails, the
        request fails when that step is due, so the frame in hand still goes out."""
        rid, offset = done.rid, done.offset + 1
        cache = self.caches.get(rid)
        if cache is None or rid in self.prebuilt or self.shard.cache_offset(cache) != offset:
            return  # freed, finished or already built
        error, out = "", cast(mx.array | tuple[mx.array, ...] | None, None)
        mark: Any = None
        if self.shard.is_first:
            slot = self._slot(rid, offset, (1, 1), np.int32)
            h = self.shard.embed(slot)
        else:
            # bfloat16 has no numpy type: fill its bits, view them as bfloat16.
            slot = self._slot(rid, offset, done.shape, NP_VIEW[done.dtype])
            h = slot.view(mx.bfloat16) if done.dtype == "bfloat16" else slot
        self._snap_answer(rid, offset, cache)
        # A stage whose caches cannot be cut back never sees a verify frame.
        undo = [] if self.spec_reason else speculation.hold(cache)
        try:
            out = self.shard.forward(h, cache)
            if self.shard.is_last:
                out, mark = self.tail_requests[rid].sampler.draw_undoable(self.shard.logits(out))
        except Exception as exc:  # the cache may be half advanced: no step can follow
            error = describe(exc)
        self.prebuilt[rid] = Prebuilt(
            offset=offset, slot=slot, out=out, error=error, undo=undo, mark=mark
        )

    def _slot(
        self, rid: str, offset: int, shape: tuple[int, ...], dtype: type[np.generic]
    ) -> mx.array:
        """An input placeholder for the step at `offset`. A request keeps two and
        alternates: the step built ahead must not share its buffer with the step still
        computing, while the one before that is done. Made from numpy, a placeholder
        holds its bytes without an `mx.eval`, which would wait for the step in flight."""
        pair = self.slots.get(rid)
        if pair is None or tuple(pair[0].shape) != tuple(shape) or pair[0].dtype != MX_OF[dtype]:
            pair = self.slots[rid] = (
                mx.array(np.zeros(shape, dtype=dtype)),
                mx.array(np.zeros(shape, dtype=dtype)),
            )
        return pair[offset % 2]

    def _cache_for(self, header: RingHeader) -> LayerCaches:
        rid = header.rid
        if rid in self.group_of:
            # The head decodes it alone again (its batch shrank to it): its row of the
            # batch becomes its own cache.
            self._extract(rid)
        if header.offset == 0 and rid not in self.caches:
            self.caches[rid] = self.shard.make_cache()
        cache = self.caches.get(rid)
        if cache is None:
            raise RequestError(f"request {rid!r} is unknown on this shard (was it freed?)")
        have = self.shard.cache_offset(cache)
        floor = self.rewind_floor.pop(rid, None)
        if have != header.offset:
            if floor is None or not floor <= header.offset < have:
                raise RequestError(
                    f"request {rid!r}: frame is for cache offset {header.offset}, "
                    f"shard is at {have}"
                )
            # The guesses past this offset were rejected: cut them out of the cache.
            self._cut_back(cache, header.offset)
        return cache

    def _tail(self, header: RingHeader) -> TailRequest:
        req = self.tail_requests.get(header.rid)
        if req is None:
            params = SamplingParams.from_dict(header.params or {})
            if problem := processor_problem(params, self.vocab):
                raise RequestError(problem)
            eos = frozenset(getattr(self.tokenizer, "eos_token_ids", ()) or ())
            grammar = None
            if params.grammar:
                grammar = Grammar(params.grammar, self.grammar_tokenizer())
            req = TailRequest(
                sampler=Sampler(params, self.xtc_special, grammar),
                eos=frozenset() if params.ignore_eos else eos,
            )
            self.tail_requests[header.rid] = req
        return req

    def _sample(self, header: RingHeader, drawn: mx.array | tuple[mx.array, ...]) -> None:
        rid = header.rid
        req = self._tail(header)
        sampled = drawn[0] if isinstance(drawn, tuple) else drawn
        # A grammar's next mask waits for this token: its step is not built ahead.
        if req.generated + 1 < req.sampler.params.max_tokens and req.sampler.grammar is None:
            if self.lone:
                self._speculate(header, req, sampled)
            elif self.prebuild:
                self._build_ahead(header)
        token = int(cast(int, self._mlx(sampled.item)))
        req.generated += 1
        self.stats.tokens += 1
        # The token goes back at once; the head turns it into text (and looks for stop
        # strings) while its shard already computes the next step.
        try:
            finish = req.finish_of(token)
        except ValueError as exc:
            self._fail(rid, str(exc))
            return
        if finish:
            self.tail_requests.pop(rid, None)
            ended = self.caches.pop(rid, None)
            if ended is not None and self.store.budget:
                self.finished[rid] = ended  # the head's "free" says whether to keep it
            self.prebuilt.pop(rid, None)  # built for a step that will not come
            self.slots.pop(rid, None)
        extra = self._carry(header.extra)
        if isinstance(drawn, tuple):
            extra["logprobs"] = drawn_logprobs(drawn)
        self.links.to_head(
            RingHeader(rid=rid, kind="token", token=token, finish=finish, extra=extra)
        )

    def _speculate(self, header: RingHeader, req: TailRequest, sampled: mx.array) -> None:
        """Build and start the next step on `sampled` before it is known, as mlx-lm
        does: the graph is built while this step computes. If the answer ends here
        (end of turn, a stop string, a cancel) the step is dropped with the cache.
        If building fails, this token still reaches the caller; the request fails
        when the head takes the step."""
        offset, error = header.offset + 1, ""
        out: mx.array | tuple[mx.array, ...] | None = None
        mark: Any = None
        self._snap_answer(header.rid, offset, self.caches[header.rid])
        try:
            h = self.shard.embed(sampled.reshape(1, 1))
            logits = self.shard.logits(self.shard.forward(h, self.caches[header.rid]))
            out, mark = req.sampler.draw_undoable(logits)
            mx.async_eval(out)
        except Exception as exc:  # the cache may be half advanced: no step can follow
            error = describe(exc)
        self.prebuilt[header.rid] = Prebuilt(
            offset=offset, slot=None, out=out, error=error, mark=mark
        )

    def _on_token(self, header: RingHeader) -> None:
        rid = header.rid
        req = self.head_requests.get(rid)
        if req is None:
            return  # cancelled while this token was on its way
        now = time.perf_counter()
        sent = self.sent_at.pop(rid, None)
        if sent is not None and self.hops > 1:
            req.hops_us.append(self._ring_figures(self.frame_began - sent, header.extra))
        if req.first_token_at is None:
            req.first_token_at = now
        # A verify frame's answer brings the guesses kept before its token.
        tokens = [*header.draft, header.token]
        req.generated += len(tokens)
        req.out += tokens
        spec = req.spec
        verified = spec is not None and spec.in_flight is not None
        if spec is not None:
            req.answer += tokens
            if spec.in_flight is not None:
                self.stats.drafted += len(spec.in_flight)
                self.stats.kept += len(header.draft)
                spec.record(len(spec.in_flight), len(header.draft))
                spec.in_flight = None
        # Start the next step first: detokenising and telling the client then overlap
        # with the shard's compute instead of standing in front of it.
        step: Launched | None = None
        lane_step: Launched | None = None
        failure = ""
        lane = self._lane(rid) if self.lanes else None
        if not header.finish:
            if lane is None or len(lane.members) == 1:
                # Alone: its own step (built ahead, or with guesses), as fast as one
                # stream goes.
                try:
                    step = self._launch_next(rid, req, header.token)
                except Exception as exc:
                    failure = describe(exc)
            else:
                # Its lane steps together: it goes with the lane's next step, its guesses
                # verified with the other rows' when that pays (`_batch_guesses`).
                self._drop_verify_ahead(rid)  # the lane's step is built on its caches
                lane.flying.discard(rid)
                lane.ready[rid] = header.token
                lane_step = self._lane_launch(lane)
        if verified:
            finish = self._deliver_all(rid, req, header, tokens)
        else:
            finish = self._deliver(rid, req, header)
        if finish:
            self._finish(rid, finish)  # a started step is dropped; "free" clears the ring
        elif finish is None:
            pass  # it failed: its step is dropped with it
        elif failure:
            self._fail(rid, failure)
        elif step is not None:
            self._complete_or_fail(step)
        if lane_step is not None:
            self._complete_lane(lane_step)  # the others' step goes on in any case

    def _deliver(self, rid: str, req: HeadRequest, header: RingHeader) -> str | None:
        """Turn a token into text for the client; why the answer ends ("" if it goes on),
        or None if the token could not be read (the request failed)."""
        read = self._read(rid, req, header)
        if read is None:
            return None
        text, more, finish = read
        self.links.to_client(req.client, "delta", rid=rid, text=text, tokens=[header.token], **more)
        return finish

    def _read(
        self, rid: str, req: HeadRequest, header: RingHeader
    ) -> tuple[str, dict[str, Any], str] | None:
        """A token's text, its log-probabilities and tool calls, and why the answer ends
        there ("" if it goes on); None if it could not be read (the request failed)."""
        try:
            text, finish = text_of(req.stream, header)
            more = self._logprobs_of(header)
            if req.tools is not None:
                text, calls = req.tools.add(text)
                if finish:
                    rest, last = req.tools.finish()
                    text, calls = text + rest, calls + last
                if calls:
                    more["tool_calls"] = calls
        except Exception as exc:  # a tokenizer that cannot decode its own token id
            self._fail(rid, f"cannot detokenise token {header.token}: {describe(exc)}")
            return None
        return text, more, finish

    def _complete_or_fail(self, step: Launched) -> None:
        try:
            self._complete(step)
        except Exception as exc:
            for rid in rows_of(step.header):
                self._fail(rid, describe(exc))

    def _logprobs_of(self, header: RingHeader) -> dict[str, Any]:
        """The token's log-probabilities, named, if the request asked for them. The
        end-of-turn token is not part of the answer and gets none."""
        drawn = header.extra.get("logprobs")
        if drawn is None or header.finish == "stop":
            return {}
        chosen, top = drawn
        decode = self.tokenizer.decode
        entry = {
            "id": header.token,
            "token": decode([header.token]),
            "logprob": chosen,
            "top": [
                {"id": i, "token": decode([i]), "logprob": lp}
                for i, lp in sorted(top, key=lambda p: -p[1])
            ],
        }
        return {"logprobs": [entry]}
