"""What a trainer needs from dataquay: connect, open a dataset, sample ids.

    import dataquay.client as dq

    client = dq.connect()                 # DATAQUAY_ADDR or the default socket
    ds = client.dataset("imagenet")
    sampler = ds.sampler(seed=1)          # RANK / WORLD_SIZE from the environment
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        ids = sampler.indices()
        for start in range(0, len(ids), 256):
            batch = ds.get_batch(ids[start : start + 256])

In a cluster job, every rank names the job (or DATAQUAY_JOB does) and reads
the orders of the job's placement; the rest of the loop is the same::

    sampler = ds.sampler(job="resnet-run-7", mode="global")

The jobs of a hyper-parameter sweep on one node share the fetch and prep of
every batch (:mod:`dataquay.client.coordinated`)::

    loader = ds.coordinated(group="sweep-7", jobs=4, prep=decode, batch_size=256)

PyTorch adapters live in :mod:`dataquay.client.torch` (optional).
"""

from dataquay.client.client import Client, connect
from dataquay.client.coordinated import CoordinatedLoader
from dataquay.client.dataset import Dataset
from dataquay.client.errors import (
    CorruptValueError,
    DaemonUnavailableError,
    DataquayError,
    EpochTooFarError,
    JobMismatchError,
    ManifestError,
    PfsReadError,
    SampleIdError,
    UnknownDatasetError,
    UnknownJobError,
)
from dataquay.client.sampler import JobSampler, Sampler
from dataquay.client.stats import ClientStats

__all__ = [
    "Client",
    "ClientStats",
    "CoordinatedLoader",
    "CorruptValueError",
    "DaemonUnavailableError",
    "DataquayError",
    "Dataset",
    "EpochTooFarError",
    "JobMismatchError",
    "JobSampler",
    "ManifestError",
    "PfsReadError",
    "SampleIdError",
    "Sampler",
    "UnknownDatasetError",
    "UnknownJobError",
    "connect",
]
