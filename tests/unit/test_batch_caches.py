"""The pure parts of batched decode: which caches mlx-lm can batch, a batch's caches
joining, leaving and coming apart again, and batch rows on the wire."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import msgspec
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from worker import families
from worker.shard import load_shard
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol.frames import (
    FrameError,
    RingHeader,
    decode_ring_header,
    encode_ring_header,
)


def test_which_caches_mlx_lm_can_batch() -> None:
    batched = [KVCache(), RotatingKVCache(8), ArraysCache(2), CacheList(KVCache(), KVCache())]
    assert families.batch_reason(batched) == ""
    assert "QuantizedKVCache" in families.batch_reason([KVCache(), QuantizedKVCache()])
    assert "ChunkedKVCache" in families.batch_reason([ChunkedKVCache(16)])
    nested = [CacheList(KVCache(), QuantizedKVCache())]
    assert "QuantizedKVCache" in families.batch_reason(nested)


def test_rows_join_leave_and_come_apart_as_they_were(tmp_path: Path) -> None:
    # Three requests' own caches (prompts of 5, 9 and 7 tokens) on a shard of layers
    # [1, 3) of four: merged, filtered, extended, and each row extracted again holds
    # exactly the keys and values it held alone; the full list the model's forward
    # reads points at the batched caches, also where it reads a layer run elsewhere.
    model = write_demo_model(tmp_path / "m", DemoSpec(layers=4, hidden=32, heads=2, kv_heads=1))
    shard = load_shard(model, 1, 3)
    solos = []
    for n in (5, 9, 7):
        caches = shard.make_cache()
        mx.eval(shard.forward(mx.random.normal((1, n, 32)), caches))
        solos.append(caches)
    kept = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in solos[1]]

    batch = families.merge_caches(solos[:2])
    assert batch.full[1] is batch[0] and batch.full[2] is batch[1]
    assert batch.full[0] is batch[0] and batch.full[3] is batch[0]  # read elsewhere: kin
    families.extend_caches(batch, families.merge_caches(solos[2:]))
    families.filter_caches(batch, [2, 1])  # the first leaves; order may change too
    assert batch[0].keys.shape[0] == 2
    row = families.extract_caches(batch, 1, offset=9)
    assert row.offset == 9 and row.full[1] is row[0]
    for cache, (keys, values) in zip(row, kept, strict=True):
        assert mx.array_equal(cache.keys[..., : cache.offset, :], keys).item()
        assert mx.array_equal(cache.values[..., : cache.offset, :], values).item()


def test_batch_rows_cross_the_wire_and_bad_ones_are_refused() -> None:
    rows = (("a", 17), ("b", 9))
    header = RingHeader(rid="batch0", kind="decode", dtype="float32", shape=(2, 1, 4), batch=rows)
    back = decode_ring_header(encode_ring_header(header), 2 * 4 * 4)
    assert back.batch == rows and back.rid == "batch0"
    tokens = RingHeader(
        rid="batch0", kind="token", batch=(("a", 5, "", None), ("b", 6, "stop", [-0.5, []]))
    )
    assert decode_ring_header(encode_ring_header(tokens), 0).batch == (
        ("a", 5, "", None),
        ("b", 6, "stop", [-0.5, []]),
    )
    for bad in ((("a", 1), ("a", 2)), (("a",),), ((3, 1),), (("a", "x"),)):
        raw = encode_ring_header(msgspec.structs.replace(header, batch=bad))
        with pytest.raises(FrameError, match="batch") as caught:
            decode_ring_header(raw, 2 * 4 * 4)
        assert caught.value.rid == "batch0"
