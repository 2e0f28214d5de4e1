"""One node of a coded exchange over the multicast transport, on synthetic data
(tests, ``bench/experiments/coded_wire.py``).

Every node of a run computes the same dataset (seeded bytes of seeded
sizes, their xxh3 as the manifest's checksums), the same caches before the
exchange (each node's share of an earlier epoch plus random spares), the
same new owners and the same plan (:func:`~dataquay.server.node.exchange.coding.plan`),
then sends its packets and fetches over :class:`~dataquay.server.node.exchange.mcast.MulticastEndpoint`
and decodes what it lacks. A decoded sample is committed only when its xxh3
equals the manifest's. The run directory is the nodes' only meeting point:
each writes ``ready.N`` once it listens, starts when all have, writes
``done.N`` once it has every sample and every member acknowledged its
packets, keeps answering until all are done, and leaves ``result.N.json``.

Run: ``python -m dataquay.server.tools.coded_wire --node 0 --nodes 4 --rundir DIR ...``
(every node with the same arguments but ``--node``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import xxhash

from dataquay.server.config import MULTICAST_POOL
from dataquay.server.node.exchange import coded_packets, coding
from dataquay.server.node.exchange.mcast import Channel, MulticastEndpoint
from dataquay.server.tools.spare_copies import balanced_owners

#: How often a node looks for its peers' files in the run directory.
POLL_SECONDS = 0.01
#: A sample on a TCP stream: its id and length, then its bytes.
_FRAME = struct.Struct("<QI")
#: Bytes the frame adds to a sample.
FRAME_BYTES = _FRAME.size


@dataclass(frozen=True)
class Setup:
    """What every node of a run derives from the same arguments."""

    sizes: np.ndarray
    caches: list[np.ndarray]
    owners: np.ndarray
    packets: coding.Packets
    #: Per send (the packets, then the fetches): its sender, its group in the sender's numbering, its members.
    send_nodes: np.ndarray
    send_groups: np.ndarray
    members: list[frozenset[int]]
    #: Per send, the address of the pool it travels on.
    send_slots: np.ndarray


def sample_bytes(seed: int, sample: int, size: int) -> bytes:
    """The synthetic dataset's sample (what the PFS would hold)."""
    return np.random.default_rng([seed, sample]).bytes(size)


def setup(nodes: int, samples: int, mean_bytes: int, spares: int, scheme: str, seed: int, pool: int = 1) -> Setup:
    rng = np.random.default_rng(seed)
    sizes = np.maximum(1, rng.lognormal(np.log(mean_bytes), 0.5, samples)).astype(np.int64)
    before = balanced_owners(samples, nodes, rng)
    caches = []
    for node in range(nodes):
        owned = np.flatnonzero(before == node)
        others = np.flatnonzero(before != node)
        caches.append(np.union1d(owned, rng.choice(others, min(spares, len(others)), replace=False)))
    owners = balanced_owners(samples, nodes, rng)
    packets = coding.plan(coding.holder_bits(caches, samples), owners, scheme, sizes)
    sent = coded_packets.streams(packets)
    return Setup(
        sizes, caches, owners, packets, sent.senders, sent.groups, sent.members, coded_packets.slots(sent, pool)
    )


@dataclass
class NodeResult:
    node: int
    lacked: int
    committed: int
    checksum_failures: int
    pfs_reads: int
    digest: str
    expected_digest: str
    started: float
    received_all: float
    finished: float
    stats: dict[str, int]
    #: This process's CPU seconds (user and system) from the start to ``received_all``.
    cpu_s: float
    #: Bytes of the samples committed: what the exchange delivered here.
    committed_bytes: int


def _digest(ids: list[int], value: dict[int, bytes]) -> str:
    hasher = xxhash.xxh3_64()
    for sample in sorted(ids):
        hasher.update(sample.to_bytes(8, "little"))
        hasher.update(value[sample])
    return hasher.hexdigest()


async def run_node(node: int, s: Setup, seed: int, endpoint: MulticastEndpoint, rundir: Path, nodes: int) -> NodeResult:
    packets = s.packets
    cache = {int(i): sample_bytes(seed, int(i), int(s.sizes[i])) for i in s.caches[node]}
    num_packets = len(packets)
    sends = np.flatnonzero(s.send_nodes == node)
    for group, (members, slot) in {
        int(s.send_groups[i]): (s.members[i], int(s.send_slots[i])) for i in sends.tolist()
    }.items():
        endpoint.open_group(group, members, slot)
    expected = [i for i, m in enumerate(s.members) if node in m and s.send_nodes[i] != coding.PFS]
    for (sender, group), slot in {
        (int(s.send_nodes[i]), int(s.send_groups[i])): int(s.send_slots[i]) for i in expected
    }.items():
        await endpoint.join(slot)
        endpoint.expect(sender, group)
    owned = np.flatnonzero(s.owners == node)
    lacked = [int(i) for i in np.setdiff1d(owned, s.caches[node])]
    # The manifest's checksums of what this node will receive.
    manifest = {i: xxhash.xxh3_64_intdigest(sample_bytes(seed, i, int(s.sizes[i]))) for i in lacked}
    committed: dict[int, bytes] = {}
    fetched = {int(p): asyncio.Event() for p in packets.fetch_packets if packets.senders[p] == node}
    failures = pfs_reads = 0

    def commit(sample: int, value: bytes) -> None:
        nonlocal failures
        if xxhash.xxh3_64_intdigest(value) != manifest[sample]:
            failures += 1
            return
        committed[sample] = value
        cache[sample] = value

    (rundir / f"ready.{node}").touch()
    while len(list(rundir.glob("ready.*"))) < nodes:
        await asyncio.sleep(POLL_SECONDS)
    started, cpu_started = time.time(), time.process_time()

    for p in np.flatnonzero(packets.senders == coding.PFS).tolist():
        sample = int(packets.samples[packets.start[p]])
        if packets.decoders[packets.start[p]] == node:
            pfs_reads += 1
            commit(sample, sample_bytes(seed, sample, int(s.sizes[sample])))
    for fetch in np.flatnonzero(packets.fetch_sources == coding.PFS).tolist():
        p = int(packets.fetch_packets[fetch])
        if packets.senders[p] == node:
            pfs_reads += 1
            sample = int(packets.fetch_samples[fetch])
            commit(sample, sample_bytes(seed, sample, int(s.sizes[sample])))
            fetched[p].set()

    async def send_all() -> None:
        # Fetches first, then packets that wait on none: a wait on a peer's fetch never blocks its own.
        for i in sorted(sends.tolist(), key=lambda i: (i < num_packets, i in fetched)):
            if i >= num_packets:
                sample = int(packets.fetch_samples[i - num_packets])
                await endpoint.send(int(s.send_groups[i]), i, cache[sample])
                continue
            if i in fetched:
                await fetched[i].wait()
            parts = packets.samples[packets.start[i] : packets.start[i + 1]].tolist()
            await endpoint.send(int(s.send_groups[i]), i, coded_packets.xor_encode([cache[p] for p in parts]))
        await endpoint.flush()

    async def receive_all() -> None:
        for _ in range(len(expected)):
            _, _, i, packet = await endpoint.ready.get()
            if i >= num_packets:
                fetch = i - num_packets
                commit(int(packets.fetch_samples[fetch]), packet)
                fetched[int(packets.fetch_packets[fetch])].set()
                continue
            lo, hi = packets.start[i], packets.start[i + 1]
            parts, decoders = packets.samples[lo:hi].tolist(), packets.decoders[lo:hi].tolist()
            mine = parts[decoders.index(node)]
            known = [cache[p] for p in parts if p != mine]
            commit(mine, coded_packets.xor_decode(packet, known, int(s.sizes[mine])))

    receiving = asyncio.create_task(receive_all())
    await send_all()
    await receiving
    received_all, cpu_s = time.time(), time.process_time() - cpu_started
    (rundir / f"done.{node}").touch()
    while len(list(rundir.glob("done.*"))) < nodes:
        await asyncio.sleep(POLL_SECONDS)
    return NodeResult(
        node,
        len(lacked),
        len(committed),
        failures,
        pfs_reads,
        _digest(owned.tolist(), cache),
        _digest(owned.tolist(), {i: sample_bytes(seed, i, int(s.sizes[i])) for i in owned.tolist()}),
        started,
        received_all,
        time.time(),
        asdict(endpoint.stats),
        cpu_s,
        sum(len(v) for v in committed.values()),
    )


async def run_node_tcp(node: int, s: Setup, seed: int, port: int, rundir: Path, nodes: int) -> NodeResult:
    """This node's part of the uncoded exchange (scheme ``none``) as jobs run it: a TCP stream to each
    receiver (node n listens on ``port + 1 + n``), each sample framed by its id and length."""
    packets = s.packets
    if len(packets.fetch_packets):
        raise ValueError("the TCP exchange carries the uncoded plan (scheme none) only")
    cache = {int(i): sample_bytes(seed, int(i), int(s.sizes[i])) for i in s.caches[node]}
    owned = np.flatnonzero(s.owners == node)
    lacked = [int(i) for i in np.setdiff1d(owned, s.caches[node])]
    manifest = {i: xxhash.xxh3_64_intdigest(sample_bytes(seed, i, int(s.sizes[i]))) for i in lacked}
    expected = sum(1 for i, m in enumerate(s.members) if node in m and s.send_nodes[i] != coding.PFS)
    committed: dict[int, bytes] = {}
    stats = {"payload_bytes_sent": 0, "payload_bytes_received": 0}
    failures = pfs_reads = 0
    arrived = asyncio.Event()

    def commit(sample: int, value: bytes) -> None:
        nonlocal failures
        if xxhash.xxh3_64_intdigest(value) != manifest[sample]:
            failures += 1
            return
        committed[sample] = value
        cache[sample] = value

    async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal expected
        while header := await _frame(reader):
            sample, length = header
            commit(sample, await reader.readexactly(length))
            stats["payload_bytes_received"] += _FRAME.size + length
            expected -= 1
            if expected == 0:
                arrived.set()
        writer.close()

    server = await asyncio.start_server(take, "127.0.0.1", port + 1 + node)
    (rundir / f"ready.{node}").touch()
    while len(list(rundir.glob("ready.*"))) < nodes:
        await asyncio.sleep(POLL_SECONDS)
    started, cpu_started = time.time(), time.process_time()
    if expected == 0:
        arrived.set()
    by_receiver: dict[int, list[int]] = {}
    for i in range(len(packets)):
        sample, receiver = int(packets.samples[packets.start[i]]), int(packets.decoders[packets.start[i]])
        if packets.senders[i] == coding.PFS and receiver == node:
            pfs_reads += 1
            commit(sample, sample_bytes(seed, sample, int(s.sizes[sample])))
        elif packets.senders[i] == node:
            by_receiver.setdefault(receiver, []).append(sample)

    async def ship(receiver: int, samples: list[int]) -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", port + 1 + receiver)
        for sample in samples:
            writer.write(_FRAME.pack(sample, len(cache[sample])) + cache[sample])
            stats["payload_bytes_sent"] += _FRAME.size + len(cache[sample])
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    await asyncio.gather(*(ship(r, samples) for r, samples in by_receiver.items()), arrived.wait())
    received_all, cpu_s = time.time(), time.process_time() - cpu_started
    (rundir / f"done.{node}").touch()
    while len(list(rundir.glob("done.*"))) < nodes:
        await asyncio.sleep(POLL_SECONDS)
    server.close()
    return NodeResult(
        node,
        len(lacked),
        len(committed),
        failures,
        pfs_reads,
        _digest(owned.tolist(), cache),
        _digest(owned.tolist(), {i: sample_bytes(seed, i, int(s.sizes[i])) for i in owned.tolist()}),
        started,
        received_all,
        time.time(),
        stats,
        cpu_s,
        sum(len(v) for v in committed.values()),
    )


async def _frame(reader: asyncio.StreamReader) -> tuple[int, int] | None:
    """The next frame's (sample, length), None at the end of the stream."""
    try:
        sample, length = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    except asyncio.IncompleteReadError:
        return None
    return int(sample), int(length)


async def _main(args: argparse.Namespace) -> None:
    s = setup(args.nodes, args.samples, args.mean_bytes, args.spares, args.scheme, args.seed, args.pool)
    if args.tcp:
        result = await run_node_tcp(args.node, s, args.seed, args.port, args.rundir, args.nodes)
    else:
        channel = Channel(args.group, args.port, pool=args.pool)
        endpoint = MulticastEndpoint(
            args.node,
            channel,
            token=args.token,
            payload_bytes=args.payload_bytes,
            window_bytes=args.window_bytes,
            rate=args.rate,
            pass_id=args.pass_id,
        )
        async with endpoint:
            result = await run_node(args.node, s, args.seed, endpoint, args.rundir, args.nodes)
    planned = coding.load(s.packets, s.sizes)
    document = {**asdict(result), "planned_bytes": planned.bytes, "planned_transmissions": planned.transmissions}
    (args.rundir / f"result.{args.node}.json").write_text(json.dumps(document))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--mean-bytes", type=int, default=4096)
    parser.add_argument("--spares", type=int, default=100, help="random extra samples each cache holds")
    parser.add_argument("--scheme", choices=sorted(coding.SCHEMES), default="uber")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--group", default="239.255.16.1")
    parser.add_argument("--port", type=int, default=47016)
    parser.add_argument(
        "--pool", type=int, default=MULTICAST_POOL, help="multicast addresses, --group's and those after it"
    )
    parser.add_argument("--token", default="")
    parser.add_argument(
        "--pass-id",
        type=int,
        default=1,
        help="the pass's id, the same at every node (with the token it keys the datagrams)",
    )
    parser.add_argument("--payload-bytes", type=int, default=1400)
    parser.add_argument("--window-bytes", type=int, default=256 << 10)
    parser.add_argument("--rate", type=float, default=None, help="bytes/s each node multicasts at most")
    parser.add_argument(
        "--tcp",
        action="store_true",
        help="the uncoded plan (--scheme none) over a TCP stream per "
        "receiver, as jobs exchange without coding; node n listens on --port + 1 + n",
    )
    parser.add_argument("--rundir", type=Path, required=True)
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
