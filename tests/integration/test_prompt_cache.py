"""The prefix cache on real stages: every family, 1 and 2 shards, token for token.

Each case runs a chat's requests through one in-process ring (tests/ring_harness.py:
real shards, real `Stage`s, frames as bytes) and checks every answer against mlx-lm's
`generate_step` on the same prompt, and the last against a ring that never saw the
conversation: the same prompt twice, a grown history, an edited earlier turn, and two
conversations on one system prompt, interleaved (their decode steps batched). Where a
family's caches can be cut back (`KVCache`), every kind of hit reuses tokens; where
they cannot (linear attention, sliding windows past their window) only the snapshots
at the end of each prompt are reused, whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from tests.support.answers import greedy_turn
from tests.support.cluster_fixture import LocalCluster
from tests.support.family_models import small_family_models
from tests.support.ring_harness import CHUNK, InProcessRing
from worker.prompt_cache import safetensors_metadata, trimmable_at
from worker.shared.demo_model import FAMILIES, DemoSpec, write_demo_model

N = 4
SYSTEM = list(range(40, 52))  # a system prompt both conversations share
ASK_A, ASK_B = list(range(60, 70)), list(range(80, 87))
SPLITS = {1: [(0, 5)], 2: [(0, 2), (2, 5)]}
GREEDY = {"max_tokens": N, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return small_family_models(tmp_path_factory.mktemp("prompt-cache"), seed=11)


class Ring(InProcessRing):
    def ask(self, *asks: tuple[str, list[int]], n: int = N) -> dict[str, tuple[list[int], int]]:
        """Submit requests together; each one's tokens and cached prompt tokens."""
        params = {**GREEDY, "max_tokens": n}
        for rid, prompt in asks:
            self.stages[0].submit(b"c", {"rid": rid, "params": params, "tokens": prompt})
        self.drain()
        out = {}
        for rid, _ in asks:
            [done] = [f for k, f in self.client if k == "done" and f["rid"] == rid]
            out[rid] = (self.tokens(rid), done["usage"]["cached_tokens"])
        return out

    def held(self) -> list[int]:
        return [len(s.caches) + len(s.finished) + len(s.snapshots) for s in self.stages]


class Reference:
    def __init__(self, model: Path) -> None:
        self.model, _ = mlx_lm.load(str(model))

    def __call__(self, prompt: list[int], n: int = N) -> list[int]:
        steps = generate_step(mx.array(prompt), self.model, max_tokens=n, prefill_step_size=CHUNK)
        return [int(t) for t, _ in steps]


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_kind_of_hit_answers_as_mlx_lm_and_a_cold_ring(
    models: Callable[[str], Path], arch: str
) -> None:
    model = models(arch)
    ref = Reference(model)
    a1 = SYSTEM + ASK_A
    for n, split in SPLITS.items():
        ring = Ring(model, split)
        cuts = trimmable_at(ring.stages[0].kinds, 1 << 62)
        got = ring.ask(("a1", a1))
        answer_a1, cached = got["a1"]
        assert (answer_a1, cached) == (ref(a1), 0), f"{arch}/{n}: turn 1"
        # The same request again (regenerate): all of it but its last token.
        assert ring.ask(("again", a1))["again"] == (answer_a1, len(a1) - 1), f"{arch}/{n}"
        # Turn 2 of conversation A while conversations B and C start on the same system
        # prompt (long enough answers that their decode steps run as batches).
        a2 = a1 + answer_a1 + [90, 91, 92]
        b1, c1 = SYSTEM + ASK_B, [*SYSTEM, 100, 101, 102]
        got = ring.ask(("a2", a2), ("b1", b1), ("c1", c1), n=3 * N)
        assert got["a2"][0] == ref(a2, 3 * N), f"{arch}/{n}: grown history"
        assert got["b1"][0] == ref(b1, 3 * N), f"{arch}/{n}: second conversation"
        assert got["c1"][0] == ref(c1, 3 * N), f"{arch}/{n}: third conversation"
        assert got["a2"][1] >= len(a1) - 1
        # B shares only the system prompt with A: a prefix cut out of A's entry.
        assert got["b1"][1] == (len(SYSTEM) if cuts else 0), f"{arch}/{n}"
        # An edited earlier turn: the prefix before the edit.
        edited = SYSTEM + ASK_A[:3] + [99] + ASK_A[4:] + answer_a1 + [90, 91, 92]
        got = ring.ask(("edited", edited))
        assert got["edited"][0] == ref(edited), f"{arch}/{n}: edited turn"
        assert got["edited"][1] == (len(SYSTEM) + 3 if cuts else 0), f"{arch}/{n}"
        # B's turn 2 still finds B's own entry after A's turns were stored.
        b2 = b1 + got_b1_answer(ring) + [93]
        got = ring.ask(("b2", b2))
        assert got["b2"][0] == ref(b2) and got["b2"][1] >= len(b1) - 1, f"{arch}/{n}"
        assert ring.held() == [0] * n
        if not ring.stages[0].batch_reason:
            assert ring.stages[0].stats.batched > 0, "a hit decodes in the batch"
    # A placement that never saw the conversation answers the same.
    cold = Ring(model, SPLITS[2]).ask(("edited", edited))["edited"]
    assert cold == (ref(edited), 0)


def got_b1_answer(ring: Ring) -> list[int]:
    return ring.tokens("b1")


def test_a_stage_that_lost_the_entry_makes_the_request_prefill_in_full(
    models: Callable[[str], Path],
) -> None:
    model = models("qwen3")
    ref = Reference(model)
    prompt = SYSTEM + ASK_A
    ring = Ring(model, SPLITS[2])
    first = ring.ask(("one", prompt))["one"]
    [entry] = list(ring.stages[1].store.entries)
    ring.stages[1].store.drop(entry)  # as if evicted, or the stage restarted
    again = ring.ask(("two", prompt))["two"]
    assert again == (first[0], 0) and first[0] == ref(prompt)
    accepted = [f for k, f in ring.client if k == "accepted" and f["rid"] == "two"]
    assert accepted[0]["cached_tokens"] == len(prompt) - 1  # planned, then fell back
    assert ring.held() == [0, 0]
    # The head forgot the entry it could not use; the full prefill stored a new one.
    assert ring.ask(("three", prompt))["three"] == (first[0], len(prompt) - 1)


def test_cancel_mid_prefill_keeps_no_entry(models: Callable[[str], Path]) -> None:
    ring = Ring(models("llama"), SPLITS[2])
    long = list(range(40, 100))
    ring.stages[0].submit(b"c", {"rid": "x", "params": GREEDY, "tokens": long})
    ring.drain(steps=3)
    ring.stages[0].cancel("x")
    ring.drain()
    assert [len(s.store.entries) for s in ring.stages] == [0, 0]
    assert ring.held() == [0, 0]
    assert ring.ask(("y", long))["y"][1] == 0


def test_a_small_budget_evicts_the_least_recently_used_on_every_stage(
    models: Callable[[str], Path],
) -> None:
    model = models("llama")
    ref = Reference(model)
    probe = Ring(model, SPLITS[2])
    probe.ask(("a", SYSTEM + ASK_A))
    budget = max(s.store.bytes for s in probe.stages)  # room for one entry
    ring = Ring(model, SPLITS[2], prompt_cache_bytes=budget)
    a, b = [1, 2, 3, *ASK_A], [4, 5, 6, *ASK_B]
    ring.ask(("a", a))
    ring.ask(("b", b))  # pushes a's entry out
    assert [len(s.store.entries) for s in ring.stages] == [1, 1]
    assert all(s.store.bytes <= budget for s in ring.stages)
    got = ring.ask(("a-again", a))["a-again"]
    assert got == (ref(a), 0)
    assert ring.ask(("b-again", b))["b-again"][1] == 0  # a's entry pushed b's out in turn


# ---- through real agents and runner processes ------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_two_real_stages_reuse_a_conversation_s_history(
    engine_cluster: LocalCluster, models: Callable[[str], Path], arch: str
) -> None:
    model = models(arch)
    ref = Reference(model)
    turn1 = SYSTEM + ASK_A

    async def run() -> list[tuple[list[int], int]]:
        ctl = engine_cluster.controller()
        try:
            await ctl.refresh()
            names = list(engine_cluster.inventory.names)[:2]
            await ctl.place(model, names, f"pc-{arch}", prefill_chunk=CHUNK)
            assert len(ctl.state.placement(f"pc-{arch}").shards) == 2
            first = await greedy_turn(ctl, f"pc-{arch}", turn1, N)
            turn2 = turn1 + first[0] + [90, 91]
            second = await greedy_turn(ctl, f"pc-{arch}", turn2, N)
            await ctl.unload(f"pc-{arch}")
            return [first, second, (turn2, 0)]
        finally:
            await ctl.close()

    first, second, (turn2, _) = asyncio.run(run())
    assert first == (ref(turn1), 0)
    assert second[0] == ref(turn2)
    # Turn 1's prompt and answer (all but its last token): cut back, or the snapshot
    # at the end of the answer (linear attention).
    assert second[1] == len(turn1) + N - 1


# ---- on disk -----------------------------------------------------------------------------


def _disk_ring(model: Path, cache_dir: Path, key: str = "k", **options: Any) -> Ring:
    return Ring(model, SPLITS[2], cache_dir=cache_dir, cache_key=key, **options)


def test_entries_pushed_out_of_memory_come_back_from_disk_and_survive_a_restart(
    models: Callable[[str], Path], tmp_path: Path
) -> None:
    model = models("qwen3")
    ref = Reference(model)
    a, b = SYSTEM + ASK_A, [7, 8, 9, *ASK_B]
    probe = _disk_ring(model, tmp_path / "probe")
    probe.ask(("a", a))
    budget = max(s.store.bytes for s in probe.stages)  # memory for one entry
    ring = _disk_ring(model, tmp_path / "cache", prompt_cache_bytes=budget)
    first = ring.ask(("a", a))["a"]
    ring.ask(("b", b))  # a's entry leaves memory for disk
    assert all(len(s.store.entries) == 1 for s in ring.stages)
    again = ring.ask(("a2", a))["a2"]
    assert again == (first[0], len(a) - 1) and first[0] == ref(a)
    assert all(s.store.stats.from_disk == 1 for s in ring.stages)
    for stage in ring.stages:
        stage.close()  # a stopping runner lets its writes finish
        assert stage.store.disk is not None and stage.store.disk.bytes > 0

    # Restarted (every stage anew, nothing in memory): the head's index is rebuilt from
    # the files, and every stage reads its entry back.
    restarted = _disk_ring(model, tmp_path / "cache", prompt_cache_bytes=budget)
    assert restarted.ask(("a3", a))["a3"] == (first[0], len(a) - 1)
    grown = a + first[0] + [90, 91]
    assert restarted.ask(("a4", grown))["a4"] == (ref(grown), len(a) + N - 1)

    # Another split (another key) never reads them.
    other = _disk_ring(model, tmp_path / "cache", key="other split")
    assert other.ask(("a5", a))["a5"] == (first[0], 0)


def _cut_short(raw: bytes) -> bytes:
    return raw[:200]


def _flipped(raw: bytes) -> bytes:
    """The same length and header, one byte of the last array's data changed."""
    return raw[:-5] + bytes([raw[-5] ^ 0x5A]) + raw[-4:]


@pytest.mark.parametrize("damage", [_cut_short, _flipped], ids=["cut_short", "bytes_flipped"])
def test_a_damaged_entry_on_disk_is_removed_and_the_prompt_prefilled(
    models: Callable[[str], Path], tmp_path: Path, damage: Callable[[bytes], bytes]
) -> None:
    model = models("llama")
    prompt = SYSTEM + ASK_A
    ring = _disk_ring(model, tmp_path)
    first = ring.ask(("a", prompt))["a"]
    for stage in ring.stages:
        stage.close()
    tail = ring.stages[1].store.disk
    assert tail is not None
    [ident] = list(tail.files)
    raw = tail.path(ident).read_bytes()
    tail.path(ident).write_bytes(damage(raw))
    if damage is _flipped:  # the header still reads: only the digest can tell
        assert safetensors_metadata(tail.path(ident)).get("key") == tail.key

    restarted = _disk_ring(model, tmp_path)
    assert restarted.ask(("b", prompt))["b"] == (first[0], 0)  # fell back, same answer
    disk = restarted.stages[1].store.disk
    assert disk is not None and not disk.path(ident).exists()
    # The full prefill stored the entry anew: the next request reuses it.
    assert restarted.ask(("c", prompt))["c"] == (first[0], len(prompt) - 1)


def test_a_quantized_entry_comes_back_from_disk_and_a_changed_one_does_not(
    tmp_path: Path,
) -> None:
    """A quantized KV cache's file holds (data, scales, biases) for keys and values and
    its offset and settings as scalars: all are in the file's digest."""
    # Heads 32 wide: KV quantizes in groups of 32 along them.
    spec = DemoSpec(arch="llama", dtype="float32", seed=11, layers=5, hidden=128, heads=4)
    model = write_demo_model(tmp_path / "model", spec)
    prompt = SYSTEM + ASK_A
    quant = {"kv_bits": 8, "kv_group_size": 32}
    first = _disk_ring(model, tmp_path, shard_options=quant)
    answer = first.ask(("a", prompt))["a"][0]
    for stage in first.stages:
        stage.close()
    again = _disk_ring(model, tmp_path, shard_options=quant)
    assert again.ask(("b", prompt))["b"] == (answer, len(prompt) - 1)
    for stage in again.stages:
        stage.close()
    head = again.stages[0].store.disk
    assert head is not None
    [(ident, _)] = head.headers()  # the turn's entry: prompt and answer
    raw = head.path(ident).read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")
    # The first bytes of data: one of the scalars (mlx-lm writes a cache's offset and
    # settings as arrays beside its state), not the last array's.
    at = header + 3
    head.path(ident).write_bytes(raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1 :])
    third = _disk_ring(model, tmp_path, shard_options=quant)
    assert third.ask(("c", prompt))["c"] == (answer, 0)


def test_a_small_disk_budget_removes_the_least_recently_used_files(
    models: Callable[[str], Path], tmp_path: Path
) -> None:
    model = models("llama")
    ref = Reference(model)
    a, b = [1, 2, 3, *ASK_A], [4, 5, 6, *ASK_B]
    probe = _disk_ring(model, tmp_path / "probe")
    probe.ask(("a", a))
    one = max(s.store.bytes for s in probe.stages)
    ring = _disk_ring(
        model, tmp_path / "cache", prompt_cache_bytes=one, prompt_cache_disk_bytes=one
    )
    ring.ask(("a", a))
    ring.ask(("b", b))  # a's entry leaves memory, and the disk holds only b's
    for stage in ring.stages:
        assert stage.store.disk is not None
        assert len(stage.store.disk.files) == 1 and stage.store.disk.bytes <= one
    assert ring.stages[0].index is not None and len(ring.stages[0].index.tokens) == 1
    assert ring.ask(("a2", a))["a2"] == (ref(a), 0)
