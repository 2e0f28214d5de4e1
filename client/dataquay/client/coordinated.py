"""Coordinated prep for the jobs of a sweep on one node (CoorDL's technique).

k jobs training on one dataset each fetch and prep (decode, augment) every
sample: k times the reads and k times the CPU. Here the jobs form a group
through their node's daemon: every epoch's batches come from one seeded order,
each batch is prepped by one member into shared memory, every member consumes
every batch in the same order, and the daemon frees a batch once all have.
With k members each preps about 1/k of the batches::

    loader = ds.coordinated(group="sweep-7", jobs=4, prep=decode, batch_size=256, seed=1)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:
            ...

``prep`` turns one sample's bytes into an array, or a tuple of arrays (image,
label); a batch stacks them. Members join at an epoch boundary: the first
epoch waits for ``jobs`` members (at most ``timeout`` seconds), and one that
comes later preps the running epoch alone and joins the next. A member that
dies, goes silent or stalls for ``timeout`` seconds while others wait on it is
dropped and its batches re-dealt; one that was dropped, or whose daemon stops
answering, preps the rest of the epoch alone: the order is a pure function,
so it yields exactly the batches the group would have.

Prep runs in ``workers`` threads of the loader's own (one by default), next to
the training loop; prep that releases the GIL (numpy, image decoders) runs in
parallel on them, and ``prep`` must then be safe to call from several threads.
A loader belongs to the process that made it: do not share one with
DataLoader workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from dataquay.client import prepped
from dataquay.client.errors import DaemonUnavailableError, DataquayError
from dataquay.client.prep_order import batch_count, batch_ids
from dataquay.client.prepped import Batch, PreppedBatchError
from dataquay.protos import cache_pb2 as pb

if TYPE_CHECKING:
    from dataquay.client.dataset import Dataset

log = logging.getLogger("dataquay.client")

#: Prepped batches a group holds in shared memory at once, by default.
DEFAULT_MEMORY_BYTES = 1 << 30
#: Longest a call to the daemon waits for news (a batch ready, work to do).
WAIT_SECONDS = 0.5
#: Prep threads of one member (the daemon deals a member that many batches at once, at most).
MAX_WORKERS = 16


class CoordinatedLoader:
    """Prepped batches of a dataset, shared with the other members of ``group``;
    make one with :meth:`Dataset.coordinated`.

    Args:
        dataset: the dataset every member reads.
        group: the group's name on this node; members pass the same settings.
        jobs: members the first epoch waits for.
        prep: one sample's bytes -> an array or a tuple of arrays.
        batch_size: samples per batch (the last one of an epoch is shorter
            unless ``drop_last``).
        seed: the shuffle seed.
        drop_last: drop the epoch's last, shorter batch.
        memory_bytes: prepped batches the group holds at once, in bytes.
        timeout: seconds after which a silent or stalled member is dropped,
            and the longest the first epoch waits for ``jobs`` members.
        workers: this member's prep threads (each preps one batch at a time).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        group: str,
        jobs: int,
        prep: Callable[[bytes], Any],
        batch_size: int,
        seed: int = 0,
        drop_last: bool = False,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        timeout: float = 60.0,
        workers: int = 1,
    ) -> None:
        if jobs < 1 or memory_bytes < 1 or not timeout > 0:
            raise ValueError(f"jobs, memory_bytes and timeout must be positive, not {jobs}, {memory_bytes}, {timeout}")
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"workers must be 1 to {MAX_WORKERS}, not {workers}")
        self.dataset = dataset
        self.prep = prep
        self.num_batches = batch_count(len(dataset), batch_size, drop_last)
        if self.num_batches < 1:
            raise ValueError(f"dataset {dataset.name!r} has fewer than one batch of {batch_size}")
        self.spec = pb.PrepGroupSpec(
            group=group,
            dataset=dataset.name,
            manifest_id=dataset.info.manifest_id,
            jobs=jobs,
            batch_size=batch_size,
            seed=seed,
            drop_last=drop_last,
            num_batches=self.num_batches,
            memory_bytes=memory_bytes,
            timeout_seconds=timeout,
        )
        self.member = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.workers = workers
        self.epoch = 0
        #: Batches this member prepped itself and batches it waited for (seconds), since it began.
        self.prepped_here = 0
        self.wait_seconds = 0.0
        self._cond = threading.Condition()
        self._agents: list[threading.Thread] = []
        self._closed = False
        self._running: int | None = None  # the epoch being iterated
        self._last = 0  # the epoch the member is in, or last was
        self._consumed = 0
        self._role: int = pb.PREP_ROLE_UNSPECIFIED
        self._daemon_down = False
        self._handed: list[tuple[int, pb.PreppedBatch]] = []  # (epoch, batch) prepped, not yet handed in
        self._error: BaseException | None = None
        self.members = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration yields (as DistributedSampler's)."""
        if epoch < 0:
            raise ValueError(f"epoch must be at least 0, not {epoch}")
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def batch_ids(self, index: int, epoch: int | None = None) -> Any:
        """The sample ids of batch ``index`` of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        return batch_ids(len(self.dataset), self.spec.batch_size, self.spec.seed, epoch, index)

    def __iter__(self) -> Iterator[Batch]:
        epoch = self.epoch
        with self._cond:
            if self._closed:
                raise DataquayError(f"the loader of prep group {self.spec.group!r} is closed")
            if self._running is not None:
                raise RuntimeError("a coordinated loader yields one epoch at a time")
            self._running, self._last, self._consumed, self._role = epoch, epoch, 0, pb.PREP_ROLE_UNSPECIFIED
            self._cond.notify_all()
        if not self._agents:
            self._agents = [
                threading.Thread(target=self._run_agent, name=f"dataquay-prep-{i}", daemon=True)
                for i in range(self.workers)
            ]
            for agent in self._agents:
                agent.start()
        try:
            for index in range(self.num_batches):
                batch = self._next(epoch, index)
                with self._cond:
                    self._consumed = index + 1
                yield batch
        finally:
            with self._cond:
                self._running = None
                self._consumed = self.num_batches
                self._cond.notify_all()
            with contextlib.suppress(DataquayError):  # the news that it is done; the heartbeat repeats it
                self._call(epoch, self.num_batches, [], 0, 0.0)

    def close(self) -> None:
        """Leaves the group; the loader is unusable after."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._agents:
            for agent in self._agents:
                agent.join()
            with self._cond:
                left = [batch.segment for _, batch in self._handed]
                self._handed = []
            prepped.unlink(left)
            with contextlib.suppress(DataquayError):  # a daemon that is gone drops it anyway
                self._call(self._last, 0, [], 0, 0.0, leave=True)

    def __enter__(self) -> CoordinatedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CoordinatedLoader(group={self.spec.group!r}, dataset={self.dataset.name!r}, member={self.member!r})"

    # ------------------------------------------------------------ internals

    def _next(self, epoch: int, index: int) -> Batch:
        """Batch ``index`` of ``epoch``: from the group's shared memory, or prepped here when alone."""
        started = time.perf_counter()
        try:
            while True:
                with self._cond:
                    if self._error is not None:
                        raise self._error
                    alone = self._role == pb.PREP_SOLO
                if alone:
                    return self._prep(epoch, index)
                reply = self._call(epoch, index, [], 0, WAIT_SECONDS)
                if reply is None or reply.role == pb.PREP_SOLO:
                    self._set_role(epoch, pb.PREP_SOLO)
                    continue
                for ready in reply.ready:
                    if ready.index == index:
                        try:
                            batch = prepped.read(ready.segment)
                        except PreppedBatchError as exc:
                            log.warning("%s; this member preps the rest of epoch %d alone", exc, epoch)
                            self._set_role(epoch, pb.PREP_SOLO)
                            continue
                        # The node's data wait counts it (a read alone counts its own).
                        self.dataset.client.read_stats.waited(time.perf_counter() - started)
                        return batch
        finally:
            self.wait_seconds += time.perf_counter() - started

    def _prep(self, epoch: int, index: int) -> Batch:
        samples = self.dataset.get_batch(self.batch_ids(index, epoch))
        batch = prepped.collate([self.prep(sample) for sample in samples])
        with self._cond:
            self.prepped_here += 1
        return batch

    def _set_role(self, epoch: int, role: int) -> None:
        with self._cond:
            if self._running == epoch:
                self._role = role
                self._cond.notify_all()

    def _call(
        self, epoch: int, consumed: int, handed: list[pb.PreppedBatch], claim: int, wait: float, leave: bool = False
    ) -> pb.PrepSyncReply | None:
        """One PrepSync; None when the daemon does not answer (the member goes on alone)."""
        request = pb.PrepSyncRequest(
            spec=self.spec,
            member=self.member,
            pid=os.getpid(),
            epoch=epoch,
            consumed=consumed,
            prepped=handed,
            claim=claim,
            wait_seconds=wait,
            leave=leave,
        )
        try:
            reply = self.dataset.client.prep_sync(request)
        except DaemonUnavailableError as exc:
            if not self._daemon_down:
                log.warning("prep group %r: %s; preps alone until the daemon answers", self.spec.group, exc)
            self._daemon_down = True
            prepped.unlink([batch.segment for batch in handed])
            return None
        self._daemon_down = False
        prepped.unlink(list(reply.free))
        return reply

    def _run_agent(self) -> None:
        """One prep thread: hands in what was prepped, asks for a batch, preps it;
        the member's heartbeat meanwhile."""
        self.dataset.client.read_stats.reading_ahead()
        heartbeat = min(self.spec.timeout_seconds / 4, 1.0)
        try:
            while True:
                with self._cond:
                    if self._closed:
                        return
                    epoch, running, role = self._last, self._running, self._role
                    handed = [batch for e, batch in self._handed if e == epoch]
                    stale = [batch.segment for e, batch in self._handed if e != epoch]
                    self._handed = []
                    consumed = self._consumed
                prepped.unlink(stale)
                working = running == epoch and role != pb.PREP_SOLO
                if role == pb.PREP_SOLO:
                    epoch, consumed = epoch + 1, 0  # preps this epoch alone: waits for the next one's start
                claim = self.workers if working else 0
                reply = self._call(epoch, consumed, handed, claim, WAIT_SECONDS if working else 0.0)
                if reply is None:
                    self._set_role(epoch, pb.PREP_SOLO)
                    working = False
                else:
                    if epoch == running:
                        self._set_role(epoch, reply.role)
                        self.members = reply.members
                    for index in reply.claims:
                        name, size = prepped.write(self._prep(epoch, index), reply.daemon_pid)
                        with self._cond:
                            self._handed.append((epoch, pb.PreppedBatch(index=index, segment=name, bytes=size)))
                if not working:
                    with self._cond:
                        self._cond.wait(heartbeat)
        except Exception as exc:  # the trainer raises it at its next batch
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            with contextlib.suppress(DataquayError):
                self._call(self._last, 0, [], 0, 0.0, leave=True)
