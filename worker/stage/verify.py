"""Speculative decoding's glue (worker.speculation): a request's guesses sent in a
verify frame, the tail's accept, the kept guesses delivered as one delta."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx

from worker import speculation
from worker.sampling import SamplingParams
from worker.shared.protocol.frames import RingHeader
from worker.shared.protocol.limits import prompt_too_long
from worker.speculation import Speculation
from worker.stage.base import StageBase
from worker.stage.records import (
    BatchDraw,
    HeadRequest,
    Launched,
    RequestError,
    TailRequest,
    drawn_logprobs,
)


class Verify(StageBase):
    """Verify frames: a request's guesses checked in one pass of the ring."""

    def _speculation(self, msg: dict[str, Any]) -> Speculation | None:
        """The request's speculation: its own `draft` ("lookup", "model", or "" for none)
        or the placement's; a predicted output (`prediction`, text) is looked up first,
        and is only a hint: a model that cannot speculate decodes it as usual."""
        mode = msg.get("draft")
        if mode is None:
            mode = self.draft
        if mode not in speculation.MODES:
            raise RequestError(
                f"draft {mode!r} is not one of 'lookup', 'model' or ''", param="draft"
            )
        predicted = msg.get("prediction")
        if predicted is not None and not (
            isinstance(predicted, str)
            or (
                isinstance(predicted, list)
                and all(isinstance(t, int) and 0 <= t < self.vocab for t in predicted)
            )
        ):
            raise RequestError(
                "prediction must be the predicted answer's text or token ids", param="prediction"
            )
        if predicted and (problem := prompt_too_long(len(predicted), self.context_tokens)):
            raise RequestError(f"prediction: {problem}", param="prediction")
        if predicted and mode == "" and msg.get("draft") is None:
            mode = "lookup"
        if not mode:
            return None
        if self.spec_reason:
            if predicted and msg.get("draft") is None:
                return None
            model = self.shard.config.get("model_type", "this model")
            raise RequestError(
                f"draft {mode!r}: {model} cannot speculate: {self.spec_reason}; "
                "send the request without a draft",
                param="draft",
            )
        if mode == "model" and self.draft_model is None:
            raise RequestError(
                "draft 'model': this placement has no draft model (place it with --draft "
                "DRAFT_DIR), use draft 'lookup' or none",
                param="draft",
            )
        prediction: tuple[int, ...] = ()
        if isinstance(predicted, str) and predicted:
            prediction = tuple(self.tokenizer.encode(predicted, add_special_tokens=False))
        elif isinstance(predicted, list):
            prediction = tuple(predicted)
        if mode == "model":
            # A draft model's guesses each cost a step of it: K is the placement's.
            first, most = self.draft_tokens, self.draft_tokens
        else:
            # Lookup's cost nothing to make: K starts small and grows while kept.
            first, most = speculation.LOOKUP_FIRST_TOKENS, speculation.MAX_DRAFT_TOKENS
        return Speculation(mode=mode, k=first, k_max=most, prediction=prediction)

    def _launch_next(
        self, rid: str, req: HeadRequest, token: int, params: SamplingParams | None = None
    ) -> Launched:
        """(head) A request's next step on its newest token, decoding alone: a verify
        frame of the token and its guesses while it has some, else a decode step (built
        ahead while the step before computed). A decode step built ahead that a verify
        frame replaces is dropped on every stage, never computed (`_drop_prebuilt`)."""
        offset = len(req.prompt) + req.generated - 1
        k = self._budget(req, offset)
        drafts = self._propose(req, k) if k else []
        ahead = self.verify_ahead.get(rid)
        if ahead is not None:
            step, first = ahead
            if (
                drafts
                and first == token
                and step.header.offset == offset
                and step.header.draft == tuple(drafts)
            ):
                # Every guess was kept and the big model's token is the draft's: the step
                # computed ahead is this one, half done or done.
                del self.verify_ahead[rid]
                self.rewind_floor[rid] = offset + 1
                self.stats.verified_ahead += 1
                return step
            self._drop_verify_ahead(rid)
        if not drafts:
            if req.spec is not None:
                req.spec.in_flight = None  # nothing to propose: no guesses out
            return self._launch_head(rid, [token], "decode", offset, params)
        self._drop_prebuilt(rid)
        return self._launch_head(rid, [token, *drafts], "verify", offset, params)

    def _budget(self, req: HeadRequest, offset: int) -> int | None:
        """(head) The guesses a request's step at `offset` may carry (K, within what is
        left of its answer and context), or None: it decodes without guesses."""
        spec = req.spec
        if spec is None or spec.off:
            return None
        room = min(
            req.params.max_tokens - req.generated - 1,
            self.context_tokens - offset - 1,
        )
        if self.spec_window:
            # A rotating cache can be cut back only while it holds fewer tokens than its
            # window: the frame must end short of it.
            room = min(room, self.spec_window - offset - 2)
            if room < 0:
                spec.off = f"past its rotating window of {self.spec_window} tokens"
                return None
        return spec.budget(room)

    def _propose(self, req: HeadRequest, k: int) -> list[int]:
        """(head) Up to `k` guesses from the request's draft model or prompt lookup; they
        are its guesses in flight until its tokens come back."""
        spec = req.spec
        assert spec is not None
        drafts: list[int] = []
        if k > 0:
            if spec.mode == "model" and req.drafter is not None:
                served = req.drafter.served_ahead
                drafts = req.drafter.propose(speculation.Joined(req.prompt, req.answer), k)
                self.stats.drafted_ahead += req.drafter.served_ahead - served
            else:
                drafts = spec.guesses(req.prompt, req.answer, k)
        spec.in_flight = tuple(drafts)
        return drafts

    def _guess_ahead(self, rid: str, guesses: tuple[int, ...]) -> None:
        """(head) The guesses for the step after the verify step just sent, made while it
        is round the ring, as if every guess in it is kept: a draft model's
        (`DraftSession.guess_ahead`), as many as K grows to then (`Speculation.record`
        doubles it), or prompt lookup's (the same source read on). With them this stage
        starts that step's layers at once (`_verify_ahead`)."""
        req = self.head_requests.get(rid)
        spec = req.spec if req is not None else None
        if req is None or spec is None or spec.off:
            return
        k = min(spec.k_max, spec.k * 2)
        if req.drafter is not None:
            try:
                req.drafter.guess_ahead(
                    speculation.Joined(req.prompt, req.answer), list(guesses), k
                )
            except Exception:
                # The step after proposes as usual, and fails the request if this recurs.
                req.drafter.ahead = None
                return
            ahead = req.drafter.ahead
            after = (ahead[1][-1], ahead[2]) if ahead is not None else None
        elif spec.mode == "lookup" and self.ahead_ok:
            after = spec.guesses_after(k)
        else:
            return
        if after is not None:
            self._verify_ahead(rid, req, spec, k, *after)

    def _verify_ahead(
        self,
        rid: str,
        req: HeadRequest,
        spec: Speculation,
        k: int,
        first: int,
        guesses: list[int],
    ) -> None:
        """(head) Start this stage's layers on the verify step after the one just sent,
        as guessed: every guess kept, the big model's token `first`, then `guesses`. The
        later stages compute the sent step meanwhile, on other cores or other nodes, so
        when its tokens come back as guessed the next step leaves at once instead of
        after this stage's compute (`_launch_next` takes it). When they do not, the
        caches are cut back past it as past rejected guesses (the floor stays the sent
        step's) and it is dropped: a wrong guess costs this stage compute it would
        otherwise have spent waiting."""
        floor = self.rewind_floor.get(rid)
        cache = self.caches.get(rid)
        last = spec.recent[-1] if spec.recent else None
        if (
            not self.ahead_ok
            # Only after a step that kept every guess (as K doubles only then): guesses
            # that miss would make each step computed ahead a wasted one.
            or (last is not None and last[1] < last[0])
            or self.spec_window
            or spec.in_flight is None
            or floor is None
            or cache is None
        ):
            return
        generated = req.generated + len(spec.in_flight) + 1
        offset = len(req.prompt) + generated - 1  # the next step's, past the sent one's
        # Its guesses as `_budget` will allow them once every guess is kept: K grown to
        # `k` (`Speculation.record`), within the answer's and the context's room.
        room = min(req.params.max_tokens - generated - 1, self.context_tokens - offset - 1, k)
        drafts = guesses[: max(0, room)]
        if not drafts or self.shard.cache_offset(cache) != offset:
            return
        header = RingHeader(rid=rid, kind="verify", offset=offset, draft=tuple(drafts))
        try:
            step = self._launch(header, self.shard.embed(mx.array([[first, *drafts]])))
        except Exception:
            # Only a guess: the step the tokens call for is launched as usual, from the
            # sent step's end (the caches put back there if this one advanced them).
            self._cut_back(cache, offset)
            self.rewind_floor[rid] = floor
            return
        # A miss cuts back from the sent step's offset, past this step too.
        self.rewind_floor[rid] = floor
        self.verify_ahead[rid] = (step, first)

    def _drop_verify_ahead(self, rid: str) -> None:
        """(head) A verify step computed ahead that will not be sent: its tokens are cut
        back out of this stage's caches."""
        ahead = self.verify_ahead.pop(rid, None)
        cache = self.caches.get(rid)
        if ahead is None or cache is None:
            return
        self._cut_back(cache, ahead[0].header.offset)
        self.stats.dropped_verify_ahead += 1

    # ---- batched verify steps ----------------------------------------------------------

    def _batch_guesses(self, order: list[str], offsets: list[int]) -> list[list[int]] | None:
        """(head) Each row's guesses for a lane's batched step, or None: the step decodes
        without guesses (no row speculates, the batch's caches cannot cut rows back one
        by one, or guessing would not pay for a batch this large: `batch_pays`)."""
        if self.batch_spec_reason or any(rid in self.prebuilt for rid in order):
            # A row whose next step was built ahead (it decoded alone) joins decoding:
            # its step is in its caches already, and its draw (a seeded key) too.
            return None
        reqs = [self.head_requests[rid] for rid in order]
        ks = [self._budget(req, off) or 0 for req, off in zip(reqs, offsets, strict=True)]
        if not any(ks):
            return None
        expected = [
            speculation.expected_tokens(req.spec.acceptance, k) if req.spec and k else 1.0
            for req, k in zip(reqs, ks, strict=True)
        ]
        if not speculation.batch_pays(expected, 1 + max(ks), self._row_cost()):
            self.stats.unguessed_batches += 1
            return None
        guesses = [self._propose(req, k) if k else [] for req, k in zip(reqs, ks, strict=True)]
        if not any(guesses):
            for req in reqs:
                if req.spec is not None and req.spec.in_flight == ():
                    req.spec.in_flight = None  # nothing to propose: no guesses out
            return None
        return guesses

    def _row_cost(self) -> float:
        """(head) A row-position's cost as a share of a batched step's fixed cost: the
        placement's setting, else fitted to the lanes' timed steps, else the default."""
        if self.row_cost_setting is not None:
            return self.row_cost_setting
        fitted = speculation.row_cost(list(self.lane_steps))
        return speculation.ROW_COST if fitted is None else fitted

    def _draw_verify_rows(
        self, rids: list[str], logits: mx.array, guesses: dict[str, tuple[int, ...]]
    ) -> BatchDraw:
        """(tail) A batched verify step's draws over `logits` [rows, positions, vocab]:
        one argmax when every row is plain, else each row by its own sampler at its
        first 1 + k positions, k its guesses (the rest are padding)."""
        samplers = [self.tail_requests[rid].sampler for rid in rids]
        ks = [len(guesses[rid]) for rid in rids]
        if all(s.plain for s in samplers):
            return BatchDraw(
                rows=tuple(rids), greedy=mx.argmax(logits, axis=-1), draws={}, guesses=guesses
            )
        draws: dict[str, Any] = {}
        for i, (rid, sampler, k) in enumerate(zip(rids, samplers, ks, strict=True)):
            draws[rid] = (
                sampler.draw_positions(logits[i, : k + 1]) if k else sampler.draw(logits[i, 0])
            )
        return BatchDraw(rows=tuple(rids), greedy=None, draws=draws, guesses=guesses)

    def _verified(
        self, req: TailRequest, guesses: tuple[int, ...], values: list[int], own: Any
    ) -> tuple[list[int], str]:
        """(tail) A row's tokens from a verify step: the guesses kept, then the big model's
        token after them, cut at an end of turn or max_tokens; and why it ends there."""
        n = speculation.accepted(guesses, values) if guesses else 0
        if isinstance(own, list):
            req.sampler.keep(n + 1)  # the draws past it are undone, their keys given back
        tokens: list[int] = []
        finish = ""
        for token in values[: n + 1]:
            tokens.append(token)
            req.generated += 1
            self.stats.tokens += 1
            finish = req.finish_of(token)
            if finish:
                break
        return tokens, finish

    def _take_verified(self, req: HeadRequest, kept: int, token: int) -> list[int]:
        """(head) A row's tokens back from a batched step: its guesses in flight that were
        kept, then `token`; its speculation learns from them."""
        spec = req.spec
        guessed = spec.in_flight if spec is not None and spec.in_flight is not None else ()
        tokens = [*guessed[: max(0, min(kept, len(guessed)))], token]
        req.generated += len(tokens)
        req.out += tokens
        if spec is not None:
            req.answer += tokens
            if spec.in_flight is not None:
                self.stats.drafted += len(spec.in_flight)
                self.stats.kept += len(tokens) - 1
                spec.record(len(spec.in_flight), len(tokens) - 1)
                spec.in_flight = None
        return tokens

    def _sample_verify(self, header: RingHeader, draws: list[Any] | mx.array) -> None:
        """(tail) A verify frame's draws (or, greedy, one argmax over its positions): the
        guesses kept (those equal to the token drawn at their position), then the drawn
        token after them, all back to the head in one frame. The answer ends early at an
        end of turn or at max_tokens."""
        rid = header.rid
        req = self._tail(header)
        if isinstance(draws, mx.array):
            values = cast(list[int], self._mlx(draws.tolist))
            draws = []
        else:
            sampled = [d[0] if isinstance(d, tuple) else d for d in draws]
            values = cast(list[int], self._mlx(mx.stack(sampled).reshape(-1).tolist))
        tokens, finish = self._verified(req, header.draft, values, draws or None)
        if finish:
            self.tail_requests.pop(rid, None)
            ended = self.caches.pop(rid, None)
            if ended is not None and self.store.budget:
                # The head's "free" says whether to keep it (cut back to the answer's end).
                self.finished[rid] = ended
            self.rewind_floor.pop(rid, None)
        extra = self._carry(header.extra)
        if draws and isinstance(draws[0], tuple):
            extra["logprobs"] = [drawn_logprobs(d) for d in draws[: len(tokens)]]
        self.links.to_head(
            RingHeader(
                rid=rid,
                kind="token",
                token=tokens[-1],
                finish=finish,
                extra=extra,
                draft=tuple(tokens[:-1]),
            )
        )

    def _deliver_all(
        self, rid: str, req: HeadRequest, header: RingHeader, tokens: list[int]
    ) -> str | None:
        """A verify frame's tokens (its kept guesses, then its token) as one delta to the
        client, each read in turn as `_deliver` reads one: a stop string in one ends the
        answer there, the tokens after it are dropped."""
        drawn = header.extra.get("logprobs")
        text, more, sent = "", cast(dict[str, list[Any]], {}), []
        finish: str | None = ""
        for j, token in enumerate(tokens):
            last = j == len(tokens) - 1
            extra = {"logprobs": drawn[j]} if drawn is not None else {}
            one = RingHeader(
                rid=rid,
                kind="token",
                token=token,
                finish=header.finish if last else "",
                extra=extra,
            )
            read = self._read(rid, req, one)
            if read is None:
                return None
            piece, extras, finish = read
            text += piece
            sent.append(token)
            for key, values in extras.items():
                more.setdefault(key, []).extend(values)
            if finish:
                req.generated -= len(tokens) - 1 - j  # the tokens after it are no answer
                break
        self.links.to_client(req.client, "delta", rid=rid, text=text, tokens=sent, **more)
        return finish
