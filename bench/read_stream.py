"""The parse of a streamed Read's reply, per sample: the trainer's loop
(payloads in the order asked, checksums, counts per tier) and a daemon's
loop over a peer's reply, on replies of 256 inline samples per message,
built once. What is timed is the parse alone, in CPU time of the thread
(the machine's load moves wall time more than the parse).

    .venv/bin/python bench/read_stream.py      # about 10 s
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import numpy as np
from common import report

from dataquay.client.daemon_transports import DaemonReply
from dataquay.client.wire.read_stream import ReadStream
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb

SAMPLES = 4096
PER_MESSAGE = 256
RUNS = 40
#: Small payloads: from a few KiB on, making each payload's bytes (allocation, page faults)
#: outweighs the parse and moves with the heap's state by more than the parse costs.
PAYLOAD_SIZES = {"100B": 100, "1KiB": 1024}


def reply(size: int) -> list[pb.ReadChunk]:
    """A reply of SAMPLES payloads of ``size`` bytes, ids in order."""
    payloads = [np.random.default_rng(i).bytes(size) for i in range(64)]
    chunks = []
    for start in range(0, SAMPLES, PER_MESSAGE):
        chunk = pb.ReadChunk()
        for i in range(start, start + PER_MESSAGE):
            data = payloads[i % len(payloads)]
            chunk.samples.add(id=i, tier=pb.TIER_CACHE, data=data, checksum=checksum(data))
        chunks.append(chunk)
    return chunks


def trainer(chunks: list[pb.ReadChunk], lengths: np.ndarray, verify: bool) -> None:
    taken = DaemonReply("bench", list(range(SAMPLES)), lengths, None, verify)
    for chunk in chunks:
        taken.take(chunk)
    taken.check_complete()
    assert not taken.bad


def peer(chunks: list[pb.ReadChunk], lengths: np.ndarray, verify: bool) -> None:
    stream = ReadStream("peer n1", lengths, verify=verify)
    samples = {}
    for chunk in chunks:
        for sample_id, data, digest, _, missing, _, intact in stream.take(chunk):
            if not missing and intact:
                samples[sample_id] = (data, digest)
    stream.end()
    assert len(samples) == SAMPLES


def us_per_sample(parse: Callable[[list[pb.ReadChunk], np.ndarray, bool], None], size: int, verify: bool) -> float:
    chunks, lengths = reply(size), np.full(SAMPLES, size, np.int64)
    times = []
    gc.disable()
    try:
        for _ in range(RUNS):
            started = time.thread_time()
            parse(chunks, lengths, verify)
            times.append((time.thread_time() - started) / SAMPLES * 1e6)
    finally:
        gc.enable()
    return statistics.median(times)


def main() -> None:
    rows: list[dict[str, object]] = []
    for label, size in PAYLOAD_SIZES.items():
        rows.append(
            {
                "size": label,
                "trainer_us": us_per_sample(trainer, size, False),
                "trainer_checked_us": us_per_sample(trainer, size, True),
                "peer_checked_us": us_per_sample(peer, size, True),
            }
        )
    report("read_stream", rows, ["size", "trainer_us", "trainer_checked_us", "peer_checked_us"])


if __name__ == "__main__":
    main()
