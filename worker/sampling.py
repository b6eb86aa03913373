"""Per-request sampling and streaming text on the tail shard.

Each request carries its own PRNG key derived from its seed, so a request's
tokens do not depend on which other requests share the pipeline. A request's
logits processors (logit_bias and the penalties) are mlx-lm's own
(`make_logits_processors`), fed that request's own recent tokens, so they too
are the request's alone, whatever it is batched with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, make_logits_processors

from worker.shared.protocol.limits import (
    DEFAULT_PENALTY_CONTEXT,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PENALTY,
    MAX_PENALTY_CONTEXT,
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
    # Logits processors, mlx-lm's own (`make_logits_processors`), with its meanings: a
    # bias added to a token's logit; a repetition penalty dividing (multiplying, when
    # negative) the logits of tokens among the last `repetition_context_size` (1: none);
    # presence and frequency penalties subtracted once, or once per occurrence, for the
    # tokens among their last `*_context_size`. The window counts the prompt too.
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    repetition_context_size: int = DEFAULT_PENALTY_CONTEXT
    presence_penalty: float = 0.0
    presence_context_size: int = DEFAULT_PENALTY_CONTEXT
    frequency_penalty: float = 0.0
    frequency_context_size: int = DEFAULT_PENALTY_CONTEXT
    # The prompt's last `window` tokens, set by the head: the tail shard, which applies
    # the penalties, never sees the prompt.
    recent: tuple[int, ...] = ()

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
                logit_bias=_logit_bias(raw.get("logit_bias")),
                repetition_penalty=float(raw.get("repetition_penalty", 1.0)),
                repetition_context_size=int(
                    raw.get("repetition_context_size", DEFAULT_PENALTY_CONTEXT)
                ),
                presence_penalty=float(raw.get("presence_penalty", 0.0)),
                presence_context_size=int(
                    raw.get("presence_context_size", DEFAULT_PENALTY_CONTEXT)
                ),
                frequency_penalty=float(raw.get("frequency_penalty", 0.0)),
                frequency_context_size=int(
                    raw.get("frequency_context_size", DEFAULT_PENALTY_CONTEXT)
                ),
                recent=tuple(int(t) for t in raw.get("recent") or ()),
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
        if problem := processor_problem(params):
            raise ParamError(problem)
        return params

    @property
    def window(self) -> int:
        """How many recent tokens the penalties look back on (0: no penalty)."""
        sizes = [
            size
            for penalty, size, neutral in (
                (self.repetition_penalty, self.repetition_context_size, 1.0),
                (self.presence_penalty, self.presence_context_size, 0.0),
                (self.frequency_penalty, self.frequency_context_size, 0.0),
            )
            if penalty != neutral
        ]
        return max(sizes, default=0)

    def processors(self) -> list[Any]:
        """mlx-lm's logits processors for these parameters ([] if none changes a logit)."""
        return make_logits_processors(
            logit_bias=dict(self.logit_bias) or None,
            # mlx-lm leaves out a penalty of 0 (or None); a repetition penalty of 1
            # would divide by 1: left out too.
            repetition_penalty=None if self.repetition_penalty == 1.0 else self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty,
            presence_context_size=self.presence_context_size,
            frequency_penalty=self.frequency_penalty,
            frequency_context_size=self.frequency_context_size,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
            # Pairs, not a map: every key of a header's map is a string.
            "logit_bias": [list(pair) for pair in self.logit_bias],
            "repetition_penalty": self.repetition_penalty,
            "repetition_context_size": self.repetition_context_size,
            "presence_penalty": self.presence_penalty,
            "presence_context_size": self.presence_context_size,
            "frequency_penalty": self.frequency_penalty,
            "frequency_context_size": self.frequency_context_size,
            "recent": list(self.recent),
        }


def processor_problem(params: SamplingParams, vocab: int = 0) -> str:
    """What is wrong with the logits processors' parameters ("" if nothing); token ids
    are checked against the vocabulary when it is known (`vocab` > 0)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            return f"{name} must be a number from -{MAX_PENALTY:g} to {MAX_PENALTY:g}, got {value}"
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0):
        return (
            "repetition_penalty must be a number above 0 (1 means none), "
            f"got {params.repetition_penalty}"
        )
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        value = getattr(params, name)
        if not 1 <= value <= MAX_PENALTY_CONTEXT:
            return f"{name} must be 1..{MAX_PENALTY_CONTEXT}, got {value}"
    if len(params.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        return (
            f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(params.logit_bias)}"
        )
    if len({token for token, _ in params.logit_bias}) != len(params.logit_bias):
        return "logit_bias names a token twice"
    for token, bias in params.logit_bias:
        if token < 0 or (vocab > 0 and token >= vocab):
            top = f"0..{vocab - 1}" if vocab > 0 else "0 or above"
            return (
                f"logit_bias token {token} is not in this model's vocabulary ({top}): "
                "use the model's own token ids"
            )
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            return (
                f"logit_bias for token {token} must be from -{MAX_LOGIT_BIAS:g} to "
                f"{MAX_LOGIT_BIAS:g}, got {bias}"
            )
    if len(params.recent) > MAX_PENALTY_CONTEXT or any(
        t < 0 or 0 < vocab <= t for t in params.recent
    ):
        # The head fills it from the prompt; a tail checks it all the same, since an
        # index past the logits is no error MLX would raise.
        return f"recent must be at most {MAX_PENALTY_CONTEXT} token ids of the vocabulary"
    return ""


def _logit_bias(raw: Any) -> tuple[tuple[int, float], ...]:
    """[[token, bias], ...] (as it travels) or {token: bias} (as OpenAI writes it)."""
    if not raw:
        return ()
    pairs = raw.items() if isinstance(raw, dict) else raw
    out = []
    for pair in pairs:
        token, bias = pair
        if isinstance(token, bool) or isinstance(bias, bool):
            raise TypeError(f"logit_bias entry {list(pair)} is not [token id, bias]")
        out.append((int(token), float(bias)))
    return tuple(out)


class Sampler:
    """One request's sampler. Its draws are that request's tokens in order: each is
    remembered (lazily, so a step built ahead on it costs no wait) as the next recent
    token the penalties see, as mlx-lm's `generate_step` extends its `tokens`."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._key = mx.random.key(params.seed)
        self.processors = params.processors()
        self._window = params.window
        self._recent = mx.array(list(params.recent[-self._window :] if self._window else ()))
        self._recent = self._recent.astype(mx.int32)

    @property
    def plain(self) -> bool:
        """Greedy on the model's own logits, wanting no log-probabilities: a batch's
        rows that are all plain share one argmax."""
        p = self.params
        return p.temperature == 0.0 and p.logprobs < 0 and not self.processors

    def _process(self, logits: mx.array) -> mx.array:
        if not self.processors:
            return logits
        # mlx-lm's processors take [batch, vocab] and may write into it: a new array.
        out = logits.reshape(1, -1)
        for processor in self.processors:
            out = processor(self._recent, out)
        return out.reshape(-1)

    def _remember(self, token: mx.array) -> None:
        if self._window:
            recent = mx.concatenate([self._recent, token.reshape(1).astype(mx.int32)])
            self._recent = recent[-self._window :]

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
        mlx-lm's server and OpenAI give them, after the request's logits processors
        (mlx-lm's `generate_step` takes them from the processed logits too)."""
        logits = self._process(logits)
        token = self(logits)
        self._remember(token)
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
