"""The fault suite's checker must be able to fail: a wrong byte and a
duplicated id are both caught, and a clean epoch passes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xxhash
from checker import epoch_problems, pfs_digests, pfs_files

from dataquay.server.tools.trainers import RankEpoch


def files(root: Path, count: int) -> list[bytes]:
    payloads = [bytes([i]) * (100 + i) for i in range(count)]
    for i, payload in enumerate(payloads):
        folder = root / f"class_{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:04d}.bin").write_bytes(payload)
    (root / ".hidden").write_bytes(b"not a sample")
    return payloads


def read(rank: int, ids: list[int], payloads: list[bytes]) -> RankEpoch:
    sums = [xxhash.xxh3_64_intdigest(payloads[i]) for i in ids]
    return RankEpoch(rank, f"node-{rank}", 0, ids, sums, {"local": len(ids)}, {}, 0.0, 0.0)


def test_files_are_hashed_in_the_documented_id_order(tmp_path: Path) -> None:
    payloads = files(tmp_path, 6)
    order = [0, 2, 4, 1, 3, 5]  # class_0 before class_1, names by bytes within each
    assert [p.read_bytes() for p in pfs_files(tmp_path)] == [payloads[i] for i in order]
    assert pfs_digests(tmp_path).tolist() == [xxhash.xxh3_64_intdigest(payloads[i]) for i in order]


def test_a_clean_epoch_passes_and_a_wrong_byte_and_a_duplicated_id_are_caught(tmp_path: Path) -> None:
    files(tmp_path, 6)
    payloads = [p.read_bytes() for p in pfs_files(tmp_path)]
    digests = pfs_digests(tmp_path)
    orders = [np.array([0, 1, 2]), np.array([3, 4, 5])]
    assert epoch_problems(0, [read(0, [0, 1, 2], payloads), read(1, [3, 4, 5], payloads)], orders, digests) == []

    flipped = bytearray(payloads[4])
    flipped[50] ^= 0x01
    wrong_byte = read(1, [3, 4, 5], [*payloads[:4], bytes(flipped), *payloads[5:]])
    assert epoch_problems(0, [read(0, [0, 1, 2], payloads), wrong_byte], orders, digests) == [
        "epoch 0 rank 1: id 4 has bytes other than its file's"
    ]

    duplicated = read(0, [0, 1, 4], payloads)
    assert epoch_problems(0, [duplicated, read(1, [3, 4, 5], payloads)], orders, digests) == [
        "epoch 0 rank 0: read 3 ids, its sampler has 3; first difference at position 2",
        "epoch 0: id 4 read 2 times",
        "epoch 0: 1 ids never read, first [2]",
    ]
