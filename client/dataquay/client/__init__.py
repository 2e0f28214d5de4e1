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

PyTorch adapters live in :mod:`dataquay.client.torch` (optional).
"""

from dataquay.client.client import Client, connect
from dataquay.client.dataset import Dataset
from dataquay.client.errors import (
    CorruptValueError,
    DaemonUnavailableError,
    DataquayError,
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
    "CorruptValueError",
    "DaemonUnavailableError",
    "DataquayError",
    "Dataset",
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
