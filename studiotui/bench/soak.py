"""Cancel storms and soaks against a placement: nothing lost, mixed up or leaked.

`cancel_storm` starts requests and drops each at a random point; `soak` sends many
requests over several concurrent OpenAI clients to `studiotui serve`'s app and
compares every answer with the same request's answer alone, while sampling the
resident memory of every process of the cluster. `studiotui bench --soak` prints
both; the tests run small versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from studiotui.cluster.controller import Controller, GenerationError
from worker.shared.protocol import control

MB = 1024 * 1024


@dataclass
class StormResult:
    started: int
    failed: list[str]  # requests that failed instead of being dropped (should be none)
    caches_after: list[int]  # every shard's count of KV caches once it settled


async def cancel_storm(
    ctl: Controller,
    placement: str,
    tokens: list[int],
    n: int = 50,
    at_once: int = 10,
    seed: int = 0,
    settle_s: float = 15.0,
) -> StormResult:
    """Start `n` requests (`at_once` at a time), each dropped at a random point: before
    it is accepted, in the prefill, or after a random number of tokens."""
    rng = random.Random(seed)
    plans = [
        (rng.choice(("now", "tokens", "time")), rng.randint(0, 40), rng.random() * 0.3)
        for _ in range(n)
    ]
    failed: list[str] = []

    async def one(how: str, after_tokens: int, after_s: float) -> None:
        params = {"max_tokens": 100_000, "ignore_eos": True}
        agen = ctl.generate(placement, {"tokens": tokens}, params)
        got = 0

        async def read() -> None:
            nonlocal got
            async for msg in agen:
                if isinstance(msg, control.Delta):
                    got += 1
                    if how == "tokens" and got >= after_tokens:
                        return

        task = asyncio.ensure_future(read())
        try:
            if how == "now":
                await asyncio.sleep(0)
            elif how == "time":
                await asyncio.sleep(after_s)
            else:
                await asyncio.wait_for(asyncio.shield(task), 60)
        except GenerationError as exc:
            failed.append(str(exc))
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, GenerationError):
                await task
            # Closing the generator sends the cancel, as the TUI's Esc or a client
            # hanging up does.
            await agen.aclose()

    for i in range(0, n, at_once):
        await asyncio.gather(*(one(*p) for p in plans[i : i + at_once]))
    caches = await settled_caches(ctl, placement, settle_s)
    return StormResult(started=n, failed=failed, caches_after=caches)


async def settled_caches(ctl: Controller, placement: str, timeout: float) -> list[int]:
    """Every shard's KV cache count, once all are zero or `timeout` has passed
    (the counts come with the shards' stats, once a second)."""
    deadline = time.monotonic() + timeout
    while True:
        await asyncio.sleep(1.2)
        counts = []
        for node in ctl.inventory.names:
            reply = await ctl.peer(node).ask("list_shards", control.Shards)
            for shard in reply.shards:
                if shard.placement == placement:
                    counts.append(shard.stats.in_flight)
        if not any(counts) or time.monotonic() > deadline:
            return counts


# ---- soak ------------------------------------------------------------------------------


@dataclass
class SoakResult:
    requests: int
    clients: int
    answered: int = 0
    lost: int = 0  # raised, or ended without an answer
    mixed: int = 0  # answered, but not with its answer alone
    seconds: float = 0.0
    tokens: int = 0
    rss_mb_warm: dict[str, float] = field(default_factory=dict)
    rss_mb_end: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def growth_mb(self) -> dict[str, float]:
        return {
            k: round(self.rss_mb_end[k] - v, 1)
            for k, v in self.rss_mb_warm.items()
            if k in self.rss_mb_end
        }

    def figures(self) -> dict[str, Any]:
        growth = self.growth_mb
        return {
            "soak_requests": self.requests,
            "soak_clients": self.clients,
            "soak_answered": self.answered,
            "soak_lost": self.lost,
            "soak_mixed": self.mixed,
            "soak_tps": round(self.tokens / self.seconds, 1) if self.seconds else None,
            "soak_rss_mb_end": self.rss_mb_end,
            "soak_rss_growth_mb": growth,
            "soak_rss_growth_max_mb": max(growth.values(), default=0.0),
        }


def body(i: int, max_tokens: int) -> dict[str, Any]:
    """Request `i`: its own prompt and seed, so any mix-up shows in the answer."""
    return {
        "messages": [{"role": "user", "content": f"request {i}: what runs on node {i % 7}?"}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": 1000 + i,
        "extra_body": {"ignore_eos": True},
    }


async def cluster_processes(ctl: Controller, placement: str) -> dict[str, int]:
    """name -> pid of every agent and shard runner of the placement, and this process."""
    out = {"controller": psutil.Process().pid}
    for node in ctl.inventory.names:
        with contextlib.suppress(Exception):
            reply = await ctl.peer(node).ask("hello", control.HelloReply)
            out[f"agent {node}"] = reply.pid
            for shard in reply.shards:
                if shard.placement == placement and shard.pid:
                    out[f"runner {node}"] = shard.pid
    return out


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            out[name] = round(psutil.Process(pid).memory_info().rss / MB, 1)
    return out


async def soak(
    ctl: Controller,
    base_url: str,
    placement: str,
    requests: int = 200,
    clients: int = 8,
    max_tokens: int = 16,
    distinct: int = 16,
) -> SoakResult:
    """`requests` chat completions over `clients` concurrent official OpenAI clients;
    each answer must equal the same request's answer alone (`distinct` requests,
    each asked alone first, then over and over concurrently)."""
    import openai

    result = SoakResult(requests=requests, clients=clients)
    pool = [
        openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120.0)
        for _ in range(clients)
    ]

    async def ask(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        reply = await client.chat.completions.create(model=placement, **body(i, max_tokens))
        usage = reply.usage.completion_tokens if reply.usage else 0
        return reply.choices[0].message.content or "", usage

    alone = {}
    for i in range(distinct):
        alone[i] = (await ask(pool[0], i))[0]
    pids = await cluster_processes(ctl, placement)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for k in range(requests):
        queue.put_nowait(k)
    warm_at = max(1, requests // 4)
    done = 0

    async def worker(client: openai.AsyncOpenAI) -> None:
        nonlocal done
        while True:
            try:
                k = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            i = k % distinct
            try:
                text, n = await ask(client, i)
            except Exception as exc:  # every failure is counted and its words kept
                result.lost += 1
                result.errors.append(f"request {k}: {type(exc).__name__}: {exc}")
                continue
            result.answered += 1
            result.tokens += n
            if text != alone[i]:
                result.mixed += 1
                result.errors.append(f"request {k}: {text!r} is not its answer {alone[i]!r}")
            done += 1
            if done == warm_at:
                result.rss_mb_warm = rss_mb(pids)

    began = time.monotonic()
    try:
        await asyncio.gather(*(worker(c) for c in pool))
    finally:
        for client in pool:
            await client.close()
    result.seconds = time.monotonic() - began
    result.rss_mb_end = rss_mb(pids)
    return result
