"""The prefix cache's glue (worker.prompt_cache): an entry copied down the ring for a
new request, an ended request's caches kept as entries, the cache's figures."""

from __future__ import annotations

import json
from typing import Any, cast

import msgspec

from worker.families import LayerCaches
from worker.prompt_cache import (
    cut_to,
    light_snapshot,
    ranks_agree,
    trimmable_at,
)
from worker.shared.protocol.frames import RingHeader
from worker.stage.base import StageBase
from worker.stage.records import HeadRequest


class Reuse(StageBase):
    """The prefix cache's entries copied down the ring and kept at the end."""

    def _on_reuse(self, header: RingHeader) -> None:
        """A request's prefix entry on its way down the ring (each stage copies it), or
        back at the head: if a stage lacked it (evicted, restarted), the request frees
        what the others copied and prefills from the start."""
        rid, extra = header.rid, header.extra
        entry, tokens = extra.get("entry"), extra.get("tokens")
        ok = bool(extra.get("ok")) and isinstance(entry, str) and isinstance(tokens, int)
        if self.shard.is_first:
            req = self.head_requests.get(rid)
            if req is None:
                return  # cancelled meanwhile: its "free" went down the ring
            if not ok:
                self._forget([str(entry)])
                self.store.stats.hits -= 1
                self.store.stats.misses += 1
                self.store.stats.reused_tokens -= req.cached
                self.links.to_next(RingHeader(rid=rid, kind="free"), None)
                self.caches[rid] = self.shard.make_cache()
                req.cached = 0
            self._schedule_prefill(rid, req.prompt, req.cached, req.params)
            return
        if ok:
            cache = self.store.take(cast(str, entry), cast(int, tokens), self.shard.make_cache())
            if self.tensor_group is not None:
                # Every rank of this group holds the entry, or the request prefills anew.
                held = cast(str, entry) if cache is not None else None
                if not ranks_agree(self.tensor_group, held, cast(int, tokens)):
                    cache = None
            if cache is None:
                ok = False
            else:
                self.caches[rid] = cache
        passed = msgspec.structs.replace(header, extra={**extra, "ok": ok})
        if self.shard.is_last:
            self.links.to_head(passed)
        else:
            self.links.to_next(passed, None)

    def cache_stats(self) -> dict[str, int]:
        """The prefix cache's figures, as control.ShardStats names them."""
        store = self.store
        return {
            "prompt_cache_entries": len(store.entries),
            "prompt_cache_bytes": store.bytes,
            "prompt_cache_disk_bytes": store.disk.bytes if store.disk is not None else 0,
            "prompt_cache_hits": store.stats.hits,
            "prompt_cache_misses": store.stats.misses,
            "prompt_cache_reused": store.stats.reused_tokens,
        }

    def clear_cache(self) -> tuple[int, int]:
        """(head) Empty the prefix cache on every stage; the entries and bytes this one
        held. Requests in flight keep their own caches."""
        held = (len(self.store.entries), self.store.bytes)
        self.store.clear()
        if self.index is not None:
            self.index.clear()
        if not self.shard.is_last:
            self.links.to_next(RingHeader(rid="", kind="free", extra={"clear": True}), None)
        return held

    def _forget(self, entries: list[str]) -> None:
        """Drop entries from this stage's store (and the head's index)."""
        for entry in entries:
            self.store.drop(entry)
            if self.index is not None:
                self.index.remove(entry)

    def _keep_plan(self, req: HeadRequest) -> dict[str, Any]:
        """(head) What every stage keeps of an ended request, for the "free" frame: the
        caches of its prompt and answer (all but the last token, never computed) where
        they can be cut back later, else the snapshot of its prompt; and the entries
        the new one makes useless (its prefixes). Nothing before its first token came,
        when some stage may still be short of the prompt (a cancel mid-prefill)."""
        if self.index is None or not self.store.budget or req.generated < 1:
            return {}
        held = len(req.prompt) + req.generated - 1
        if trimmable_at(self.kinds, held + 2):  # +2: a step built ahead may be in them
            tokens, kind = [*req.prompt, *req.out[: req.generated - 1]], "end"
        elif self.snapshot and len(req.prompt) > 1:
            # Snapshots, reused only whole: the prompt's (the same prompt again), and
            # where the stages could take one, the answer's (the next turn).
            prompt_id, _ = self.index.add(req.prompt[:-1], False)
            keep: list[list[Any]] = [[prompt_id, len(req.prompt) - 1, "prompt"]]
            if self.answer_snap:
                answer = [*req.prompt, *req.out[: req.generated - 1]]
                answer_id, _ = self.index.add(answer, False)
                keep.append([answer_id, len(answer), "answer"])
            return {"keep": keep, "drop": []}
        else:
            return {}
        ident, gone = self.index.add(tokens, trimmable_at(self.kinds, held + 2))
        return {"keep": [[ident, held, kind]], "drop": gone}

    def _keep(self, rid: str, keep: list[Any]) -> None:
        """Store this stage's caches of `rid` as the entries `keep` names."""
        cache = self._own_cache(rid)
        snap = self.snapshots.pop(rid, None)
        ahead = self.answer_snaps.pop(rid, None)
        for item in keep:
            if not (isinstance(item, list) and len(item) == 3):
                continue
            ident, held, kind = str(item[0]), item[1], item[2]
            if not isinstance(held, int):
                continue
            evicted = [ident]
            meta = self._entry_meta(ident)
            if kind == "end" and cache is not None and cut_to(list(cache), held):
                evicted = self.store.put(ident, list(cache), held, meta)
                cache = None  # the store owns it now
            elif kind == "prompt" and snap is not None and snap[0] == held:
                evicted = self.store.put(ident, snap[1], held, meta)
            elif kind == "answer":
                # The caches themselves if no step was built ahead into them, else
                # their copy from before that step; a stage with neither keeps nothing
                # (a later request then prefills in full: `_on_reuse`).
                if cache is not None and cache.offset == held:
                    evicted = self.store.put(ident, list(cache), held, meta)
                    cache = None
                elif ahead is not None and ahead[0] == held:
                    evicted = self.store.put(ident, ahead[1], held, meta)
            if self.index is not None:
                for gone in evicted:
                    self.index.remove(gone)

    def _snap_answer(self, rid: str, offset: int, cache: LayerCaches) -> None:
        """Before a step is built ahead into `rid`'s caches (holding `offset` tokens),
        keep their light copy: if the answer ends at that token, the copy is the end
        of the answer a snapshot family's next turn starts from."""
        if self.answer_snap:
            snap = light_snapshot(cache)
            if snap is not None:
                self.answer_snaps[rid] = (offset, snap)

    def _entry_meta(self, ident: str) -> dict[str, str]:
        """(head) What an entry's file keeps for the index to be rebuilt from it after a
        restart: its tokens, and whether it can be cut back."""
        if self.index is None or ident not in self.index.tokens:
            return {}
        return {
            "tokens": json.dumps(list(self.index.tokens[ident])),
            "trimmable": "1" if self.index.trimmable.get(ident) else "0",
        }

    def close(self) -> None:
        """Let the disk's pending writes finish (a stopping runner calls it)."""
        if self.store.disk is not None:
            self.store.disk.close()

    def _own_cache(self, rid: str) -> LayerCaches | None:
        """Take `rid`'s caches from this stage (its batch row, its own, or the tail's
        ended ones)."""
        if rid in self.group_of:
            self._extract(rid)
        cache = self.caches.pop(rid, None)
        return cache if cache is not None else self.finished.pop(rid, None)
