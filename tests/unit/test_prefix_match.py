"""The prefix cache's decisions (worker.prompt_cache): which entry serves a prompt, how
many of its tokens, and what the head's index drops; mlx-lm's caches cut back by its
own `trim`."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from worker.prompt_cache import (
    PromptIndex,
    PromptStore,
    Reuse,
    cache_kinds,
    cut_to,
    entry_id,
    trimmable_at,
)


def _index(*entries: tuple[list[int], bool]) -> PromptIndex:
    index = PromptIndex()
    for tokens, trimmable in entries:
        index.add(tokens, trimmable)
    return index


def test_the_same_prompt_again_reuses_all_but_its_last_token() -> None:
    index = _index(([1, 2, 3, 4, 5, 6], True))
    assert index.plan([1, 2, 3, 4, 5, 6]) == Reuse(entry_id([1, 2, 3, 4, 5, 6]), 6, 5)


def test_a_grown_history_reuses_the_whole_entry() -> None:
    index = _index(([1, 2, 3, 4], True))
    assert index.plan([1, 2, 3, 4, 9, 9, 9]) == Reuse(entry_id([1, 2, 3, 4]), 4, 4)


def test_an_edited_turn_reuses_the_common_prefix_only_of_a_trimmable_entry() -> None:
    prompt = [1, 2, 3, 7, 7, 7]
    assert _index(([1, 2, 3, 4, 5], True)).plan(prompt) == Reuse(entry_id([1, 2, 3, 4, 5]), 5, 3)
    # A snapshot (linear attention's state) cannot be cut back: no reuse.
    assert _index(([1, 2, 3, 4, 5], False)).plan(prompt) is None


def test_a_snapshot_serves_a_prompt_it_is_a_prefix_of() -> None:
    index = _index(([1, 2, 3], False), ([1, 2, 3, 4, 5, 6, 7, 8], False))
    assert index.plan([1, 2, 3, 4, 5, 0]) == Reuse(entry_id([1, 2, 3]), 3, 3)
    # One as long as the prompt does not leave its last token to compute: not used.
    assert _index(([1, 2, 3], False)).plan([1, 2, 3]) is None


def test_the_longer_of_two_matches_wins() -> None:
    index = _index(([1, 2], False), ([1, 2, 3, 4, 5, 6, 8], True))
    assert index.plan([1, 2, 3, 4, 5, 6, 7, 0]) == Reuse(entry_id([1, 2, 3, 4, 5, 6, 8]), 7, 6)


def test_no_entry_no_reuse_and_a_one_token_prompt_computes_itself() -> None:
    assert PromptIndex().plan([1, 2, 3]) is None
    assert _index(([1], True)).plan([1]) is None


def test_a_trimmable_entry_replaces_its_own_prefixes_not_other_conversations() -> None:
    index = PromptIndex()
    turn1, _ = index.add([1, 2, 3, 4], True)
    other, _ = index.add([1, 2, 8, 8], True)  # another conversation on the same system prompt
    turn2, gone = index.add([1, 2, 3, 4, 5, 6], True)
    assert gone == [turn1]
    assert set(index.tokens) == {other, turn2}
    # Snapshots keep their prefixes: each is only usable whole.
    snaps = PromptIndex()
    first, _ = snaps.add([1, 2, 3], False)
    _, gone = snaps.add([1, 2, 3, 4, 5], False)
    assert gone == [] and first in snaps.tokens


def test_removing_an_entry_forgets_its_tokens() -> None:
    index = _index(([1, 2, 3, 4], True))
    index.remove(entry_id([1, 2, 3, 4]))
    assert index.plan([1, 2, 3, 4, 5]) is None
    index.remove("unknown")  # a stage's report of an entry already gone


def test_what_can_be_cut_back_follows_mlx_lm() -> None:
    assert trimmable_at([("KVCache", 0)], 10**9)
    assert trimmable_at([("RotatingKVCache", 8)], 7)
    assert not trimmable_at([("RotatingKVCache", 8)], 8)  # wrapped around its window
    assert not trimmable_at([("ArraysCache", 0), ("KVCache", 0)], 1)
    assert cache_kinds([KVCache(), RotatingKVCache(max_size=16), ArraysCache(2)]) == [
        ("KVCache", 0),
        ("RotatingKVCache", 16),
        ("ArraysCache", 0),
    ]


def _filled(n: int) -> KVCache:
    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 2, n, 4)), mx.ones((1, 2, n, 4)))
    return cache


def test_cut_to_trims_kv_caches_and_refuses_arrays_and_short_ones() -> None:
    caches = [_filled(10), _filled(10)]
    assert cut_to(caches, 6) and [c.offset for c in caches] == [6, 6]
    assert not cut_to([_filled(4)], 6)  # holds fewer than asked
    assert not cut_to([ArraysCache(2)], 3)  # counts no tokens: only reusable whole


def test_the_store_evicts_least_recently_used_by_bytes() -> None:
    one = _filled(8).nbytes
    store = PromptStore(budget=2 * one)
    assert store.put("a", [_filled(8)], 8) == []
    assert store.put("b", [_filled(8)], 8) == []
    store.entries.move_to_end("a")  # "a" used since
    assert store.put("c", [_filled(8)], 8) == ["b"]
    assert list(store.entries) == ["a", "c"] and store.bytes == 2 * one
    # (a KVCache grows 256 tokens at a time: 600 hold three times the bytes of 8)
    assert store.put("huge", [_filled(600)], 600) == ["huge"]  # larger than the budget
