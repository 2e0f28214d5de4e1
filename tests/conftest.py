"""Fixtures: real daemons in child processes, real files as the PFS."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import forked_servers
import grpc
import pytest
from hypothesis import settings

import dataquay.client as dq
from dataquay.client.wire.channels import channel_options
from dataquay.protos import directory_pb2_grpc
from dataquay.server.tools import processes
from dataquay.server.tools.local_cluster import LocalCluster, TlsFiles
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess

#: Directory settings for cluster tests: a dead node is listed down within a second or so.
FAST_LEASES = ("--lease-seconds", "1", "--heartbeat-seconds", "0.2")

# Hypothesis fails an example that takes over 200 ms, and calls the test flaky
# when its replay is quicker: on a loaded machine that is the scheduler, not the code.
settings.register_profile("dataquay", deadline=None)
settings.load_profile("dataquay")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked long go first, so that a run in several workers does not
    end on one of them while the other workers wait."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(autouse=True, scope="session")
def one_blas_thread() -> Iterator[None]:
    """Every process the tests start (trainers, examples, tools) loads numpy
    with one OpenBLAS thread, as dataquay's own commands do: on a small test
    machine a thread per core at each of a thousand processes' start is a
    tenth of the suite's CPU, spent on nothing it tests."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPENBLAS_NUM_THREADS", "1")
        yield


@pytest.fixture(autouse=True, scope="session")
def forked_server_starts() -> Iterator[None]:
    """Servers start forked from one that loaded dataquay once: see forked_servers."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(processes, "launch", forked_servers.launch)
        yield


@pytest.fixture(autouse=True, scope="session")
def dataset_roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Allows every test's temp dirs as dataset roots to the servers that
    tests start themselves (they inherit the environment); the fixtures
    below name their own tmp_path instead."""
    base = tmp_path_factory.getbasetemp()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DATAQUAY_DATASET_ROOTS", str(base))
        patch.setenv("DATAQUAY_DIRECTORY_DATASET_ROOTS", str(base))
        yield base


@pytest.fixture
def client_warnings(tmp_path: Path) -> Iterator[Path]:
    """A file the client's warnings are written through to, at once: forked
    workers (a DataLoader's) inherit the handler, so it holds theirs too."""
    path = tmp_path / "client.log"
    handler = logging.FileHandler(path)
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("dataquay.client")
    logger.addHandler(handler)
    try:
        yield path
    finally:
        logger.removeHandler(handler)
        handler.close()


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Starts daemons under tmp_path; every one is stopped after the test."""
    started: list[DaemonProcess] = []

    def start(*extra_args: str, name: str = "node0") -> DaemonProcess:
        daemon = DaemonProcess(tmp_path / name, tuple(extra_args), dataset_roots=(tmp_path,)).start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.kill()


@pytest.fixture
def daemon(start_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    return start_daemon()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[dq.Client]:
    with dq.connect(daemon.address, timeout=5) as c:
        yield c


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """Starts local clusters (a directory and N daemons) under tmp_path; every
    process of each is stopped after the test."""
    started: list[LocalCluster] = []

    def start(
        nodes: int = 4,
        *,
        daemon_args: tuple[str, ...] = (),
        directory_args: tuple[str, ...] = FAST_LEASES,
        token_file: Path | None = None,
        tls: TlsFiles | None = None,
    ) -> LocalCluster:
        local = LocalCluster(
            tmp_path / f"cluster{len(started)}",
            nodes,
            daemon_args,
            directory_args,
            token_file=token_file,
            tls=tls,
            dataset_roots=(tmp_path,),
        )
        started.append(local)
        return local.start()

    yield start
    for local in started:
        local.down()


@pytest.fixture
def start_directory(tmp_path: Path) -> Iterator[Callable[..., DirectoryProcess]]:
    """Starts directories rooted at tmp_path/directory; all are killed after the test."""
    started: list[DirectoryProcess] = []

    def start(*extra_args: str) -> DirectoryProcess:
        directory = DirectoryProcess(tmp_path / "directory", tuple(extra_args)).start()
        started.append(directory)
        return directory

    yield start
    for directory in started:
        directory.kill()


@pytest.fixture
def directory(start_directory: Callable[..., DirectoryProcess]) -> DirectoryProcess:
    return start_directory()


@pytest.fixture
def stub_for() -> Iterator[Callable[[DirectoryProcess], directory_pb2_grpc.DirectoryStub]]:
    channels: list[grpc.Channel] = []

    def make(directory: DirectoryProcess) -> directory_pb2_grpc.DirectoryStub:
        channels.append(grpc.insecure_channel(directory.address, options=channel_options()))
        return directory_pb2_grpc.DirectoryStub(channels[-1])

    yield make
    for channel in channels:
        channel.close()
