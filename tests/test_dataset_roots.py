"""The allowed dataset roots: a token holder registers only what the operator allows.

Without the rule, any token holder could register a directory only the
server's user can read (its TLS key's, another user's 0700 home) and read the
files back through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc, directory_pb2_grpc
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess, ServerProcess
from dataquay.server.tools.synthetic import make_files_dataset

#: The stub of each kind of server: both take AddDataset and ListDatasets.
STUBS: dict[type[ServerProcess], Callable[[grpc.Channel], object]] = {
    DaemonProcess: cache_pb2_grpc.CacheStub,
    DirectoryProcess: directory_pb2_grpc.DirectoryStub,
}


@pytest.fixture(params=[DaemonProcess, DirectoryProcess], ids=["daemon", "directory"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ServerProcess, object]]:
    """A daemon or a directory allowed tmp_path/allowed only, and its stub."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    kind: type[ServerProcess] = request.param
    process = kind(tmp_path / "server", dataset_roots=(allowed,)).start()
    channel = grpc.insecure_channel(
        grpc_target(process.address),
        options=channel_options(),  # type: ignore[attr-defined]
    )
    try:
        yield process, STUBS[kind](channel)
    finally:
        channel.close()
        process.kill()


def refusal(stub: object, root: Path) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        stub.AddDataset(pb.AddDatasetRequest(name="x", root=str(root)))  # type: ignore[attr-defined]
    return caught.value


def test_only_roots_under_the_allowed_ones_register(server: tuple[ServerProcess, object], tmp_path: Path) -> None:
    process, stub = server
    allowed = tmp_path / "allowed"
    outside = make_files_dataset(tmp_path / "outside", 4, sizes=(10,))
    inside = make_files_dataset(allowed / "sub", 4, sizes=(10,))
    (allowed / "link").symlink_to(outside, target_is_directory=True)

    for root in (outside, allowed / "link", allowed / ".." / "outside", allowed / "missing" / ".." / ".." / "outside"):
        error = refusal(stub, root)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "is not under an allowed dataset root" in (error.details() or "")
        assert "--dataset-roots" in (error.details() or "")
    assert "does not exist" not in (refusal(stub, tmp_path / "nowhere").details() or "")

    info = stub.AddDataset(pb.AddDatasetRequest(name="sub", root=str(inside)))  # type: ignore[attr-defined]
    assert info.num_samples == 4
    listed = stub.ListDatasets(pb.ListDatasetsRequest()).datasets  # type: ignore[attr-defined]
    assert [d.name for d in listed] == ["sub"]
    assert process.process is not None and process.process.poll() is None


def test_no_roots_refuses_every_registration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATAQUAY_DATASET_ROOTS")
    root = make_files_dataset(tmp_path / "pfs", 4, sizes=(10,))
    daemon = DaemonProcess(tmp_path / "node").start()
    try:
        with grpc.insecure_channel(grpc_target(daemon.address), options=channel_options()) as channel:
            error = refusal(cache_pb2_grpc.CacheStub(channel), root)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "(allowed: none)" in (error.details() or "")
    finally:
        daemon.kill()
