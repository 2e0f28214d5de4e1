"""A registered dataset as a read-only sequence of samples (bytes).

Reads try the node's LMDB first, in this process and without an RPC; all the
misses of a call then go to the daemon together (split only where a request
would exceed the daemon's batch limit), and the results come back in request
order. Decoding is the caller's business: a sample is the bytes it was on the
PFS.

A dataset bound to a cluster job (by :meth:`Dataset.sampler` with a job) names
the job in its reads, so the daemon sends misses to the samples' owners.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import numpy as np

from dataquay.client import env
from dataquay.client.coordinated import DEFAULT_MEMORY_BYTES, CoordinatedLoader
from dataquay.client.errors import SampleIdError
from dataquay.client.jobs import job_plan, job_spec, join
from dataquay.client.local import Found, SharedLocalCache, sample_keys
from dataquay.client.manifest import Manifest
from dataquay.client.read_ahead import ReadAhead, Upcoming, chunked, join_read_ahead
from dataquay.client.sampler import JobSampler, Sampler
from dataquay.client.stats import EpochWait, ReadStats
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import jobs_pb2 as jpb

if TYPE_CHECKING:
    from dataquay.client.client import Client
    from dataquay.client.remote import RemoteReader

log = logging.getLogger("dataquay.client")

#: Samples fetched per request when iterating over a whole dataset.
ITER_BATCH = 256


class Dataset(Sequence[bytes]):
    """A dataset of ``len(ds)`` samples with ids 0..N-1; open it with
    :meth:`Client.dataset`.

    Indexing follows list semantics (``ds[-1]`` is the last sample, slices
    give lists). Local values are checked against their checksum unless the
    client was made with ``verify=False``; one that fails is read through the
    daemon, which also repairs it.

    Safe to use from several threads, from forked children (DataLoader
    workers) and, pickled, from spawned ones: each process opens its own
    connection and LMDB handle on first use.
    """

    def __init__(
        self,
        client: Client,
        info: pb.DatasetInfo,
        manifest: Manifest,
        *,
        local: SharedLocalCache,
        remote: RemoteReader,
        stats: ReadStats,
    ) -> None:
        self._bind(client, info, manifest, None, local, remote, stats)

    def _bind(
        self,
        client: Client,
        info: pb.DatasetInfo,
        manifest: Manifest,
        job: str | None,
        local: SharedLocalCache,
        remote: RemoteReader,
        stats: ReadStats,
    ) -> None:
        self._client = client
        self._local = local
        self._remote = remote
        self._stats = stats
        self._info = info
        self._manifest = manifest
        self._name = info.name
        self._db = info.cache_db
        self._len = manifest.num_samples
        self._job = job
        #: The next epoch's first batches, read on by the last call of :meth:`batches`.
        self._carried: ReadAhead | None = None
        self._classes: list[str] | None = None
        self._targets: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "client": self._client,
            "info": self._info.SerializeToString(),
            "manifest": bytes(self._manifest.data),
            "job": self._job,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        client: Client = state["client"]
        info = pb.DatasetInfo.FromString(state["info"])
        self._bind(
            client,
            info,
            Manifest(state["manifest"]),
            state["job"],
            client.local_cache,
            client.remote,
            client.read_stats,
        )

    @property
    def name(self) -> str:
        return self._name

    @property
    def info(self) -> pb.DatasetInfo:
        """The daemon's description of the dataset when it was opened."""
        return self._info

    @property
    def manifest(self) -> Manifest:
        """Where every sample lives on the PFS (also what the client falls back to)."""
        return self._manifest

    @property
    def client(self) -> Client:
        return self._client

    @property
    def job(self) -> str | None:
        """The cluster job this dataset reads for (set by :meth:`sampler`), or None."""
        return self._job

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        """One sample by index (negative counts from the end), or a list for a slice.

        Raises:
            SampleIdError: the index is out of range (an IndexError).
        """
        if isinstance(index, slice):
            return self.get_batch(np.arange(*index.indices(self._len)))
        return self._fetch([self._index(index)])[0]

    @overload
    def get_batch(self, ids: Sequence[int] | np.ndarray, *, copy: Literal[True] = True) -> list[bytes]: ...

    @overload
    def get_batch(self, ids: Sequence[int] | np.ndarray, *, copy: Literal[False]) -> list[memoryview]: ...

    @overload
    def get_batch(self, ids: Sequence[int] | np.ndarray, *, copy: bool) -> list[bytes] | list[memoryview]: ...

    def get_batch(self, ids: Sequence[int] | np.ndarray, *, copy: bool = True) -> list[bytes] | list[memoryview]:
        """The samples of ``ids`` (sample ids 0..N-1, repeats allowed), in that order.

        Local hits cost no RPC; every miss goes to the daemon in one Read.

        ``copy=False`` gives read-only memoryviews over the memory each
        sample was read into, for decoders that take a buffer
        (``np.frombuffer``, ``torch.frombuffer``, image libraries). What the
        daemon served through shared memory is then a view into that
        segment, not a copy of it: the segment is used for no other read
        until every view of the batch, and every array made over one, is
        released. Hold them for a step and a loader's read-ahead: each batch
        held keeps its segment (up to DATAQUAY_SHM_BYTES), and while 8 are
        held, further reads copy (views of fresh bytes). Local hits and
        samples that came another way are views of their bytes.

        Raises:
            SampleIdError: an id is outside 0..N-1.
            TypeError: the ids are not integers.
            PfsReadError: a sample could not be read from the PFS.
        """
        if copy:
            return self._fetch(ids)
        return [value if isinstance(value, memoryview) else memoryview(value) for value in self._fetch(ids, copy=False)]

    @contextmanager
    def views(self, ids: Sequence[int] | np.ndarray) -> Iterator[list[memoryview]]:
        """Like :meth:`get_batch`, but local hits are views into the cache, not copies.

        For decoders that read from a buffer (``np.frombuffer``, image
        libraries): they skip one copy of every sample. The views are valid
        only inside the ``with`` block and are released when it ends (misses,
        which arrive as bytes, too), so copy what must outlive it.
        """
        started = time.perf_counter()
        local = self._local.get()
        if local is None:
            with self._remote.notices.trainer_reading():
                fetched = self._read_remote(self._check_ids(ids), looked_up=False)
            self._served(0, 0, started)
            yield [memoryview(value) for value in fetched]
            return
        with local.views(self._db, self._keys(ids), self._client.verify) as found:
            with self._remote.notices.trainer_reading():
                hits, nbytes = self._hits(found)
                if found.misses:
                    for i, value in self._missing(found, ids):
                        found[i] = memoryview(value)
            self._served(hits, nbytes, started)
            yield cast("list[memoryview]", found)  # no None left

    def label(self, index: int) -> str | None:
        """The sample's label name from the manifest (files: its class folder),
        or None; its integer class is ``targets[index]``."""
        return self._manifest.label(self._index(index))

    @property
    def classes(self) -> list[str]:
        """The label names, sorted, as torchvision's ImageFolder has them."""
        if self._classes is None:
            self._classes = self._manifest.classes()
        return self._classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Each label name's integer class, as ImageFolder's."""
        return {name: i for i, name in enumerate(self.classes)}

    @property
    def targets(self) -> np.ndarray:
        """Every sample's integer class, an index into :attr:`classes` (-1:
        no label), as ImageFolder's ``targets``; read-only."""
        if self._targets is None:
            self._targets = self._manifest.targets()
            self._targets.flags.writeable = False
        return self._targets

    def sampler(
        self,
        *,
        job: str | None = None,
        mode: str | None = None,
        q: float | None = None,
        seed: int | None = None,
        drop_last: bool | None = None,
        nodes: Sequence[str] | None = None,
        partition: str | None = None,
        batch_size: int | None = None,
        exchange_coding: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        wait_for_exchange: float = 0.0,
    ) -> Sampler:
        """The ids this rank reads, epoch by epoch.

        Without a job (``job`` None and DATAQUAY_JOB unset), a :class:`Sampler`
        over one job-wide order (seed 0 and padding unless given). With one,
        this rank joins the cluster job through its daemon (creating it, with
        these settings, if it is new) and gets a :class:`JobSampler` that
        follows the job's placement; this dataset's reads then name the job,
        so misses go to the samples' owners. Settings left None take the
        job's values; a given one that differs from them is refused.

        Where the job names a batch size, a background thread then reads the
        first 2 batches of the sampler's epoch (as :meth:`batches` would
        read ahead), so that the first epoch does not begin by waiting for
        this process's first read: :meth:`batches` takes them over when it
        reads that epoch from its start in batches of that size.

        Args:
            job: the cluster job id; default DATAQUAY_JOB.
            mode: placement mode of a new job (``global``).
            q: fraction of its samples a node draws into each epoch's pool
                (``partial``); 1/M of the draws come back, so about
                q(1 - 1/M) leave it. For the fraction that leaves (the Q
                of Nguyen et al., IPDPS 2022), pass ``placement.drawn_fraction(Q, M)``.
            seed: the shuffle seed (default 0).
            drop_last: drop the tail that does not divide evenly instead of
                padding it with repeated ids (default False).
            nodes: the job's node names, in rank order (default: every live
                node, by name).
            partition: ``sample`` or ``shard`` (whole files per node).
            batch_size: ids per rank per step; ``locality`` needs it to
                split whole global batches (of world size x batch_size).
            exchange_coding: ``none``, ``coded`` or ``uber``: whether the
                exchange first multicasts XOR packets where caches overlap
                (docs/guides/coded-shuffling.md; default none).
            rank: this process's rank; default from the environment (RANK, ...).
            world_size: ranks in the job; default from the environment.
            shuffle: False reads ids in order (evaluation; no job).
            wait_for_exchange: seconds each ``set_epoch`` may wait for the
                exchange into its epoch (:class:`JobSampler`; 0: never).
                For jobs that train little or not at all between batches;
                :meth:`batches` then reads no batch of the next epoch ahead.

        Raises:
            ValueError: job settings without a job, ``shuffle=False`` with one,
                a rank or world size that does not fit the job, or a dataset
                already bound to another job.
            JobMismatchError: a setting differs from the job's, or the
                dataset was replaced since the job began.
        """
        job_id = job if job is not None else env.job_id()
        cluster = {
            "mode": mode,
            "q": q,
            "nodes": nodes,
            "partition": partition,
            "batch_size": batch_size,
            "exchange_coding": exchange_coding,
        }
        if job_id is not None:
            if not shuffle:
                raise ValueError(f"job {job_id!r} shuffles by its placement; shuffle=False needs no job")
            spec = job_spec(
                job_id, self._name, seed=seed, drop_last=drop_last, ranks_per_node=env.local_world_size(), **cluster
            )
            return self._join(spec, rank, world_size, wait_for_exchange)
        named = [name for name, value in cluster.items() if value is not None]
        named += ["wait_for_exchange"] if wait_for_exchange else []
        if named:
            raise ValueError(f"{', '.join(named)} apply to cluster jobs: pass job= or set DATAQUAY_JOB")
        return Sampler(
            self._len,
            rank=rank,
            world_size=world_size,
            seed=0 if seed is None else seed,
            shuffle=shuffle,
            drop_last=bool(drop_last),
        )

    def coordinated(
        self,
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
    ) -> CoordinatedLoader:
        """Prepped batches shared with the other jobs of a sweep on this node:
        each batch is fetched and prepped once, by one member, and every member
        gets every batch, in the same order (see :mod:`dataquay.client.coordinated`).

        Args:
            group: the group's name; every member passes the same settings.
            jobs: members the first epoch waits for (at most ``timeout``).
            prep: one sample's bytes -> an array or a tuple of arrays.
            batch_size: samples per batch.
            seed: the shuffle seed.
            drop_last: drop each epoch's last, shorter batch.
            memory_bytes: prepped batches held at once in shared memory.
            timeout: seconds after which a silent or stalled member is dropped.
            workers: this member's prep threads; ``prep`` must then be thread-safe.
        """
        return CoordinatedLoader(
            self,
            group=group,
            jobs=jobs,
            prep=prep,
            batch_size=batch_size,
            seed=seed,
            drop_last=drop_last,
            memory_bytes=memory_bytes,
            timeout=timeout,
            workers=workers,
        )

    def batches(self, sampler: Sampler, batch_size: int, *, read_ahead: int = 2) -> Iterator[list[bytes]]:
        """The samples of the sampler's current epoch, ``batch_size`` at a time
        (the last batch may be shorter), read ``read_ahead`` batches ahead.

        A background thread reads the next batches while the caller trains on
        this one, so peer and PFS latency overlap with compute; the time the
        caller still waits for a batch is its data wait (:meth:`Client.stats`).
        Once it has read this epoch's last batch, the thread reads on into the
        first ``read_ahead`` batches of the sampler's next epoch (its order is
        known), so that the next epoch does not begin by waiting for them: the
        next call takes them over if it reads that epoch from its start with
        the same sampler and batch size, and drops them otherwise. Reads for
        a job name their epoch, so the daemon serves them from what it fetched
        ahead for it; a job's first epoch is read ahead as soon as the sampler is
        made (:meth:`sampler`). ``read_ahead=0`` reads each batch when it is
        asked for.
        A pass that ends is recorded in ``Client.stats().epochs``. The sampler's
        cursor moves with the batches handed out, so a checkpoint taken
        between two of them resumes at the next.

        Raises:
            ValueError: ``batch_size`` below 1 or ``read_ahead`` below 0.
            PfsReadError: as :meth:`get_batch`, when its batch is reached.
        """
        if batch_size < 1 or read_ahead < 0:
            raise ValueError(f"batch_size must be at least 1 and read_ahead at least 0, not {batch_size}, {read_ahead}")
        carried, self._carried = self._carried, None
        epoch = sampler.epoch
        ids = sampler.remaining()
        chunks = chunked(ids, batch_size)
        if carried is not None and not (read_ahead and carried.carries(sampler, epoch, chunks)):
            carried.close()
            carried = None
        read = self._reader(sampler, epoch)
        ahead = None
        if read_ahead:
            upcoming = Upcoming(sampler, epoch + 1, batch_size, read_ahead, self._reader(sampler, epoch + 1))
            # A sampler that waits for the exchange at set_epoch would read
            # the next epoch's first batches before their arrivals otherwise.
            waits = isinstance(sampler, JobSampler) and sampler.wait_for_exchange > 0
            ahead = ReadAhead(read, self._stats, chunks, read_ahead, carried=carried, then=None if waits else upcoming)
        started, waited = time.perf_counter(), self._stats.data_wait_seconds
        carrying = False
        try:
            for chunk in chunks:
                batch = read(chunk) if ahead is None else ahead.next_batch()
                sampler.position += len(chunk)
                yield batch
            sampler.position = 0
            self._stats.epoch_read(
                EpochWait(epoch, len(chunks), time.perf_counter() - started, self._stats.data_wait_seconds - waited)
            )
            if ahead is not None:
                self._carried, carrying = ahead, True
        finally:
            if ahead is not None and not carrying:
                ahead.close()

    def __iter__(self) -> Iterator[bytes]:
        for start in range(0, self._len, ITER_BATCH):
            yield from self.get_batch(np.arange(start, min(start + ITER_BATCH, self._len)))

    def __repr__(self) -> str:
        return f"Dataset({self._name!r}, N={self._len}, node={self._client.info.node!r})"

    # ---------------------------------------------------------- internals

    def _reader(self, sampler: Sampler, epoch: int) -> Callable[[np.ndarray], list[bytes]]:
        """Reads a batch of ``sampler``'s ``epoch``, naming the epoch where it is this dataset's job's."""
        if isinstance(sampler, JobSampler) and sampler.job_id == self._job:
            return lambda ids: self._fetch(ids, epoch)
        return self._fetch

    def _join(
        self, spec: jpb.JobSpec, rank: int | None, world_size: int | None, wait_for_exchange: float = 0.0
    ) -> JobSampler:
        """Joins the job of ``spec`` as this rank and binds the dataset's reads to it."""
        if self._job not in (None, spec.job_id):
            raise ValueError(
                f"dataset {self._name!r} reads for job {self._job!r}; "
                f"open it again with client.dataset({self._name!r}) to read for job {spec.job_id!r}"
            )
        where = env.topology()
        rank = where.rank if rank is None else rank
        world_size = where.world_size if world_size is None else world_size
        joined = join(self._client, spec, world_size)
        sampler = JobSampler(
            joined,
            job_plan(joined, self._manifest),
            rank=rank,
            world_size=world_size,
            reporter=self._client,
            wait_for_exchange=wait_for_exchange,
        )
        self._job = spec.job_id
        batch_size = sampler.plan.settings.batch_size
        if self._carried is not None:
            self._carried.close()
            self._carried = None
        read_ahead = join_read_ahead()
        if batch_size and read_ahead:
            # The first read of a process makes its connection's shared-memory
            # segment; this pays for it, and reads the epoch's first batches,
            # while the trainer builds its model and waits for the other ranks.
            self._carried = ReadAhead(
                self._fetch,
                self._stats,
                [],
                read_ahead,
                then=Upcoming(sampler, sampler.epoch, batch_size, read_ahead, self._reader(sampler, sampler.epoch)),
            )
        placed_on, runs_on = joined.spec.nodes[sampler.node], self._client.info.node
        if runs_on and placed_on != runs_on:
            log.warning(
                "rank %d runs on node %r but job %r places it on %r (rank // %d ranks per node): its reads "
                "are right but not local; start the ranks in the order of the job's nodes",
                rank,
                runs_on,
                spec.job_id,
                placed_on,
                sampler.plan.settings.ranks_per_node,
            )
        return sampler

    def _index(self, index: int) -> int:
        i = operator.index(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise SampleIdError(f"index {index} out of range for dataset {self._name!r} (N={self._len})")
        return i

    def _check_ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(ids).ravel()
        if not arr.size:
            return np.empty(0, dtype=np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"sample ids must be integers, not {arr.dtype}")
        low, high = arr.min(), arr.max()
        if low < 0 or high >= self._len:
            bad = int(low if low < 0 else high)
            raise SampleIdError(f"sample id {bad} out of range for dataset {self._name!r} (N={self._len})")
        return arr.astype(np.int64, copy=False)

    def _keys(self, ids: Sequence[int] | np.ndarray) -> list[bytes]:
        try:
            return sample_keys(ids)
        except SampleIdError:
            self._check_ids(ids)  # the same error, worded for this dataset
            raise

    def _fetch(self, ids: Sequence[int] | np.ndarray, epoch: int | None = None, *, copy: bool = True) -> list[bytes]:
        """Local lookups, then one remote read of the misses (for the job's
        ``epoch``, default its current one); ``copy=False`` leaves the
        daemon's payloads as views into their segment.

        Ids are range-checked only on the miss path: an id outside 0..N-1 can
        never be a local hit, so every batch that holds one gets there.
        """
        with self._remote.notices.trainer_reading():
            return self._fetch_marked(ids, epoch, copy)

    def _fetch_marked(self, ids: Sequence[int] | np.ndarray, epoch: int | None, copy: bool = True) -> list[bytes]:
        started = time.perf_counter()
        local = self._local.get()
        if local is None:
            out = self._read_remote(self._check_ids(ids), epoch, copy, looked_up=False)
            self._served(0, 0, started)
            return out
        found = local.get_many(self._db, self._keys(ids), self._client.verify)
        if found.misses == len(found):
            # All misses: the batch goes to the miss path whole, nothing to merge.
            out = self._read_remote(self._check_ids(ids), epoch, copy)
            self._served(0, 0, started)
            return out
        hits, nbytes = self._hits(found)
        if found.misses:
            for i, value in self._missing(found, ids, epoch, copy):
                found[i] = value
        self._served(hits, nbytes, started)
        return cast("list[bytes]", found)  # no None left

    @staticmethod
    def _hits(found: Found[bytes] | Found[memoryview]) -> tuple[int, int]:
        hits = len(found) - found.misses
        if not hits:
            return 0, 0
        payloads: Iterable[Any] = filter(None, found) if found.misses else found
        return hits, sum(map(len, payloads))

    def _missing(
        self, found: list[Any], ids: Sequence[int] | np.ndarray, epoch: int | None = None, copy: bool = True
    ) -> Iterator[tuple[int, bytes]]:
        """(position, bytes) for each None in ``found``, read remotely in one go."""
        positions = [i for i, value in enumerate(found) if value is None]
        return zip(positions, self._read_remote(self._check_ids(ids)[positions], epoch, copy))

    def _read_remote(
        self, ids: np.ndarray, epoch: int | None = None, copy: bool = True, looked_up: bool = True
    ) -> list[bytes]:
        """``ids`` through the miss path; ``looked_up`` False: the local cache
        could not be read here, so they are not known to be misses."""
        return self._remote.read(self, ids, epoch, copy=copy, looked_up=looked_up) if len(ids) else []

    def _served(self, local_hits: int, local_bytes: int, started: float) -> None:
        """Counts a call's local hits and data wait; reports the counters when a report is due."""
        self._stats.served(local_hits, local_bytes, started)
        if self._stats.report_due():
            self._client.report_stats()
