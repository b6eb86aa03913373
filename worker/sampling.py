"""Per-request sampling and streaming text on the tail shard.

Each request carries its own PRNG key derived from its seed, so a request's
tokens do not depend on which other requests share the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

MAX_TOKENS_LIMIT = 1 << 20
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
        try:
            params = cls(
                max_tokens=int(raw.get("max_tokens", 256)),
                temperature=float(raw.get("temperature", 0.0)),
                top_p=float(raw.get("top_p", 1.0)),
                seed=int(raw.get("seed", 0)),
                stop=tuple(str(s) for s in raw.get("stop", ()) if s),
                ignore_eos=bool(raw.get("ignore_eos", False)),
                logprobs=int(raw.get("logprobs", -1)),
            )
        except (TypeError, ValueError) as exc:
            raise ParamError(f"bad sampling parameter: {exc}") from None
        if not 0 <= params.seed < 2**63:
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
    sees the beginning of a stop string that is then taken away.
    """

    def __init__(self, detokenizer: Any, stop: tuple[str, ...]) -> None:
        self._detok = detokenizer
        self._stop = stop
        self._emitted = 0
        self._text = ""
        self.stopped = False

    def add(self, token: int) -> str:
        self._detok.add_token(token)
        self._text += self._detok.last_segment
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._detok.finalize()
        self._text += self._detok.last_segment
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        cut = _first_stop(self._text, self._stop, self._emitted)
        if cut is not None:
            self.stopped = True
            return self._take(cut)
        hold = 0 if final else _held_back(self._text, self._stop)
        return self._take(len(self._text) - hold)

    def _take(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self._text[self._emitted : upto]
        self._emitted = upto
        return out


def _first_stop(text: str, stops: tuple[str, ...], since: int) -> int | None:
    found = [i for s in stops if (i := text.find(s, max(0, since - len(s) + 1))) >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if s.startswith(text[-n:]):
                best = max(best, n)
                break
    return best
