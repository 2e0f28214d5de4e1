"""Small pure pieces of the daemon: sizes, durations, the rate limiter, byte
budgets, the write queue's index, reply windows and reply messages."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from dataquay.client.wire.pieces import PIECE_BYTES
from dataquay.protos import cache_pb2 as pb
from dataquay.server.errors import ConfigError
from dataquay.server.limits import ByteBudget, ByteBudgets
from dataquay.server.node.cache.write_queue import PendingWrite, WriteQueue
from dataquay.server.node.handoff.segments import ALIGN, place
from dataquay.server.node.reads.replies import reply_chunks
from dataquay.server.node.reads.served import Served, Window
from dataquay.server.node.reads.service import window_bounds
from dataquay.server.ratelimit import TokenBucket
from dataquay.server.sizes import format_bytes, format_duration, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("200G", 200 << 30),
        ("512MiB", 512 << 20),
        ("1.5TB", 1_500_000_000_000),
        ("10k", 10 << 10),
        ("7 KB", 7000),
        ("1b", 1),
    ],
)
def test_sizes_accept_binary_and_decimal_units(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1G", "1X", "G"])
def test_bad_sizes_name_the_value(text: str) -> None:
    with pytest.raises(ConfigError, match="bad size"):
        parse_size(text)


def test_durations_and_byte_formatting() -> None:
    assert parse_duration("2s") == 2 and parse_duration("5m") == 300 and parse_duration("250ms") == 0.25
    with pytest.raises(ConfigError):
        parse_duration("soon")
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.4, "0s"),
        (-3, "0s"),
        (42, "42s"),
        (303, "5m3s"),
        (3600, "1h0m"),
        (8100.9, "2h15m"),
        (3 * 86400 + 4 * 3600 + 59, "3d4h"),
    ],
)
def test_durations_are_shown_in_their_two_largest_units(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_token_bucket_never_admits_more_than_its_rate() -> None:
    bucket = TokenBucket(rate=1_000_000)
    started = time.monotonic()
    threads = [threading.Thread(target=bucket.acquire, args=(50_000,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started >= 0.3 * 0.99


def test_a_byte_budget_hands_out_in_order_and_lets_a_large_request_through_alone() -> None:
    async def scenario() -> list[str]:
        budget = ByteBudget(100)
        order: list[str] = []
        assert budget.try_take(60)

        async def want(name: str, nbytes: int) -> None:
            await budget.take(nbytes)
            order.append(name)

        big = asyncio.ensure_future(want("big", 500))
        small = asyncio.ensure_future(want("small", 10))
        await asyncio.sleep(0)
        assert order == [] and not budget.try_take(10), "nobody jumps the queue"
        budget.give(60)
        await asyncio.gather(big)
        assert budget.held == 500 and order == ["big"]
        cancelled = asyncio.ensure_future(want("cancelled", 50))
        await asyncio.sleep(0)
        cancelled.cancel()
        budget.give(500)
        await asyncio.gather(small, cancelled, return_exceptions=True)
        assert budget.held == 10
        budget.give(10)
        assert budget.idle
        return order

    assert asyncio.run(scenario()) == ["big", "small"]


def test_byte_budgets_keep_one_budget_per_key_and_drop_idle_ones() -> None:
    budgets = ByteBudgets(100, keep=2)
    held = budgets.get("a")
    assert held.try_take(1) and budgets.get("a") is held
    budgets.get("b")
    budgets.get("c")  # over `keep`: the idle "b" goes, the busy "a" stays
    assert len(budgets) == 2 and budgets.get("a") is held


def test_reply_windows_cover_every_position_once_and_put_an_oversized_one_alone() -> None:
    lengths = np.array([30, 30, 30, 200, 10, 10, 95, 5], dtype=np.uint64)
    bounds = window_bounds(lengths, 100)
    assert bounds == [(0, 3), (3, 4), (4, 6), (6, 8)]
    assert window_bounds(np.array([], dtype=np.uint64), 100) == []


def test_a_queued_write_is_found_by_key_until_the_writer_commits_it_or_its_dataset_goes() -> None:
    async def scenario() -> None:
        queue = WriteQueue()
        first, second = PendingWrite(b"a", 1, b"old"), PendingWrite(b"a", 1, b"new")
        queue.push(first)
        queue.push(second)
        queue.push(PendingWrite(b"b", 1, b"other"))
        assert queue.waiting(b"a", 1) is second and queue.waiting(b"a", 2) is None
        queue.drop(b"b")
        assert queue.waiting(b"b", 1) is None and queue.waiting(b"a", 1) is second
        assert queue.take_batch() == [first, second]
        # While the batch commits the sample is neither cached nor gone: a read finds it here.
        assert queue.waiting(b"a", 1) is second
        queue.resolve(2)
        assert queue.waiting(b"a", 1) is None

    asyncio.run(scenario())


def test_a_reply_keeps_order_sends_a_repeat_once_per_position_and_a_large_payload_in_pieces() -> None:
    small, large, placed = b"s" * 10, bytes(range(256)) * (PIECE_BYTES // 256) + b"tail", b"p" * 5
    window = Window(
        [Served(1, "cache", small, 11), Served(2, "pfs", memoryview(large), 22), Served(3, "peer", placed, 33)],
        np.array([0, 1, 2, 0, 0]),
    )
    chunks = list(reply_chunks(window, [None, None, 4096], limit=15))
    assert [c.HasField("piece") for c in chunks] == [False, True, True, False, False]
    assert [s.id for s in chunks[0].samples] == [1]
    pieces = [c.piece for c in chunks[1:3]]
    assert [(p.id, p.offset, p.length, p.checksum) for p in pieces] == [
        (2, 0, len(large), 22),
        (2, PIECE_BYTES, len(large), 22),
    ]
    assert b"".join(p.data for p in pieces) == large and pieces[0].tier == pb.TIER_PFS
    third, fourth = chunks[3].samples, chunks[4].samples
    assert [(s.id, s.in_shm, s.shm_offset, s.length) for s in third] == [(3, True, 4096, 5), (1, False, 0, 0)]
    assert [s.data for s in fourth] == [small], "a chunk holds about `limit` bytes of payload"


def test_shm_placement_aligns_and_skips_what_does_not_fit() -> None:
    offsets = list(place([100, 5000, 30, 10], capacity=4096))
    assert offsets == [0, None, ALIGN * 2, ALIGN * 3]


def test_grouped_tar_framing_round_trips_and_rejects_truncation() -> None:
    from dataquay.client.wire.records import frame_members, unframe_members

    value = frame_members([("jpg", b"\xff\xd8" * 300), ("cls", b"7"), ("json", b"")])
    members = unframe_members(value)
    assert {k: bytes(v) for k, v in members.items()} == {"jpg": b"\xff\xd8" * 300, "cls": b"7", "json": b""}
    with pytest.raises(ValueError, match="truncated in member 'jpg'"):
        unframe_members(value[:100])
    with pytest.raises(ValueError, match="not a grouped sample"):
        unframe_members(b"plain bytes")
