"""TensorFlow: a rank's epochs as a ``tf.data.Dataset``, through
``tf.data.Dataset.from_generator``.

The generator is plain Python (:func:`sample_generator`), so it is tested and
usable without TensorFlow; :func:`tf_dataset` imports TensorFlow only when
called. tf.data runs the generator in the training process; batching,
shuffling buffers and prefetch are tf.data's own, after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from dataquay.client.dataset import ITER_BATCH, Dataset
from dataquay.client.loading import SampleReader
from dataquay.client.sampler import Sampler


def sample_generator(
    dataset: Dataset,
    sampler: Sampler,
    *,
    decode: str | Callable[[bytes], Any] | None = None,
    with_labels: bool = False,
    on_error: str = "raise",
    retries: int = 2,
    read_batch: int = ITER_BATCH,
) -> Callable[[], Iterator[Any]]:
    """A generator function for ``from_generator``: each call yields the
    sampler's current epoch, from its cursor, one decoded sample at a time.

    Ids are read ``read_batch`` at a time (one request for the misses of
    each). The sampler's position moves with the ids handed out, so
    ``sampler.state_dict(consumed=...)`` with the samples trained on resumes
    exactly (tf.data's prefetch takes samples ahead of training); call
    ``sampler.set_epoch`` before each epoch.

    Args: as :class:`~dataquay.client.loading.SampleReader`.
    """
    reader = SampleReader(dataset, decode, with_labels=with_labels, on_error=on_error, retries=retries)
    if read_batch < 1:
        raise ValueError(f"read_batch must be at least 1, not {read_batch}")

    def samples() -> Iterator[Any]:
        ids = sampler.remaining()
        for start in range(0, len(ids), read_batch):
            chunk = ids[start : start + read_batch]
            done = sampler.position
            for count, sample in enumerate(reader.read(chunk), 1):
                # Counted as handed out before the yield, as Sampler's iteration does;
                # a sample skipped is counted with the next one (read and skipped again on resume).
                sampler.position = done + count
                yield sample
            sampler.position = done + len(chunk)
        sampler.position = 0

    return samples


def tf_dataset(dataset: Dataset, sampler: Sampler, output_signature: Any, **options: Any) -> Any:
    """``tf.data.Dataset.from_generator`` over :func:`sample_generator`.

    ``output_signature`` is TensorFlow's (``tf.TensorSpec(shape=(), dtype=tf.string)``
    for raw bytes); ``options`` go to :func:`sample_generator`.

    Raises:
        ImportError: TensorFlow is not installed.
    """
    try:
        import tensorflow as tf
    except ImportError as exc:
        raise ImportError("dataquay.client.tf.tf_dataset needs TensorFlow: pip install tensorflow-cpu") from exc
    return tf.data.Dataset.from_generator(
        sample_generator(dataset, sampler, **options), output_signature=output_signature
    )
