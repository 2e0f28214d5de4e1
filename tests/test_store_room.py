"""The store's fullness follows its pages: what deletes free is used again,
and a reservation holds room that ordinary inserts cannot take. Real LMDB."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from store_runs import with_store

from dataquay.client.wire.records import encode_value
from dataquay.server.node.cache.space import CacheSpace
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.planning.capacity import stored_bytes

MiB = 1 << 20
VALUE = 40_000


def write(sample_id: int, **flags: bool) -> PendingWrite:
    return PendingWrite(b"ds", sample_id, encode_value(bytes([sample_id % 251]) * VALUE), **flags)


async def fill(store: Store, first: int, count: int) -> np.ndarray:
    """Offers ``count`` samples from ``first`` on; returns which the cache took."""
    ids = np.arange(first, first + count)
    await store.committed(await store.put_all(write(int(i)) for i in ids))
    return store.cached_mask("ds", ids)


def test_space_freed_by_deletes_is_used_again(tmp_path: Path) -> None:
    async def test(store: Store) -> None:
        taken = await fill(store, 0, 200)  # 8 MB into a 4 MiB cache
        assert store.full and 0 < taken.sum() < 200
        held = np.flatnonzero(taken)
        assert await store.discard("ds", held[: len(held) // 2]) == len(held) // 2
        assert not store.full
        again = await fill(store, 1000, 200)
        assert again.sum() >= len(held) // 2 - 2  # what was freed, give or take a page run
        assert store.full
        assert store.space.live_bytes <= store.capacity

    with_store(tmp_path / "cache", 4 * MiB, test)


def test_a_map_grown_to_hold_an_offer_takes_it_without_growing_again(tmp_path: Path) -> None:
    """A growth remaps the whole map and faults its pages in anew: the
    exchange's receiver grows once per offer, by what the offer's values will
    take and a margin for the estimate, so that no growth comes while they land."""
    count, per_message = 600, 37

    async def test(store: Store) -> None:
        await store.grow_to_hold(stored_bytes(np.full(count, VALUE)))
        grown = store.env.info()["map_size"]
        for first in range(0, count, per_message):
            ids = range(first, min(count, first + per_message))
            await store.committed(await store.put_all(write(i, reserved=True) for i in ids))
        assert store.get_values("ds", list(range(count))) == [bytes(write(i).value) for i in range(count)]
        assert store.env.info()["map_size"] == grown
        assert store.unstored_writes == 0  # what the receiver reads as "all committed, no need to look"

    with_store(tmp_path / "cache", 1 << 30, test)


def test_a_reservation_waits_for_room_and_its_writes_are_never_dropped(tmp_path: Path) -> None:
    async def test(store: Store) -> None:
        await fill(store, 0, 200)
        assert store.full and store.space.free == 0
        need = 10 * (VALUE + 8192)
        assert not await store.space.reserve(need, timeout=0.2)  # nothing frees room
        waiting = asyncio.get_running_loop().create_task(store.space.reserve(need, timeout=10))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await store.discard("ds", np.arange(0, 40))
        assert await waiting
        # Ordinary inserts take what is left over, not the reserved room.
        await fill(store, 2000, 200)
        assert store.space.live_bytes + need <= store.capacity
        dropped, unstored = store.inserts_dropped, store.unstored_writes
        ids = np.arange(5000, 5010)
        await store.committed(await store.put_all(write(int(i), reserved=True) for i in ids))
        await store.space.release(need)
        # Most fit; any LMDB could not place (no run of free pages long enough)
        # is not dropped: the exchange's receiver writes it again.
        held = int(store.cached_mask("ds", ids).sum())
        assert held >= 8
        assert store.inserts_dropped == dropped
        assert store.unstored_writes - unstored == len(ids) - held

    with_store(tmp_path / "cache", 4 * MiB, test)


def test_writes_whose_dataset_is_deleted_count_as_unstored(tmp_path: Path) -> None:
    """The exchange's receiver skips looking its writes up only while nothing
    it put can have left the cache: deleting the dataset counts as leaving."""

    async def test(store: Store) -> None:
        await store.committed(await store.put_all(write(i, reserved=True) for i in range(3)))
        assert store.unstored_writes == 0
        assert await store.drop_dataset("ds") == 3
        assert store.unstored_writes == 3

    with_store(tmp_path / "cache", 64 * MiB, test)


def test_inserts_that_leave_room_for_the_exchange_stop_short_of_its_reserve(tmp_path: Path) -> None:
    async def test(store: Store) -> None:
        ids = np.arange(0, 200)
        await store.committed(await store.put_all(write(int(i), leaves_room=True) for i in ids))
        assert store.space.reserve_reached and not store.full
        assert store.capacity - store.space.live_bytes >= store.space.exchange_reserve - VALUE
        assert await store.space.reserve(store.space.exchange_reserve // 2, timeout=1)

    with_store(tmp_path / "cache", 8 * MiB, test)


def test_a_map_that_refused_ordinary_inserts_still_takes_reserved_ones(tmp_path: Path) -> None:
    async def test(store: Store) -> None:
        await fill(store, 0, 200)
        assert store.full
        # Reserved writes are the exchange's, which frees room on every node by
        # taking what it is sent: they may use the housekeeping room.
        await store.committed(await store.put_all([write(9000, reserved=True)]))
        assert store.cached_mask("ds", np.array([9000])).all()
        assert store.env.info()["map_size"] > store.capacity

    with_store(tmp_path / "cache", 4 * MiB, test)


def test_only_a_refused_reserved_write_stops_reservations() -> None:
    async def test() -> None:
        space = CacheSpace(64 * MiB)
        space.live_bytes = 40 * MiB
        space.map_filled()
        assert space.full and space.free > 0
        space.map_filled(reserved=True)
        assert space.free == 0
        space.live_bytes -= MiB
        await space.changed(freed=True)
        assert not space.full and space.free > 0

    asyncio.run(test())


def test_a_reservation_leaves_the_room_kept_free_for_others_until_they_need_less() -> None:
    async def test() -> None:
        space = CacheSpace(64 * MiB)
        space.live_bytes = 40 * MiB
        earlier = [space.free - MiB]  # what earlier arrivals still need
        assert not await space.reserve(2 * MiB, 0.05, lambda: earlier[0])
        waiting = asyncio.create_task(space.reserve(2 * MiB, 5, lambda: earlier[0]))
        await asyncio.sleep(0.05)
        assert not waiting.done() and space.reserved_bytes == 0
        earlier[0] -= MiB  # one came in
        await space.changed()
        assert await waiting and space.reserved_bytes == 2 * MiB

    asyncio.run(test())
