"""The gRPC face of the directory: parse, call a plain handler, map errors to codes.

Only this module knows gRPC status codes and message types; the server and
the state machine speak in dataclasses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import TYPE_CHECKING
from urllib.parse import unquote

import grpc

from dataquay.client.job_settings import JobSettings, named_settings
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.directory.records import Job, JoinRequest, NodeInfo
from dataquay.server.directory.state import identity_of
from dataquay.server.proto_maps import FORMAT_FROM_PROTO, dataset_info
from dataquay.server.servicer_errors import status_on_error

if TYPE_CHECKING:
    from dataquay.server.directory.server import DirectoryServer

#: Hosts a daemon may bind to that no other machine can connect to.
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")

#: Manifest bytes per streamed message.
MANIFEST_CHUNK_BYTES = 4 << 20


class DirectoryServicer(directory_pb2_grpc.DirectoryServicer):
    """dataquay.v1.Directory over one :class:`DirectoryServer`."""

    def __init__(self, server: DirectoryServer) -> None:
        self.server = server

    # ---------------------------------------------------------------- nodes

    async def RegisterNode(
        self, request: dpb.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> dpb.RegisterNodeReply:
        n, peer = request.node, context.peer()
        info = NodeInfo(
            name=n.name,
            tcp_address=reachable(n.tcp_address, peer),
            metrics_address=reachable(n.metrics_address, peer) if n.metrics_address else "",
            cache_capacity=n.cache_capacity,
            pid=n.pid,
            version=n.version,
            bulk_address=reachable(n.bulk_address, peer) if n.bulk_address else "",
        )
        async with status_on_error(context):
            session = await self.server.register_node(info, identity_of(request.identity_key))
        config = self.server.config
        return dpb.RegisterNodeReply(
            lease_seconds=config.lease_seconds,
            heartbeat_seconds=config.heartbeat_seconds,
            versions=self.server.versions_proto(),
            session=session,
        )

    async def Heartbeat(self, request: dpb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> dpb.HeartbeatReply:
        return self.server.heartbeat_reply(request)

    async def ListNodes(self, request: dpb.ListNodesRequest, context: grpc.aio.ServicerContext) -> bytes:
        """A ListNodesReply, encoded (see :mod:`.listing`)."""
        return self.server.list_nodes(request.since_version)

    # ------------------------------------------------------------- datasets

    async def AddDataset(self, request: pb.AddDatasetRequest, context: grpc.aio.ServicerContext) -> pb.DatasetInfo:
        fmt = FORMAT_FROM_PROTO.get(request.format)
        async with status_on_error(context):
            entry = await self.server.add_dataset(
                request.name, request.root, fmt, request.replace, not request.tar_member_samples
            )
        return dataset_info(entry)

    async def ListDatasets(
        self, request: pb.ListDatasetsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListDatasetsReply:
        registry = self.server.registry
        return pb.ListDatasetsReply(datasets=[dataset_info(registry.get(n)) for n in registry.names()])

    async def GetDataset(self, request: pb.GetDatasetRequest, context: grpc.aio.ServicerContext) -> pb.DatasetInfo:
        async with status_on_error(context):
            entry = self.server.registry.get(request.name)
        return dataset_info(entry)

    async def GetManifest(
        self, request: pb.GetDatasetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ManifestChunk]:
        async with status_on_error(context):
            data = self.server.registry.get(request.name).manifest.data
        for start in range(0, len(data), MANIFEST_CHUNK_BYTES):
            yield pb.ManifestChunk(data=bytes(data[start : start + MANIFEST_CHUNK_BYTES]))

    async def DropDataset(
        self, request: pb.DropDatasetRequest, context: grpc.aio.ServicerContext
    ) -> pb.DropDatasetReply:
        async with status_on_error(context):
            await self.server.drop_dataset(request.name)
        return pb.DropDatasetReply(freed_samples=0)

    # ----------------------------------------------------------------- jobs

    async def JoinJob(self, request: jpb.JoinJobRequest, context: grpc.aio.ServicerContext) -> jpb.Job:
        async with status_on_error(context):
            job = await self.server.join_job(join_request(request))
        return job_proto(job)

    async def GetJob(self, request: jpb.GetJobRequest, context: grpc.aio.ServicerContext) -> jpb.Job:
        async with status_on_error(context):
            job = self.server.state.get_job(request.job_id)
        return job_proto(job)

    async def ListJobs(self, request: jpb.ListJobsRequest, context: grpc.aio.ServicerContext) -> jpb.ListJobsReply:
        return jpb.ListJobsReply(jobs=[job_proto(j) for j in self.server.state.jobs()])

    async def DropJob(self, request: jpb.DropJobRequest, context: grpc.aio.ServicerContext) -> jpb.DropJobReply:
        async with status_on_error(context):
            await self.server.drop_job(request.job_id, request.min_idle_seconds)
        return jpb.DropJobReply()

    async def ReportEpoch(self, request: jpb.ReportEpochRequest, context: grpc.aio.ServicerContext) -> jpb.Job:
        async with status_on_error(context):
            job = await self.server.report_epoch(request.job_id, request.epoch, request.node, request.lost_nodes)
        return job_proto(job)


def reachable(address: str, peer: str) -> str:
    """``address`` with a wildcard host (``0.0.0.0:9470``) replaced by the IP the
    call came from, so that peers and Prometheus get an address they can use.

    ``peer`` is gRPC's ``ipv4:10.0.0.7:51234`` or ``ipv6:[fe80::1]:51234``
    (percent-encoded by some gRPC versions); other callers leave it unchanged.
    """
    host, sep, port = address.rpartition(":")
    kind, _, where = unquote(peer).partition(":")
    if not sep or host not in _WILDCARD_HOSTS or kind not in ("ipv4", "ipv6"):
        return address
    return f"{where.rpartition(':')[0]}:{port}"


def join_request(request: jpb.JoinJobRequest) -> JoinRequest:
    """The settings the caller named; proto3 ``optional`` tells unset from zero."""
    spec = request.spec
    return JoinRequest(JobSettings.from_proto(spec), named_settings(spec), request.must_exist)


def job_proto(job: Job) -> jpb.Job:
    return jpb.Job(
        spec=job.spec.to_proto(),
        manifest_id=job.manifest_id,
        num_samples=job.num_samples,
        epoch=job.epoch,
        created_unix=job.created,
        started=job.started,
        last_active_unix=job.last_active,
        absences=[jpb.NodeAbsence(**asdict(a)) for a in job.absences],
    )
