"""The worker side of the load generator: a process of client threads that
the driver (:mod:`dataquay.server.tools.loadgen`) starts as ``python -m
dataquay.server.tools.load_worker``.

A worker reads its plan as one JSON line on stdin, connects every client,
says it is ready and waits for the driver's "go", so that start-up never counts
in the figures. Its events (ready, a tick a second, the final report) are
lines on stdout after :data:`EVENT_PREFIX`; anything else it prints is ignored.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.records import checksum
from dataquay.client.wire.security import Credentials
from dataquay.client.wire.shm import Segment
from dataquay.client.wire.tiers import SERVED_TIERS
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc

#: How the clients call: the client's miss path (unix socket, payloads in
#: shared memory), the unix socket inline, and TCP as a remote caller.
TRANSPORTS = ("shm", "unix", "tcp")
#: Deadline of one Read: a reply slower than this counts as an error.
READ_TIMEOUT_SECONDS = 30.0
#: Pause of a client after a failed call, so a dead daemon is not spun on.
ERROR_PAUSE_SECONDS = 0.05
#: How long workers may take to import, connect and say they are ready.
READY_TIMEOUT_SECONDS = 60.0
#: What starts a worker's event lines on stdout.
EVENT_PREFIX = "dq-load "


class _LoadClient:
    """One client: a thread with its own channel, reading random batches until the deadline."""

    def __init__(self, plan: dict[str, Any], index: int, expected: np.ndarray) -> None:
        self.plan = plan
        self.transport: str = plan["transports"][index]
        self.expected = expected
        self.rng = np.random.default_rng((plan["seed"], plan["worker"], index))
        address = plan["tcp"] if self.transport == "tcp" and plan["tcp"] else plan["socket"]
        options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
        self.channel = Credentials.from_env().channel(address, options)
        self.stub = cache_pb2_grpc.CacheStub(self.channel)
        self.segment = Segment(plan["shm_bytes"]) if self.transport == "shm" else None
        self.batches = self.samples = self.verified = self.bytes = 0
        self.latencies: list[float] = []
        self.tiers: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def connect(self) -> None:
        self.stub.Info(pb.InfoRequest(), timeout=READY_TIMEOUT_SECONDS, wait_for_ready=True)

    def run(self, deadline: float) -> None:
        try:
            while time.monotonic() < deadline:
                self._one_batch()
        except Exception as exc:  # counted: a client that crashes is an error of the run, not of the worker
            self._error(f"client crashed: {type(exc).__name__}", str(exc))

    def _one_batch(self) -> None:
        plan = self.plan
        ids = self.rng.integers(0, plan["num_samples"], plan["batch"])
        request = pb.ReadRequest(dataset=plan["dataset"], ids=ids.tolist(), manifest_id=plan["manifest_id"])
        if self.segment is not None:
            request.shm_name, request.shm_size = self.segment.name, self.segment.size
        started = time.perf_counter()
        try:
            samples = [s for chunk in self.stub.Read(request, timeout=READ_TIMEOUT_SECONDS) for s in chunk.samples]
        except grpc.RpcError as exc:
            self._error(f"rpc {exc.code().name}", str(exc.details()))
            time.sleep(ERROR_PAUSE_SECONDS)
            return
        self.latencies.append(time.perf_counter() - started)
        self.batches += 1
        self.samples += len(samples)
        self._verify(ids.tolist(), samples)

    def _verify(self, ids: list[int], samples: list[pb.Sample]) -> None:
        if len(samples) != len(ids):
            self._error("wrong sample count", f"{len(samples)} samples for {len(ids)} ids")
            return
        in_shm = False
        for want, sample in zip(ids, samples):
            if sample.id != want:
                self._error("wrong id", f"sample {sample.id} where {want} was due")
                continue
            if sample.in_shm:
                if self.segment is None or sample.shm_offset + sample.length > self.segment.size:
                    self._error("bad shm offset", f"sample {want} at {sample.shm_offset}+{sample.length}")
                    continue
                data = self.segment.map[sample.shm_offset : sample.shm_offset + sample.length]
                in_shm = True
            else:
                data = sample.data
            digest, truth = checksum(data), int(self.expected[want])
            if digest != truth:
                self._error("wrong bytes", f"sample {want}: xxh3 {digest:#018x}, the PFS file's {truth:#018x}")
            elif sample.checksum != digest:
                self._error("wrong checksum field", f"sample {want}: {sample.checksum:#018x} for {digest:#018x}")
            else:
                self.verified += 1
                self.bytes += len(data)
                self.tiers[SERVED_TIERS.get(sample.tier, "unspecified")] += 1
        if in_shm and self.segment is not None:
            self.segment.daemon_mapped()

    def _error(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        self.examples.setdefault(kind, message)

    def close(self) -> None:
        self.channel.close()
        if self.segment is not None:
            self.segment.close()


def _say(event: dict[str, Any]) -> None:
    sys.stdout.write(EVENT_PREFIX + json.dumps(event) + "\n")
    sys.stdout.flush()


def main() -> None:
    """A worker process: reads its plan from stdin, connects, says ready,
    runs its clients from "go" until the deadline, reports and exits."""
    plan = json.loads(sys.stdin.readline())
    expected = np.load(plan["checksums"], mmap_mode="r")
    clients: list[_LoadClient] = []
    try:
        for index in range(len(plan["transports"])):
            clients.append(_LoadClient(plan, index, expected))
        for client in clients:
            client.connect()
        _say({"event": "ready"})
        if sys.stdin.readline().strip() != "go":
            return
        started = time.monotonic()
        deadline = started + plan["seconds"]
        threads = [threading.Thread(target=c.run, args=(deadline,), daemon=True) for c in clients]
        for thread in threads:
            thread.start()
        while alive := [thread for thread in threads if thread.is_alive()]:
            alive[0].join(1.0)
            _say(
                {
                    "event": "tick",
                    "samples": sum(c.samples for c in clients),
                    "errors": sum(sum(c.errors.values()) for c in clients),
                }
            )
        _say({"event": "done", **_report(clients, time.monotonic() - started)})
    finally:
        for client in clients:
            client.close()


def _report(clients: Sequence[_LoadClient], wall: float) -> dict[str, Any]:
    transports: dict[str, dict[str, Any]] = {}
    for transport in dict.fromkeys(c.transport for c in clients):
        mine = [c for c in clients if c.transport == transport]
        latencies = np.array([x for c in mine for x in c.latencies], dtype=np.float32)
        transports[transport] = {
            "clients": len(mine),
            "batches": sum(c.batches for c in mine),
            "samples": sum(c.samples for c in mine),
            "verified": sum(c.verified for c in mine),
            "bytes": sum(c.bytes for c in mine),
            "latencies": base64.b64encode(latencies.tobytes()).decode(),
        }
    errors: Counter[str] = Counter()
    tiers: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for client in clients:
        errors.update(client.errors)
        tiers.update(client.tiers)
        for kind, message in client.examples.items():
            examples.setdefault(kind, message)
    return {"wall": wall, "transports": transports, "errors": dict(errors), "examples": examples, "tiers": dict(tiers)}


if __name__ == "__main__":
    main()
