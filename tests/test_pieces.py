"""Pieces of payloads larger than a message: split in order, joined only when
they add up to the sample the manifest describes."""

from __future__ import annotations

import pytest

from dataquay.client.errors import PieceError
from dataquay.client.wire.pieces import Joiner, pieces


def test_pieces_join_back_into_the_payload() -> None:
    payload = bytes(range(256)) * 40 + b"end"
    parts = list(pieces(payload, size=1000))
    assert [offset for offset, _ in parts] == list(range(0, len(payload), 1000))
    joiner = Joiner("the daemon")
    got = [joiner.add(7, offset, len(payload), part, len(payload)) for offset, part in parts]
    assert got[:-1] == [None] * (len(parts) - 1) and got[-1] == payload
    assert joiner.pending is None
    joiner.check_done()


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([(7, 1000, 3000, b"x" * 1000)], "at offset 1000 of a 3000-byte payload, where a first piece"),
        ([(7, 0, 9999, b"x" * 1000)], "of a 9999-byte payload, where a first piece of its 3000 bytes"),
        ([(7, 0, 3000, b"x" * 1000), (8, 1000, 3000, b"x" * 1000)], "piece of sample 8 at offset 1000, where"),
        ([(7, 0, 3000, b"x" * 1000), (7, 2000, 3000, b"x" * 1000)], "where the piece of sample 7 at offset 1000"),
        ([(7, 0, 3000, b"x" * 1000), (7, 1000, 3000, b"x" * 2500)], "sent 2500 bytes at offset 1000 of sample 7"),
        ([(7, 0, 3000, b"")], "sent 0 bytes at offset 0 of sample 7"),
    ],
)
def test_pieces_that_do_not_add_up_are_refused_naming_the_sample(
    steps: list[tuple[int, int, int, bytes]], message: str
) -> None:
    joiner = Joiner("peer n1")
    with pytest.raises(PieceError, match=f"^peer n1 .*{message}"):
        for sample_id, offset, length, data in steps:
            joiner.add(sample_id, offset, length, data, 3000)


def test_a_payload_cut_short_is_refused_naming_the_sample() -> None:
    joiner = Joiner("the daemon")
    assert joiner.add(5, 0, 3000, b"x" * 1000, 3000) is None
    assert joiner.pending == 5
    with pytest.raises(PieceError, match="stopped sending sample 5 after 1000 of its 3000 bytes"):
        joiner.check_done()
