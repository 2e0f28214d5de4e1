"""Batch reads on a sealed memfd segment's own connection: the trainer's hop without a gRPC call.

A streamed gRPC Read costs the daemon and the trainer about 0.9 ms of fixed
work per batch (setting up the call, its metadata, each reply message), paid
one after the other with the transfer: at 110 KiB samples a third of a peer
hit's time (bench/experiments/wire.py). Once a trainer has handed its daemon a sealed
memfd segment, the connection that keeps it mapped (:mod:`.memfd`) is
already authenticated by the cluster token and tied to that one segment, and
the payloads go through the segment anyway: what is left to say per batch is
a few numbers each way. So a daemon that says so in its handshake reply
(``"reads"``: the most ids one request may carry) answers one packed
request per batch on that connection with one packed reply:

- request: :data:`_REQUEST` (magic, count, epoch or -1, the lengths of the
  dataset's name, its manifest id and the job's id), those three UTF-8
  strings, then the ids as little-endian uint64;
- reply: :data:`_REPLY` (magic, count, status code, the lengths of the error
  class's name and of the message), those two strings, then per position
  the payload's offset in the segment, its length and its checksum (uint64
  each), its tier (the proto's Tier) and whether the daemon checked it where
  it lies (uint8 each).

A status other than :data:`OK` carries the gRPC status code and class name a
streamed Read would end with, so the same error comes back as the same
exception; :data:`NOT_PLACED` says the segment could not hold the batch, which
then goes over gRPC (payloads inline): rare, since the client sizes a
segment to its batch (a peer payload that failed its checksum in place while
another landed after it leaves its room unused). Control (Info, jobs, datasets) stays
on gRPC. A daemon closes a connection that sends anything else, which also
unmaps its segment.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

#: The most ids one request may carry (the replies' size then stays far under a socket's default buffer).
MAX_IDS = 4096
#: Longest dataset name, manifest id or job id a request may carry, in UTF-8 bytes.
MAX_NAME_BYTES = 1024
#: A reply's status: the batch is in the segment.
OK = 0
#: A reply's status: the segment could not hold every payload; read the batch over gRPC.
NOT_PLACED = 1000
#: Longest message a reply carries (as a gRPC status's details).
MAX_MESSAGE_BYTES = 8192

_REQUEST = struct.Struct("<4sIqHHH")
_REPLY = struct.Struct("<4sIIHH")
_REQUEST_MAGIC = b"DQr1"
_REPLY_MAGIC = b"DQa1"
#: Per position: offset, length, checksum (uint64), tier, checked in place (uint8).
_PER_SAMPLE = 8 * 3 + 2
#: Largest request or reply either side receives.
REQUEST_BYTES = _REQUEST.size + 3 * MAX_NAME_BYTES + 8 * MAX_IDS
REPLY_BYTES = _REPLY.size + 2 * MAX_MESSAGE_BYTES + _PER_SAMPLE * MAX_IDS


@dataclass(frozen=True)
class BatchRequest:
    dataset: str
    manifest_id: str
    job: str
    #: The job's epoch the batch is read for; None for its current one.
    epoch: int | None
    ids: np.ndarray


@dataclass(frozen=True)
class BatchReply:
    """A request's answer: ``code`` :data:`OK` with the arrays, or an error's
    status code, class name and message."""

    code: int
    error: str = ""
    message: str = ""
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    checksums: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    tiers: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    checked: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))


def request_frame(request: BatchRequest) -> bytes:
    names = [s.encode() for s in (request.dataset, request.manifest_id, request.job)]
    if max(map(len, names)) > MAX_NAME_BYTES or len(request.ids) > MAX_IDS:
        raise ValueError(f"a batch request holds at most {MAX_IDS} ids and names of {MAX_NAME_BYTES} bytes")
    epoch = -1 if request.epoch is None else request.epoch
    header = _REQUEST.pack(_REQUEST_MAGIC, len(request.ids), epoch, *map(len, names))
    return b"".join((header, *names, np.asarray(request.ids, dtype="<u8").tobytes()))


def parse_request(frame: bytes) -> BatchRequest:
    """The request in ``frame``.

    Raises:
        ValueError: it is not one (wrong magic, lengths that do not add up,
            names that are not UTF-8, too many ids).
    """
    if len(frame) < _REQUEST.size:
        raise ValueError(f"a request of {len(frame)} bytes is shorter than its header")
    magic, count, epoch, *lengths = _REQUEST.unpack_from(frame)
    if magic != _REQUEST_MAGIC:
        raise ValueError("not a batch request")
    if count > MAX_IDS or max(lengths) > MAX_NAME_BYTES:
        raise ValueError(f"a batch request holds at most {MAX_IDS} ids and names of {MAX_NAME_BYTES} bytes")
    if len(frame) != _REQUEST.size + sum(lengths) + 8 * count:
        raise ValueError(f"a request of {len(frame)} bytes does not match its header")
    at, names = _REQUEST.size, []
    for length in lengths:
        names.append(frame[at : at + length].decode())
        at += length
    ids = np.frombuffer(frame, dtype="<u8", count=count, offset=at).astype(np.uint64)
    return BatchRequest(names[0], names[1], names[2], None if epoch < 0 else epoch, ids)


def reply_frame(reply: BatchReply) -> bytes:
    error, message = reply.error.encode(), reply.message.encode()[:MAX_MESSAGE_BYTES]
    count = len(reply.offsets)
    header = _REPLY.pack(_REPLY_MAGIC, count, reply.code, len(error), len(message))
    arrays = [
        np.asarray(a, dtype=t).tobytes()
        for a, t in (
            (reply.offsets, "<u8"),
            (reply.lengths, "<u8"),
            (reply.checksums, "<u8"),
            (reply.tiers, "u1"),
            (reply.checked, "u1"),
        )
    ]
    return b"".join((header, error, message, *arrays))


def parse_reply(frame: bytes, count: int) -> BatchReply:
    """The reply in ``frame`` to a request of ``count`` ids.

    Raises:
        ValueError: it is not one.
    """
    if len(frame) < _REPLY.size:
        raise ValueError(f"a reply of {len(frame)} bytes is shorter than its header")
    magic, got, code, error_length, message_length = _REPLY.unpack_from(frame)
    if magic != _REPLY_MAGIC:
        raise ValueError("not a batch reply")
    at = _REPLY.size
    error = frame[at : at + error_length].decode(errors="replace")
    message = frame[at + error_length : at + error_length + message_length].decode(errors="replace")
    at += error_length + message_length
    if code != OK:
        return BatchReply(code, error, message)
    if got != count or len(frame) != at + _PER_SAMPLE * count:
        raise ValueError(f"a reply of {got} samples in {len(frame)} bytes for {count} ids")
    offsets, at = np.frombuffer(frame, "<u8", count, at), at + 8 * count
    lengths, at = np.frombuffer(frame, "<u8", count, at), at + 8 * count
    checksums, at = np.frombuffer(frame, "<u8", count, at), at + 8 * count
    tiers, at = np.frombuffer(frame, "u1", count, at), at + count
    return BatchReply(
        OK,
        offsets=offsets,
        lengths=lengths,
        checksums=checksums,
        tiers=tiers,
        checked=np.frombuffer(frame, "u1", count, at),
    )
