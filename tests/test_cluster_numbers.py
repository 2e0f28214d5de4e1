"""A cluster's numbers agree: `stage --job` names, node by node, the bytes
each node read from the PFS as that node's ``dataquay_pfs_read_bytes_total``
counts them (a node's share of a tar dataset is read with the headers and
the other nodes' samples between its own); and the cluster's `status --json`
is plain JSON with every key of its documented schema
(docs/reference/status-json.md), typed as documented."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from dataquay.client.connection import DaemonConnection
from dataquay.protos import cache_pb2, jobs_pb2
from dataquay.server.cli import main as cli_main
from dataquay.server.sizes import format_bytes
from dataquay.server.tools.local_cluster import LocalCluster, node_name
from dataquay.server.tools.synthetic import make_tar_dataset

NODES = 2
SAMPLES = 200
DOCS = Path(__file__).resolve().parents[1] / "docs" / "reference" / "status-json.md"

_JSON_TYPES: dict[int, tuple[type, ...]] = {
    FieldDescriptor.CPPTYPE_INT32: (int,),
    FieldDescriptor.CPPTYPE_INT64: (int,),
    FieldDescriptor.CPPTYPE_UINT32: (int,),
    FieldDescriptor.CPPTYPE_UINT64: (int,),
    FieldDescriptor.CPPTYPE_DOUBLE: (float, int),
    FieldDescriptor.CPPTYPE_FLOAT: (float, int),
    FieldDescriptor.CPPTYPE_BOOL: (bool,),
    FieldDescriptor.CPPTYPE_STRING: (str,),
    FieldDescriptor.CPPTYPE_ENUM: (str,),
}


def conforms(value: Any, message: Descriptor, where: str) -> None:
    """Fails unless ``value`` holds exactly ``message``'s keys, each of the documented JSON type."""
    assert isinstance(value, dict), where
    assert set(value) == {f.name for f in message.fields}, where
    documented = DOCS.read_text()
    assert f"### {message.name}\n" in documented, f"{message.name} is not documented"
    for f in message.fields:
        item = value[f.name]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            assert isinstance(item, dict), f"{where}.{f.name}"
            continue
        items = item if f.is_repeated else [item]
        assert isinstance(items, list), f"{where}.{f.name}"
        for one in items:
            if one is None and f.has_presence and f.message_type is None:
                continue
            if f.message_type is not None:
                conforms(one, f.message_type, f"{where}.{f.name}")
            else:
                kinds = _JSON_TYPES[f.cpp_type]
                assert isinstance(one, kinds) and (bool in kinds or not isinstance(one, bool)), f"{where}.{f.name}"
                if f.cpp_type == FieldDescriptor.CPPTYPE_ENUM:
                    assert one == one.lower() and "_" not in one.split("_")[0], f"{where}.{f.name}: {one}"


def dataset_info(address: str) -> cache_pb2.DatasetInfo:
    connection = DaemonConnection(address)
    try:
        request = cache_pb2.GetDatasetRequest(name="shards")
        info: cache_pb2.DatasetInfo = connection.call("GetDataset", lambda stub: stub.GetDataset(request))
        return info
    finally:
        connection.close()


def pfs_read_bytes(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as reply:
        (value,) = re.findall(r"^dataquay_pfs_read_bytes_total (\S+)$", reply.read().decode(), re.M)
    return int(float(value))


def test_stage_job_names_each_nodes_pfs_bytes_as_its_metrics_and_status_json_is_plain(
    cluster: Callable[..., LocalCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = cluster(NODES)
    root = make_tar_dataset(tmp_path / "pfs", SAMPLES, samples_per_shard=50, sizes=(3000, 5000))
    assert cli_main(["dataset", "add", "shards", str(root), "--addr", local.daemons[0].address]) == 0
    capsys.readouterr()
    code = cli_main(
        ["stage", "shards", "--job", "j", "--mode", "global", "--quiet", "--directory", local.directory_address]
    )
    out = capsys.readouterr().out
    assert code == 0, out

    rows = {
        name: (cached, read)
        for name, cached, read in re.findall(r"^(node-\d+)\s+\d+/\d+\s+(\S+ \S+)\s+(\S+ \S+)\s", out, re.M)
    }
    assert len(rows) == NODES, out
    for index, daemon in enumerate(local.daemons):
        read = pfs_read_bytes(daemon.metrics_url)
        assert read > 0 and rows[node_name(index)][1] == format_bytes(read), (index, out)
    total = sum(pfs_read_bytes(d.metrics_url) for d in local.daemons)
    assert f"; {format_bytes(total)} read from the PFS" in out
    # Each node reads its own samples, not the holes between them: the
    # cluster reads the dataset about once, not once per node.
    shards = sum(path.stat().st_size for path in root.rglob("*.tar"))
    assert total <= 1.1 * shards, (total, shards)
    # CACHED is what `dataset show` says each node holds: samples as trainers
    # read them, not their spans in the tar files (headers included).
    held = 0
    for index, daemon in enumerate(local.daemons):
        assert cli_main(["dataset", "show", "shards", "--addr", daemon.address]) == 0
        shown = re.search(r"^cached\s+\d+ samples, (\S+ \S+) \(", capsys.readouterr().out, re.M)
        assert shown and rows[node_name(index)][0] == shown[1], (index, out)
        held += dataset_info(daemon.address).cached_bytes
    assert f"/{SAMPLES} samples cached, {format_bytes(held)};" in out

    assert cli_main(["status", "--json", "--directory", local.directory_address]) == 0
    document = json.loads(capsys.readouterr().out)
    assert set(document) == {"directory", "nodes", "jobs"} and document["directory"] == local.directory_address
    assert len(document["nodes"]) == NODES and len(document["jobs"]) == 1
    for node in document["nodes"]:
        stats = node.pop("stats")
        conforms(node, jobs_pb2.NodeStatus.DESCRIPTOR, "node")
        conforms(stats, cache_pb2.StatsReply.DESCRIPTOR, "stats")
        index = int(node["info"]["name"].removeprefix("node-"))
        assert node["state"] == "up" and stats["pfs_bytes"] == pfs_read_bytes(local.daemons[index].metrics_url)
    (job,) = document["jobs"]
    conforms(job, jobs_pb2.Job.DESCRIPTOR, "job")
    assert job["spec"]["mode"] == "global" and job["num_samples"] == SAMPLES and job["epoch"] == 0
