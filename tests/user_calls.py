"""What one user of a shared daemon tries, run by the tests as that user (setpriv).

Each command prints one JSON line: what the daemon answered, or the error's
class and message. Every call goes through the client's own connection, so
it carries the caller ticket the daemon gave this process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

import dataquay.client as dq
from dataquay.client.connection import DaemonConnection
from dataquay.client.errors import DataquayError
from dataquay.client.wire.batch_reads import BatchRequest, parse_reply, request_frame
from dataquay.client.wire.memfd import MemfdSegment, daemon_socket_of, fd_socket_path
from dataquay.client.wire.shm import SHM_DIR
from dataquay.protos import cache_pb2 as pb


def outcome(call: Callable[[], Any]) -> dict[str, Any]:
    """What ``call`` returned, or the error it raised."""
    try:
        return {"ok": call()}
    except DataquayError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


def digests(payloads: list[bytes]) -> list[str]:
    return [hashlib.sha256(p).hexdigest() for p in payloads]


def add(conn: DaemonConnection, name: str, root: str) -> dict[str, Any]:
    request = pb.AddDatasetRequest(name=name, root=root)
    return outcome(lambda: conn.call("AddDataset", lambda stub: stub.AddDataset(request).num_samples))


def drop(conn: DaemonConnection, name: str) -> dict[str, Any]:
    request = pb.DropDatasetRequest(name=name)
    return outcome(lambda: conn.call("DropDataset", lambda stub: stub.DropDataset(request).freed_samples))


def read_grpc(conn: DaemonConnection, name: str, ids: list[int]) -> dict[str, Any]:
    """A streamed Read without the manifest: what bytes come back."""
    request = pb.ReadRequest(dataset=name, ids=ids)
    return outcome(
        lambda: conn.call("Read", lambda stub: digests([s.data for c in stub.Read(request) for s in c.samples]))
    )


def read_into(conn: DaemonConnection, name: str, segment: str, ids: list[int]) -> dict[str, Any]:
    """A Read whose payloads the daemon is to write into ``segment`` (under /dev/shm)."""
    request = pb.ReadRequest(dataset=name, ids=ids, shm_name=segment, shm_size=1 << 20)
    return outcome(lambda: conn.call("Read", lambda stub: sum(len(c.samples) for c in stub.Read(request))))


def read_segment(addr: str, token: str, name: str, ids: list[int]) -> dict[str, Any]:
    """A batch read on a sealed memfd segment's own connection: its status and the bytes placed."""
    daemon_socket = daemon_socket_of(addr)
    assert daemon_socket is not None
    seg = MemfdSegment(1 << 20, fd_socket_path(daemon_socket), token)
    try:
        frame = seg.read(request_frame(BatchRequest(name, "", "", None, np.array(ids, np.uint64))), 10.0)
        reply = parse_reply(frame, len(ids))
        if reply.code:
            return {"error": reply.error, "message": reply.message}
        return {"ok": digests([bytes(seg.map[int(o) : int(o) + int(n)]) for o, n in zip(reply.offsets, reply.lengths)])}
    finally:
        seg.close()


def read_client(addr: str, name: str, ids: list[int]) -> dict[str, Any]:
    """A trainer's read: the manifest, then the batch."""
    with dq.connect(addr, timeout=10) as client:
        return outcome(lambda: digests(client.dataset(name).get_batch(ids)))


def trainer(addr: str, name: str, ids: list[int]) -> dict[str, Any]:
    """A trainer's read, with the tiers its client read from."""
    with dq.connect(addr, timeout=10) as client:
        read = outcome(lambda: digests(client.dataset(name).get_batch(ids)))
        return {**read, "samples": client.stats().samples}


def prep_spec(group: str, dataset: str, batch_size: int) -> pb.PrepGroupSpec:
    return pb.PrepGroupSpec(
        group=group,
        dataset=dataset,
        jobs=2,
        batch_size=batch_size,
        num_batches=4,
        memory_bytes=1 << 20,
        timeout_seconds=30,
    )


def prep_sync(conn: DaemonConnection, spec: pb.PrepGroupSpec, member: str) -> dict[str, Any]:
    request = pb.PrepSyncRequest(spec=spec, member=member, pid=os.getpid(), epoch=0, wait_seconds=0)
    return outcome(lambda: conn.call("PrepSync", lambda stub: stub.PrepSync(request).role))


def steal_segment(conn: DaemonConnection, dataset: str, segment: str) -> dict[str, Any]:
    """Hands in another user's prepped batch as this member's own, then leaves: a group
    that took it frees it, and its daemon removes the segment."""
    spec = prep_spec("own", dataset, 4)
    spec.jobs = 1

    def sync(**fields: Any) -> Any:
        request = pb.PrepSyncRequest(spec=spec, member="m", pid=os.getpid(), epoch=0, wait_seconds=0, **fields)
        return conn.call("PrepSync", lambda stub: stub.PrepSync(request))

    def steal() -> list[int]:
        claims = list(sync(claim=1).claims)
        sync(prepped=[pb.PreppedBatch(index=claims[0], segment=segment, bytes=4096)])
        sync(leave=True)
        return claims

    return outcome(steal)


def hand_over(conn: DaemonConnection, name: str, segment: str, sample: int, length: int) -> dict[str, Any]:
    """Writes a wrong payload into ``segment`` (under /dev/shm) and hands it over as ``sample``."""
    with open(SHM_DIR / segment, "r+b") as seg:
        seg.write(b"\xee" * length)
    info = conn.call("GetDataset", lambda stub: stub.GetDataset(pb.GetDatasetRequest(name=name)))
    request = pb.CacheBehindRequest(
        dataset=name,
        manifest_id=info.manifest_id,
        shm_name=segment,
        shm_size=1 << 20,
        handed=[pb.Sample(id=sample, shm_offset=0, length=length)],
    )
    return outcome(lambda: conn.call("CacheBehind", lambda stub: stub.CacheBehind(request).queued))


def no_ticket(addr: str, name: str) -> dict[str, Any]:
    """A call on the unix socket that carries no caller ticket."""
    with grpc.insecure_channel(f"unix:{addr}") as channel:
        try:
            stub_call = channel.unary_stream(
                "/dataquay.v1.Cache/GetManifest",
                request_serializer=pb.GetDatasetRequest.SerializeToString,
                response_deserializer=pb.ManifestChunk.FromString,
            )
            return {"ok": len(b"".join(c.data for c in stub_call(pb.GetDatasetRequest(name=name))))}
        except grpc.RpcError as exc:
            return {"error": exc.code().name, "message": exc.details()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--addr", required=True)
    parser.add_argument("command")
    parser.add_argument("args", nargs="*")
    args = parser.parse_args()
    conn = DaemonConnection(args.addr)
    a = args.args
    try:
        if args.command == "add":
            result = add(conn, a[0], a[1])
        elif args.command == "drop":
            result = drop(conn, a[0])
        elif args.command == "read":
            ids = [int(i) for i in a[1:]]
            result = {
                "grpc": read_grpc(conn, a[0], ids),
                "segment": read_segment(args.addr, "", a[0], ids),
                "client": read_client(args.addr, a[0], ids),
            }
        elif args.command == "trainer":
            result = trainer(args.addr, a[0], [int(i) for i in a[1:]])
        elif args.command == "prep":
            groups = [(group, int(batch)) for group, _, batch in (arg.partition(":") for arg in a[1:])]
            result = {
                "results": [
                    prep_sync(conn, prep_spec(group, a[0], batch), f"m{i}") for i, (group, batch) in enumerate(groups)
                ]
            }
        elif args.command == "steal-segment":
            result = steal_segment(conn, a[0], a[1])
        elif args.command == "read-into":
            result = read_into(conn, a[0], a[1], [int(i) for i in a[2:]])
        elif args.command == "hand-over":
            result = hand_over(conn, a[0], a[1], int(a[2]), int(a[3]))
        elif args.command == "no-ticket":
            result = no_ticket(args.addr, a[0])
        else:
            raise SystemExit(f"unknown command {args.command}")
    finally:
        conn.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
