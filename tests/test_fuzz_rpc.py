"""Random and malformed requests against every RPC of real daemons and a real
directory: each call must end with a status a caller can act on (never
UNKNOWN or INTERNAL, which mean an unhandled exception), the server must keep
serving the right bytes, and its memory must stay bounded."""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc, directory_pb2_grpc
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess, ServerProcess
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

NUM_SAMPLES = 24
SIZES = (64, 700, 3000)
MAX_BATCH = 64
#: A call that takes longer than this is a hang.
CALL_SECONDS = 20.0
#: Growth of a server's resident memory over one fuzzing test that counts as a leak.
RSS_GROWTH_BYTES = 64 << 20
#: The largest UDP payload there is: longer garbage is cut to it.
MAX_DATAGRAM = 65_507

#: Every status a well-formed refusal may carry; UNKNOWN, INTERNAL and
#: DEADLINE_EXCEEDED (a hang) are not among them.
ACCEPTED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)

FUZZ = settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@dataclass(frozen=True)
class Method:
    path: str
    request: type[Message]
    streams_in: bool
    streams_out: bool


def methods(module: object, service: str) -> dict[str, Method]:
    """Every method of ``service`` as its descriptor declares it."""
    descriptor = module.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
    return {
        m.name: Method(
            f"/{descriptor.full_name}/{m.name}", m.input_type._concrete_class, m.client_streaming, m.server_streaming
        )
        for m in descriptor.methods
    }


CACHE = methods(pb, "Cache")
DIRECTORY = methods(dpb, "Directory")


def call(channel: grpc.Channel, method: Method, request: bytes | list[bytes]) -> grpc.StatusCode:
    """Sends raw request bytes, so that the server itself parses them; the status the call ends with."""
    kind = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[method.streams_in, method.streams_out]
    stub = kind(method.path, request_serializer=None, response_deserializer=None)
    sent = iter(request) if method.streams_in else request
    try:
        answer = stub(sent, timeout=CALL_SECONDS)
        if method.streams_out:
            list(answer)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def serialized(request: Message | list[Message]) -> bytes | list[bytes]:
    if isinstance(request, list):
        return [m.SerializeToString() for m in request]
    return request.SerializeToString()


def rss_bytes(server: ServerProcess) -> int:
    """Resident memory of the server's process, from /proc."""
    assert server.process is not None
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc status")


# ------------------------------------------------------------------ strategies

uint64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1]))
uint32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**31, 2**32 - 1]))
odd_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "nope", "../evil", "a/b", ".", "\0", "ds\0", "Δ€😀", " ds", "ds ", "-x", "%s%n"]),
    st.integers(1_000, 200_000).map(lambda n: "x" * n),
)
#: Names that may refer to the datasets and the job the servers serve: the
#: fuzzing must neither drop nor replace these.
dataset_names = st.one_of(st.sampled_from(["ds", "ex"]), odd_text)
free_names = odd_text.filter(lambda name: name not in ("ds", "ex"))
job_ids = st.one_of(st.just("fz"), odd_text)
sample_ids = st.one_of(
    st.lists(st.one_of(st.integers(0, NUM_SAMPLES + 2), uint64), max_size=20),
    st.integers(MAX_BATCH - 1, MAX_BATCH + 1).map(lambda n: list(range(n))),
    st.integers(0, 200_000).map(lambda n: list(range(n))),
)
job_specs = st.builds(
    jpb.JobSpec,
    job_id=job_ids,
    dataset=dataset_names,
    mode=st.one_of(st.sampled_from(["global", "partial", "local", "locality", ""]), st.text(max_size=12)),
    q=st.floats(allow_nan=True, allow_infinity=True),
    seed=uint64,
    drop_last=st.booleans(),
    nodes=st.lists(odd_text, max_size=4),
    ranks_per_node=uint32,
    partition=st.one_of(st.sampled_from(["sample", "shard"]), st.text(max_size=8)),
    batch_size=uint32,
)


@st.composite
def roots(draw: st.DrawFn, real_root: Path) -> str:
    """Dataset roots: the real one, a file, missing and odd paths; never a
    directory a walk would take long over ("/", the working directory)."""
    return draw(
        st.one_of(
            st.just(str(real_root)),
            st.just(str(next(real_root.rglob("*.bin")))),
            st.sampled_from(["", "\0", f"{real_root}\0x", "relative/missing", "/nonexistent/root"]),
            st.text(max_size=30).map(lambda t: f"/nonexistent/{t}"),
            st.integers(1_000, 100_000).map(lambda n: "/x" * n),
        )
    )


def shared_methods(real_root: Path) -> list[st.SearchStrategy[tuple[str, Message]]]:
    """(method name, request) for the methods the daemon and the directory both have."""
    return [
        st.tuples(
            st.just("AddDataset"),
            st.builds(
                pb.AddDatasetRequest,
                name=free_names,
                root=roots(real_root),
                format=st.integers(-(2**31), 2**31 - 1),
                replace=st.booleans(),
                tar_member_samples=st.booleans(),
            ),
        ),
        st.tuples(st.just("ListDatasets"), st.just(pb.ListDatasetsRequest())),
        st.tuples(st.just("GetDataset"), st.builds(pb.GetDatasetRequest, name=dataset_names)),
        st.tuples(st.just("GetManifest"), st.builds(pb.GetDatasetRequest, name=dataset_names)),
        st.tuples(st.just("DropDataset"), st.builds(pb.DropDatasetRequest, name=free_names)),
        st.tuples(st.just("JoinJob"), st.builds(jpb.JoinJobRequest, spec=job_specs, must_exist=st.booleans())),
        st.tuples(
            st.just("ReportEpoch"), st.builds(jpb.ReportEpochRequest, job_id=job_ids, epoch=uint64, node=odd_text)
        ),
    ]


def cache_requests(real_root: Path) -> st.SearchStrategy[tuple[str, Message | list[Message]]]:
    """(method name, request) for every Cache method."""
    samples = st.lists(
        st.builds(pb.Sample, id=uint64, data=st.binary(max_size=64), checksum=uint64, value=st.binary(max_size=64)),
        max_size=4,
    )
    offer = st.builds(
        pb.ExchangeOffer,
        job=job_ids,
        dataset=st.one_of(st.just("ex"), dataset_names),
        manifest_id=st.text(max_size=40),
        epoch=st.one_of(st.integers(0, 3), uint64),
        sender=odd_text,
        ids=sample_ids,
    )
    exchange = st.tuples(
        st.one_of(st.none(), offer), st.lists(samples.map(lambda s: pb.ExchangeMessage(samples=s)), max_size=3)
    ).map(lambda first_rest: ([pb.ExchangeMessage(offer=first_rest[0])] if first_rest[0] else []) + first_rest[1])
    return st.one_of(
        st.tuples(st.just("Info"), st.just(pb.InfoRequest())),
        st.tuples(
            st.just("Read"),
            st.builds(
                pb.ReadRequest,
                dataset=dataset_names,
                ids=sample_ids,
                shm_name=st.one_of(st.just(""), st.sampled_from(["dataquay-1-x", "../../etc/passwd"]), odd_text),
                shm_size=uint64,
                manifest_id=st.text(max_size=40),
                job=job_ids,
                peer=st.booleans(),
            ),
        ),
        *shared_methods(real_root),
        st.tuples(st.just("Stage"), st.builds(pb.StageRequest, dataset=dataset_names, seed=uint64, job=job_ids)),
        st.tuples(st.just("Stats"), st.just(pb.StatsRequest())),
        st.tuples(
            st.just("ReportClientStats"),
            st.builds(
                pb.ClientStatsReport,
                client=odd_text,
                reads=st.lists(
                    st.builds(pb.ClientReads, tier=st.text(max_size=12), samples=uint64, bytes=uint64), max_size=4
                ),
                data_wait_seconds=st.floats(allow_nan=True, allow_infinity=True),
                read_positions=st.lists(
                    st.builds(pb.RankPosition, job=job_ids, epoch=uint32, rank=uint32, position=uint64), max_size=4
                ),
            ),
        ),
        st.tuples(st.just("Exchange"), exchange),
        st.tuples(
            st.just("CacheBehind"),
            st.builds(
                pb.CacheBehindRequest,
                dataset=dataset_names,
                manifest_id=st.text(max_size=40),
                ids=sample_ids,
                shm_name=st.one_of(st.just(""), st.sampled_from(["dataquay-1-x", "../../etc/passwd"]), odd_text),
                shm_size=uint64,
                handed=st.lists(st.builds(pb.Sample, id=uint64, shm_offset=uint64, length=uint64), max_size=3),
            ),
        ),
        st.tuples(
            st.just("ManageCache"),
            st.builds(
                # Evictions are dry runs: the fuzz's own dataset stays cached for the calls that read it.
                pb.ManageCacheRequest,
                action=st.one_of(st.sampled_from(["ls", "evict", "pin", "unpin"]), odd_text),
                name=st.one_of(dataset_names, odd_text),
                dry_run=st.just(True),
                force=st.booleans(),
            ),
        ),
        st.tuples(
            st.just("PrepSync"),
            st.builds(
                pb.PrepSyncRequest,
                spec=st.builds(
                    pb.PrepGroupSpec,
                    group=st.one_of(st.just("fz"), odd_text),
                    dataset=dataset_names,
                    manifest_id=st.text(max_size=40),
                    jobs=uint32,
                    batch_size=uint32,
                    seed=uint64,
                    num_batches=uint64,
                    memory_bytes=uint64,
                    timeout_seconds=st.floats(allow_nan=True, allow_infinity=True),
                ),
                member=odd_text,
                pid=uint32,
                epoch=uint64,
                consumed=uint64,
                claim=uint32,
                prepped=st.lists(
                    st.builds(
                        pb.PreppedBatch,
                        index=uint64,
                        bytes=uint64,
                        segment=st.one_of(
                            st.sampled_from(["dataquay-prep-1-1-0123456789ab", "../../etc/passwd"]), odd_text
                        ),
                    ),
                    max_size=3,
                ),
                # Calls wait for news at most this long; the fuzz does not wait.
                wait_seconds=st.sampled_from([0.0, -1.0, math.nan, math.inf]),
                leave=st.booleans(),
            ),
        ),
    )


def directory_requests(real_root: Path) -> st.SearchStrategy[tuple[str, Message | list[Message]]]:
    """(method name, request) for every Directory method."""
    node = st.builds(
        jpb.NodeInfo,
        name=odd_text,
        tcp_address=st.one_of(st.sampled_from(["0.0.0.0:1", "[::1]:99999", "host:", ":1"]), odd_text),
        metrics_address=odd_text,
        cache_capacity=uint64,
        pid=uint32,
        version=odd_text,
    )
    return st.one_of(
        st.tuples(st.just("RegisterNode"), st.builds(dpb.RegisterNodeRequest, node=node)),
        st.tuples(
            st.just("Heartbeat"),
            st.builds(dpb.HeartbeatRequest, name=odd_text, cache_used_bytes=uint64, cache_entries=uint64),
        ),
        st.tuples(st.just("ListNodes"), st.just(dpb.ListNodesRequest())),
        *shared_methods(real_root),
        st.tuples(st.just("GetJob"), st.builds(jpb.GetJobRequest, job_id=job_ids)),
        st.tuples(st.just("ListJobs"), st.just(jpb.ListJobsRequest())),
        st.tuples(
            st.just("DropJob"),
            st.builds(
                jpb.DropJobRequest,
                job_id=job_ids.filter(lambda j: j != "fz"),
                min_idle_seconds=st.floats(allow_nan=True, allow_infinity=True),
            ),
        ),
    )


@st.composite
def garbage(draw: st.DrawFn, valid: st.SearchStrategy[tuple[str, Message | list[Message]]]) -> tuple[str, bytes]:
    """(method name, bytes): random bytes, or a valid request truncated or with bits flipped."""
    name, request = draw(valid)
    first = request[0] if isinstance(request, list) and request else request
    raw = first.SerializeToString() if isinstance(first, Message) else b""
    how = draw(st.sampled_from(["random", "truncated", "flipped"]))
    if how == "random" or not raw:
        return name, draw(st.binary(min_size=1, max_size=300))
    if how == "truncated":
        return name, raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    flipped = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        flipped[draw(st.integers(0, len(raw) - 1))] ^= 1 << draw(st.integers(0, 7))
    return name, bytes(flipped)


# ------------------------------------------------------------------- servers


@dataclass
class Servers:
    """A standalone daemon, a daemon in a cluster (its directory, a job "fz"),
    and a directory of its own, all serving dataset "ds" (and "ex", the
    target of exchange offers) from ``root``."""

    root: Path
    standalone: DaemonProcess
    clustered: DaemonProcess
    cluster_directory: DirectoryProcess
    directory: DirectoryProcess
    manifest: bytes


def cache_channel(daemon: DaemonProcess) -> grpc.Channel:
    return grpc.insecure_channel(grpc_target(daemon.address), options=channel_options())


def directory_channel(directory: DirectoryProcess) -> grpc.Channel:
    return grpc.insecure_channel(directory.address, options=channel_options())


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    base = tmp_path_factory.mktemp("fuzz")
    root = make_files_dataset(base / "pfs", NUM_SAMPLES, sizes=SIZES, classes=3)
    started: list[ServerProcess] = []
    try:
        cluster_directory = DirectoryProcess(base / "cluster-directory").start()
        started.append(cluster_directory)
        directory = DirectoryProcess(base / "directory").start()
        started.append(directory)
        standalone = DaemonProcess(base / "standalone", ("--max-batch", str(MAX_BATCH))).start()
        started.append(standalone)
        clustered = DaemonProcess(
            base / "clustered",
            ("--max-batch", str(MAX_BATCH), "--node-name", "fz-node", "--directory", cluster_directory.address),
        ).start()
        started.append(clustered)
        for daemon in (standalone, clustered):
            with cache_channel(daemon) as channel:
                stub = cache_pb2_grpc.CacheStub(channel)
                for name in ("ds", "ex"):
                    stub.AddDataset(pb.AddDatasetRequest(name=name, root=str(root)))
                    list(stub.Stage(pb.StageRequest(dataset=name)))
                if daemon is clustered:
                    stub.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id="fz", dataset="ds", nodes=["fz-node"])))
        with directory_channel(directory) as channel:
            stub = directory_pb2_grpc.DirectoryStub(channel)
            stub.AddDataset(pb.AddDatasetRequest(name="ds", root=str(root)))
            manifest = b"".join(c.data for c in stub.GetManifest(pb.GetDatasetRequest(name="ds")))
        yield Servers(root, standalone, clustered, cluster_directory, directory, manifest)
    finally:
        for server in reversed(started):
            server.kill()


def expected(sample_id: int) -> bytes:
    return sample_bytes(0, sample_id, SIZES[sample_id % len(SIZES)])


def assert_daemon_serves(channel: grpc.Channel) -> None:
    """Info, Stats and a read of known samples still work, with the right bytes."""
    stub = cache_pb2_grpc.CacheStub(channel)
    assert stub.Info(pb.InfoRequest(), timeout=CALL_SECONDS).max_batch == MAX_BATCH
    stub.Stats(pb.StatsRequest(), timeout=CALL_SECONDS)
    ids = [0, 5, NUM_SAMPLES - 1]
    got = [s for chunk in stub.Read(pb.ReadRequest(dataset="ds", ids=ids), timeout=CALL_SECONDS) for s in chunk.samples]
    assert [s.data for s in got] == [expected(i) for i in ids]
    assert all(s.checksum == checksum(s.data) for s in got)


def assert_directory_serves(channel: grpc.Channel, manifest: bytes) -> None:
    """The directory lists and serves the known dataset's manifest unchanged."""
    stub = directory_pb2_grpc.DirectoryStub(channel)
    stub.ListNodes(dpb.ListNodesRequest(), timeout=CALL_SECONDS)
    assert "ds" in [d.name for d in stub.ListDatasets(pb.ListDatasetsRequest(), timeout=CALL_SECONDS).datasets]
    got = b"".join(c.data for c in stub.GetManifest(pb.GetDatasetRequest(name="ds"), timeout=CALL_SECONDS))
    assert got == manifest


# --------------------------------------------------------------------- tests


@pytest.mark.parametrize("which", ["standalone", "clustered"])
def test_random_cache_requests_get_a_clear_status_and_the_daemon_keeps_serving(servers: Servers, which: str) -> None:
    daemon: DaemonProcess = getattr(servers, which)
    with cache_channel(daemon) as channel:
        assert_daemon_serves(channel)
        before = rss_bytes(daemon)

        @FUZZ
        @given(cache_requests(servers.root))
        def fuzz(named: tuple[str, Message | list[Message]]) -> None:
            name, request = named
            status = call(channel, CACHE[name], serialized(request))
            assert status in ACCEPTED, f"{name} answered {status}"
            assert_daemon_serves(channel)

        fuzz()
        assert rss_bytes(daemon) - before < RSS_GROWTH_BYTES
    assert daemon.process is not None and daemon.process.poll() is None


@pytest.mark.parametrize("which", ["standalone", "clustered"])
def test_malformed_cache_request_bytes_are_refused_as_invalid(servers: Servers, which: str) -> None:
    daemon: DaemonProcess = getattr(servers, which)
    with cache_channel(daemon) as channel:

        @FUZZ
        @given(garbage(cache_requests(servers.root)))
        def fuzz(named: tuple[str, bytes]) -> None:
            name, raw = named
            method = CACHE[name]
            status = call(channel, method, [raw] if method.streams_in else raw)
            assert status in ACCEPTED, f"{name} answered {status} to {raw[:40]!r}"
            assert_daemon_serves(channel)

        fuzz()


def test_bytes_that_are_no_request_get_invalid_argument_naming_the_message(servers: Servers) -> None:
    with cache_channel(servers.clustered) as channel:
        for method in CACHE.values():
            request = [b"\xff"] if method.streams_in else b"\xff"
            stub = {
                (False, False): channel.unary_unary,
                (False, True): channel.unary_stream,
                (True, False): channel.stream_unary,
                (True, True): channel.stream_stream,
            }[method.streams_in, method.streams_out](method.path, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:
                answer = stub(iter(request) if method.streams_in else request, timeout=CALL_SECONDS)
                if method.streams_out:
                    list(answer)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method.path
            assert f"malformed request: Error parsing message with type '{method.request.DESCRIPTOR.full_name}'" in (
                err.value.details()
            )


def test_sample_ids_beyond_int64_are_out_of_range_not_an_overflow(servers: Servers) -> None:
    with cache_channel(servers.standalone) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Read(pb.ReadRequest(dataset="ds", ids=[1, 2**64 - 1])))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sample id {2**64 - 1} out of range for dataset 'ds' (N={NUM_SAMPLES})" in err.value.details()


def test_client_reports_at_the_counters_limits_keep_stats_answering(servers: Servers) -> None:
    with cache_channel(servers.standalone) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportClientStats(pb.ClientStatsReport(client="c", data_wait_seconds=float("inf")))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "data_wait_seconds inf is not a finite number of seconds" in err.value.details()
        for client in ("a", "b"):
            reads = [pb.ClientReads(tier="local", samples=2**64 - 1, bytes=2**64 - 1)]
            stub.ReportClientStats(pb.ClientStatsReport(client=client, reads=reads))
        stats = stub.Stats(pb.StatsRequest())
        assert math.isfinite(stats.client_data_wait_seconds)
        assert {r.tier: r.samples for r in stats.client_reads}["local"] == 2**64 - 1


@pytest.mark.parametrize(
    ("root", "message"),
    [("", "no dataset root given"), ("/tmp/x\0y", "dataset root '/tmp/x\\x00y' contains a NUL character")],
)
def test_an_empty_or_nul_dataset_root_is_refused(servers: Servers, root: str, message: str) -> None:
    with cache_channel(servers.standalone) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.AddDataset(pb.AddDatasetRequest(name="rooted", root=root))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in err.value.details()


def test_random_directory_requests_get_a_clear_status_and_it_keeps_serving(servers: Servers) -> None:
    with directory_channel(servers.directory) as channel:
        assert_directory_serves(channel, servers.manifest)
        before = rss_bytes(servers.directory)

        @FUZZ
        @given(directory_requests(servers.root))
        def fuzz(named: tuple[str, Message | list[Message]]) -> None:
            name, request = named
            status = call(channel, DIRECTORY[name], serialized(request))
            assert status in ACCEPTED, f"{name} answered {status}"
            assert_directory_serves(channel, servers.manifest)

        fuzz()
        assert rss_bytes(servers.directory) - before < RSS_GROWTH_BYTES


def test_malformed_directory_request_bytes_and_datagrams_are_refused(servers: Servers) -> None:
    port = int(servers.directory.address.rpartition(":")[2])
    with directory_channel(servers.directory) as channel, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:

        @FUZZ
        @given(garbage(directory_requests(servers.root)))
        def fuzz(named: tuple[str, bytes]) -> None:
            name, raw = named
            status = call(channel, DIRECTORY[name], raw)
            assert status in ACCEPTED, f"{name} answered {status} to {raw[:40]!r}"
            udp.sendto(raw[:MAX_DATAGRAM], ("127.0.0.1", port))
            assert_directory_serves(channel, servers.manifest)

        fuzz()
