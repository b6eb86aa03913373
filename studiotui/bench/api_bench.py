"""How much the HTTP API costs: the same concurrent requests through it and around it.

The machine the bench runs on is often busy with other work, so each round runs
the API side and the direct side back to back (in alternating order) and the
ratio is the median of the rounds' own ratios: load that comes and goes between
rounds then cancels out instead of landing on one side. CPU seconds of this
process per token are reported too, since other processes' load hardly moves them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from studiotui.api.server import start_server
from studiotui.cluster.controller import Controller
from worker.shared.protocol import control

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')


def bench_body(i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": f"client {i}: say something about pipelines"}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i,
        # A fixed number of tokens per request, whatever the model samples.
        "ignore_eos": True,
    }


async def _timed(runs: list[Awaitable[int]]) -> tuple[int, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    counts = await asyncio.gather(*runs)
    return sum(counts), time.perf_counter() - wall, time.process_time() - cpu


async def _raw_client(host: str, port: int, body: dict[str, Any]) -> int:
    """One streaming request over a bare socket: it wakes for every chunk as any client
    does, but parses only the closing usage, so the figure is the server's cost."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\n"
            + f"Host: {host}:{port}\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        parts = []
        while chunk := await reader.read(65536):
            parts.append(chunk)
    finally:
        writer.close()
    raw = b"".join(parts)
    if not raw.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the API answered {raw[:200]!r}")
    found = _COMPLETION_TOKENS.findall(raw)
    return int(found[-1]) if found else 0


async def _httpx_client(pool: httpx.AsyncClient, body: dict[str, Any]) -> int:
    tokens = 0
    async with pool.stream("POST", "/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


async def bench_api(
    controller: Controller,
    placement: str,
    clients: int = 8,
    max_tokens: int = 32,
    rounds: int = 5,
    full_client: bool = False,
) -> dict[str, Any]:
    """Aggregate tokens/s of `clients` concurrent streaming API clients against the same
    requests sent straight through controller.generate, after one warm-up round.

    The clients share this process and its CPU with the server. By default they
    are bare sockets, so the ratio measures the server; `full_client` uses httpx
    with a JSON parse per chunk, whose own CPU is then counted against the API.
    """
    server = await start_server(controller, "127.0.0.1", 0)
    bodies = [bench_body(i, max_tokens) for i in range(clients)]
    try:
        async with contextlib.AsyncExitStack() as stack:
            # One connection pool per client, as separate programs would have.
            pools = [
                await stack.enter_async_context(httpx.AsyncClient(base_url=server.url, timeout=120))
                for _ in range(clients if full_client else 0)
            ]

            def via_api(i: int) -> Awaitable[int]:
                body = {**bodies[i], "model": placement, "stream": True}
                body["stream_options"] = {"include_usage": True}
                if full_client:
                    return _httpx_client(pools[i], body)
                return _raw_client(server.host, server.port, body)

            async def direct(body: dict[str, Any]) -> int:
                params = {k: body[k] for k in ("max_tokens", "temperature", "seed", "ignore_eos")}
                tokens = 0
                request = {"messages": body["messages"]}
                async for msg in controller.generate(placement, request, params):
                    if isinstance(msg, control.Done):
                        tokens = int(msg.usage["completion_tokens"])
                return tokens

            sides: dict[str, Callable[[], list[Awaitable[int]]]] = {
                "api": lambda: [via_api(i) for i in range(clients)],
                "direct": lambda: [direct(b) for b in bodies],
            }
            results: dict[str, list[tuple[int, float, float]]] = {"api": [], "direct": []}
            # Warm-up: the first prefill shapes. One side is enough (the raw clients
            # open a connection per request either way).
            await _timed(sides["direct"]())
            for r in range(1, rounds + 1):
                order = ("api", "direct") if r % 2 else ("direct", "api")
                measured = {side: await _timed(sides[side]()) for side in order}
                for side, result in measured.items():
                    results[side].append(result)
    finally:
        await server.close()

    def tps(side: str) -> float:
        return sum(t for t, _, _ in results[side]) / sum(w for _, w, _ in results[side])

    def cpu_us(side: str) -> float:
        return 1e6 * sum(c for _, _, c in results[side]) / sum(t for t, _, _ in results[side])

    pairs = zip(results["api"], results["direct"], strict=True)
    ratios = [(a[0] / a[1]) / (d[0] / d[1]) for a, d in pairs]
    return {
        "api_tps": tps("api"),
        "direct_tps": tps("direct"),
        "api_overhead_ratio": statistics.median(ratios),
        "round_ratios": ratios,
        "api_cpu_us_per_token": cpu_us("api"),
        "direct_cpu_us_per_token": cpu_us("direct"),
        "clients": clients,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "client": "httpx" if full_client else "socket",
    }
