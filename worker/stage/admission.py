"""(head) Requests from clients: checked, tokenised, admitted to a stream or queued,
and their prompts scheduled chunk by chunk."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

from worker.families import LayerCaches
from worker.prompt_cache import ranks_agree
from worker.sampling import (
    ParamError,
    SamplingParams,
    TextStream,
    check_processors,
    grammar_tokenizer,
)
from worker.shared.protocol.frames import RingHeader
from worker.shared.protocol.limits import (
    BUSY,
    prompt_chars,
    prompt_too_long,
)
from worker.speculation import DraftSession, Speculation
from worker.stage.base import StageBase
from worker.stage.records import (
    HeadRequest,
    RequestError,
    Waiting,
    describe,
)
from worker.tool_calls import ToolCallStream, supports_tools

# The smallest chunk `prefill_split` cuts a prompt into: below it a chunk's own costs (a
# hop, a frame's Python, thin products) outweigh what the overlap saves.
MIN_SPLIT_CHUNK = 64


def prefill_split(prompt: int, chunk: int, stages: int) -> int:
    """The size of a prompt's prefill chunks: the placement's `chunk`, or less on a ring
    of two or more stages, so that a prompt of `prompt` tokens spans two chunks a stage.

    A stage starts on a chunk once the stage before has finished it, so while a prompt
    is a single chunk the stages take turns and its first token waits for the sum of
    their work (a 600-token prompt at the default 512: 512 then 87, in turn); cut into
    k equal chunks on s stages they compute side by side, and the prompt takes about
    (1 + (s - 1) / k) / s of that sum. Never below MIN_SPLIT_CHUNK (nor above `chunk`).
    On MLX's CPU backend a prompt's caches and logits do not depend on the chunking
    (mlx-lm's own `prefill_step_size` gives the same bits), so neither do the tokens."""
    if stages < 2:
        return chunk
    return min(chunk, max(MIN_SPLIT_CHUNK, -(-prompt // (2 * stages))))


class Admission(StageBase):
    """(head) Requests in: checked, admitted or queued; prompts scheduled."""

    def grammar_tokenizer(self) -> Any:
        """llguidance's view of this model's tokenizer (ParamError if it has none)."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab)
        return self._grammar_tokenizer

    def submit(self, client: bytes, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        try:
            if rid in self.head_requests or rid in self.waiting:
                raise RequestError(f"request id {rid!r} is already in flight", "conflict")
            params = SamplingParams.from_dict(msg["params"])
            tools = self._tools(msg)
            if len(self.head_requests) >= self.streams and len(self.waiting) >= self.max_waiting:
                # Before tokenising: a busy head should not spend time on a refusal.
                raise RequestError(
                    f"{BUSY} this placement serves {self.streams} request(s) at once and "
                    f"{len(self.waiting)} more are waiting; try again shortly, or place the "
                    "model with more --streams",
                    "busy",
                )
            check_processors(params, self.vocab)
            if params.grammar:
                self.grammar_tokenizer()  # the tail needs it: refuse here if it cannot be
            prompt = self._prompt_tokens(msg, tools)
            params = self._fit_context(prompt, params)
            # The penalties look back on the prompt's last tokens too (as mlx-lm's do);
            # the tail never sees the prompt, so those travel with the params.
            params = replace(
                params, recent=tuple(prompt[-params.window :] if params.window else ())
            )
            # A schema's mask follows each token drawn; a verify step draws several at
            # once without it: such a request decodes token by token.
            spec = None if params.grammar else self._speculation(msg)
        except (RequestError, ParamError) as exc:
            code = exc.code if isinstance(exc, RequestError) else "bad_request"
            self.links.to_client(
                client, "failed", rid=rid, message=str(exc), code=code, param=exc.param
            )
            return
        if len(self.head_requests) >= self.streams:
            # "accepted" on its turn
            self.waiting[rid] = Waiting(client, params, prompt, tools, spec)
            return
        self._admit(rid, client, params, prompt, tools, spec)

    def _admit(
        self,
        rid: str,
        client: bytes,
        params: SamplingParams,
        prompt: list[int],
        tools: list[dict[str, Any]] | None,
        spec: Speculation | None = None,
    ) -> None:
        drafter = None
        if spec is not None and spec.mode == "model":
            drafter = DraftSession(self.draft_model, self.prefill_chunk)
        self.head_requests[rid] = HeadRequest(
            client=client,
            params=params,
            prompt=prompt,
            stream=TextStream(self.tokenizer.detokenizer, params.stop),
            tools=ToolCallStream(self.tokenizer, tools) if tools else None,
            spec=spec,
            drafter=drafter,
        )
        reuse = self.index.plan(prompt) if self.index is not None and self.store.budget else None
        cache = None
        if reuse is not None:
            cache = self.store.take(reuse.entry, reuse.tokens, self.shard.make_cache())
            if cache is None:
                self._forget([reuse.entry])
                reuse = None
        if self.tensor_group is not None and self.index is not None and self.store.budget:
            # Every rank of a head group reuses the same entry, or none prefills less.
            mine = (reuse.entry, reuse.tokens) if reuse is not None else (None, 0)
            if not ranks_agree(self.tensor_group, *mine):
                reuse = cache = None
        req = self.head_requests[rid]
        if reuse is None:
            if self.store.budget:  # with the cache off there is nothing to miss
                self.store.stats.misses += 1
            self.caches[rid] = self.shard.make_cache()
        else:
            self.store.stats.hits += 1
            self.store.stats.reused_tokens += reuse.tokens
            req.cached = reuse.tokens
            self.caches[rid] = cast(LayerCaches, cache)
        self.links.to_client(
            client, "accepted", rid=rid, prompt_tokens=len(prompt), cached_tokens=req.cached
        )
        if reuse is not None and not self.shard.is_last:
            # Every other stage copies its own layers' state of the entry; the prefill
            # starts when the tail says they all held it (`_on_reuse`).
            extra = {"entry": reuse.entry, "tokens": reuse.tokens, "ok": True}
            self.links.to_next(RingHeader(rid=rid, kind="reuse", extra=extra), None)
            return
        self._schedule_prefill(rid, prompt, req.cached, params)

    def _fit_context(self, prompt: list[int], params: SamplingParams) -> SamplingParams:
        """Refuse a prompt the KV budget cannot hold; end the answer where it runs out."""
        room = self.context_tokens - len(prompt)
        if room < 1:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens but this placement holds a context of "
                f"{self.context_tokens}: shorten it, or place the model with a larger --context"
            )
        return replace(params, max_tokens=min(params.max_tokens, room))

    def _tools(self, msg: dict[str, Any]) -> list[dict[str, Any]] | None:
        tools = msg.get("tools")
        if not tools:
            return None
        if not isinstance(tools, list) or not isinstance(msg.get("messages"), list):
            raise RequestError("tools must be a list, given with messages", param="tools")
        if not supports_tools(self.tokenizer):
            # The template would drop them or the answer could not be read back.
            raise RequestError(
                "tools are not supported by this model: mlx-lm knows no tool-call format "
                "for its chat template; send the request without tools",
                param="tools",
            )
        return tools

    def _prompt_tokens(
        self, msg: dict[str, Any], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        # Counted before tokenising: megabytes of text would hold this thread (and
        # every other stream on it) for seconds, and grow the process by gigabytes.
        if isinstance(msg.get("messages"), list):
            chars = prompt_chars(msg["messages"])
        else:
            chars = len(msg["prompt"]) if isinstance(msg.get("prompt"), str) else 0
        if problem := prompt_too_long(chars, self.context_tokens):
            raise RequestError(problem)
        if isinstance(msg.get("messages"), list):
            try:
                # The model's own template lays the tools out in its own words.
                tokens = self.tokenizer.apply_chat_template(
                    msg["messages"], tools=tools, add_generation_prompt=True
                )
            except Exception as exc:
                raise RequestError(f"cannot apply the chat template: {exc}") from None
        elif isinstance(msg.get("prompt"), str):
            tokens = self.tokenizer.encode(msg["prompt"])
        elif isinstance(msg.get("tokens"), list):
            tokens = msg["tokens"]
        else:
            raise RequestError("a request needs 'messages', 'prompt' or 'tokens'")
        tokens = list(tokens)
        if not tokens:
            raise RequestError("the prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < self.vocab for t in tokens):
            raise RequestError(f"prompt tokens must be integers in [0, {self.vocab})")
        return tokens

    def _schedule_prefill(
        self, rid: str, prompt: list[int], done: int, params: SamplingParams, first: bool = True
    ) -> None:
        """Queue the prompt one chunk at a time, like mlx-lm: all but the last token
        in chunks (`prefill_split`'s size for what the cache did not hold), then the
        last token as the first decode step. `done` tokens are in the caches already
        (0, or a reused prefix)."""

        def step() -> None:
            req = self.head_requests.get(rid)
            if req is None:
                return
            self._start_frame()
            remaining = len(prompt) - done - 1
            if remaining > 0:
                size = prefill_split(len(prompt) - req.cached - 1, self.prefill_chunk, self.hops)
                n = min(size, remaining)
                sent = params if first else None
                self._head_step(rid, prompt[done : done + n], "prefill", done, sent)
                self._schedule_prefill(rid, prompt, done + n, params, first=False)
            else:
                try:
                    # A schema travels once: the tail keeps it from the first prefill frame,
                    # unless the cache held the whole prompt and this is the first frame.
                    last = params if first else replace(params, grammar="")
                    self._complete(self._launch_next(rid, req, prompt[-1], last))
                except Exception as exc:
                    self._fail(rid, describe(exc))

        self.schedule(step)

    def _head_step(
        self, rid: str, tokens: list[int], kind: str, offset: int, params: SamplingParams | None
    ) -> None:
        try:
            self._complete(self._launch_head(rid, tokens, kind, offset, params))
        except Exception as exc:
            self._fail(rid, describe(exc))

    def _admit_waiting(self) -> None:
        """A stream came free: the oldest waiting request takes it."""
        while self.waiting and len(self.head_requests) < self.streams:
            rid = next(iter(self.waiting))
            w = self.waiting.pop(rid)
            self._admit(rid, w.client, w.params, w.prompt, w.tools, w.spec)

    def cancel(self, rid: str) -> None:
        if rid in self.head_requests:
            self._finish(rid, "cancelled")
        elif rid in self.waiting:
            w = self.waiting.pop(rid)
            usage = {"prompt_tokens": len(w.prompt), "completion_tokens": 0}
            self.links.to_client(w.client, "done", rid=rid, finish_reason="cancelled", usage=usage)
