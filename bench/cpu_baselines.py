"""The raw baselines of bench/cpu_per_gb.py, each run in processes of its own
(this file, as a child): a raw TCP stream between two processes, the same
stream whose receiver also stores into an LMDB opened as a daemon opens its
cache, raw LMDB reads with the client's checksum, and the PFS's files read
and stored into a fresh such LMDB. Each process times
its own CPU around the transfer alone and prints it as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import lmdb
from common import MiB

from dataquay.client.malloc import tune_malloc
from dataquay.client.wire.records import checksum, encode_value, sample_key
from dataquay.server.node.cache.file import CacheFile

BATCH = 64
#: Passes the raw stream + put baseline sends: about what the measured exchanges move, each sample a key of its own.
PUT_PASSES = 4
GB = 1e9


def row(path: str, nbytes: int, spent: dict[str, float], wall: float) -> dict[str, object]:
    total = sum(spent.values())
    out: dict[str, object] = {"path": path, "MB": nbytes / 1e6, "cpu_s": total, "cpu_s_per_GB": total / (nbytes / GB)}
    out |= {f"{role}_s": seconds for role, seconds in spent.items()}
    out["wall_s"] = wall
    return out


def _child(*args: str, prefix: Sequence[str] = ()) -> subprocess.Popen[str]:
    command = [*prefix, sys.executable, str(Path(__file__).resolve()), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def _answer(process: subprocess.Popen[str]) -> dict[str, float]:
    out, _ = process.communicate(timeout=600)
    if process.returncode:
        raise RuntimeError(f"baseline process failed ({process.returncode})")
    return dict(json.loads(out.splitlines()[-1]))


def raw_stream(paths: list[str], home: Path, store: bool = False, prefix: Sequence[str] = ()) -> dict[str, object]:
    """The files' bytes sent from one process to another over loopback TCP;
    each side times its own CPU around the transfer alone. With ``store`` the
    receiver also puts them into an LMDB of its own, a transaction per batch,
    as a daemon commits what an exchange brings it. Both processes start
    under ``prefix`` (``ip netns exec NAME``: the loopback of a namespace)."""
    listing = home / "stream.json"
    listing.write_text(json.dumps(paths))
    into = ["--into", str(home / "stream-lmdb")] if store else []
    receiver = _child("--stream-receive", str(listing), *into, prefix=prefix)
    assert receiver.stdout is not None
    port = receiver.stdout.readline().strip()
    sender = _child("--stream-send", str(listing), port, prefix=prefix)
    sent, got = _answer(sender), _answer(receiver)
    assert got["bytes"] == sent["bytes"], (got, sent)
    nbytes = int(sent["bytes"])
    return row(
        "raw_stream_put" if store else "raw_stream",
        nbytes,
        {"sender": sent["cpu_s"], "receiver": got["cpu_s"]},
        got["wall_s"],
    )


def _stream_receive(listing: str, into: str | None) -> None:
    lengths = [os.path.getsize(p) for p in json.loads(Path(listing).read_text())]
    per_pass = len(lengths) // PUT_PASSES
    cache = _baseline_cache(Path(into), 2 * sum(lengths[:per_pass]) + 64 * MiB) if into else None
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        with conn:
            started, wall = time.process_time(), time.perf_counter()
            received, batch = 0, []
            for index, length in enumerate(lengths):
                buffer = bytearray(length)
                view, got = memoryview(buffer), 0
                while got < length:
                    n = conn.recv_into(view[got:])
                    if not n:
                        raise RuntimeError("the sender closed early")
                    got += n
                received += got
                batch.append((sample_key(index), buffer))
                if cache is not None and (len(batch) == BATCH or index == len(lengths) - 1):
                    with cache.env.begin(write=True) as txn:
                        txn.cursor().putmulti(batch, overwrite=False)
                        # A pass on, what the pass before put goes: later passes write into freed pages.
                        for before in range(index + 1 - len(batch) - per_pass, index + 1 - per_pass):
                            if before >= 0:
                                txn.delete(sample_key(before))
                if len(batch) == BATCH:
                    batch = []
            spent, wall = time.process_time() - started, time.perf_counter() - wall
    if cache is not None:
        cache.close()
    print(json.dumps({"bytes": received, "cpu_s": spent, "wall_s": wall}))


def _baseline_cache(path: Path, capacity: int) -> CacheFile:
    """An LMDB opened as a daemon opens its cache (writemap over a file
    allocated ahead where the file system can; no fsync per commit), its map
    grown to ``capacity`` at once, as a cache that has filled once."""
    path.mkdir()
    cache = CacheFile(path)
    cache.open(capacity)
    asyncio.run(cache.grow(capacity, slack=0, wanted=capacity))
    return cache


def _stream_send(listing: str, port: str) -> None:
    files: dict[str, bytes] = {}
    for path in json.loads(Path(listing).read_text()):
        if path not in files:
            files[path] = Path(path).read_bytes()
    payloads = [files[path] for path in json.loads(Path(listing).read_text())]
    with socket.create_connection(("127.0.0.1", int(port))) as conn:
        started = time.process_time()
        for payload in payloads:
            conn.sendall(payload)
        spent = time.process_time() - started
    print(json.dumps({"bytes": sum(len(p) for p in payloads), "cpu_s": spent}))


def raw_lmdb(cache_dir: Path, db: str, batches: list[list[int]], home: Path) -> dict[str, object]:
    """The values read in ``batches`` from a daemon's LMDB by a plain process
    (each copied out of the map, as py-lmdb's ``get`` does), xxh3 of each."""
    listing = home / "lmdb.json"
    listing.write_text(json.dumps({"path": str(cache_dir), "db": db, "batches": batches}))
    got = _answer(_child("--lmdb-read", str(listing)))
    return row("raw_lmdb", int(got["bytes"]), {"reader": got["cpu_s"]}, got["wall_s"])


def _lmdb_read(listing: str) -> None:
    spec = json.loads(Path(listing).read_text())
    env = lmdb.open(spec["path"], readonly=True, lock=True, max_dbs=8)
    db = env.open_db(spec["db"].encode(), create=False)
    keys = [[sample_key(i) for i in batch] for batch in spec["batches"]]
    started, wall, nbytes = time.process_time(), time.perf_counter(), 0
    for batch in keys:
        with env.begin(db=db) as txn:
            values = [txn.get(k) for k in batch]
        for value in values:
            if value is None:
                raise RuntimeError("a local-hit sample is not in the daemon's LMDB")
            payload = memoryview(value)[8:]  # past the record's header, as the client checks it
            checksum(payload)
            nbytes += len(payload)
    spent, wall = time.process_time() - started, time.perf_counter() - wall
    env.close()
    print(json.dumps({"bytes": nbytes, "cpu_s": spent, "wall_s": wall}))


def raw_pfs_put(paths: list[str], home: Path) -> dict[str, object]:
    """The files of ``paths`` read by a plain process, each framed with its
    xxh3 and put, a batch at a time, into a fresh LMDB opened as a daemon
    opens its cache: what caching a dataset from the PFS must do (its pages
    new to the cache, as staging's and the misses' are)."""
    listing = home / "pfs.json"
    listing.write_text(json.dumps(paths))
    got = _answer(_child("--pfs-put", str(listing), "--into", str(home / "pfs-put")))
    return row("raw_pfs_put", int(got["bytes"]), {"reader": got["cpu_s"]}, got["wall_s"])


def _pfs_put(listing: str, into: str) -> None:
    paths = json.loads(Path(listing).read_text())
    cache = _baseline_cache(Path(into), 2 * sum(os.path.getsize(p) for p in paths) + 64 * MiB)
    started, wall, nbytes = time.process_time(), time.perf_counter(), 0
    for start in range(0, len(paths), BATCH):
        batch = []
        for index in range(start, min(start + BATCH, len(paths))):
            payload = Path(paths[index]).read_bytes()
            nbytes += len(payload)
            batch.append((sample_key(index), encode_value(payload)))
        with cache.env.begin(write=True) as txn:
            txn.cursor().putmulti(batch, overwrite=False)
    spent, wall = time.process_time() - started, time.perf_counter() - wall
    cache.close()
    print(json.dumps({"bytes": nbytes, "cpu_s": spent, "wall_s": wall}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream-receive", nargs=1)
    parser.add_argument("--into")
    parser.add_argument("--stream-send", nargs=2)
    parser.add_argument("--lmdb-read", nargs=1)
    parser.add_argument("--pfs-put", nargs=1)
    args = parser.parse_args()
    tune_malloc()  # as the daemons and the client run
    if args.stream_receive:
        _stream_receive(*args.stream_receive, args.into)
    elif args.stream_send:
        _stream_send(*args.stream_send)
    elif args.lmdb_read:
        _lmdb_read(*args.lmdb_read)
    elif args.pfs_put:
        _pfs_put(*args.pfs_put, args.into)
    else:
        parser.error("name a baseline to run")


if __name__ == "__main__":
    main()
