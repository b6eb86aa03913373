"""Speculative decoding's decisions, apart from the ring: what to guess, what to keep.

The head guesses the next K tokens (from a draft model it runs, or from earlier text:
prompt lookup) and sends the last token it has plus the K guesses around the ring as
one "verify" frame; the tail samples the big model at each of the K + 1 positions as
mlx-lm's `speculative_generate_step` does (the target's own token at every position,
a guess kept while it equals that token), so the answer is the one decoding without
guesses gives, token for token, greedy or seeded. Every stage then cuts its caches
back to the tokens that were kept (`rewind`), learning how far from the offset of the
request's next frame.

This module holds the pure parts: the lookup proposer, the acceptance count, how K
adapts to a request's acceptance and when speculation stands aside, and the draft
model's own session (its cache cut back with mlx-lm's `trim_prompt_cache`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

# The draft choices, per placement (`--draft`) and per request.
MODES = ("", "lookup", "model")
# Guesses per verify frame: the default, and the most a frame may carry (the rows a
# stage computes at once for it; a verify frame is a small prefill chunk).
DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 16
# Prompt lookup's K starts here and doubles while every guess is kept, up to
# MAX_DRAFT_TOKENS: its guesses cost nothing to make, but a rejected one costs its row
# in every stage, so a request earns a wide step by a narrow one kept whole.
LOOKUP_FIRST_TOKENS = 2
# Prompt lookup matches the last `NGRAM_MAX` .. `NGRAM_MIN` tokens (longest first).
NGRAM_MAX = 4
NGRAM_MIN = 2
# Speculation stands aside for a request whose guesses are kept less often than this,
# once it has guessed `JUDGE_AFTER` tokens: a rejected guess costs its row of compute
# in every stage, and the steps it makes cannot be built ahead while the last is
# still out (a verify step's offset is only known when its tokens come back).
MIN_ACCEPTANCE = 0.3
JUDGE_AFTER = 12
# ... or once it has made this many verify steps (K falls to 1 after rejections, so
# a request missing every guess would take 12 steps to reach JUDGE_AFTER guesses).
JUDGE_ROUNDS = 4
# A request's acceptance before it has guessed: what a batch expects of its guesses.
PRIOR_ACCEPTANCE = 0.5
# Batched verify steps (`batch_pays`): a row-position's compute as a share of a step's
# fixed cost (reading the weights, the trips around the ring) until the head has timed
# steps of different sizes, and how much more a verify step must yield to be taken.
ROW_COST = 0.05
BATCH_MARGIN = 0.05


def lookup(sources: Sequence[Sequence[int]], context: Sequence[int], k: int) -> list[int]:
    """Prompt lookup decoding: up to `k` tokens that followed the longest earlier match
    (of NGRAM_MAX down to NGRAM_MIN tokens) of the end of `context` (the prompt and the
    answer so far). Each of `sources` is searched too, first (a predicted output), and
    within each the latest match wins: recent text is the likeliest to repeat."""
    if k <= 0:
        return []
    for n in range(min(NGRAM_MAX, len(context) - 1), NGRAM_MIN - 1, -1):
        tail = list(context[-n:])
        for source, own in [*((s, False) for s in sources), (context, True)]:
            # In the context itself the match must end before its own tail.
            last = len(source) - n - (1 if own else 0)
            for start in range(last, -1, -1):
                if source[start] == tail[0] and list(source[start : start + n]) == tail:
                    follow = list(source[start + n : start + n + k])
                    if follow:
                        return follow
    return []


class LookupIndex:
    """Prompt lookup over a growing context without rescanning it: for each n-gram
    (NGRAM_MIN..NGRAM_MAX tokens) the position after its latest occurrence that has a
    token after it, kept up to date token by token (`extend`), so a proposal costs a
    few dictionary reads however long the context. `propose` returns what `lookup`
    does on the same sources and context.

    An n-gram ending at the context's last token is entered only once a token follows
    it: `lookup` wants the latest match that ends before the context's own tail."""

    def __init__(self, sources: Sequence[Sequence[int]] = ()) -> None:
        # A predicted output is fixed: its n-grams are entered once, each source its own
        # table (the sources are searched in order before the context).
        self.sources: list[tuple[list[int], dict[tuple[int, ...], int]]] = []
        for src in sources:
            tokens: list[int] = []
            table: dict[tuple[int, ...], int] = {}
            _enter(tokens, table, src)
            self.sources.append((tokens, table))
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], int] = {}
        # Where the last proposal came from: its source and the position it began at.
        self.taken: tuple[Sequence[int], int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        _enter(self.tokens, self.table, tokens)

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        context = self.tokens
        for n in range(min(NGRAM_MAX, len(context) - 1), NGRAM_MIN - 1, -1):
            tail = tuple(context[-n:])
            for source, table in [*self.sources, (context, self.table)]:
                at = table.get(tail)
                if at is not None:
                    self.taken = (source, at)
                    return list(source[at : at + k])
        self.taken = None
        return []


def _enter(tokens: list[int], table: dict[tuple[int, ...], int], new: Sequence[int]) -> None:
    """Append `new` to `tokens`, entering in `table` each n-gram (NGRAM_MIN..NGRAM_MAX)
    that a token now follows, at the position after it (a later occurrence overwrites
    an earlier one)."""
    for token in new:
        end = len(tokens)  # the n-grams ending just before `token` get it next
        for n in range(NGRAM_MIN, min(NGRAM_MAX, end) + 1):
            table[tuple(tokens[end - n : end])] = end
        tokens.append(token)


def lookup_guesses(
    prediction: Sequence[int], prompt: Sequence[int], answer: Sequence[int], k: int
) -> list[int]:
    """Prompt lookup's guesses for an answer so far: while the answer is the start of a
    predicted output, the prediction's next tokens; else `lookup` in the prediction,
    then in the prompt and answer."""
    n = len(answer)
    if prediction and n < len(prediction) and list(prediction[:n]) == list(answer):
        return list(prediction[n : n + k])
    sources = [prediction] if prediction else []
    return lookup(sources, [*prompt, *answer], k)


def accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many guesses are kept: the leading ones equal to the token the big model
    drew at their position (`sampled` has one more, the token after the last guess)."""
    n = 0
    while n < len(drafts) and n < len(sampled) and drafts[n] == sampled[n]:
        n += 1
    return n


@dataclass
class Speculation:
    """One request's speculation: how many guesses its next frame carries, what it has
    kept so far, and (`off`) why it stopped guessing."""

    mode: str  # "lookup" or "model"
    k: int = DEFAULT_DRAFT_TOKENS
    k_max: int = DEFAULT_DRAFT_TOKENS
    prediction: tuple[int, ...] = ()  # a predicted output's tokens, looked up first
    drafted: int = 0
    kept: int = 0
    off: str = ""
    in_flight: tuple[int, ...] | None = None  # the guesses of the verify frame out now
    recent: list[tuple[int, int]] = field(default_factory=list)  # (drafted, kept) lately
    # Prompt lookup's index of the prompt and the kept answer (`guesses`), and how much
    # of the answer is still the predicted output's beginning.
    index: LookupIndex | None = None
    taken: tuple[Sequence[int], int] | None = None  # where the last guesses came from
    answered: int = 0  # answer tokens entered in the index
    predicted: int = 0  # answer tokens that are the prediction's first ones (if all)

    def guesses(self, prompt: Sequence[int], answer: Sequence[int], k: int) -> list[int]:
        """Prompt lookup's guesses (what `lookup_guesses` gives), from the index: only
        the answer's tokens new since the last call are entered."""
        if self.index is None:
            self.index = LookupIndex([self.prediction] if self.prediction else [])
            self.index.extend(prompt)
        fresh = answer[self.answered :]
        self.index.extend(fresh)
        if self.predicted == self.answered:
            # Still the prediction's beginning? Only the new tokens need a look.
            for token in fresh:
                at = self.predicted
                if at >= len(self.prediction) or self.prediction[at] != token:
                    break
                self.predicted += 1
        self.answered = len(answer)
        if k <= 0:
            return []
        if self.prediction and self.predicted == len(answer) < len(self.prediction):
            self.taken = (self.prediction, len(answer))
            return list(self.prediction[len(answer) : len(answer) + k])
        guesses = self.index.propose(k)
        self.taken = self.index.taken
        return guesses

    def guesses_after(self, k: int) -> tuple[int, list[int]] | None:
        """Prompt lookup's guess at the step after the guesses in flight, were they all
        kept: the token their source has next (the big model's own, guessed) and the `k`
        after it, or None when the source ends there. What `guesses` proposes then may
        differ (a later match of the new tail): the caller compares before using it."""
        if self.taken is None or not self.in_flight:
            return None
        source, at = self.taken
        end = at + len(self.in_flight)
        if end >= len(source):
            return None
        return source[end], list(source[end + 1 : end + 1 + k])

    @property
    def rejected(self) -> int:
        return self.drafted - self.kept

    @property
    def acceptance(self) -> float:
        """The share of its recent guesses kept (PRIOR_ACCEPTANCE before any)."""
        made = sum(d for d, _ in self.recent)
        return sum(a for _, a in self.recent) / made if made else PRIOR_ACCEPTANCE

    def budget(self, room: int) -> int:
        """Guesses the next frame may carry: K, within `room` (the tokens the answer may
        still have past the next one, and the context's)."""
        return 0 if self.off else max(0, min(self.k, room))

    def record(self, drafted: int, kept: int) -> None:
        """A verify frame came back with `kept` of its `drafted` guesses: K doubles
        after a frame kept them all (up to `k_max`) and after one that did not halves,
        or falls to what was kept plus one if that is less; speculation stands aside
        when it is not paying."""
        if drafted == 0:
            # Nothing to propose: the step decoded (built ahead, as without guesses), so
            # prompt lookup goes on looking: a match may come later in the answer.
            return
        self.drafted += drafted
        self.kept += kept
        self.recent = [*self.recent, (drafted, kept)][-8:]
        if kept == drafted:
            self.k = min(self.k_max, self.k * 2)
        else:
            self.k = max(1, min(self.k // 2, kept + 1))
        made = sum(d for d, _ in self.recent)
        judged = made >= JUDGE_AFTER or len(self.recent) >= JUDGE_ROUNDS
        if judged and sum(a for _, a in self.recent) < MIN_ACCEPTANCE * made:
            self.off = (
                f"its guesses were kept {sum(a for _, a in self.recent)} of {made} times lately "
                f"(below {MIN_ACCEPTANCE:.0%})"
            )


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify frame of `k` guesses yields when each is kept with probability
    `acceptance` (independently): 1 + a + a^2 + ... + a^k."""
    return float(sum(acceptance**i for i in range(k + 1)))


def batch_pays(expected: Sequence[float], width: int, row_cost: float) -> bool:
    """Whether a batch's step should verify guesses: `expected` is the tokens each row
    would yield from it (1 for a row without guesses), `width` the positions every row
    then computes (1 + the most guesses of a row: the others are padded to it). A step
    costs 1 (its fixed part) plus `row_cost` per row-position; a decode step computes
    one position a row and yields one token a row. Guesses pay when their tokens per
    unit of cost beat decoding's by BATCH_MARGIN: a large batch, whose rows already
    fill the compute, or guesses seldom kept, decode without them."""
    rows = len(expected)
    if rows == 0 or width <= 1:
        return False
    guessing = sum(expected) / (1 + row_cost * rows * width)
    decoding = rows / (1 + row_cost * rows)
    return guessing > decoding * (1 + BATCH_MARGIN)


def row_cost(steps: Sequence[tuple[int, float]]) -> float | None:
    """A row-position's cost as a share of a step's fixed cost, fitted (least squares,
    seconds = fixed + per_position x positions) to timed steps (positions, seconds);
    None until there are 8 steps whose sizes differ by 2x or more."""
    if len(steps) < 8:
        return None
    sizes = [n for n, _ in steps]
    if max(sizes) < 2 * min(sizes):
        return None
    mean_n = sum(sizes) / len(steps)
    mean_t = sum(t for _, t in steps) / len(steps)
    spread = sum((n - mean_n) ** 2 for n in sizes)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in steps) / spread
    fixed = mean_t - slope * mean_n
    if fixed <= 0:
        return 1.0  # all cost scales with the positions: guesses in a batch never pay
    return min(1.0, max(0.0, slope / fixed))


def _leaves(caches: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for cache in caches:
        inner = getattr(cache, "caches", None)
        out += _leaves(list(inner)) if isinstance(inner, tuple | list) else [cache]
    return out


def batch_reason(caches: Sequence[Any]) -> str:
    """Why a batch of requests holding these caches (one request's, mlx-lm's) cannot
    verify guesses in one pass ("" if it can): each row keeps its own number of guesses,
    so each is cut back by its own amount, which mlx-lm's `BatchKVCache` does (its
    right padding rolled to the left, `prepare` / `finalize`); other batched caches
    cannot."""
    for cache in _leaves(caches):
        if type(cache).__name__ != "KVCache":
            return f"its {type(cache).__name__} cannot cut the rows of a batch back one by one"
    return ""


# A batch's caches drop the padding all its rows have on the left once it is this wide.
COMPACT_AFTER = 32


def rewind_rows(caches: Sequence[Any], amounts: Sequence[int]) -> None:
    """Cut row i of a batch's caches (mlx-lm's `BatchKVCache`s) back by amounts[i]: all
    by the least, then each by the rest, which mlx-lm's `finalize` rolls into the row's
    left padding (masked from then on)."""
    if not any(amounts):
        return
    least = min(amounts)
    rest = [a - least for a in amounts]
    for cache in _leaves(caches):
        if least:
            cache.trim(least)
        if any(rest):
            cache.prepare(right_padding=rest)
            cache.finalize()
    leaves = _leaves(caches)
    # Padding every row has is dropped (mlx-lm's `filter` does it) now and then.
    if (
        any(rest)
        and leaves
        and int(cast(int, mx.min(leaves[0].left_padding).item())) >= COMPACT_AFTER
    ):
        for cache in leaves:
            cache.filter(list(range(len(amounts))))


def trim_reason(caches: Sequence[Any]) -> str:
    """Why these caches (mlx-lm's, a whole model's kinds) cannot be cut back after a
    rejected guess ("" if they can): linear attention's state (`ArraysCache`) holds no
    history to cut, a rotating window can be cut only until it wraps (checked per step:
    `window`)."""
    for cache in caches:
        inner = getattr(cache, "caches", None)
        if isinstance(inner, tuple | list):
            if reason := trim_reason(list(inner)):
                return reason
        elif not hasattr(cache, "trim") or not cache.is_trimmable():
            return (
                f"its {type(cache).__name__} (linear attention's running state) cannot be "
                "cut back after a rejected guess"
            )
    return ""


def window(caches: Sequence[Any]) -> int:
    """The fewest tokens a rotating cache among these keeps (0: none rotates): past it a
    cache wraps and can no longer be cut back, so speculation stops there."""
    sizes = []
    for cache in caches:
        inner = getattr(cache, "caches", None)
        if isinstance(inner, tuple | list):
            if size := window(list(inner)):
                sizes.append(size)
        elif getattr(cache, "max_size", None):
            sizes.append(int(cache.max_size))
    return min(sizes, default=0)


def hold(caches: Sequence[Any]) -> list[tuple[Any, dict[str, Any]]]:
    """What `put_back` needs to return these caches (mlx-lm's) to how they are now, once
    a step has been built on them that will not run: each one's attributes, an array
    among them by a handle of its own (a cache writes its arrays in place, which gives
    the array it wrote a new value; the handle keeps the old one, sharing its buffer,
    so nothing of the step built on it is ever computed)."""
    return [(cache, {k: _handle(v) for k, v in vars(cache).items()}) for cache in _leaves(caches)]


def _handle(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.reshape(value.shape)  # the same array, not a copy
    if isinstance(value, tuple | list) and any(isinstance(v, mx.array) for v in value):
        return type(value)(_handle(v) for v in value)
    return value


def put_back(held: Sequence[tuple[Any, dict[str, Any]]]) -> None:
    """Return caches to what `hold` saw."""
    for cache, attrs in held:
        vars(cache).update(attrs)


def rewind(caches: Sequence[Any], tokens: int) -> None:
    """Cut `tokens` off the end of a shard's caches (mlx-lm's `trim_prompt_cache`)."""
    if tokens <= 0:
        return
    if not can_trim_prompt_cache(list(caches)):
        raise ValueError("these caches cannot be cut back (speculation needs them to be)")
    trim_prompt_cache(list(caches), tokens)


class Joined(Sequence[int]):
    """Two token lists read as one without copying them (a request's prompt and answer
    so far): a draft reads only their last few tokens each step."""

    def __init__(self, first: Sequence[int], second: Sequence[int]) -> None:
        self.first, self.second = first, second

    def __len__(self) -> int:
        return len(self.first) + len(self.second)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        n = len(self.first)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            if start >= n:
                return list(self.second[start - n : stop - n])
            if stop <= n:
                return list(self.first[start:stop])
            return [*self.first[start:], *self.second[: stop - n]]
        if i < 0:
            i += len(self)
        return self.first[i] if i < n else self.second[i - n]


class DraftSession:
    """A draft model's proposals for one request: its own cache, which holds the tokens
    it has seen (the prompt, the kept answer, and its own last guesses); before each
    proposal it is cut back to what still agrees with the context, fed the rest, and
    asked for K greedy tokens, as mlx-lm's `speculative_generate_step` runs its draft.

    The context only grows at its end between proposals (the answer so far): what
    agreed with it last time still does, so each step compares only the few tokens
    past that, however long the context (`Joined` passes it without a copy)."""

    def __init__(self, model: Any, prefill_chunk: int = 512) -> None:
        self.model = model
        self.cache = make_prompt_cache(model)
        self.seen: list[int] = []
        # Leading tokens of `seen` known to be the context's (they stay so as it grows).
        self.agree = 0
        self.prefill_chunk = prefill_chunk
        # Guesses made ahead (`guess_ahead`): the context's length then, the tokens
        # they assume follow it, and them; and the proposals they served.
        self.ahead: tuple[int, list[int], list[int]] | None = None
        self.served_ahead = 0

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        ahead, self.ahead = self.ahead, None
        if ahead is not None and len(ahead[2]) >= k:
            known, assumed, guesses = ahead
            if len(context) == known + len(assumed) and list(context[known:]) == assumed:
                self.served_ahead += 1
                return guesses[:k]  # the guesses made while the last step was out
        return self._propose(context, k, len(context))

    def guess_ahead(self, context: Sequence[int], guesses: Sequence[int], k: int) -> None:
        """While a verify step of `guesses` is out, guess the step after it as if every
        guess is kept and the big model's next token is the draft's own: the step after
        then starts without waiting for the draft. The draft ran while the head had
        nothing else to do (the ring computed); a wrong assumption only costs that, and
        `propose` cuts the draft's cache back to what agrees."""
        if k <= 0 or not guesses:
            return
        known = len(context)
        made = self._propose(Joined(context, list(guesses)), k + 1, known)
        self.ahead = (known, [*guesses, made[0]], made[1:])

    def _propose(self, context: Sequence[int], k: int, known: int) -> list[int]:
        """K greedy guesses after `context`, whose first `known` tokens are the
        request's own (the rest assumed)."""
        if k <= 0:
            return []
        same = min(self.agree, len(self.seen), len(context))
        while same < len(self.seen) and same < len(context) and self.seen[same] == context[same]:
            same += 1
        same = min(same, len(context) - 1)  # the last token is fed again: its logits
        if same < len(self.seen):
            trim_prompt_cache(self.cache, len(self.seen) - same)
            del self.seen[same:]
        feed = list(context[same:])
        self.agree = min(known, same)
        # The tokens new to it since its last guesses (after a verify: the big model's
        # token, and the last guess if all were kept) go in with the first guess's step.
        while len(feed) > self.prefill_chunk:
            self.model(mx.array([feed[: self.prefill_chunk]]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.seen += feed[: self.prefill_chunk]
            feed = feed[self.prefill_chunk :]
        y = mx.array([feed])
        out: list[mx.array] = []
        for _ in range(k):
            logits = self.model(y, cache=self.cache)[:, -1, :]
            y = mx.argmax(logits, axis=-1, keepdims=True)
            mx.async_eval(y)
            out.append(y)
        drafts = cast(list[int], mx.concatenate(out, axis=1)[0].tolist())
        self.seen += [*feed, *drafts[:-1]]  # the last guess was never fed
        self.agree = known  # `seen` now starts with the whole context
        return drafts
