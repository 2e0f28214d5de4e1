"""Data-parallel training with PyTorch DDP on a dataquay dataset.

Each rank reads its share of every epoch through the node's daemon, dealt to
two DataLoader workers by the dataset itself. On CPUs (gloo):

    torchrun --standalone --nproc-per-node 2 examples/torch_ddp.py imgs --epochs 2

DATAQUAY_ADDR names the node's daemon (default: its local socket); torchrun
sets RANK and WORLD_SIZE, which the sampler reads. Rank 0 prints one JSON
line per epoch (the loss, and how often each class was seen across ranks)
and every rank prints where its samples were read from.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import dataquay.client as dq
from dataquay.client.torch import IterableDataset

FEATURES = 64


def features(data: bytes) -> np.ndarray:
    """Your decoder goes here; this one takes a sample's first 64 bytes as floats."""
    return np.frombuffer(data, np.uint8, count=FEATURES).astype(np.float32) / 255


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # "nccl" on GPUs
    client = dq.connect()
    ds = client.dataset(args.dataset)
    train = IterableDataset(ds, args.batch_size, sampler=ds.sampler(seed=42), decode=features, with_labels=True)
    loader = DataLoader(train, batch_size=None, num_workers=2)
    model = DistributedDataParallel(torch.nn.Linear(FEATURES, len(ds.classes)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        seen = torch.zeros(len(ds.classes), dtype=torch.int64)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += torch.bincount(y, minlength=len(ds.classes))
        dist.all_reduce(seen)
        if dist.get_rank() == 0:
            print(json.dumps({"epoch": epoch, "loss": loss.item(), "seen": seen.tolist()}), flush=True)

    print(json.dumps({"rank": dist.get_rank(), "samples": client.stats().samples}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
