"""The state every part of a `Stage` reads, and the methods the parts call on each other."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx

from worker import families, speculation
from worker.cpu_fusion import DecodeRMSNorm, fuse_for_cpu
from worker.families import LayerCaches
from worker.prompt_cache import (
    DiskStore,
    PromptIndex,
    PromptStore,
    cache_kinds,
    light_snapshot,
    trimmable_at,
)
from worker.sampling import SamplingParams
from worker.shard import Shard
from worker.shared.protocol.frames import RingHeader
from worker.shared.protocol.limits import (
    DEFAULT_PROMPT_CACHE_BYTES,
    DEFAULT_PROMPT_CACHE_DISK_BYTES,
    DEFAULT_STREAMS,
)
from worker.speculation import Speculation
from worker.stage.arrays import hidden_size
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
    Stats,
    TailRequest,
    Waiting,
)

_T = TypeVar("_T")


class StageBase:
    """What a stage holds; the parts (`worker.stage.admission` ...) are its subclasses,
    and `Stage` joins them. The methods one part calls on another are declared below
    for the type checker, which checks each part's definition against them."""

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
        prompt_cache_bytes: int | None = None,
        prompt_cache_disk_bytes: int | None = None,
        cache_dir: Path | None = None,
        cache_key: str = "",
        draft: str = "",
        draft_tokens: int = 0,
        draft_model: Any = None,
        row_cost: float | None = None,
        tensor_group: Any = None,
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
        # of their tokens. None means the default; 0 (`place --prompt-cache 0`, or a
        # node with nothing to spare) turns it off: the plan promised it no memory.
        budget = DEFAULT_PROMPT_CACHE_BYTES if prompt_cache_bytes is None else prompt_cache_bytes
        disk_budget = (
            DEFAULT_PROMPT_CACHE_DISK_BYTES
            if prompt_cache_disk_bytes is None
            else prompt_cache_disk_bytes
        )
        disk = None
        if cache_dir is not None and budget > 0 and disk_budget > 0:
            # On disk under `cache_dir`, in a folder named by `cache_key` (whose model,
            # adapter, layers and settings the entries are), surviving a restart.
            # The shard's own layers are part of the key: another split's entries differ.
            layers = f"layers={shard.start}-{shard.end}/{shard.n_layers}"
            disk = DiskStore(cache_dir, f"{cache_key} {layers}", disk_budget)
        self.store = PromptStore(max(0, budget), disk)
        # A tensor group's ranks agree before any of them reuses an entry (ranks_agree).
        self.tensor_group = tensor_group
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
        # And at the end of each answer: the caches as they were before a step built
        # ahead (of a token that may never come) went into them (Reuse._snap_answer).
        self.answer_snaps: dict[str, tuple[int, list[Any]]] = {}
        self.answer_snap = self.snapshot and light_snapshot(shard.make_cache().full) is not None
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
        if draft_model is not None and not any(
            isinstance(m, DecodeRMSNorm) for m in draft_model.modules()
        ):
            # Its one-token steps on the CPU: fewer, fused ops, bit-identical (as a
            # shard's: worker.cpu_fusion; a no-op on a GPU), once for every stage.
            fuse_for_cpu([draft_model])
        self.draft_model = draft_model
        # Per request, after a verify frame: the least offset its next frame may take
        # (the frame's first token is always kept); a frame below the cache's offset,
        # and not below this, cuts the cache back to it.
        self.rewind_floor: dict[str, int] = {}
        # (head) A request's next verify step, computed on this stage while the one
        # before is round the ring, on the guess that all of that one's guesses are kept
        # (`Verify._verify_ahead`), with the token it starts with. Only a pipeline's head
        # that is not its tail: a tensor group's ranks compute in step, a lone stage has
        # no ring to overlap with.
        self.verify_ahead: dict[str, tuple[Launched, int]] = {}
        self.ahead_ok = shard.is_first and not shard.is_last and tensor_group is None
        # A lane's batched step verifies its rows' guesses in one pass when the batch's
        # caches can cut each row back by its own amount (`batch_spec_reason` says why
        # not) and it pays (`speculation.batch_pays`, with `row_cost`: the setting, or
        # fitted to the lanes' steps, timed from launch to tokens back).
        self.batch_spec_reason = self.batch_reason or speculation.batch_reason(kinds)
        self.row_cost_setting = row_cost
        self.lane_steps: deque[tuple[int, float]] = deque(maxlen=64)
        self.lane_launched: dict[str, tuple[int, float]] = {}
        self._grammar_tokenizer: Any = None  # llguidance's, built on the first schema
        self.warmed: dict[str, float] = {}  # the warm-up's pieces and their ms (`warm_up`)

    def _cut_back(self, cache: LayerCaches, offset: int) -> None:
        """Cut a request's caches back to the first `offset` tokens (mlx-lm's trim)."""
        have = self.shard.cache_offset(cache)
        if have > offset:
            speculation.rewind(cache, have - offset)
        cache.offset = offset

    def held(self) -> int:
        """Requests whose KV cache this stage holds, alone or as a row of a batch."""
        return len(self.caches) + len(self.group_of)

    if TYPE_CHECKING:
        # ---- the parts' methods, as the others call them -----------------------

        def grammar_tokenizer(self) -> Any: ...

        def _speculation(self, msg: dict[str, Any]) -> Speculation | None: ...

        def _on_reuse(self, header: RingHeader) -> None: ...

        def clear_cache(self) -> tuple[int, int]: ...

        def _forget(self, entries: list[str]) -> None: ...

        def _schedule_prefill(
            self, rid: str, prompt: list[int], done: int, params: SamplingParams, first: bool = True
        ) -> None: ...

        def _launch_next(
            self, rid: str, req: HeadRequest, token: int, params: SamplingParams | None = None
        ) -> Launched: ...

        def _launch_head(
            self, rid: str, tokens: list[int], kind: str, offset: int, params: SamplingParams | None
        ) -> Launched: ...

        def _complete(self, step: Launched) -> None: ...

        def _complete_batch(self, step: Launched) -> None: ...

        def _take_prebuilt(self, header: RingHeader) -> Prebuilt | None: ...

        def _drop_prebuilt(self, rid: str) -> None: ...

        def _drop_verify_ahead(self, rid: str) -> None: ...

        def _launch(
            self, header: RingHeader, h: mx.array | None = None, pre: Prebuilt | None = None
        ) -> Launched: ...

        def _cache_for(self, header: RingHeader) -> LayerCaches: ...

        def _tail(self, header: RingHeader) -> TailRequest: ...

        def _sample_verify(self, header: RingHeader, draws: list[Any] | mx.array) -> None: ...

        def _deliver_all(
            self, rid: str, req: HeadRequest, header: RingHeader, tokens: list[int]
        ) -> str | None: ...

        def _deliver(self, rid: str, req: HeadRequest, header: RingHeader) -> str | None: ...

        def _read(
            self, rid: str, req: HeadRequest, header: RingHeader
        ) -> tuple[str, dict[str, Any], str] | None: ...

        def _complete_or_fail(self, step: Launched) -> None: ...

        def _lane(self, rid: str) -> Lane: ...

        def _leave_lane(self, rid: str) -> None: ...

        def _lane_launch(self, lane: Lane) -> Launched | None: ...

        def _on_batch_tokens(self, header: RingHeader) -> None: ...

        def _complete_lane(self, step: Launched) -> None: ...

        def _on_batch_frame(self, header: RingHeader, payload: bytes | memoryview) -> None: ...

        def _leave_group(self, rid: str) -> None: ...

        def _extract(self, rid: str) -> None: ...

        def _admit_waiting(self) -> None: ...

        def _finish(self, rid: str, reason: str) -> None: ...

        def _keep_plan(self, req: HeadRequest) -> dict[str, Any]: ...

        def _keep(self, rid: str, keep: list[Any]) -> None: ...

        def _snap_answer(self, rid: str, offset: int, cache: LayerCaches) -> None: ...

        def _free(self, rid: str, forward: bool, extra: dict[str, Any] | None = None) -> None: ...

        def _start_frame(self, arrived: float | None = None) -> None: ...

        def _mlx(self, evaluate: Callable[..., _T], *args: Any) -> _T: ...

        def _carry(self, extra: dict[str, Any]) -> dict[str, Any]: ...

        def _ring_figures(self, ring_s: float, extra: dict[str, Any]) -> float: ...

        def _fail(self, rid: str, message: str) -> None: ...

        def _on_error(self, header: RingHeader) -> None: ...

        def _batch_guesses(
            self, order: list[str], offsets: list[int]
        ) -> list[list[int]] | None: ...

        def _draw_verify_rows(
            self, rids: list[str], logits: mx.array, guesses: dict[str, tuple[int, ...]]
        ) -> BatchDraw: ...

        def _verified(
            self, req: TailRequest, guesses: tuple[int, ...], values: list[int], own: Any
        ) -> tuple[list[int], str]: ...

        def _take_verified(self, req: HeadRequest, kept: int, token: int) -> list[int]: ...

        def _guess_ahead(self, rid: str, guesses: tuple[int, ...]) -> None: ...
