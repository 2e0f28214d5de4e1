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

PyTorch adapters live in :mod:`dataquay.client.torch` (optional).
"""

from dataquay.client.client import Client, ClientStats, connect
from dataquay.client.dataset import Dataset
from dataquay.client.errors import (
    CorruptValueError,
    DaemonUnavailableError,
    DataquayError,
    ManifestError,
    PfsReadError,
    SampleIdError,
    UnknownDatasetError,
)
from dataquay.client.sampler import Sampler

__all__ = [
    "Client",
    "ClientStats",
    "CorruptValueError",
    "DaemonUnavailableError",
    "DataquayError",
    "Dataset",
    "ManifestError",
    "PfsReadError",
    "SampleIdError",
    "Sampler",
    "UnknownDatasetError",
    "connect",
]
