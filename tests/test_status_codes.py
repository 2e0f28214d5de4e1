"""The status <-> error table: every error a call can end with comes back as
its own class with its own message, on every hop and over several."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from dataquay.client import connect
from dataquay.client.errors import DataquayError, JobMismatchError, UnknownDatasetError, UnknownJobError
from dataquay.client.jobs import job_spec
from dataquay.client.wire.status_codes import ERROR_CODES, error_from_rpc, status_of
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli.common import open_channel, rpc_errors
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset


class _Status(grpc.RpcError):
    """A failed call as gRPC raises it: a code, details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._code, self._details, self._metadata = code, details, metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


@pytest.mark.parametrize(("kind", "code"), ERROR_CODES, ids=[kind.__name__ for kind, _ in ERROR_CODES])
def test_every_error_of_the_table_comes_back_as_its_class_and_message(
    kind: type[DataquayError], code: grpc.StatusCode
) -> None:
    sent, metadata = status_of(kind("job 'run-1' exists with seed 1; this join asked for 2"))
    assert sent == code
    back = error_from_rpc(_Status(sent, "job 'run-1' exists with seed 1; this join asked for 2", metadata))
    assert type(back) is kind
    assert str(back) == "job 'run-1' exists with seed 1; this join asked for 2"


def test_an_error_outside_the_table_goes_as_its_nearest_listed_base() -> None:
    class LocalOnly(UnknownJobError):
        pass

    code, metadata = status_of(LocalOnly("no job 'x'"))
    assert code == grpc.StatusCode.NOT_FOUND
    assert type(error_from_rpc(_Status(code, "no job 'x'", metadata))) is UnknownJobError


def test_a_status_that_names_no_class_means_what_the_call_expects_else_the_general_class() -> None:
    bare = _Status(grpc.StatusCode.NOT_FOUND, "no job 'x'")
    assert type(error_from_rpc(bare)) is UnknownDatasetError
    assert type(error_from_rpc(bare, {grpc.StatusCode.NOT_FOUND: UnknownJobError})) is UnknownJobError
    assert type(error_from_rpc(_Status(grpc.StatusCode.FAILED_PRECONDITION, "x"))) is DataquayError
    assert error_from_rpc(_Status(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many calls")) is None


def test_the_directorys_errors_reach_clients_through_a_daemon_as_their_own_class(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local = cluster(1)
    address = local.daemons[0].address
    root = make_files_dataset(tmp_path / "pfs", 8, sizes=(100,))
    channel = open_channel(address)
    try:
        stub = cache_pb2_grpc.CacheStub(channel)
        stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(root), format=pb.FORMAT_FILES))
        with connect(address) as client:
            client.join_job(job_spec("run-1", "imgs", seed=1))
            with pytest.raises(JobMismatchError, match="exists with seed 1; this join asked for 2"):
                client.join_job(job_spec("run-1", "imgs", seed=2))
            with pytest.raises(UnknownDatasetError, match="'nope'"):
                client.dataset("nope")

        # NOT_FOUND on the wire, as for an unknown dataset; the class the
        # directory raised comes through the daemon with it.
        missing = jpb.JoinJobRequest(spec=jpb.JobSpec(job_id="run-2"), must_exist=True)
        with pytest.raises(grpc.RpcError) as caught:
            stub.JoinJob(missing)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        relayed = error_from_rpc(caught.value)
        assert type(relayed) is UnknownJobError and "no job 'run-2'" in str(relayed)
        with pytest.raises(UnknownJobError, match="no job 'run-2'"):
            with rpc_errors("daemon", address, "is it running?"):
                stub.JoinJob(missing)
    finally:
        channel.close()
