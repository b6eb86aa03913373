"""Per-request sampling and streaming text on the tail shard.

Each request carries its own PRNG key derived from its seed, so a request's
tokens do not depend on which other requests share the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from worker.shared.protocol.limits import (
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKENS_LIMIT,
)

# OpenAI's ceiling for top_logprobs; each one costs the tail a sort of the vocabulary.
MAX_TOP_LOGPROBS = 20


class ParamError(ValueError):
    pass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # -1: none; 0: the chosen token's log-probability; k: that and the k likeliest.
    logprobs: int = -1

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SamplingParams:
        stop = raw.get("stop") or ()
        if not isinstance(stop, list | tuple) or not all(isinstance(x, str) for x in stop):
            raise ParamError("stop strings must be a list of strings")
        if len(stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in stop):
            raise ParamError(
                f"stop strings: at most {MAX_STOP_STRINGS} of at most {MAX_STOP_CHARS} characters"
            )
        try:
            params = cls(
                max_tokens=int(raw.get("max_tokens", 256)),
                temperature=float(raw.get("temperature", 0.0)),
                top_p=float(raw.get("top_p", 1.0)),
                seed=int(raw.get("seed", 0)),
                stop=tuple(x for x in stop if x),
                ignore_eos=bool(raw.get("ignore_eos", False)),
                logprobs=int(raw.get("logprobs", -1)),
            )
        except (TypeError, ValueError) as exc:
            raise ParamError(f"bad sampling parameter: {exc}") from None
        if not 0 <= params.seed <= MAX_SEED:
            raise ParamError(f"seed must be 0..2**63-1, got {params.seed}")
        if not 1 <= params.max_tokens <= MAX_TOKENS_LIMIT:
            raise ParamError(f"max_tokens must be 1..{MAX_TOKENS_LIMIT}, got {params.max_tokens}")
        if not 0.0 <= params.temperature <= 10.0:
            raise ParamError(f"temperature must be 0..10, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise ParamError(f"top_p must be in (0, 1], got {params.top_p}")
        if not -1 <= params.logprobs <= MAX_TOP_LOGPROBS:
            raise ParamError(f"logprobs must be -1..{MAX_TOP_LOGPROBS}, got {params.logprobs}")
        return params

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
        }


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._key = mx.random.key(params.seed)

    def __call__(self, logits: mx.array) -> mx.array:
        if self.params.temperature == 0.0:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if self.params.top_p < 1.0:
            logprobs = apply_top_p(logprobs[None], self.params.top_p)[0]
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self.params.temperature), key=sub)

    def draw(self, logits: mx.array) -> mx.array | tuple[mx.array, ...]:
        """The sampled token; with logprobs asked for, a tuple of the token, its
        log-probability, and the ids and log-probabilities of the k likeliest. They are
        the model's own (a log-softmax of the logits, before temperature and top_p), as
        mlx-lm's server and OpenAI give them."""
        token = self(logits)
        k = self.params.logprobs
        if k < 0:
            return token
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits)
        ids = mx.argpartition(-logprobs, kth=k - 1)[:k] if k else mx.zeros((0,), mx.int32)
        return token, logprobs[token], ids, logprobs[ids]


class TextStream:
    """Detokenises token by token and cuts the text at the first stop string.

    Text that could still turn into a stop string is held back, so a caller never
    sees the beginning of a stop string that is then taken away. Each stop string
    is followed by a KMP matcher fed only the text a token adds, and only the held
    back text is kept: a token costs O(its text x stop strings), not a rescan of
    the answer, however long the answer grows.
    """

    def __init__(self, detokenizer: Any, stop: tuple[str, ...]) -> None:
        self._detok = detokenizer
        self._matchers = [_StopMatcher(s) for s in stop if s]
        self._pending = ""  # text not yet given out: at most the longest stop string
        self.stopped = False

    @property
    def work(self) -> int:
        """Matcher steps so far, for tests that check the cost per token."""
        return sum(m.steps for m in self._matchers)

    def add(self, token: int) -> str:
        self._detok.add_token(token)
        return self._release(self._detok.last_segment, final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._detok.finalize()
        return self._release(self._detok.last_segment, final=True)

    def _release(self, segment: str, final: bool) -> str:
        if self.stopped:
            return ""
        base = len(self._pending)
        self._pending += segment
        # A match can only start in text still held back: anything given out was not
        # the start of any stop string (the hold below is the longest such tail).
        cuts = [base + end - len(m.stop) for m in self._matchers if (end := m.feed(segment)) >= 0]
        if cuts:
            self.stopped = True
            out, self._pending = self._pending[: max(0, min(cuts))], ""
            return out
        hold = (
            0
            if final
            else min(len(self._pending), max((m.state for m in self._matchers), default=0))
        )
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out


class _StopMatcher:
    """Knuth-Morris-Pratt over a stream: `state` is the length of the longest tail of
    the text so far that begins the stop string."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        self.steps = 0
        # fail[i]: the longest proper prefix of stop[: i + 1] that is also its suffix.
        fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail[i] = k
        self._fail = fail

    def feed(self, text: str) -> int:
        """Advance over `text`; the end of the first match in it, or -1."""
        stop, fail, k = self.stop, self._fail, self.state
        steps = 0
        for i, ch in enumerate(text):
            while k and ch != stop[k]:
                k = fail[k - 1]
                steps += 1
            if ch == stop[k]:
                k += 1
            steps += 1
            if k == len(stop):
                self.state, self.steps = k, self.steps + steps
                return i + 1
        self.state, self.steps = k, self.steps + steps
        return -1
