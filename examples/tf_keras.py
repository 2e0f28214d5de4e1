"""Training in TensorFlow on a dataquay dataset, through tf.data.

tf.data reads this rank's share of each epoch through the node's daemon.
One process per rank, as srun or a launcher starts them (RANK and
WORLD_SIZE, or SLURM_PROCID and SLURM_NTASKS, say which):

    RANK=0 WORLD_SIZE=1 python examples/tf_keras.py imgs --epochs 2

Prints one JSON line per epoch (the loss, and how often this rank saw each
class) and where its samples were read from.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import tensorflow as tf

import dataquay.client as dq
from dataquay.client.tf import tf_dataset

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

    client = dq.connect()
    ds = client.dataset(args.dataset)
    sampler = ds.sampler(seed=42)  # this rank's share of each epoch
    signature = (tf.TensorSpec((FEATURES,), tf.float32), tf.TensorSpec((), tf.int64))
    data = tf_dataset(ds, sampler, signature, decode=features, with_labels=True)
    data = data.batch(args.batch_size).prefetch(2)
    classes = len(ds.classes)
    model = tf.keras.Sequential([tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(classes)])
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        seen = np.zeros(classes, np.int64)
        for x, y in data:
            loss = model.train_on_batch(x, y)
            seen += np.bincount(y.numpy(), minlength=classes)
        print(json.dumps({"epoch": epoch, "loss": float(loss), "seen": seen.tolist()}), flush=True)

    print(json.dumps({"rank": sampler.rank, "samples": client.stats().samples}), flush=True)


if __name__ == "__main__":
    main()
