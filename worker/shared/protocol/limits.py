"""Limits both sides enforce: the API refuses past them with a 400, the shards again.

Pure constants and arithmetic, so the operator side can import them (it may not
import `worker.sampling`, which needs MLX) and the two sides never disagree.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MAX_TOKENS_LIMIT = 1 << 20
# The runners' PRNG keys take a non-negative int64 (mx.random.key).
MAX_SEED = (1 << 63) - 1
# OpenAI takes 4 stop strings; a few more cost little. Each is matched only against
# the text a token adds (worker/sampling.py), so their total length bounds the work.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
# Logits processors (worker/sampling.py, mlx-lm's own): OpenAI's ranges for its
# penalties and logit_bias, and how many tokens back a penalty may look. mlx-lm's
# default window is 20; the head ships the prompt's last tokens of the widest window to
# the tail in the request's parameters, so the window is bounded like any header field.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300
DEFAULT_PENALTY_CONTEXT = 20
MAX_PENALTY_CONTEXT = 2048
# repetition_penalty divides a recent token's positive logit by the penalty and
# multiplies its negative one: a penalty of 1e-40 turns a logit of 10 into inf in
# float32 (and the log-probabilities into NaN, which no JSON can carry). Within
# 0.01..10 the logits stay finite in float32 and bfloat16 for any logit below 3e36, and
# in float16 (max 65504) for any below 650. vLLM and Hugging Face take any value above
# 0, OpenRouter documents (0, 2]; the usual ones are 1.05-1.5, and below 1 it favours
# repeating.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
# Samplers (worker/sampling.py, mlx-lm's `make_sampler`): top_k is an integer >= 0 as
# mlx_lm.server takes it (0: off); one at or past the vocabulary keeps every token.
# Past this it could not travel in a msgpack header, and no vocabulary is that large.
MAX_TOP_K = (1 << 31) - 1
# mlx-lm's `apply_xtc` raises past a threshold of 0.5 (mlx_lm.server lets up to 1 through
# and fails later); its default threshold is 0.1.
MAX_XTC_THRESHOLD = 0.5
DEFAULT_XTC_THRESHOLD = 0.1
# OpenAI's ceiling for top_logprobs; each one costs the tail a sort of the vocabulary.
MAX_TOP_LOGPROBS = 20


# An error message quotes at most this much of a value (a 16 MB string sent where a
# number belongs is not worth sending back).
SHOWN_CHARS = 80


def shown(value: object) -> str:
    """`value` as an error message quotes it: in JSON's spelling, as the client wrote
    it (true, null, "hot", not Python's True, None, 'hot'), cut short."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**60:
        return "a huge integer"
    try:
        text = json.dumps(value, ensure_ascii=False)
        text.encode()  # a lone surrogate has no UTF-8: then the escaped spelling
    except UnicodeEncodeError:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


@dataclass(frozen=True)
class Limit:
    """A sampling parameter's range: the API refuses a value outside it with a 400, the
    head shard (worker/sampling.py) with the same words. `meaning` is said with the
    range, for the client."""

    lo: float
    hi: float
    integer: bool = False
    meaning: str = ""

    def admits(self, value: object) -> bool:
        """A number (an integer, if it must be) inside the range; JSON's true/false and
        NaN are not."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        return self.lo <= value <= self.hi

    def number(self, value: float) -> str:
        """A value as this limit's kind writes it (an integer whole, a number short)."""
        return str(int(value)) if self.integer else f"{value:g}"

    def words(self) -> str:
        kind = "an integer" if self.integer else "a number"
        span = f"{kind} from {self.number(self.lo)} to {self.number(self.hi)}"
        return span + (f" ({self.meaning})" if self.meaning else "")

    def problem(self, name: str, value: object) -> str:
        """What is wrong with `value` for `name`, in words ("" if nothing)."""
        return "" if self.admits(value) else f"{name} must be {self.words()}; got {shown(value)}"


# Every sampling parameter's range, for the API (studiotui/api/request.py) and the head
# shard (worker/sampling.py) alike. Why each bound: the constants above.
SAMPLING_LIMITS: dict[str, Limit] = {
    "max_tokens": Limit(1, MAX_TOKENS_LIMIT, integer=True),
    "seed": Limit(0, MAX_SEED, integer=True),
    # OpenAI documents 0 to 2; the chat screen and the runners have taken up to 10.
    "temperature": Limit(0.0, 10.0, meaning="0 is greedy"),
    # Nucleus sampling over no mass keeps only the likeliest token: 0 is greedy, as in
    # OpenAI (mlx-lm's `make_sampler` would take 0 for "off").
    "top_p": Limit(0.0, 1.0, meaning="0 keeps only the likeliest token"),
    "top_k": Limit(
        0, MAX_TOP_K, integer=True, meaning="sample among the k likeliest tokens; 0 means all"
    ),
    "min_p": Limit(0.0, 1.0),
    "xtc_probability": Limit(0.0, 1.0),
    "xtc_threshold": Limit(0.0, MAX_XTC_THRESHOLD),
    "presence_penalty": Limit(-MAX_PENALTY, MAX_PENALTY),
    "frequency_penalty": Limit(-MAX_PENALTY, MAX_PENALTY),
    "repetition_penalty": Limit(
        MIN_REPETITION_PENALTY,
        MAX_REPETITION_PENALTY,
        meaning="1 means none, above 1 discourages repeating recent tokens; 1.1-1.3 is usual",
    ),
    "repetition_context_size": Limit(1, MAX_PENALTY_CONTEXT, integer=True),
    "presence_context_size": Limit(1, MAX_PENALTY_CONTEXT, integer=True),
    "frequency_context_size": Limit(1, MAX_PENALTY_CONTEXT, integer=True),
    # Each token's bias.
    "logit_bias": Limit(
        -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, meaning="-100 bans the token, 100 forces it"
    ),
    "top_logprobs": Limit(0, MAX_TOP_LOGPROBS, integer=True),
}


def limit_problem(name: str, value: object, label: str = "") -> str:
    """`SAMPLING_LIMITS[name]`'s words on `value` ("" if it is inside), under `label`
    (the name, unless told: a logit_bias names its token)."""
    return SAMPLING_LIMITS[name].problem(label or name, value)


# No tokenizer studiotui serves has a token longer than this many characters (the
# longest are runs of spaces or dashes in code vocabularies, 20-60). A prompt with
# more characters than context x this cannot fit the context whatever its text, so
# it is refused by counting characters, before anyone spends seconds and gigabytes
# tokenising it (a 10 MB prompt took 27 s and 2.5 GB on a head shard).
MAX_CHARS_PER_TOKEN = 64
# Requests a placement serves at once unless told otherwise (`place --streams`): the
# plan reserves a whole context of KV cache for each, and the head runs no more.
DEFAULT_STREAMS = 4
# A stage's prefix cache when it is built with no budget at all (tests, tools): per
# shard, in memory and on the node's disk. A placement always sends the plan's budget,
# and its 0 turns the cache off. Conservative: it must fit beside the KV of the streams
# on a small node.
DEFAULT_PROMPT_CACHE_BYTES = 1 << 30
DEFAULT_PROMPT_CACHE_DISK_BYTES = 8 << 30
# How a head shard's refusal for want of a free stream begins: the API answers 429.
BUSY = "busy:"


# Every socket refuses (disconnects) a peer whose message part is over its limit, so
# nothing a peer sends is buffered unbounded: control and client sockets carry msgpack
# messages of at most this (messages.MAX_MESSAGE_BYTES), the ring an activation.
MAX_CONTROL_BYTES = 16 * 1024 * 1024
# Messages a socket queues each way before ZeroMQ pushes back (ZeroMQ's own default,
# stated, so that it is a decision and not an accident).
SOCKET_HWM = 1000
# Work items a runner queues from its sockets before it stops reading them: what is
# left unread waits in ZeroMQ's queue, which pushes back on the sender. Admission keeps
# a healthy ring far below it.
MAX_QUEUED_WORK = 4096
# A ring frame's header: a request id, a shape, sampling parameters with their stop
# strings (16 x 1024 characters, up to 4 bytes each in UTF-8), and some slack.
RING_HEADER_BYTES = 256 * 1024
# ZeroMQ checks MAXMSGSIZE against a part as it arrives, and under CURVE that is the
# encrypted box: the payload plus its nonce, MAC and command header (a few dozen
# bytes). Without this slack a float32 chunk that fills the limit exactly was refused
# and the next stage never heard of the request.
CURVE_BOX_SLACK = 4096


def ring_frame_limit(hidden: int, prefill_chunk: int) -> int:
    """The largest ring message part ZeroMQ accepts: a prefill chunk's activation in
    float32, the widest dtype that travels, or the header, whichever is larger, each in
    its CURVE box."""
    payload = max(RING_HEADER_BYTES, max(1, prefill_chunk) * max(1, hidden) * 4)
    return payload + CURVE_BOX_SLACK


# A log tail asked for over the control socket (read_log): lines and bytes read at most,
# however long the log or the request.
MAX_LOG_LINES = 2000
MAX_LOG_TAIL_BYTES = 1 << 20


def tail_lines(path: Path, lines: int, max_bytes: int = MAX_LOG_TAIL_BYTES) -> list[str]:
    """The last `lines` lines of a file, reading at most `max_bytes` from its end."""
    lines = max(0, min(lines, MAX_LOG_LINES))
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read(size - start)
    except OSError:
        return []
    text = data.decode(errors="replace").splitlines()
    if start > 0 and text:
        text = text[1:]  # the first line read is probably cut
    return text[-lines:] if lines else []


def max_prompt_chars(context_tokens: int) -> int:
    """The most characters a prompt for a context of `context_tokens` may have."""
    return max(0, context_tokens) * MAX_CHARS_PER_TOKEN


def prompt_chars(messages: Iterable[object]) -> int:
    """Characters of text in chat messages (their contents and roles), junk counted as 0."""
    total = 0
    for msg in messages:
        if isinstance(msg, dict):
            for value in msg.values():
                if isinstance(value, str):
                    total += len(value)
    return total


def prompt_too_long(chars: int, context_tokens: int) -> str | None:
    """Why a prompt of `chars` characters cannot fit, or None if it may."""
    if context_tokens <= 0 or chars <= max_prompt_chars(context_tokens):
        return None
    return (
        f"the prompt has {chars} characters: more than a context of {context_tokens} tokens "
        f"can hold (at most {MAX_CHARS_PER_TOKEN} characters a token); shorten it, or place "
        "the model with a larger --context"
    )


# What a cluster benchmark may ask of an agent (the operator refuses the same before
# asking): `measure_links` sizes, so a request cannot make an agent stream for minutes or
# allocate gigabytes, and `device_bench` sizes (worker/device_bench.py).
LINK_MEASURE_BOUNDS: dict[str, tuple[float, float]] = {
    "pings": (3, 1000),
    "pad_bytes": (0, 1 << 20),
    "bulk_seconds": (0.01, 10.0),
    "chunk_bytes": (4096, 16 << 20),
    "in_flight": (1, 64),
}
DEVICE_BENCH_BOUNDS: dict[str, tuple[float, float]] = {
    "matmul_n": (64, 1 << 15),
    "copy_mib": (1, 1 << 16),
    "seconds": (0.001, 60.0),
}
# The group's distributed product (a `benchmark` job's rank): timed steps, each waiting
# for every rank in all_sum. The default is 5; an extra zero or two is minutes of work.
GROUP_BENCH_BOUNDS: dict[str, tuple[float, float]] = {"reps": (1, 1000)}


def out_of_bounds(values: dict[str, object], bounds: dict[str, tuple[float, float]]) -> str:
    """The first value outside its bounds (or unknown, or not a number), in words; ""
    when all are fine."""
    for name, value in values.items():
        if name not in bounds:
            return f"unknown size {name!r} (known: {', '.join(bounds)})"
        lo, hi = bounds[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
            return f"{name} must be between {lo:g} and {hi:g}, not {value!r}"
    return ""
