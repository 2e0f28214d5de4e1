"""What a share takes in LMDB, checked against the store's own pages, and what a node needs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import JobPlan, owners
from dataquay.client.wire.records import encode_value
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.planning.capacity import (
    EXCHANGE_HEADROOM_BYTES,
    cache_need,
    cached_bytes,
    node_shares,
    stored_bytes,
    write_slack_bytes,
)
from dataquay.server.sizes import parse_size, size_flag

KiB, MiB = 1 << 10, 1 << 20
_MIXES = {
    "1 KiB": lambda rng: np.full(12_000, KiB),
    "2014 B, the largest inline": lambda rng: np.full(8_000, 2014),
    "2015 B, the smallest on overflow pages": lambda rng: np.full(8_000, 2015),
    "4 KiB": lambda rng: np.full(5_000, 4 * KiB),
    "110 KiB": lambda rng: np.full(300, 110 * KiB),
    "mixed": lambda rng: rng.choice([100, KiB, 4 * KiB, 110 * KiB], 3_000),
}


def store_pages(tmp_path: Path, sizes: np.ndarray) -> tuple[int, int]:
    """(bytes of branch, leaf and overflow pages, the map's high-water mark) once
    the store has written values of ``sizes`` in random order, as staging does."""
    order = np.random.default_rng(1).permutation(len(sizes))
    writes = [PendingWrite(b"ds", int(i), encode_value(bytes(int(sizes[i])))) for i in order]

    async def write() -> tuple[int, int]:
        store = Store(tmp_path / "cache", 1 << 30)
        store.open()
        await store.open_dataset("ds")
        writer = asyncio.get_running_loop().create_task(store.run_writer())
        await asyncio.wait_for(store.committed(await store.put_all(writes)), 60)
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer
        env = store.env
        with env.begin() as txn:
            stat = txn.stat(env.open_db(b"ds"))
        high_water = (env.info()["last_pgno"] + 1) * stat["psize"]
        store.close()
        pages = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        return pages * stat["psize"], high_water

    return asyncio.run(write())


@pytest.mark.parametrize("mix", list(_MIXES))
def test_stored_bytes_match_the_pages_the_store_takes_within_3_percent(tmp_path: Path, mix: str) -> None:
    sizes = _MIXES[mix](np.random.default_rng(7))
    pages, used = store_pages(tmp_path, sizes)
    assert stored_bytes(sizes) == pytest.approx(pages, rel=0.03)
    # The map's high-water mark (what meets the capacity) sits above the tree
    # by the writer's copies.
    assert cached_bytes(sizes) == pytest.approx(used, rel=0.1)


def test_small_values_leave_the_writer_tens_of_pages_of_slack_large_ones_almost_none() -> None:
    assert write_slack_bytes(np.full(100_000, KiB)) > 16 * MiB
    assert write_slack_bytes(np.full(5_000, 110 * KiB)) < stored_bytes(np.full(5_000, 110 * KiB)) * 0.002
    assert stored_bytes(np.empty(0, dtype=np.int64)) == write_slack_bytes(np.empty(0, dtype=np.int64)) == 0


@pytest.mark.parametrize("mode", ["global", "local", "locality"])
def test_a_node_needs_its_share_where_owners_never_move(mode: str) -> None:
    assert cache_need(100 * MiB, mode, 0.0) == 100 * MiB


@pytest.mark.parametrize("q", [0.1, 0.5, 1.0])
def test_partial_needs_the_exchange_headroom_on_top(q: float) -> None:
    assert cache_need(100 * MiB, "partial", q) == 105 * MiB + EXCHANGE_HEADROOM_BYTES


def test_node_shares_follow_the_owners_epoch_by_epoch() -> None:
    sizes = np.random.default_rng(3).integers(500, 300 * KiB, 4_000)
    partial = JobPlan(JobSettings(mode="partial", q=0.5, seed=2), 4_000, 4)
    shares = node_shares(partial, sizes, epochs=3)
    current = owners(partial, 0)
    for epoch in range(3):
        current = owners(partial, epoch, current if epoch else None)
        assert shares[epoch].tolist() == [cached_bytes(sizes[current == m]) for m in range(4)]
    assert len(set(shares[:, 0].tolist())) == 3  # bytes move with the samples, counts do not
    local = JobPlan(JobSettings(mode="local", seed=2), 4_000, 4)
    assert node_shares(local, sizes, epochs=3).shape == (1, 4)


@pytest.mark.parametrize("size", [1, 800 * KiB, 17 * MiB + 1, 1_300_000_000, 1023 * MiB + 5, 5 << 40])
def test_a_size_flag_is_never_short_of_the_bytes_it_stands_for(size: int) -> None:
    flag = size_flag(size)
    assert size <= parse_size(flag) <= max(size * 1.1, 1024)
