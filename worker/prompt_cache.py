"""A placement's prefix cache: KV states of earlier requests, reused by later ones.

Every stage of a ring keeps its own layers' states (`PromptStore`), under an id that is
the digest of the tokens they hold, so every stage names the same entry alike. Only the
head knows token ids: its `PromptIndex` (mlx-lm's `PromptTrie`) finds the entry that
shares the longest prefix with a new prompt (`plan_reuse`), and the head's frames tell
the other stages which entry to copy and how many of its tokens to keep.

What an entry may be cut back to depends on its caches, as in mlx-lm's
`LRUPromptCache`: `KVCache` (and a `CacheList` of them) can be trimmed to any shorter
prefix; a `RotatingKVCache` only while it has not wrapped around its window; an
`ArraysCache` (linear attention's state) never. Entries that cannot be trimmed are
snapshots taken at an exact point (the end of a prompt but its last token) and are
reused only whole, by a prompt they are a prefix of.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    PromptTrie,
    load_prompt_cache,
    save_prompt_cache,
)

from worker import families
from worker.families import LayerCaches

# The trie holds one placement's entries; mlx-lm's keys its tries by model.
_MODEL = "placement"


def entry_id(tokens: Sequence[int]) -> str:
    """The name every stage gives the entry holding `tokens` (their digest)."""
    raw = b"".join(int(t).to_bytes(4, "little") for t in tokens)
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


# ---- which entry serves a prompt (pure) --------------------------------------------------


@dataclass(frozen=True)
class Reuse:
    """Entry `entry` (holding `held` tokens) serves the first `tokens` of the prompt."""

    entry: str
    held: int
    tokens: int


def trimmable_at(kinds: Sequence[tuple[str, int]], tokens: int) -> bool:
    """Whether the caches of a model, as (type name, window) per layer, holding `tokens`
    tokens can be cut back to fewer, by mlx-lm's rules (`is_trimmable`)."""
    for name, window in kinds:
        if name in ("KVCache", "QuantizedKVCache"):
            continue
        if name == "RotatingKVCache" and tokens < window:
            continue  # not wrapped around yet: trimming keeps it consistent
        return False
    return True


def cache_kinds(caches: Sequence[Any]) -> list[tuple[str, int]]:
    """(type name, window) of every cache a model makes, a `CacheList` by its members."""
    out: list[tuple[str, int]] = []
    for cache in caches:
        inner = getattr(cache, "caches", None)
        if isinstance(inner, tuple | list):
            out += cache_kinds(list(inner))
        else:
            out.append((type(cache).__name__, int(getattr(cache, "max_size", 0) or 0)))
    return out


def plan_reuse(trie: PromptTrie, trimmable: dict[str, bool], prompt: Sequence[int]) -> Reuse | None:
    """The entry of `trie` (values: entry ids) that spares the most of `prompt`'s prefill.

    At least the prompt's last token is always computed (its logits give the first
    token), so an entry serves at most len(prompt) - 1 tokens. An entry that is a prefix
    of that serves all its tokens; a longer one, or one that branches off, serves the
    common prefix but only if it can be trimmed back to it (`trimmable[id]`)."""
    head = list(prompt[:-1])
    if not head:
        return None
    found = trie.search(_MODEL, head)
    best: Reuse | None = None
    if found.exact is not None:
        ident = trie.get(_MODEL, found.exact)
        return Reuse(ident, len(head), len(head))
    if found.shorter is not None:
        ident = trie.get(_MODEL, found.shorter)
        best = Reuse(ident, len(found.shorter), len(found.shorter))
    if found.longer is not None:
        ident = trie.get(_MODEL, found.longer)
        common = found.common_prefix
        if trimmable.get(ident, False) and common > (best.tokens if best else 0):
            best = Reuse(ident, len(found.longer), common)
    return best


def ranks_agree(group: Any, entry: str | None, tokens: int = 0) -> bool:
    """(a tensor group) Whether every rank of `group` would reuse the same entry: this
    one `tokens` of `entry` (None: it cannot: evicted, a damaged file, another index
    after a restart). A rank that computed from an entry its partners did not hold
    would feed its all-reduces other numbers: a wrong answer, never a slow one. This is
    a collective: every rank calls it at the same point of the same work item. Without
    a group, whether this stage can."""
    if group is None or group.size() < 2:
        return entry is not None
    # The tokens and 48 bits of the entry's name, in int32-sized parts.
    row = [1, tokens, int(entry[:6], 16), int(entry[6:12], 16)] if entry is not None else [0] * 4
    gathered = mx.distributed.all_gather(mx.array(row, dtype=mx.int32), group=group, stream=mx.cpu)
    values = [int(v) for v in cast(list[int], gathered.tolist())]
    rows = [values[i : i + 4] for i in range(0, len(values), 4)]
    return rows[0][0] == 1 and all(r == rows[0] for r in rows)


# ---- one stage's entries -------------------------------------------------------------


def _held(cache: Any) -> int | None:
    """Tokens one layer's cache holds, if it counts them."""
    inner = getattr(cache, "caches", None)
    if isinstance(inner, tuple | list):
        counts = [_held(c) for c in inner]
        return None if None in counts or len(set(counts)) != 1 else counts[0]
    offset = getattr(cache, "offset", None)
    return offset if isinstance(offset, int) else None


def cut_to(caches: Sequence[Any], tokens: int) -> bool:
    """Trim every layer's cache to hold `tokens` tokens, in place, with mlx-lm's own
    `trim`; False (caches untouched or not to be used) where one cannot."""
    for cache in caches:
        held = _held(cache)
        if held is None or held < tokens or (held > tokens and not cache.is_trimmable()):
            return False
    for cache in caches:
        held = _held(cache)
        assert held is not None
        if held > tokens:
            cache.trim(held - tokens)
        if _held(cache) != tokens:
            return False
    return True


def _state_leaves(caches: Sequence[Any]) -> list[tuple[str, Any]]:
    """Every leaf of the caches' states by its place, as `save_prompt_cache` writes them
    (a quantized cache's (data, scales, biases), a `CacheList`'s inner states, offsets
    and settings as scalars)."""
    return cast(list[tuple[str, Any]], tree_flatten([c.state for c in caches]))


def state_arrays(caches: Sequence[Any]) -> list[mx.array]:
    return [leaf for _, leaf in _state_leaves(caches) if isinstance(leaf, mx.array)]


def digest(caches: Sequence[Any]) -> str:
    """The digest of evaluated caches' states as `save_prompt_cache` writes them: every
    leaf by its place, arrays by their bytes, scalars (offsets, settings) by value. An
    entry's file carries the digest of what it holds, so a file of the right length with
    changed bytes (a failing disk, a copy cut and padded) is not reused as sound."""
    h = hashlib.blake2b(digest_size=16)
    for place, leaf in _state_leaves(caches):
        h.update(place.encode())
        if isinstance(leaf, mx.array):
            view = memoryview(cast(Any, leaf))  # mx.array has the buffer protocol
            # A cache's state is a view of a longer buffer; hash its bytes in order.
            h.update(view if view.c_contiguous else view.tobytes())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


def nbytes(caches: Sequence[Any]) -> int:
    return sum(int(c.nbytes) for c in caches)


@dataclass
class Entry:
    caches: list[Any]  # one per layer of the shard, mlx-lm's cache objects
    tokens: int
    nbytes: int


@dataclass
class StoreStats:
    hits: int = 0  # requests that reused an entry (counted on the head)
    misses: int = 0  # requests that found none
    reused_tokens: int = 0
    evicted: int = 0  # entries memory let go (kept on disk if there is one)
    from_disk: int = 0  # entries read back from disk


class DiskStore:
    """A stage's entries on the node's disk, in mlx-lm's `save_prompt_cache` format (one
    safetensors file per entry, its metadata saying whose it is), least recently used
    first within `budget` bytes. The folder is named by `key` (the model's content,
    the adapter, the shard's layers, the cache settings), and each file says the key
    again: a shard never loads another model's or another split's entry. Files are
    written by one background thread, so a request does not wait for the disk; a
    damaged or foreign file (cut short, bytes changed: each file carries the digest of
    its arrays) is removed when it is read."""

    def __init__(self, root: Path, key: str, budget: int) -> None:
        self.key, self.budget = key, budget
        self.dir = root / hashlib.blake2b(key.encode(), digest_size=10).hexdigest()
        self.tmp = self.dir / "writing"
        self.tmp.mkdir(parents=True, exist_ok=True)
        for part in self.tmp.iterdir():  # a write a stop cut short
            part.unlink(missing_ok=True)
        self.files: OrderedDict[str, int] = OrderedDict()
        found = [(f.stat().st_mtime_ns, f) for f in self.dir.glob("*" + _SUFFIX)]
        for _, f in sorted(found):
            self.files[f.name[: -len(_SUFFIX)]] = f.stat().st_size
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="prompt-cache")
        self.pending: dict[str, Future[None]] = {}

    @property
    def bytes(self) -> int:
        return sum(self.files.values())

    def path(self, ident: str) -> Path:
        return self.dir / (ident + _SUFFIX)

    def save(self, ident: str, caches: list[Any], meta: dict[str, str]) -> list[str]:
        """Write entry `ident` (in the background); return the ids pushed off the disk."""
        size = nbytes(caches)
        if size > self.budget:
            return []
        self.files[ident] = size
        self.files.move_to_end(ident)
        gone: list[str] = []
        while self.bytes > self.budget:
            old = next(iter(self.files))
            self.remove(old)
            gone.append(old)
        metadata = {**meta, "key": self.key}
        self.pending[ident] = self.pool.submit(self._write, ident, caches, metadata)
        return gone

    def _write(self, ident: str, caches: list[Any], metadata: dict[str, str]) -> None:
        part = self.tmp / (ident + _SUFFIX)
        metadata = {**metadata, "digest": digest(caches)}
        save_prompt_cache(str(part), caches, metadata)
        os.replace(part, self.path(ident))

    def _settle(self, ident: str) -> bool:
        """Wait for a pending write of `ident`; False if it failed (the file is gone)."""
        future = self.pending.pop(ident, None)
        if future is None:
            return True
        try:
            future.result()
        except Exception:
            self.remove(ident)
            return False
        return True

    def load(self, ident: str) -> tuple[list[Any], dict[str, str]] | None:
        """Entry `ident` read back, with its metadata; None if absent, damaged or not
        this shard's (the file is removed then)."""
        if ident not in self.files or not self._settle(ident):
            return None
        try:
            caches, meta = load_prompt_cache(str(self.path(ident)), return_metadata=True)
            if meta.get("key") != self.key or not str(meta.get("held", "")).isdigit():
                raise ValueError("the entry is another shard's")
            arrays = state_arrays(caches)
            if arrays:
                mx.eval(arrays)  # read now: a damaged file fails here, not mid-request
            if meta.get("digest") != digest(caches):
                raise ValueError("the entry's bytes are not the ones written")
        except Exception:
            self.remove(ident)
            return None
        self.files.move_to_end(ident)
        with contextlib.suppress(OSError):
            os.utime(self.path(ident))
        return caches, meta

    def headers(self) -> list[tuple[str, dict[str, str]]]:
        """Every entry's metadata, read from its file's header alone (the head's index
        after a restart)."""
        out = []
        for ident in list(self.files):
            self._settle(ident)
            try:
                meta = safetensors_metadata(self.path(ident))
            except (OSError, ValueError):
                self.remove(ident)
                continue
            if meta.get("key") != self.key:
                self.remove(ident)
                continue
            out.append((ident, meta))
        return out

    def remove(self, ident: str) -> None:
        future = self.pending.pop(ident, None)
        if future is not None:
            with contextlib.suppress(Exception):
                future.result()
        self.files.pop(ident, None)
        self.path(ident).unlink(missing_ok=True)

    def clear(self) -> None:
        for ident in list(self.files):
            self.remove(ident)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


_SUFFIX = ".safetensors"


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The metadata `save_prompt_cache` wrote (its own first part, "0.*"), from the
    file's header only: 8 bytes of length, then JSON."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("no safetensors header")
        length = int.from_bytes(raw, "little")
        if length > 64 << 20:
            raise ValueError("safetensors header too long")
        header = json.loads(f.read(length))
    meta = header.get("__metadata__") or {}
    return {k[2:]: str(v) for k, v in meta.items() if k.startswith("0.")}


class PromptStore:
    """One stage's entries, least recently used first, within `budget` bytes of memory;
    with `disk`, every entry is also written there and read back once memory let it go."""

    def __init__(self, budget: int, disk: DiskStore | None = None) -> None:
        self.budget = budget
        self.disk = disk
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.bytes = 0
        self.stats = StoreStats()

    def put(
        self, ident: str, caches: list[Any], tokens: int, meta: dict[str, str] | None = None
    ) -> list[str]:
        """Keep `caches` (owned from now on) as entry `ident`; return the ids gone from
        memory and disk alike. `meta` goes into its file on disk."""
        arrays = state_arrays(caches)
        if arrays:
            mx.eval(arrays)  # nothing lazy (a step built ahead) stays referenced
        self.drop(ident)
        gone: list[str] = []
        if self.disk is not None:
            gone += self.disk.save(ident, caches, {**(meta or {}), "held": str(tokens)})
        return gone + self._remember(ident, caches, tokens)

    def _remember(self, ident: str, caches: list[Any], tokens: int) -> list[str]:
        size = nbytes(caches)
        on_disk = self.disk.files if self.disk is not None else {}
        if size > self.budget:
            return [] if ident in on_disk else [ident]
        self.entries[ident] = Entry(caches, tokens, size)
        self.bytes += size
        gone: list[str] = []
        while self.bytes > self.budget:
            old, entry = self.entries.popitem(last=False)
            self.bytes -= entry.nbytes
            self.stats.evicted += 1
            if old not in on_disk:
                gone.append(old)
        return gone

    def drop(self, ident: str) -> None:
        entry = self.entries.pop(ident, None)
        if entry is not None:
            self.bytes -= entry.nbytes
        if self.disk is not None:
            self.disk.remove(ident)

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
        if self.disk is not None:
            self.disk.clear()

    def take(self, ident: str, tokens: int, like: LayerCaches) -> LayerCaches | None:
        """A copy of entry `ident` cut back to `tokens`, as a request's own caches (the
        entry stays as it is, read back from disk into memory if it was only there);
        None if this stage lacks it or cannot cut it so."""
        entry = self.entries.get(ident)
        if entry is None and self.disk is not None:
            loaded = self.disk.load(ident)
            if loaded is not None:
                caches, meta = loaded
                self._remember(ident, caches, int(meta["held"]))
                self.stats.from_disk += 1
                entry = self.entries.get(ident)
                if entry is None:  # larger than the memory budget: used from disk only
                    entry = Entry(caches, int(meta["held"]), 0)
        if entry is None or entry.tokens < tokens:
            return None
        caches = copy.deepcopy(entry.caches)
        if entry.tokens != tokens and not cut_to(caches, tokens):
            return None
        if ident in self.entries:
            self.entries.move_to_end(ident)
        return families.adopt(caches, like, tokens)


def snapshot(caches: LayerCaches) -> list[Any]:
    """A copy of a request's caches as they are now (its later steps do not change it)."""
    return [copy.deepcopy(c) for c in caches]


def light_snapshot(caches: Sequence[Any]) -> list[Any] | None:
    """A copy of caches as they are now that shares their arrays, cheap enough to take
    at every decode step; None unless every layer's is a `KVCache` or an `ArraysCache`.

    Sharing is safe for these two: an `ArraysCache`'s later steps put new arrays in its
    slots (the copy keeps its own list of the old ones), and a `KVCache`'s write only
    past the copy's offset (or into a grown buffer of the original's own); MLX arrays
    are values. A `RotatingKVCache` writes over its window, and others are not known."""
    out: list[Any] = []
    for cache in caches:
        kind = type(cache)
        if kind is ArraysCache:
            twin = copy.copy(cache)
            twin.cache = list(cache.cache)
        elif kind is KVCache:
            twin = copy.copy(cache)
        else:
            return None
        out.append(twin)
    return out


class PromptIndex:
    """(head) Which token sequences the placement holds, for `plan_reuse`."""

    def __init__(self) -> None:
        self.trie = PromptTrie()
        self.tokens: dict[str, tuple[int, ...]] = {}
        self.trimmable: dict[str, bool] = {}

    def add(self, tokens: Sequence[int], trimmable: bool) -> tuple[str, list[str]]:
        """Index `tokens`; return its id and the ids it makes useless: the entries of
        its own prefixes, when it can be trimmed to each of them."""
        ident = entry_id(tokens)
        self.trie.add(_MODEL, list(tokens), ident)
        self.tokens[ident] = tuple(tokens)
        self.trimmable[ident] = trimmable
        gone: list[str] = []
        if trimmable:
            for _, old in self.trie.pop_prefixes(_MODEL, list(tokens)):
                if old != ident:
                    gone.append(old)
                    self.tokens.pop(old, None)
                    self.trimmable.pop(old, None)
            # pop_prefixes leaves the trie's own value at `tokens` alone
        return ident, gone

    def restore(self, tokens: Sequence[int], trimmable: bool) -> str:
        """Index an entry found on disk (after a restart), as it was."""
        ident = entry_id(tokens)
        self.trie.add(_MODEL, list(tokens), ident)
        self.tokens[ident] = tuple(tokens)
        self.trimmable[ident] = trimmable
        return ident

    def remove(self, ident: str) -> None:
        tokens = self.tokens.pop(ident, None)
        self.trimmable.pop(ident, None)
        if tokens is not None:
            with contextlib.suppress(KeyError):
                self.trie.pop(_MODEL, list(tokens))

    def clear(self) -> None:
        self.trie = PromptTrie()
        self.tokens.clear()
        self.trimmable.clear()

    def plan(self, prompt: Sequence[int]) -> Reuse | None:
        if not self.tokens:
            return None
        return plan_reuse(self.trie, self.trimmable, prompt)
