"""Per-request sampling and streaming text on the tail shard.

A request samples as mlx-lm's `make_sampler` does (temperature, top_p, min_p, top_k
and XTC, in mlx-lm's order, with its compiled pieces where they can take the values as
arrays) from its own PRNG keys, derived from its seed, so a request's tokens do not
depend on which other requests share the pipeline, and equal `generate_step`'s after
`mx.random.seed(seed)`. The values enter the compiled pieces as arrays, not Python
numbers, which `mx.compile` would take for constants: each new temperature, top_p, min_p
or XTC value a client sent compiled new kernels (0.5-1 s on a CPU) into a cache that
never shrinks; now one trace serves them all. Its logits
processors (logit_bias and the penalties) are mlx-lm's own
(`make_logits_processors`), fed that request's own recent tokens, so they too are
the request's alone, whatever it is batched with.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import cache, partial
from typing import Any, cast

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from mlx_lm.sample_utils import apply_top_k, apply_top_p, make_logits_processors

from worker.shared.protocol.limits import (
    DEFAULT_PENALTY_CONTEXT,
    DEFAULT_XTC_THRESHOLD,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PENALTY_CONTEXT,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SAMPLING_LIMITS,
    limit_problem,
)
from worker.shared.structured import MAX_SCHEMA_BYTES, compile_grammar


class ParamError(ValueError):
    """Sampling parameters refused; `param` the request's field to blame, if one (it
    travels in the `failed` message, so the API names it without reading these words)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    # mlx-lm's `make_sampler`, with its meanings (each only when temperature > 0): keep
    # the `top_k` likeliest tokens (0: all), those at least `min_p` times as likely as
    # the likeliest (0: all); XTC drops, with probability `xtc_probability`, every
    # token above `xtc_threshold` but the least likely of them.
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = DEFAULT_XTC_THRESHOLD
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
    # Structured output: the JSON Schema every answer must match, as compact JSON text
    # (worker/shared/structured.py builds and checks it); "" for free text. The tail
    # compiles it and masks each draw to the tokens the grammar allows next.
    grammar: str = ""

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
                top_k=_whole(raw.get("top_k", 0)),
                min_p=float(raw.get("min_p", 0.0)),
                xtc_probability=float(raw.get("xtc_probability", 0.0)),
                xtc_threshold=float(raw.get("xtc_threshold", DEFAULT_XTC_THRESHOLD)),
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
                grammar=_grammar(raw.get("grammar")),
            )
        except (TypeError, ValueError) as exc:
            raise ParamError(f"bad sampling parameter: {exc}") from None
        if found := limits_problem(params):
            raise ParamError(found[1], found[0])
        if params.top_p == 0.0:
            # Nucleus sampling over no mass keeps only the likeliest token (as OpenAI
            # means it; mlx-lm's `make_sampler` would take 0 for "off").
            params = replace(params, temperature=0.0, top_p=1.0)
        # -1: none; else as many of the likeliest as the API's top_logprobs takes.
        if params.logprobs != -1 and (
            problem := limit_problem("top_logprobs", params.logprobs, "logprobs")
        ):
            raise ParamError(problem)
        check_processors(params)
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
            "top_k": self.top_k,
            "min_p": self.min_p,
            "xtc_probability": self.xtc_probability,
            "xtc_threshold": self.xtc_threshold,
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
            "grammar": self.grammar,
        }


# SAMPLING_LIMITS' parameters that are one number of SamplingParams each (a logit_bias
# is a number per token, top_logprobs is the API's name for `logprobs`).
SCALAR_LIMITS = tuple(
    name
    for name in SAMPLING_LIMITS
    if name != "logit_bias" and name in {f.name for f in fields(SamplingParams)}
)


def limits_problem(params: SamplingParams) -> tuple[str, str] | None:
    """The first parameter outside its range in SAMPLING_LIMITS, the table the API
    checks too: its name and what is wrong (None if none). mlx-lm's pieces check some
    of them only when a token is drawn, or not at all (a repetition penalty of 1e-40
    overflows the logits)."""
    for name in SCALAR_LIMITS:
        if problem := limit_problem(name, getattr(params, name)):
            return name, problem
    return None


def check_processors(params: SamplingParams, vocab: int = 0) -> None:
    """processor_problem's words as a ParamError, blaming logit_bias when it is that."""
    if problem := logit_bias_problem(params, vocab):
        raise ParamError(problem, "logit_bias")
    if problem := processor_problem(params, vocab):
        raise ParamError(problem)


def processor_problem(params: SamplingParams, vocab: int = 0) -> str:
    """What is wrong with the logits processors' tokens ("" if nothing); token ids are
    checked against the vocabulary when it is known (`vocab` > 0)."""
    if problem := logit_bias_problem(params, vocab):
        return problem
    if len(params.recent) > MAX_PENALTY_CONTEXT or any(
        t < 0 or 0 < vocab <= t for t in params.recent
    ):
        # The head fills it from the prompt; a tail checks it all the same, since an
        # index past the logits is no error MLX would raise.
        return f"recent must be at most {MAX_PENALTY_CONTEXT} token ids of the vocabulary"
    return ""


def logit_bias_problem(params: SamplingParams, vocab: int = 0) -> str:
    """What is wrong with the request's logit_bias ("" if nothing)."""
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
        if problem := limit_problem("logit_bias", bias, f"logit_bias for token {token}"):
            return problem
    return ""


def _whole(raw: Any) -> int:
    """An integer as it travels; 2.5 is no top_k (int() would make it 2)."""
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise TypeError(f"expected an integer, got {raw!r}")
    return raw


def _grammar(raw: Any) -> str:
    """The schema text as it travels: a string within the size the API allows."""
    if raw is None:
        return ""
    if not isinstance(raw, str) or len(raw.encode()) > MAX_SCHEMA_BYTES:
        raise TypeError(f"grammar must be JSON Schema text of at most {MAX_SCHEMA_BYTES} bytes")
    return raw


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


# mlx-lm's `make_sampler` pieces, for the values it cannot take as arrays: its
# `apply_min_p` and `apply_xtc` check their ranges in Python inside `mx.compile` (which
# cannot read an array while tracing), and its `categorical_sampling` divides by the
# temperature itself (`1 / temp` in the logits' dtype can differ by a bit from Python's
# reciprocal, which would change a token now and then). The same operations in the same
# dtypes, so the tokens are mlx-lm's (tests/unit/test_sampler_chain.py compares them
# with `make_sampler`'s); the ranges are checked when a request is parsed (LIMITS).
@mx.compile
def _min_p(logprobs: mx.array, log_min_p: mx.array) -> mx.array:
    """`apply_min_p` (min_tokens_to_keep=1) with log(min_p) an input."""
    top = mx.max(logprobs, axis=-1, keepdims=True)
    return mx.where(logprobs < top + log_min_p, -float("inf"), logprobs)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def _xtc(
    logits: mx.array, probability: mx.array, threshold: mx.array, special: list[int]
) -> mx.array:
    """`apply_xtc` with the probability and threshold inputs."""
    probs = mx.softmax(logits, -1)
    mask = probs > mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    if special:
        mask[..., special] = False
    return mx.where(mx.random.uniform(0, 1) > probability, logits, mx.where(mask, -mx.inf, logits))


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def _categorical(logits: mx.array, inverse_temperature: mx.array) -> mx.array:
    """`categorical_sampling` with 1 / temperature an input."""
    return mx.random.categorical(logits * inverse_temperature)


def sampler_chain(
    params: SamplingParams, vocab: int, dtype: mx.Dtype, special: tuple[int, ...] = ()
) -> Callable[[mx.array], mx.array]:
    """`make_sampler(temperature, top_p, min_p, top_k=..., xtc_...)` for log-probabilities
    of `vocab` tokens in `dtype` (temperature > 0): its chain in its order, each value an
    array of the dtype mlx-lm's Python number would take in it (the logits', or float32
    where mlx-lm compares with float32), so one compiled trace serves every value.
    top_k stays a number (`argpartition` needs it), traced once per k but compiling no
    kernel."""
    p = params

    def scalar(value: float, kind: mx.Dtype = dtype) -> mx.array:
        return mx.array(value, dtype=kind)

    steps: list[Callable[[mx.array], mx.array]] = []
    if 0 < p.top_p < 1.0:
        # mlx-lm's own piece takes an array (its annotation says float): it multiplies
        # float32 probabilities by it.
        top_p: Any = scalar(p.top_p, mx.float32)
        steps.append(lambda x: apply_top_p(x, top_p))
    if p.min_p != 0.0:
        log_min_p = scalar(math.log(p.min_p))
        steps.append(lambda x: _min_p(x, log_min_p))
    if p.xtc_probability > 0.0:
        # XTC's coin is a float32 uniform draw; its threshold meets the probabilities.
        probability, threshold = scalar(p.xtc_probability, mx.float32), scalar(p.xtc_threshold)
        steps.append(lambda x: _xtc(x, probability, threshold, list(special)))
    # mlx-lm's `apply_top_k` raises for a k at or past the vocabulary, which would keep
    # every token: that is no top_k.
    if 0 < p.top_k < vocab:
        steps.append(lambda x: apply_top_k(x, p.top_k))
    inverse = scalar(1.0 / p.temperature)

    def sample(logprobs: mx.array) -> mx.array:
        for step in steps:
            logprobs = step(logprobs)
        return _categorical(logprobs, inverse)

    return sample


# How many keys a request's `_Keys` computes at a time.
KEY_CHUNK = 64


@cache
def _key_stream() -> mx.Stream:
    """The keys are computed on a stream of their own, so reading them back waits for
    no model step in flight on the default one (made on first use, not on import)."""
    return mx.new_stream(mx.cpu)


class _Keys:
    """A request's PRNG keys: the state MLX's global PRNG holds before each step of
    mlx-lm's `generate_step` after `mx.random.seed(seed)`, each as the integer
    `mx.random.seed` turns back into it (a key is two uint32 words, `key(n)` is
    [n >> 32, n & 0xffffffff]).

    mlx-lm's sampler takes no key: it draws from the global state (its compiled pieces
    take and give back `mx.random.state`, which cannot be assigned from Python), and a
    request cannot own that while others are sampled beside it. So a request seeds the
    global state with its own key before each draw. Every random call splits the state
    and keeps the first half; the state left by the sampler cannot be read back without
    waiting for the logits it was drawn on (a step built ahead on a token not yet known
    could not be), so the keys are computed from the seed alone: `draws` splits a step
    (the tests check this against mlx-lm's own generate)."""

    def __init__(self, seed: int, draws: int) -> None:
        self._key = mx.random.key(seed)
        self._draws = draws
        self._ahead: deque[int] = deque()

    def next(self) -> int:
        if not self._ahead:
            with mx.stream(_key_stream()):
                keys = []
                key = self._key
                for _ in range(KEY_CHUNK):
                    keys.append(key)
                    for _ in range(self._draws):
                        key = mx.random.split(key)[0]
                self._key = key
                words = cast(list[list[int]], mx.stack(keys).tolist())
            self._ahead.extend((hi << 32) | lo for hi, lo in words)
        return self._ahead.popleft()

    def unread(self, keys: list[int]) -> None:
        """Give back keys taken for draws that were dropped (rejected guesses), in order:
        the next draws take them again."""
        self._ahead.extendleft(reversed(keys))


class Sampler:
    """One request's sampler. Its draws are that request's tokens in order: each is
    remembered (lazily, so a step built ahead on it costs no wait) as the next recent
    token the penalties see, as mlx-lm's `generate_step` extends its `tokens`.

    `special` are the tokens XTC never drops: mlx_lm.server's, the tokens of a newline
    and the end-of-sequence tokens."""

    def __init__(
        self,
        params: SamplingParams,
        special: tuple[int, ...] = (),
        grammar: Grammar | None = None,
    ) -> None:
        self.params = params
        self.special = special
        self.grammar = grammar
        # mlx-lm's sampler draws once for the token, and once more for XTC's coin.
        self._keys = _Keys(params.seed, 2 if params.xtc_probability > 0 else 1)
        self._sample: Callable[[mx.array], mx.array] | None = None
        self.processors = params.processors()
        self._window = params.window
        self._recent = mx.array(list(params.recent[-self._window :] if self._window else ()))
        self._recent = self._recent.astype(mx.int32)
        self._last_key: int | None = None  # the key the last draw took (None: greedy)
        # A verify frame's draws: per position, the recent tokens and key before it.
        self._marks: list[tuple[mx.array, int | None]] = []

    @property
    def plain(self) -> bool:
        """Greedy on the model's own logits, wanting no log-probabilities: a batch's
        rows that are all plain share one argmax."""
        p = self.params
        plain = p.temperature == 0.0 and p.logprobs < 0 and not self.processors
        return plain and self.grammar is None

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

    def _sampler(self, logprobs: mx.array) -> Callable[[mx.array], mx.array]:
        if self._sample is None:
            self._sample = sampler_chain(
                self.params, logprobs.shape[-1], logprobs.dtype, self.special
            )
        return self._sample

    def __call__(self, logits: mx.array) -> mx.array:
        if self.params.temperature == 0.0:
            return mx.argmax(logits, axis=-1)  # mlx-lm's greedy_sampler
        # As `generate_step` hands them to the sampler: log-probabilities, [1, vocab].
        logprobs = (logits - mx.logsumexp(logits, keepdims=True))[None]
        self._last_key = self._keys.next()
        mx.random.seed(self._last_key)
        return self._sampler(logprobs)(logprobs)[0]

    def draw(self, logits: mx.array) -> mx.array | tuple[mx.array, ...]:
        """The sampled token; with logprobs asked for, a tuple of the token, its
        log-probability, and the ids and log-probabilities of the k likeliest. They are
        the model's own (a log-softmax of the logits, before temperature and the
        sampler's top_p, min_p, top_k and XTC), as mlx-lm's server and OpenAI give them,
        after the request's logits processors (mlx-lm's `generate_step` takes them from
        the processed logits too), before a grammar's mask (which would make the
        tokens it rules out -inf, which JSON cannot carry).

        With a grammar the draw is among the tokens it allows after the tokens drawn so
        far (`Grammar.accept`): so a step is drawn only once the token before it is
        known, never built ahead."""
        logits = self._process(logits)
        chosen = logits
        if self.grammar is not None:
            # The step's layers compute while the library works out the mask.
            mx.async_eval(logits)
            chosen = mx.where(self.grammar.allowed(), logits, -mx.inf)
        token = self(chosen)
        self._remember(token)
        k = self.params.logprobs
        if k < 0:
            return token
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits)
        ids = mx.argpartition(-logprobs, kth=k - 1)[:k] if k else mx.zeros((0,), mx.int32)
        return token, logprobs[token], ids, logprobs[ids]

    def draw_positions(self, logits: mx.array) -> list[mx.array | tuple[mx.array, ...]]:
        """A verify frame's draws, one per row of `logits` ([positions, vocab]), each as
        `draw` gives it after the ones before. Position i's penalties see the tokens
        drawn before it where the guesses were (a draw that differs from its guess ends
        what is kept there, so the rows after it are never read). `keep` says how many
        are kept: the rest are undone, their keys given back, so the next draws are the
        ones decoding without guesses would have made."""
        self._marks = []
        outs = []
        for row in range(logits.shape[0]):
            before = self._recent
            self._last_key = None
            outs.append(self.draw(logits[row]))
            self._marks.append((before, self._last_key))
        return outs

    def draw_undoable(
        self, logits: mx.array
    ) -> tuple[mx.array | tuple[mx.array, ...], tuple[mx.array, int | None]]:
        """`draw`, and what `undo` needs to take it back (a step built ahead that does
        not run after all: the next draw is then the one it would have been)."""
        before = self._recent
        self._last_key = None
        out = self.draw(logits)
        return out, (before, self._last_key)

    def undo(self, mark: tuple[mx.array, int | None]) -> None:
        before, key = mark
        self._recent = before
        if key is not None:
            self._keys.unread([key])

    def keep(self, n: int) -> None:
        """Keep the first `n` draws of the last `draw_positions`; undo the others."""
        dropped, self._marks = self._marks[n:], []
        if not dropped:
            return
        self._recent = dropped[0][0]
        self._keys.unread([key for _, key in dropped if key is not None])


def grammar_tokenizer(tokenizer: Any, vocab: int) -> LLTokenizer:
    """llguidance's view of a model's tokenizer (mlx-lm's TokenizerWrapper, or the
    Hugging Face tokenizer it wraps), over the `vocab` logits the model gives (past the
    tokenizer's own tokens, never allowed), ending at its end-of-sequence tokens.
    Building it reads the whole vocabulary (about a second for 150 k tokens): a stage
    builds it once. A tokenizer the library cannot read is a ParamError saying so."""
    from llguidance.hf import from_tokenizer  # imports transformers: only when needed

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    try:
        return from_tokenizer(hf, n_vocab=vocab or None, eos_token=eos or None)
    except Exception as exc:
        raise ParamError(
            "response_format cannot be enforced for this model: the grammar library "
            f"(llguidance) cannot read its tokenizer ({type(exc).__name__}: {exc}); "
            "leave response_format out",
            "response_format",
        ) from None


class Grammar:
    """One request's structured output on the tail: llguidance's matcher for its schema,
    advanced by every token drawn. `allowed` is the mask of the tokens it takes next
    (once the answer is complete, only end-of-sequence)."""

    def __init__(self, schema: str, tokenizer: LLTokenizer) -> None:
        self._matcher = LLMatcher(tokenizer, compile_grammar(schema))
        if self._matcher.is_error():
            # The API compiled it already; a schema that got past it names itself here.
            raise ParamError(
                f"response_format cannot be enforced: {self._matcher.get_error()}",
                "response_format",
            )
        self._vocab = tokenizer.vocab_size
        self._eos = frozenset(tokenizer.eos_tokens)
        self._bits = allocate_token_bitmask(1, self._vocab)

    def allowed(self) -> mx.array:
        """[vocab] booleans: which tokens may come next."""
        fill_next_token_bitmask(self._matcher, self._bits, 0)
        # Bit i of 32-bit word j is token 32j + i; both platforms are little-endian.
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab]
        return mx.array(bits.astype(np.bool_))

    def accept(self, token: int) -> bool:
        """Advance past the drawn token; True if it ended the answer (an end-of-sequence
        token the complete answer allowed). A token the mask ruled out is a ValueError."""
        if not self._matcher.consume_token(token):
            raise ValueError(
                f"the grammar refused token {token}: {self._matcher.get_error() or 'not allowed'}"
            )
        return token in self._eos and self._matcher.is_stopped()


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
        self.matched: str | None = None  # the stop string that ended the text

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
        found = [
            (base + end - len(m.stop), m.stop)
            for m in self._matchers
            if (end := m.feed(segment)) >= 0
        ]
        if found:
            self.stopped = True
            cut, self.matched = min(found)
            out, self._pending = self._pending[: max(0, cut)], ""
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
