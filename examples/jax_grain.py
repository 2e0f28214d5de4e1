"""Training in JAX on a dataquay dataset, fed by grain's DataLoader.

grain's worker processes read the samples through the node's daemon, in
the order of this rank's dataquay sampler. One process per rank, as srun or
a launcher starts them (RANK and WORLD_SIZE, or SLURM_PROCID and
SLURM_NTASKS, say which):

    RANK=0 WORLD_SIZE=1 python examples/jax_grain.py --dataset imgs --epochs 2

Prints one JSON line per epoch (the loss, and how often this rank saw each
class) and where its samples were read from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import grain.python as gp
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import dataquay.client as dq
from dataquay.client.grain import GrainSampler, GrainSource

FEATURES = 64
DATASET = flags.DEFINE_string("dataset", None, "a registered dataset", required=True)
EPOCHS = flags.DEFINE_integer("epochs", 2, "epochs to train")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "samples a step of this rank")


def features(data: bytes) -> np.ndarray:
    """Your decoder goes here; this one takes a sample's first 64 bytes as floats."""
    return np.frombuffer(data, np.uint8, count=FEATURES).astype(np.float32) / 255


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    logits = x @ params["w"] + params["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


@jax.jit
def step(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> tuple[dict[str, jax.Array], jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def main(argv: Sequence[str]) -> None:
    client = dq.connect()
    ds = client.dataset(DATASET.value)
    sampler = ds.sampler(seed=42)  # this rank's share of each epoch
    loader = gp.DataLoader(  # records in this rank's order, epoch after epoch
        data_source=GrainSource(ds, decode=features, with_labels=True),
        sampler=GrainSampler(sampler, epochs=EPOCHS.value),
        worker_count=2,
        shard_options=gp.NoSharding(),  # the dataquay sampler already splits over ranks
    )
    classes = len(ds.classes)
    params = {"w": jnp.zeros((FEATURES, classes)), "b": jnp.zeros(classes)}
    batch: list[tuple[np.ndarray, int]] = []
    seen = np.zeros(classes, np.int64)
    for record, (x, y) in enumerate(loader, 1):
        batch.append((x, y))
        epoch_done = record % len(sampler) == 0
        if len(batch) == BATCH_SIZE.value or epoch_done:  # an epoch's last batch may be short
            labels = np.array([y for _, y in batch])
            params, loss = step(params, np.stack([x for x, _ in batch]), labels)
            seen += np.bincount(labels, minlength=classes)
            batch = []
        if epoch_done:
            print(json.dumps({"epoch": record // len(sampler) - 1, "loss": float(loss), "seen": seen.tolist()}))
            seen[:] = 0

    print(json.dumps({"rank": sampler.rank, "samples": client.stats().samples}), flush=True)


if __name__ == "__main__":
    app.run(main)  # grain's workers read absl flags: parsed here
