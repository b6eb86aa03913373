"""One pipeline stage's request logic, apart from its sockets.

A stage is a shard plus the per-request state it keeps: a KV cache on every
stage, the client's request on the head, the sampler and text stream on the
tail. It reacts to three things: a client request (head), a ring frame, and a
cancel. What it sends goes through the `Links` it is given, so the same code runs
a one-stage pipeline in a single process and a ring spread over nodes.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import mlx.core as mx
import numpy as np

from worker import families, speculation
from worker.families import LayerCaches
from worker.prompt_cache import (
    DiskStore,
    PromptIndex,
    PromptStore,
    cache_kinds,
    cut_to,
    trimmable_at,
)
from worker.prompt_cache import snapshot as snapshot_of
from worker.sampling import (
    Grammar,
    ParamError,
    Sampler,
    SamplingParams,
    TextStream,
    grammar_tokenizer,
    processor_problem,
)
from worker.shard import Shard
from worker.shared.protocol.frames import STEPS, RingHeader
from worker.shared.protocol.limits import (
    BUSY,
    DEFAULT_PROMPT_CACHE_BYTES,
    DEFAULT_PROMPT_CACHE_DISK_BYTES,
    DEFAULT_STREAMS,
    prompt_chars,
    prompt_too_long,
)
from worker.speculation import DraftSession, Speculation
from worker.tool_calls import ToolCallStream, supports_tools

# How an activation of each dtype is read and written with numpy (bfloat16, which numpy
# lacks, as its uint16 bits).
NP_VIEW: dict[str, type[np.generic]] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
}
_MX_DTYPE = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_DTYPE_NAME = {v: k for k, v in _MX_DTYPE.items()}
_MX_OF = {np.int32: mx.int32, np.float32: mx.float32, np.float16: mx.float16, np.uint16: mx.uint16}
# What the head measures of each decode step's round (`Stage._ring_figures`), in µs:
# a hop (a send call to the next stage's recv returning), a stage's own time with a
# frame less MLX's evaluation (its Python), the step's time less every stage's MLX
# evaluation (the ring's whole overhead), the step's time, and the MLX evaluation.
RING_FIGURES = ("hop", "frame", "overhead", "token", "mlx")
_T = TypeVar("_T")


class Links(Protocol):
    def to_next(self, header: RingHeader, activation: mx.array | None) -> None: ...
    def to_head(self, header: RingHeader) -> None: ...
    def to_client(self, client: bytes, kind: str, **fields: Any) -> None: ...


class RequestError(ValueError):
    pass


# Requests that may wait for a stream, per stream the placement serves: enough to
# smooth a burst, few enough that a client is told "busy" in time to go elsewhere.
WAITING_PER_STREAM = 4


@dataclass
class HeadRequest:
    client: bytes
    params: SamplingParams
    prompt: list[int]
    stream: TextStream
    tools: ToolCallStream | None = None  # the request gave tools: calls are parsed out
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    generated: int = 0
    cached: int = 0  # prompt tokens served by the prefix cache, not prefilled
    out: list[int] = field(default_factory=list)  # the tokens of the answer so far
    # Its decode steps' hops on a ring (the last 512, as the stage keeps its own).
    hops_us: deque[float] = field(default_factory=lambda: deque(maxlen=512))
    # Speculative decoding (None: it decodes a token a step): its guesses, what it kept,
    # the answer's tokens so far (prompt lookup reads them), its draft model's session.
    spec: Speculation | None = None
    answer: list[int] = field(default_factory=list)
    drafter: DraftSession | None = None


@dataclass(frozen=True)
class Waiting:
    """(head) A request waiting for a stream, as it will be admitted."""

    client: bytes
    params: SamplingParams
    prompt: list[int]
    tools: list[dict[str, Any]] | None
    spec: Speculation | None


@dataclass
class TailRequest:
    sampler: Sampler
    eos: frozenset[int]
    generated: int = 0

    def finish_of(self, token: int) -> str:
        """Why the answer ends at `token`, just drawn ("" if it goes on): end of turn
        (or of the grammar's answer), or max_tokens. A grammar advances past it."""
        grammar = self.sampler.grammar
        if grammar is not None and grammar.accept(token):
            return "stop"  # even with ignore_eos: the schema's answer is complete
        if token in self.eos:
            return "stop"
        return "length" if self.generated >= self.sampler.params.max_tokens else ""


@dataclass(frozen=True)
class Launched:
    """A step whose evaluation has begun (`mx.async_eval`); `_complete` waits for it
    and passes its result on. Between the two the stage does its bookkeeping, so
    that overlaps with the compute instead of delaying the next shard."""

    header: RingHeader
    out: Any  # the activation (or sampled token, or cache state) being evaluated


@dataclass(frozen=True)
class Prebuilt:
    """A request's next decode step, built while its input is still on the way.

    Building an MLX graph in Python costs about as much as a hop (1-2 ms for a
    few layers on a slow CPU). mlx-lm hides it by building step n+1 on the lazy
    token of step n; a pipeline stage cannot, its input comes from another
    process. So while each decode step computes, the stage builds the next one on
    `slot`, a placeholder holding bytes, and when the input arrives writes them
    into `slot` and evaluates `out`: the build happened while the stage waited.
    """

    offset: int  # the cache offset the step is for
    # Token ids (head) or the activation's bits (others), in place. None when the
    # step is built on the lazy token of the step before (a lone stage): no input to write.
    slot: mx.array | None
    # lazy; the activation to pass on, or what the tail's sampler drew
    out: mx.array | tuple[mx.array, ...] | None
    error: str = ""  # building it failed: the request ends when the step is due


@dataclass
class Group:
    """Requests this stage decodes together: one row each of mlx-lm's batched caches
    (`BatchKVCache` and kin), in `rows` order, which every stage of the ring keeps alike."""

    rows: list[str]
    offsets: list[int]  # per row, the cache offset of its next step
    caches: LayerCaches


@dataclass
class Lane:
    """(head) Requests that take their decode steps together. A placement has a lane
    per stage, so while one lane's batch computes on one shard another's can compute
    on the next; each decode-phase request belongs to the least-loaded lane."""

    gid: str  # names the lane's batch in the ring frames
    members: list[str] = field(default_factory=list)
    ready: dict[str, int] = field(default_factory=dict)  # a member's next input token
    flying: set[str] = field(default_factory=set)  # members of the step in flight


@dataclass(frozen=True)
class BatchDraw:
    """(tail) What a batched step sampled, per row of `rows`: either its own draw (in
    `draws`), or its place in `greedy`, one argmax over the rows without a draw."""

    rows: tuple[str, ...]
    greedy: mx.array | None
    draws: dict[str, mx.array | tuple[mx.array, ...]]


@dataclass
class Stats:
    tokens: int = 0
    dropped: int = 0
    errors: int = 0
    finished: int = 0
    prebuilt: int = 0  # decode steps whose graph was built before their input came
    batched: int = 0  # decode steps that ran several requests as one batch
    batched_rows: int = 0  # the requests those steps ran, summed
    drafted: int = 0  # (head) guesses sent in verify frames
    kept: int = 0  # (head) ... of them kept


def to_array(header: RingHeader, payload: bytes | memoryview) -> mx.array:
    flat = np.frombuffer(payload, dtype=NP_VIEW[header.dtype])
    arr = mx.array(flat)
    if header.dtype == "bfloat16":
        arr = arr.view(mx.bfloat16)
    return arr.reshape(header.shape)


def dtype_name(arr: mx.array) -> str:
    if arr.dtype not in _DTYPE_NAME:
        raise RequestError(f"activation dtype {arr.dtype} cannot travel the ring")
    return _DTYPE_NAME[arr.dtype]


class Stage:
    def __init__(
        self,
        shard: Shard,
        tokenizer: Any,
        links: Links,
        *,
        prefill_chunk: int = 512,
        hops: int = 1,
        context_tokens: int = 4096,
        streams: int = DEFAULT_STREAMS,
        schedule: Callable[[Callable[[], None]], None],
        prebuild: bool = True,
        batch: bool = True,
        prompt_cache_bytes: int = 0,
        prompt_cache_disk_bytes: int = 0,
        cache_dir: Path | None = None,
        cache_key: str = "",
        draft: str = "",
        draft_tokens: int = 0,
        draft_model: Any = None,
    ) -> None:
        self.shard = shard
        self.tokenizer = tokenizer
        self.links = links
        self.prefill_chunk = prefill_chunk
        self.schedule = schedule
        self.caches: dict[str, LayerCaches] = {}
        self.head_requests: dict[str, HeadRequest] = {}
        self.tail_requests: dict[str, TailRequest] = {}
        self.stats = Stats()
        self.hops = hops
        self.context_tokens = context_tokens
        # Admission: the plan reserved KV memory for `streams` requests of a whole
        # context, so the head runs at most that many; a few more wait, in order.
        self.streams = max(1, streams)
        self.waiting: dict[str, Waiting] = {}
        self.max_waiting = WAITING_PER_STREAM * self.streams
        self.sent_at: dict[str, float] = {}
        self.ring_us = {name: deque[float](maxlen=512) for name in RING_FIGURES}
        # The frame (or job) in hand: when it arrived, and how long MLX has evaluated since.
        self.frame_began = time.perf_counter()
        self.frame_mlx_s = 0.0
        self.vocab = int(shard.config.get("vocab_size", 0))
        # The tokens XTC never drops, as mlx_lm.server names them: a newline's tokens
        # (as its tokenizer encodes "\n") and the end-of-sequence ones.
        self.xtc_special: tuple[int, ...] = ()
        if shard.is_last and tokenizer is not None:
            eos = getattr(tokenizer, "eos_token_ids", ()) or ()
            self.xtc_special = (*tokenizer.encode("\n"), *eos)
        self.hidden = hidden_size(shard.config)
        # A lone stage is never idle between steps: it builds each step on the lazy
        # token of the one before (`_speculate`), as mlx-lm's loop does, instead.
        self.lone = shard.is_first and shard.is_last
        self.prebuild = prebuild and not self.lone
        self.prebuilt: dict[str, Prebuilt] = {}
        self.slots: dict[str, tuple[mx.array, mx.array]] = {}
        # Batched decode: every stage keeps the groups the head's frames name; the head
        # decides each step's rows. Families whose caches mlx-lm cannot batch decode
        # each request on its own (`batch_reason` says why).
        self.groups: dict[str, Group] = {}
        self.group_of: dict[str, str] = {}
        self.batch_reason = (
            families.batch_reason(shard.make_cache().full) if batch else "turned off"
        )
        self.lanes: list[Lane] = []
        if shard.is_first and not self.batch_reason:
            self.lanes = [Lane(gid=f"batch{i}") for i in range(max(1, hops))]
        self.lane_of: dict[str, Lane] = {}
        # The prefix cache (worker.prompt_cache): this stage's entries; the head's index
        # of their tokens. 0 bytes means the default; a negative budget turns it off.
        budget = prompt_cache_bytes or DEFAULT_PROMPT_CACHE_BYTES
        disk_budget = prompt_cache_disk_bytes or DEFAULT_PROMPT_CACHE_DISK_BYTES
        disk = None
        if cache_dir is not None and budget > 0 and disk_budget > 0:
            # On disk under `cache_dir`, in a folder named by `cache_key` (whose model,
            # adapter, layers and settings the entries are), surviving a restart.
            # The shard's own layers are part of the key: another split's entries differ.
            layers = f"layers={shard.start}-{shard.end}/{shard.n_layers}"
            disk = DiskStore(cache_dir, f"{cache_key} {layers}", disk_budget)
        self.store = PromptStore(max(0, budget), disk)
        self.index = PromptIndex() if shard.is_first else None
        if self.index is not None and disk is not None:
            for ident, meta in disk.headers():
                try:
                    tokens = [int(t) for t in json.loads(meta.get("tokens", "null"))]
                except (ValueError, TypeError):
                    disk.remove(ident)  # not written by a head, or damaged
                    continue
                if self.index.restore(tokens, meta.get("trimmable") == "1") != ident:
                    self.index.remove(ident)
                    disk.remove(ident)
        self.kinds = cache_kinds(shard.make_cache().full)
        # Caches that cannot always be cut back are kept as snapshots at the end of each
        # prompt (but its last token), taken as the first decode step starts.
        self.snapshot = budget > 0 and not trimmable_at(self.kinds, 1 << 62)
        self.snapshots: dict[str, tuple[int, list[Any]]] = {}
        self.finished: dict[str, LayerCaches] = {}  # (tail) ended, until "free" says keep
        # Speculative decoding (worker/speculation.py): the placement's draft ("",
        # "lookup", "model"; a request may choose its own), and whether this model's
        # caches can be cut back after a rejected guess (the head judges for the whole
        # model: its `full` cache list has an entry of every kind the model has).
        kinds = shard.make_cache().full
        self.spec_reason = speculation.trim_reason(kinds)
        self.spec_window = speculation.window(kinds)
        if draft not in speculation.MODES:
            raise ValueError(f"draft {draft!r} is not one of {speculation.MODES[1:]}")
        if draft and self.spec_reason:
            model = shard.config.get("model_type", "this model")
            raise ValueError(f"--draft {draft}: {model} cannot speculate: {self.spec_reason}")
        if draft == "model" and draft_model is None:
            raise ValueError("--draft model needs the draft model loaded")
        self.draft = draft
        self.draft_tokens = min(
            draft_tokens or speculation.DEFAULT_DRAFT_TOKENS, speculation.MAX_DRAFT_TOKENS
        )
        self.draft_model = draft_model
        # Per request, after a verify frame: the least offset its next frame may take
        # (the frame's first token is always kept); a frame below the cache's offset,
        # and not below this, cuts the cache back to it.
        self.rewind_floor: dict[str, int] = {}
        self._grammar_tokenizer: Any = None  # llguidance's, built on the first schema

    def grammar_tokenizer(self) -> Any:
        """llguidance's view of this model's tokenizer (ParamError if it has none)."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab)
        return self._grammar_tokenizer

    def held(self) -> int:
        """Requests whose KV cache this stage holds, alone or as a row of a batch."""
        return len(self.caches) + len(self.group_of)

    # ---- head: requests from clients -------------------------------------------------

    def submit(self, client: bytes, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        try:
            if rid in self.head_requests or rid in self.waiting:
                raise RequestError(f"request id {rid!r} is already in flight")
            params = SamplingParams.from_dict(msg["params"])
            tools = self._tools(msg)
            if len(self.head_requests) >= self.streams and len(self.waiting) >= self.max_waiting:
                # Before tokenising: a busy head should not spend time on a refusal.
                raise RequestError(
                    f"{BUSY} this placement serves {self.streams} request(s) at once and "
                    f"{len(self.waiting)} more are waiting; try again shortly, or place the "
                    "model with more --streams"
                )
            if problem := processor_problem(params, self.vocab):
                raise RequestError(problem)
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
            self.links.to_client(client, "failed", rid=rid, message=str(exc))
            return
        if len(self.head_requests) >= self.streams:
            # "accepted" on its turn
            self.waiting[rid] = Waiting(client, params, prompt, tools, spec)
            return
        self._admit(rid, client, params, prompt, tools, spec)

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
        req = self.head_requests[rid]
        if reuse is None:
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

    def _on_reuse(self, header: RingHeader) -> None:
        """A request's prefix entry on its way down the ring (each stage copies it), or
        back at the head: if a stage lacked it (evicted, restarted), the request frees
        what the others copied and prefills from the start."""
        rid, extra = header.rid, header.extra
        entry, tokens = extra.get("entry"), extra.get("tokens")
        ok = bool(extra.get("ok")) and isinstance(entry, str) and isinstance(tokens, int)
        if self.shard.is_first:
            req = self.head_requests.get(rid)
            if req is None:
                return  # cancelled meanwhile: its "free" went down the ring
            if not ok:
                self._forget([str(entry)])
                self.store.stats.hits -= 1
                self.store.stats.misses += 1
                self.store.stats.reused_tokens -= req.cached
                self.links.to_next(RingHeader(rid=rid, kind="free"), None)
                self.caches[rid] = self.shard.make_cache()
                req.cached = 0
            self._schedule_prefill(rid, req.prompt, req.cached, req.params)
            return
        if ok:
            cache = self.store.take(cast(str, entry), cast(int, tokens), self.shard.make_cache())
            if cache is None:
                ok = False
            else:
                self.caches[rid] = cache
        passed = replace(header, extra={**extra, "ok": ok})
        if self.shard.is_last:
            self.links.to_head(passed)
        else:
            self.links.to_next(passed, None)

    def cache_stats(self) -> dict[str, int]:
        """The prefix cache's figures, as control.ShardStats names them."""
        store = self.store
        return {
            "prompt_cache_entries": len(store.entries),
            "prompt_cache_bytes": store.bytes,
            "prompt_cache_disk_bytes": store.disk.bytes if store.disk is not None else 0,
            "prompt_cache_hits": store.stats.hits,
            "prompt_cache_misses": store.stats.misses,
            "prompt_cache_reused": store.stats.reused_tokens,
        }

    def clear_cache(self) -> tuple[int, int]:
        """(head) Empty the prefix cache on every stage; the entries and bytes this one
        held. Requests in flight keep their own caches."""
        held = (len(self.store.entries), self.store.bytes)
        self.store.clear()
        if self.index is not None:
            self.index.clear()
        if not self.shard.is_last:
            self.links.to_next(RingHeader(rid="", kind="free", extra={"clear": True}), None)
        return held

    def _forget(self, entries: list[str]) -> None:
        """Drop entries from this stage's store (and the head's index)."""
        for entry in entries:
            self.store.drop(entry)
            if self.index is not None:
                self.index.remove(entry)

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
            raise RequestError("tools must be a list, given with messages")
        if not supports_tools(self.tokenizer):
            # The template would drop them or the answer could not be read back.
            raise RequestError(
                "tools are not supported by this model: mlx-lm knows no tool-call format "
                "for its chat template; send the request without tools"
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
        in chunks, then the last token as the first decode step. `done` tokens are in
        the caches already (0, or a reused prefix)."""

        def step() -> None:
            if rid not in self.head_requests:
                return
            self._start_frame()
            remaining = len(prompt) - done - 1
            if remaining > 0:
                n = min(self.prefill_chunk, remaining)
                sent = params if first else None
                self._head_step(rid, prompt[done : done + n], "prefill", done, sent)
                self._schedule_prefill(rid, prompt, done + n, params, first=False)
            else:
                try:
                    req = self.head_requests[rid]
                    # A schema travels once: the tail keeps it from the first prefill frame,
                    # unless the cache held the whole prompt and this is the first frame.
                    last = params if first else replace(params, grammar="")
                    self._complete(self._launch_next(rid, req, prompt[-1], last))
                except Exception as exc:
                    self._fail(rid, _describe(exc))

        self.schedule(step)

    def _head_step(
        self, rid: str, tokens: list[int], kind: str, offset: int, params: SamplingParams | None
    ) -> None:
        try:
            self._complete(self._launch_head(rid, tokens, kind, offset, params))
        except Exception as exc:
            self._fail(rid, _describe(exc))

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

    # ---- every stage: ring frames ----------------------------------------------------

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
                pre = self._take_prebuilt(header) if kind == "decode" else None
                if pre is not None and pre.slot is not None:
                    fill_slot(pre.slot, np.frombuffer(payload, dtype=NP_VIEW[header.dtype]))
                    self._complete(self._launch(header, pre=pre))
                else:
                    self._complete(self._launch(header, to_array(header, payload)))
            except Exception as exc:  # one bad request must not take the stage down
                self._fail(header.rid, _describe(exc))
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
                    # The target's own token at each position (mlx-lm's rule).
                    out = self._tail(header).sampler.draw_positions(out[0])
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

    # ---- every stage: building the next decode step ahead ------------------------------

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
        self.stats.prebuilt += 1
        return pre

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
        if self.shard.is_first:
            slot = self._slot(rid, offset, (1, 1), np.int32)
            h = self.shard.embed(slot)
        else:
            # bfloat16 has no numpy type: fill its bits, view them as bfloat16.
            slot = self._slot(rid, offset, done.shape, NP_VIEW[done.dtype])
            h = slot.view(mx.bfloat16) if done.dtype == "bfloat16" else slot
        try:
            out = self.shard.forward(h, cache)
            if self.shard.is_last:
                out = self.tail_requests[rid].sampler.draw(self.shard.logits(out))
        except Exception as exc:  # the cache may be half advanced: no step can follow
            error = _describe(exc)
        self.prebuilt[rid] = Prebuilt(offset=offset, slot=slot, out=out, error=error)

    def _slot(
        self, rid: str, offset: int, shape: tuple[int, ...], dtype: type[np.generic]
    ) -> mx.array:
        """An input placeholder for the step at `offset`. A request keeps two and
        alternates: the step built ahead must not share its buffer with the step still
        computing, while the one before that is done. Made from numpy, a placeholder
        holds its bytes without an `mx.eval`, which would wait for the step in flight."""
        pair = self.slots.get(rid)
        if pair is None or tuple(pair[0].shape) != tuple(shape) or pair[0].dtype != _MX_OF[dtype]:
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
            speculation.rewind(cache, have - header.offset)
            cache.offset = header.offset
        return cache

    # ---- tail: sampling ----------------------------------------------------------------

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
            extra["logprobs"] = _logprobs(drawn)
        self.links.to_head(
            RingHeader(rid=rid, kind="token", token=token, finish=finish, extra=extra)
        )

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
            extra["logprobs"] = [_logprobs(d) for d in draws[: len(tokens)]]
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

    def _speculate(self, header: RingHeader, req: TailRequest, sampled: mx.array) -> None:
        """Build and start the next step on `sampled` before it is known, as mlx-lm
        does: the graph is built while this step computes. If the answer ends here
        (end of turn, a stop string, a cancel) the step is dropped with the cache.
        If building fails, this token still reaches the caller; the request fails
        when the head takes the step."""
        offset, error = header.offset + 1, ""
        out: mx.array | tuple[mx.array, ...] | None = None
        try:
            h = self.shard.embed(sampled.reshape(1, 1))
            logits = self.shard.logits(self.shard.forward(h, self.caches[header.rid]))
            out = req.sampler.draw(logits)
            mx.async_eval(out)
        except Exception as exc:  # the cache may be half advanced: no step can follow
            error = _describe(exc)
        self.prebuilt[header.rid] = Prebuilt(offset=offset, slot=None, out=out, error=error)

    # ---- head: tokens coming back ------------------------------------------------------

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
                    failure = _describe(exc)
            else:
                # Its lane decodes together: it goes with the lane's next step, without
                # guesses (a batch's rows take one token each).
                if spec is not None and not spec.off:
                    spec.off = "other requests decode in a batch with it"
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
            text, finish = _text_of(req.stream, header)
            more = self._logprobs_of(header)
            if req.tools is not None:
                text, calls = req.tools.add(text)
                if finish:
                    rest, last = req.tools.finish()
                    text, calls = text + rest, calls + last
                if calls:
                    more["tool_calls"] = calls
        except Exception as exc:  # a tokenizer that cannot decode its own token id
            self._fail(rid, f"cannot detokenise token {header.token}: {_describe(exc)}")
            return None
        return text, more, finish

    def _complete_or_fail(self, step: Launched) -> None:
        try:
            self._complete(step)
        except Exception as exc:
            for rid in _rows_of(step.header):
                self._fail(rid, _describe(exc))

    # ---- head: lanes of requests decoded together ---------------------------------------

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
                self._fail(rid, _describe(exc))
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

    # ---- every stage: batched steps ----------------------------------------------------

    def _on_batch_frame(self, header: RingHeader, payload: bytes | memoryview) -> None:
        rows = _rows_of(header)
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
                self._fail(rid, _describe(exc))
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
                self._fail(rid, _describe(exc))
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
        return Launched(header=replace(header, batch=rows_done), out=result)

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
            logprobs = _logprobs(own) if isinstance(own, tuple) else None
            rows.append((rid, token, finish, logprobs))
        extra = self._carry(header.extra)
        self.links.to_head(RingHeader(rid=header.rid, kind="token", batch=tuple(rows), extra=extra))

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

    def _admit_waiting(self) -> None:
        """A stream came free: the oldest waiting request takes it."""
        while self.waiting and len(self.head_requests) < self.streams:
            rid = next(iter(self.waiting))
            w = self.waiting.pop(rid)
            self._admit(rid, w.client, w.params, w.prompt, w.tools, w.spec)

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
        self.links.to_client(
            req.client,
            "done",
            rid=rid,
            finish_reason=reason,
            usage=usage,
            timings=timings,
            **matched,
        )
        extra = self._keep_plan(req)
        if extra.get("drop"):
            self._forget(extra["drop"])
        if extra.get("keep"):
            self._keep(rid, extra["keep"])
        self._free(rid, forward=True, extra=extra)
        self._admit_waiting()

    def _keep_plan(self, req: HeadRequest) -> dict[str, Any]:
        """(head) What every stage keeps of an ended request, for the "free" frame: the
        caches of its prompt and answer (all but the last token, never computed) where
        they can be cut back later, else the snapshot of its prompt; and the entries
        the new one makes useless (its prefixes). Nothing before its first token came,
        when some stage may still be short of the prompt (a cancel mid-prefill)."""
        if self.index is None or not self.store.budget or req.generated < 1:
            return {}
        held = len(req.prompt) + req.generated - 1
        if trimmable_at(self.kinds, held + 2):  # +2: a step built ahead may be in them
            tokens, kind = [*req.prompt, *req.out[: req.generated - 1]], "end"
        elif self.snapshot and len(req.prompt) > 1:
            tokens, kind = req.prompt[:-1], "prompt"
            held = len(tokens)
        else:
            return {}
        ident, gone = self.index.add(tokens, trimmable_at(self.kinds, held + 2))
        return {"keep": [[ident, held, kind]], "drop": gone}

    def _keep(self, rid: str, keep: list[Any]) -> None:
        """Store this stage's caches of `rid` as the entries `keep` names."""
        cache = self._own_cache(rid)
        snap = self.snapshots.pop(rid, None)
        for item in keep:
            if not (isinstance(item, list) and len(item) == 3):
                continue
            ident, held, kind = str(item[0]), item[1], item[2]
            if not isinstance(held, int):
                continue
            evicted = [ident]
            meta = self._entry_meta(ident)
            if kind == "end" and cache is not None and cut_to(list(cache), held):
                evicted = self.store.put(ident, list(cache), held, meta)
                cache = None  # the store owns it now
            elif kind == "prompt" and snap is not None and snap[0] == held:
                evicted = self.store.put(ident, snap[1], held, meta)
            if self.index is not None:
                for gone in evicted:
                    self.index.remove(gone)

    def _entry_meta(self, ident: str) -> dict[str, str]:
        """(head) What an entry's file keeps for the index to be rebuilt from it after a
        restart: its tokens, and whether it can be cut back."""
        if self.index is None or ident not in self.index.tokens:
            return {}
        return {
            "tokens": json.dumps(list(self.index.tokens[ident])),
            "trimmable": "1" if self.index.trimmable.get(ident) else "0",
        }

    def close(self) -> None:
        """Let the disk's pending writes finish (a stopping runner calls it)."""
        if self.store.disk is not None:
            self.store.disk.close()

    def _own_cache(self, rid: str) -> LayerCaches | None:
        """Take `rid`'s caches from this stage (its batch row, its own, or the tail's
        ended ones)."""
        if rid in self.group_of:
            self._extract(rid)
        cache = self.caches.pop(rid, None)
        return cache if cache is not None else self.finished.pop(rid, None)

    def cancel(self, rid: str) -> None:
        if rid in self.head_requests:
            self._finish(rid, "cancelled")
        elif rid in self.waiting:
            w = self.waiting.pop(rid)
            usage = {"prompt_tokens": len(w.prompt), "completion_tokens": 0}
            self.links.to_client(w.client, "done", rid=rid, finish_reason="cancelled", usage=usage)

    def _free(self, rid: str, forward: bool, extra: dict[str, Any] | None = None) -> None:
        self._leave_group(rid)
        self.snapshots.pop(rid, None)
        self.finished.pop(rid, None)
        if self.lanes:
            self._leave_lane(rid)
        self.caches.pop(rid, None)
        self.prebuilt.pop(rid, None)
        self.slots.pop(rid, None)
        self.sent_at.pop(rid, None)
        self.tail_requests.pop(rid, None)
        self.rewind_floor.pop(rid, None)
        if forward and not self.shard.is_last:
            self.links.to_next(RingHeader(rid=rid, kind="free", extra=extra or {}), None)

    # ---- the ring's timing -------------------------------------------------------------

    def _start_frame(self, arrived: float | None = None) -> None:
        self.frame_began = time.perf_counter() if arrived is None else arrived
        self.frame_mlx_s = 0.0

    def _mlx(self, evaluate: Callable[..., _T], *args: Any) -> _T:
        """Wait for MLX (an `eval`, `async_eval` or `item`), counting the time: the
        ring's figures tell it apart from the Python around it."""
        began = time.perf_counter()
        try:
            return evaluate(*args)
        finally:
            self.frame_mlx_s += time.perf_counter() - began

    def _carry(self, extra: dict[str, Any]) -> dict[str, Any]:
        """The step's timing so far, for the next stage's frame: the head's time with
        its frame (`head_us`), the other stages' (`work_us`: each from its recv to
        its send), and the MLX evaluation of them all (`mlx_us`)."""
        spent = (time.perf_counter() - self.frame_began) * 1e6
        mlx = float(extra.get("mlx_us", 0.0)) + self.frame_mlx_s * 1e6
        if self.shard.is_first:
            return {"head_us": spent, "mlx_us": mlx}
        work = float(extra.get("work_us", 0.0)) + spent
        return {"head_us": float(extra.get("head_us", 0.0)), "work_us": work, "mlx_us": mlx}

    def _ring_figures(self, ring_s: float, extra: dict[str, Any]) -> float:
        """(head) A decode step's round, `ring_s` from its frame's send call to its
        token's recv, both on this node's clock: what the stages spent is in the token
        frame, so no clocks are compared across nodes. The step's time (the head's own
        with the frame before, plus the round) is MLX's evaluation on every stage plus
        the ring's overhead, which is the hops plus each stage's Python. Returns the
        step's hop."""
        ring, head = ring_s * 1e6, float(extra.get("head_us", 0.0))
        work, mlx = float(extra.get("work_us", 0.0)), float(extra.get("mlx_us", 0.0))
        token = ring + head
        figures = {
            "hop": (ring - work) / self.hops,
            "frame": (work + head - mlx) / self.hops,
            "overhead": token - mlx,
            "token": token,
            "mlx": mlx,
        }
        for name, value in figures.items():
            self.ring_us[name].append(max(0.0, value))
        return max(0.0, figures["hop"])

    # ---- errors ------------------------------------------------------------------------

    def _fail(self, rid: str, message: str) -> None:
        """This stage could not run `rid`: free it here and tell the head."""
        self.stats.errors += 1
        self._leave_group(rid)
        self.snapshots.pop(rid, None)
        self.finished.pop(rid, None)
        self.caches.pop(rid, None)
        self.prebuilt.pop(rid, None)
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
                    self._on_error(replace(header, rid=member))
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


def hidden_size(config: dict[str, Any]) -> int:
    """The width of the activations between layers (0 if the config does not say)."""
    text = config.get("text_config")
    raw = config.get("hidden_size") or (text.get("hidden_size") if isinstance(text, dict) else 0)
    return int(raw or 0)


def _rows_of(header: RingHeader) -> list[str]:
    """The requests a step is for: the rows of a batch, or its one request."""
    return [str(row[0]) for row in header.batch] if header.batch else [header.rid]


def _text_of(stream: TextStream, header: RingHeader) -> tuple[str, str]:
    """The text a token from the tail adds, and why the answer ends there ("" if not)."""
    if header.finish == "stop":  # end of turn: the token itself is not text
        return stream.finish(), "stop"
    text = stream.add(header.token)
    if stream.stopped:
        return text, "stop"
    if header.finish:
        return text + stream.finish(), header.finish
    return text, ""


def _logprobs(drawn: tuple[mx.array, ...]) -> tuple[float, list[tuple[int, float]]]:
    """What the tail's sampler gave besides the token, as it travels to the head."""
    _, chosen, ids, values = drawn
    pairs = zip(cast(list[int], ids.tolist()), cast(list[float], values.tolist()), strict=True)
    return float(cast(float, chosen.item())), list(pairs)


def fill_slot(slot: mx.array, values: np.ndarray) -> None:
    """Write an input into an evaluated placeholder, in place; MLX reads the bytes
    when the step built on it is evaluated. (copy=False fails rather than copies.)"""
    view = np.array(slot, copy=False)
    if values.dtype != view.dtype or values.size != view.size:
        # Assigning would convert the numbers, not copy the bits: refuse instead.
        raise RequestError(
            f"frame holds {values.dtype} x {values.size}, "
            f"the step expects {view.dtype} x {view.size}"
        )
    view[...] = values.reshape(view.shape)


def _describe(exc: Exception) -> str:
    if isinstance(exc, RequestError | ValueError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
