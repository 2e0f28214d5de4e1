"""The cluster token on every call, signed heartbeats, and TLS on TCP, against
real daemon and directory processes."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import dataquay.client as dq
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.security import Credentials, CredentialsError, read_token
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.auth import NODE_METHODS, new_token_file, sign, verified
from dataquay.server.cli import main as cli_main
from dataquay.server.tools.local_cluster import LocalCluster, TlsFiles
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

SERVICES = [("dataquay.v1.Cache", pb), ("dataquay.v1.Directory", dpb)]
METHODS = [
    (service, method)
    for service, module in SERVICES
    for method in module.DESCRIPTOR.services_by_name[service.rpartition(".")[2]].methods
]


def call(channel: grpc.Channel, service: str, method: object, metadata: tuple[tuple[str, str], ...]) -> None:
    """Calls ``method`` with an empty request, the whole answer read."""
    path = f"/{service}/{method.name}"  # type: ignore[attr-defined]
    message = method.input_type._concrete_class()  # type: ignore[attr-defined]
    codecs = {"request_serializer": type(message).SerializeToString, "response_deserializer": lambda b: b}
    streaming_in, streaming_out = method.client_streaming, method.server_streaming  # type: ignore[attr-defined]
    if streaming_in:
        list(channel.stream_stream(path, **codecs)(iter([message]), metadata=metadata, timeout=10))
    elif streaming_out:
        list(channel.unary_stream(path, **codecs)(message, metadata=metadata, timeout=10))
    else:
        channel.unary_unary(path, **codecs)(message, metadata=metadata, timeout=10)


def test_token_files_are_made_owner_only_and_refused_when_others_can_read_them(tmp_path: Path) -> None:
    path = new_token_file(tmp_path / "sub" / "token")
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(read_token(path)) == 64
    with pytest.raises(CredentialsError, match="exists; pass --force"):
        new_token_file(path)
    before = read_token(path)
    assert read_token(new_token_file(path, force=True)) != before
    os.chmod(path, 0o644)
    with pytest.raises(CredentialsError, match=f"readable by others than its owner; chmod 600 {path}"):
        read_token(path)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    os.chmod(empty, 0o600)
    with pytest.raises(CredentialsError, match="holds no valid token"):
        read_token(empty)
    with pytest.raises(CredentialsError, match="cannot read the token file"):
        read_token(tmp_path / "missing")


def test_heartbeat_signatures_reject_changed_bytes_and_other_tokens() -> None:
    signed = sign("a" * 64, b"beat")
    assert verified("a" * 64, signed) == b"beat"
    assert verified("b" * 64, signed) is None
    assert verified("a" * 64, b"beaT" + signed[4:]) is None
    assert verified("a" * 64, b"beat") is None
    assert sign("", b"beat") == b"beat" and verified("", b"beat") == b"beat"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two daemons and a directory that require a token; shared by this module's tests."""
    base = tmp_path_factory.mktemp("secured")
    with LocalCluster(
        base / "cluster",
        2,
        (),
        ("--lease-seconds", "3", "--heartbeat-seconds", "0.5"),
        token_file=new_token_file(base / "token"),
    ) as local:
        yield local


@pytest.mark.parametrize(("service", "method"), METHODS, ids=[f"{s.rpartition('.')[2]}.{m.name}" for s, m in METHODS])
def test_every_call_without_the_token_is_refused(secured: LocalCluster, service: str, method: object) -> None:
    ready = secured.daemons[0].ready
    assert ready is not None
    address = secured.directory_address if service.endswith("Directory") else str(ready["tcp"])
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        for metadata in ((), (("authorization", "Bearer " + "0" * 64),)):
            with pytest.raises(grpc.RpcError) as refused:
                call(channel, service, method, metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value.details()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    log = (secured.daemons[0].home / "daemon.log").read_text() + (
        secured.base_dir / "directory" / "directory.log"
    ).read_text()
    needed = "node token" if f"/{service}/{method.name}" in NODE_METHODS else "cluster token"  # type: ignore[attr-defined]
    assert f"refused a call without the {needed}" in log
    assert read_token(secured.token_file) not in log  # type: ignore[arg-type]


def test_a_cluster_with_a_token_serves_its_trainers_and_its_peers(
    secured: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_files_dataset(tmp_path / "pfs", 40, sizes=(3000,))
    for name, value in secured.node_env(0).items():
        monkeypatch.setenv(name, value)
    assert cli_main(["dataset", "add", "imgs", str(root)]) == 0
    assert cli_main(["stage", "imgs", "--job", "j", "--ranks-per-node", "1", "--quiet"]) == 0
    with dq.connect() as client:
        ds = client.dataset("imgs")
        ds.sampler(job="j", rank=0, world_size=2)
        assert ds.get_batch(list(range(40))) == [sample_bytes(0, i, 3000) for i in range(40)]
        assert client.stats().samples["peer"] == 20  # half of them from node-1, token and all
    # Signed heartbeats keep both nodes up past the 3 s lease.
    time.sleep(3.5)
    nodes = secured.wait_for_nodes(up=["node-0", "node-1"], timeout=10)
    assert all(n.state == jpb.NODE_UP for n in nodes)

    monkeypatch.delenv("DATAQUAY_TOKEN_FILE")
    capsys.readouterr()
    assert cli_main(["dataset", "ls"]) == 1
    assert "refused the call: this call needs the cluster token (set DATAQUAY_TOKEN_FILE)" in capsys.readouterr().err
    with pytest.raises(dq.DataquayError, match="UNAUTHENTICATED"):
        dq.connect(timeout=5)


def make_certificates(directory: Path) -> TlsFiles:
    """A CA and a certificate it signed for 127.0.0.1, with openssl."""
    directory.mkdir()

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=dataquay test CA",
    )
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=127.0.0.1")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run(
        "x509",
        "-req",
        "-in",
        "node.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "node.pem",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    )
    return TlsFiles(directory / "ca.pem", directory / "node.pem", directory / "node.key")


@pytest.mark.skipif(
    subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
    reason="openssl is not installed: the test makes its certificates with it",
)
def test_a_cluster_with_mutual_tls_works_and_refuses_plaintext(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    pem = make_certificates(tmp_path / "pki")
    local = cluster(2, tls=pem)
    root = make_files_dataset(tmp_path / "pfs", 20, sizes=(2000,))
    with local.credentials().channel(local.daemons[0].address, channel_options()) as channel:
        pb_stub(channel).AddDataset(pb.AddDatasetRequest(name="imgs", root=str(root)), timeout=30)
    ready = local.daemons[1].ready
    assert ready is not None
    credentials = local.credentials()
    with credentials.channel(str(ready["tcp"]), channel_options()) as channel:
        stub = pb_stub(channel)
        samples = [s for c in stub.Read(pb.ReadRequest(dataset="imgs", ids=[0, 1, 2])) for s in c.samples]
        assert [s.data for s in samples] == [sample_bytes(0, i, 2000) for i in range(3)]
    with grpc.insecure_channel(str(ready["tcp"]), options=channel_options()) as plain:
        with pytest.raises(grpc.RpcError) as refused:
            pb_stub(plain).Info(pb.InfoRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    no_client_cert = Credentials.from_files(ca=pem.ca)
    with no_client_cert.channel(str(ready["tcp"]), channel_options()) as anonymous:
        with pytest.raises(grpc.RpcError) as refused:
            pb_stub(anonymous).Info(pb.InfoRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()


def pb_stub(channel: grpc.Channel) -> object:
    from dataquay.protos import cache_pb2_grpc

    return cache_pb2_grpc.CacheStub(channel)
