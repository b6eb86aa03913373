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
    HeadRequest,
    Launched,
    RequestError,
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
            raise RequestError(f"draft {mode!r} is not one of 'lookup', 'model' or ''")
        predicted = msg.get("prediction")
        if predicted is not None and not (
            isinstance(predicted, str)
            or (
                isinstance(predicted, list)
                and all(isinstance(t, int) and 0 <= t < self.vocab for t in predicted)
            )
        ):
            raise RequestError("prediction must be the predicted answer's text or token ids")
        if predicted and (problem := prompt_too_long(len(predicted), self.context_tokens)):
            raise RequestError(f"prediction: {problem}")
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
                "send the request without a draft"
            )
        if mode == "model" and self.draft_model is None:
            raise RequestError(
                "draft 'model': this placement has no draft model (place it with --draft "
                "DRAFT_DIR), use draft 'lookup' or none"
            )
        prediction: tuple[int, ...] = ()
        if isinstance(predicted, str) and predicted:
            prediction = tuple(self.tokenizer.encode(predicted, add_special_tokens=False))
        elif isinstance(predicted, list):
            prediction = tuple(predicted)
        # Lookup's guesses cost nothing to make: K may grow past the placement's.
        most = self.draft_tokens if mode == "model" else 2 * self.draft_tokens
        return Speculation(
            mode=mode,
            k=self.draft_tokens,
            k_max=min(most, speculation.MAX_DRAFT_TOKENS),
            prediction=prediction,
        )

    def _launch_next(
        self, rid: str, req: HeadRequest, token: int, params: SamplingParams | None = None
    ) -> Launched:
        """(head) A request's next step on its newest token, decoding alone: a verify
        frame of the token and its guesses while it speculates, else a decode step."""
        offset = len(req.prompt) + req.generated - 1
        spec = req.spec
        if spec is None or spec.off:
            return self._launch_head(rid, [token], "decode", offset, params)
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
        k = spec.budget(room)
        drafts: list[int] = []
        if k > 0:
            if spec.mode == "model" and req.drafter is not None:
                drafts = req.drafter.propose([*req.prompt, *req.answer], k)
            else:
                drafts = speculation.lookup_guesses(spec.prediction, req.prompt, req.answer, k)
        spec.in_flight = tuple(drafts)
        return self._launch_head(rid, [token, *drafts], "verify", offset, params)

    def _sample_verify(self, header: RingHeader, draws: list[Any]) -> None:
        """(tail) A verify frame's draws: the guesses kept (those equal to the token drawn
        at their position), then the drawn token after them, all back to the head in one
        frame. The answer ends early at an end of turn or at max_tokens."""
        rid = header.rid
        req = self._tail(header)
        sampled = [d[0] if isinstance(d, tuple) else d for d in draws]
        values = cast(list[int], self._mlx(mx.stack(sampled).reshape(-1).tolist))
        n = speculation.accepted(header.draft, values)
        req.sampler.keep(n + 1)
        tokens: list[int] = []
        finish = ""
        for token in values[: n + 1]:
            tokens.append(token)
            req.generated += 1
            self.stats.tokens += 1
            if token in req.eos:
                finish = "stop"
            elif req.generated >= req.sampler.params.max_tokens:
                finish = "length"
            if finish:
                break
        if finish:
            self.tail_requests.pop(rid, None)
            self.caches.pop(rid, None)
            self.rewind_floor.pop(rid, None)
        extra = self._carry(header.extra)
        if isinstance(draws[0], tuple):
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
