"""Trainers with PyTorch DataLoader workers, for tests/test_torch.py to run in
a process of their own (:func:`in_a_trainer`): a fresh interpreter that forks
its workers, as a trainer's does, rather than a test worker with the threads
and channels of every test it ran before."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.utils.data

import dataquay.client as dq
from dataquay.client.sampler import Sampler
from dataquay.client.torch import TorchDataset, TorchSampler
from dataquay.server.tools.pids import stat_state

#: Longer than any trainer here takes, shorter than pytest-timeout's limit.
TRAINER_SECONDS = 100


def as_list(batch: list[bytes]) -> list[bytes]:
    return batch


def in_a_trainer(tmp_path: Path, trainer: Callable[..., Any], *args: object) -> Any:
    """What ``trainer(*args)`` returns, run in a trainer process of its own."""
    call, result = tmp_path / "trainer-call.pickle", tmp_path / "trainer-result.pickle"
    call.write_bytes(pickle.dumps((trainer.__name__, args)))
    code = (
        "import pickle, sys, torch_trainers; name, args = pickle.loads(open(sys.argv[1], 'rb').read()); "
        "open(sys.argv[2], 'wb').write(pickle.dumps(getattr(torch_trainers, name)(*args)))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(call), str(result)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TRAINER_SECONDS,
    )
    assert done.returncode == 0, done.stderr
    return pickle.loads(result.read_bytes())


def epochs_read(
    address: str,
    dataset: str,
    epochs: int,
    context: str,
    persistent: bool = False,
    warnings: str | None = None,
    kill_first: int | None = None,
) -> list[list[bytes]]:
    """The samples each epoch of a DataLoader with two workers read, in order.

    ``warnings``: a file the client's warnings go to as they come (the
    workers inherit the handler). ``kill_first``: a daemon's pid, killed once
    the trainer has its dataset and before the epochs.
    """
    if warnings is not None:
        handler = logging.FileHandler(warnings)
        handler.setLevel(logging.WARNING)
        logging.getLogger("dataquay.client").addHandler(handler)
    with dq.connect(address, timeout=5) as client:
        ds = client.dataset(dataset)
        if kill_first is not None:
            _kill(kill_first)
        loader = torch.utils.data.DataLoader(
            TorchDataset(ds),
            batch_size=8,
            num_workers=2,
            multiprocessing_context=context,
            persistent_workers=persistent,
            collate_fn=as_list,
        )
        read = [[sample for batch in loader for sample in batch] for _ in range(epochs)]
        del loader  # persistent workers end with their loader
    return read


def read_ahead_of_the_cursor(samples: int, trained_batches: int) -> tuple[int, list[int], dict[str, Any], list[int]]:
    """A DataLoader whose workers run ahead of a sampler's cursor: the
    cursor's position after ``trained_batches`` batches, those batches'
    samples, the state saved with them as consumed, and the rest of the epoch."""
    sampler = TorchSampler(Sampler(samples, rank=0, world_size=1, seed=3))
    loader = torch.utils.data.DataLoader(
        list(range(samples)),
        batch_size=4,
        sampler=sampler,
        num_workers=2,
        prefetch_factor=2,
        multiprocessing_context="fork",
        collate_fn=as_list,
    )
    batches = iter(loader)
    trained = [i for _ in range(trained_batches) for i in next(batches)]
    position = sampler.sampler.position
    state = sampler.state_dict(consumed=len(trained))
    rest = [i for batch in batches for i in batch]
    return position, trained, state, rest


def _kill(pid: int) -> None:
    """SIGKILL, then wait until the process is gone (a zombie its parent has not reaped counts)."""
    os.kill(pid, signal.SIGKILL)
    while True:
        try:
            state = stat_state(Path(f"/proc/{pid}/stat"))
        except FileNotFoundError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)


def _iterable(ds: dq.Dataset, rank: int, world: int, batch_size: int, **options: Any) -> Any:
    from dataquay.client.torch import IterableDataset

    return IterableDataset(
        ds, batch_size, sampler=ds.sampler(rank=rank, world_size=world, seed=4), collate=None, **options
    )


def iterable_epochs(address: str, dataset: str, world: int, workers: int, batch_size: int) -> list[list[list[Any]]]:
    """Per epoch (two), per rank of ``world``: the batches an IterableDataset
    gave a DataLoader of ``workers`` forked workers, and that rank's sampler
    order (as the last list)."""
    epochs: list[list[list[Any]]] = []
    with dq.connect(address, timeout=5) as client:
        ds = client.dataset(dataset)
        for epoch in range(2):
            ranks = []
            for rank in range(world):
                iterable = _iterable(ds, rank, world, batch_size)
                iterable.set_epoch(epoch)
                loader = torch.utils.data.DataLoader(
                    iterable, batch_size=None, num_workers=workers, multiprocessing_context="fork"
                )
                ranks.append([list(loader), iterable.sampler.indices().tolist()])
            epochs.append(ranks)
    return epochs


def iterable_resumed(
    address: str, dataset: str, workers: int, batch_size: int, trained: int, stateful: bool
) -> tuple[list[Any], list[Any], list[Any]]:
    """Rank 1 of 2, epoch 1: the batches trained before a checkpoint, the rest
    of the epoch's, and the rest a restarted loader yields from the
    checkpoint: through torchdata's StatefulDataLoader, or the dataset's own
    state with a plain DataLoader."""
    loader_class: Any = torch.utils.data.DataLoader
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader_class = StatefulDataLoader
    with dq.connect(address, timeout=5) as client:
        ds = client.dataset(dataset)

        def loader(iterable: Any) -> Any:
            return loader_class(iterable, batch_size=None, num_workers=workers, multiprocessing_context="fork")

        first = _iterable(ds, 1, 2, batch_size)
        first.set_epoch(1)
        running = loader(first)
        batches = iter(running)
        before = [next(batches) for _ in range(trained)]
        state = running.state_dict() if stateful else first.state_dict(consumed=trained * batch_size)
        rest = list(batches)
        del batches, running
        again = _iterable(client.dataset(dataset), 1, 2, batch_size)
        again.set_epoch(1)
        restarted = loader(again)
        if stateful:
            restarted.load_state_dict(state)
        else:
            again.load_state_dict(state)
        return before, rest, list(restarted)


def iterable_stats(
    address: str, dataset: str, workers: int, on_error: str, restore: tuple[str, bytes, int] | None = None
) -> tuple[int, int, int, list[bytes], str | None]:
    """One epoch of an IterableDataset over ``workers`` forked workers: the
    samples, skipped and retried counts the training process's
    ``client.stats()`` shows after it, the samples read, and the error that
    ended it (None). ``restore``: (path, bytes, mtime_ns) written back once
    the stats show a retry."""
    with dq.connect(address, timeout=5) as client:
        ds = client.dataset(dataset)
        iterable = _iterable(ds, 0, 1, 4, on_error=on_error, retries=5)
        loader = torch.utils.data.DataLoader(
            iterable, batch_size=None, num_workers=workers, multiprocessing_context="fork" if workers else None
        )
        if restore is not None:
            threading.Thread(target=_restore_on_retry, args=(client, *restore), daemon=True).start()
        read: list[bytes] = []
        error = None
        try:
            read = [sample for batch in loader for sample in batch]
        except dq.DataquayError as exc:
            error = type(exc).__name__
        stats = client.stats()
        return sum(stats.samples.values()), stats.skipped, stats.retried, read, error


def _restore_on_retry(client: dq.Client, path: str, data: bytes, mtime_ns: int) -> None:
    while not client.stats().retried:
        time.sleep(0.005)
    Path(path).write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))
