"""Which sample ids this rank reads, epoch by epoch.

A thin stateful wrapper over :mod:`dataquay.client.placement`: it holds the
job's settings and a cursor (epoch, position), and takes rank and world size
from the launcher's environment when they are not given. :class:`JobSampler`
does the same for a rank of a cluster job, whose orders follow the job's
placement. The cursor is what a checkpoint saves (:meth:`Sampler.state_dict`):
the order itself is recomputed, so a restarted job reads the same ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from dataquay.client.env import topology
from dataquay.client.jobs import check_epoch_ahead
from dataquay.client.placement import (
    MODES,
    JobPlan,
    epoch_order,
    node_of_rank,
    owners,
    rank_indices,
    rank_length,
    rank_order,
    rank_split,
    samples_per_rank,
)
from dataquay.protos import jobs_pb2 as jpb


class Sampler:
    """Ids of ``num_samples`` for one rank, reshuffled by :meth:`set_epoch`.

    Deals one job-wide order over ranks as torch's DistributedSampler does:
    every rank of the job, in any process, computes the same order from
    ``seed`` and the epoch, takes every ``world_size``-th id, and yields the
    same number of ids as every other rank.

    Args:
        num_samples: ids are 0..num_samples-1.
        rank: this process's rank; default RANK, else SLURM_PROCID, else 0.
        world_size: ranks in the job; default WORLD_SIZE, else SLURM_NTASKS,
            else 1.
        seed: the job's shuffle seed; the same on every rank.
        shuffle: False reads ids in order (evaluation).
        drop_last: drop the tail that does not divide evenly instead of
            padding it with repeated ids.

    Iteration moves a cursor: :attr:`position` counts the ids of the current
    epoch that iteration has yielded, so :meth:`state_dict` can save it and a
    restarted job's :meth:`load_state_dict` resume there (torchdata's
    StatefulDataLoader calls both when the sampler has them). ``len()`` stays
    an epoch's full length, as DistributedSampler's does; an iteration resumed
    at ``position`` yields the remaining ``len(sampler) - position`` ids.

    Raises:
        ValueError: a negative size or seed, or a rank outside 0..world_size-1.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if rank is None or world_size is None:
            env = topology()
            rank = env.rank if rank is None else rank
            world_size = env.world_size if world_size is None else world_size
        if num_samples < 0:
            raise ValueError(f"num_samples must not be negative, not {num_samples}")
        if seed < 0:
            raise ValueError(f"seed must not be negative, not {seed}")
        if world_size < 1:
            raise ValueError(f"world size must be at least 1, not {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        #: Ids of the current epoch yielded by iteration; 0 again once an
        #: epoch's iteration completes.
        self.position = 0
        # Ids of the current epoch's job-wide order that ranks read before
        # a resume on another world size; the rest is dealt over this one.
        self._start = 0
        # A restored position that the next iteration starts from.
        self._resuming = False
        # The last order computed, by (epoch, _start): a permutation of N ids
        # costs ~100 ms at a million samples, and loops call indices() per step.
        self._order: tuple[tuple[int, int], np.ndarray] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose order the next iteration yields, from its start.

        Call it with the same value on every rank before each epoch, or every
        epoch repeats epoch 0's order. After :meth:`load_state_dict`, setting
        the restored epoch keeps the restored position until an iteration
        has started from it, so the usual ``set_epoch(epoch)`` then ``for``
        loop resumes mid-epoch; any other epoch, or the same one again later,
        starts at 0.
        """
        if epoch < 0:
            raise ValueError(f"epoch must not be negative, not {epoch}")
        if not (self._resuming and epoch == self.epoch):
            self.position = 0
            self._resuming = False
            self._start = 0
        self.epoch = epoch

    def state_dict(self, consumed: int | None = None) -> dict[str, int | str]:
        """The cursor a checkpoint saves: ``epoch``, ``position``, ``consumed`` and this sampler's identity.

        ``consumed`` counts the ids of the epoch's job-wide order that the
        job's ranks read, all of them stepping together: what a resume on
        another world size starts from. The identity (``num_samples``,
        ``world_size``, ``rank``, ``seed``, ``shuffle``, ``drop_last``, as
        ints) lets :meth:`load_state_dict` refuse a restore whose order
        would differ. Plain ints and strings, so
        it survives json as well as ``torch.save``. A state saved after an
        epoch's iteration completed reads position 0 of that epoch: the
        trainer's next :meth:`set_epoch` starts the next one.

        Args:
            consumed: the ids of the current epoch that training has used,
                counted from the epoch's start, when that is fewer than this
                sampler handed out. A DataLoader takes ids ahead of what it
                yields (``prefetch_factor`` batches per worker), so the
                sampler's own position runs that far ahead of training, and
                a restore from it would skip those batches. torchdata's
                StatefulDataLoader counts what it yielded by itself.

        Raises:
            ValueError: ``consumed`` is outside this rank's epoch.
        """
        position = self.position
        if consumed is not None:
            if not 0 <= consumed <= len(self):
                raise ValueError(f"consumed={consumed} is outside the {len(self)} ids of rank {self.rank}'s epoch")
            position = consumed if consumed < len(self) else 0
        consumed = self._start + position * self.world_size
        return {"epoch": self.epoch, "position": position, "consumed": consumed, **self._identity()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes at a cursor from :meth:`state_dict` of a sampler with the same order.

        The next iteration yields the saved epoch's order from ``position``
        on; the epochs after it start at 0. A state saved by a rank of
        another world size (or another rank) resumes the job, not the rank:
        the epoch's job-wide order is the same (a function of the seed and
        the epoch), so the ids its ranks had not read (from ``consumed`` on)
        are dealt over this world's ranks, each read once, and the epochs
        after it are dealt as usual. Ranks step together, so any rank's
        state names the same ``consumed``.

        Raises:
            ValueError: a field is missing, a field that fixes the order
                differs from this sampler's (named in the message), or the
                cursor is not inside the saved epoch.
        """
        order, dealing = self._identity(), {"world_size": self.world_size, "rank": self.rank}
        for field, mine in order.items():
            if field not in dealing and field in state and state[field] != mine:
                raise ValueError(
                    f"sampler state was saved with {field}={state[field]!r} but this sampler has "
                    f"{field}={mine!r}; restore it into a sampler built with the same settings"
                )
        for field in ("epoch", "position", *order):
            if field not in state:
                raise ValueError(f"sampler state has no {field!r}; pass a dict from state_dict()")
        for field in ("epoch", "position", "world_size", "consumed"):
            if field in state and (not isinstance(state[field], int) or state[field] < 0):
                raise ValueError(f"sampler state needs a non-negative int {field}, not {state[field]!r}")
        consumed = state.get("consumed", state["position"] * state["world_size"])
        if all(state[field] == mine for field, mine in dealing.items()):
            # The rank's own cursor; ``consumed`` adds where a resumed epoch's dealing began.
            start, position = max(0, consumed - state["position"] * self.world_size), state["position"]
        else:
            start, position = consumed, 0
        if not 0 <= start <= self.num_samples:
            raise ValueError(
                f"sampler state consumed {consumed} ids at position {state['position']}: not inside "
                f"the {self.num_samples} ids of the epoch"
            )
        if position > self._epoch_length(start):
            raise ValueError(
                f"sampler state position {position} is past the {self._epoch_length(start)} ids of "
                f"rank {self.rank}'s epoch"
            )
        self._start, self.epoch, self.position = start, state["epoch"], position
        self._resuming = True

    def _identity(self) -> dict[str, int | str]:
        """The settings that fix this rank's order: a state saved under others is refused."""
        return {
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "rank": self.rank,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "drop_last": int(self.drop_last),
        }

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's ids for ``epoch`` (default: the current one), in reading
        order (int64, read-only): computed once per epoch, however often asked."""
        epoch = self.epoch if epoch is None else epoch
        key = (epoch, self._start if epoch == self.epoch else 0)
        if self._order is not None and self._order[0] == key:
            return self._order[1]
        ids = self._compute_indices(epoch)
        ids.flags.writeable = False
        self._order = (key, ids)
        return ids

    def _compute_indices(self, epoch: int) -> np.ndarray:
        if self._start and epoch == self.epoch:
            rest = epoch_order(self.num_samples, self.seed, epoch, self.shuffle)[self._start :]
            return rank_split(rest, self.rank, self.world_size, self.drop_last)
        return rank_indices(
            self.num_samples,
            self.rank,
            self.world_size,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
        )

    def __iter__(self) -> Iterator[int]:
        return self._advance(self.remaining().tolist())

    def remaining(self) -> np.ndarray:
        """Starts an iteration of the current epoch: the ids from the cursor on
        (from a restored cursor after :meth:`load_state_dict`, else from 0).
        A caller that reads them itself moves :attr:`position` as it goes."""
        self.position = self.position if self._resuming else 0
        self._resuming = False
        return self.indices()[self.position :]

    def _advance(self, ids: list[int]) -> Iterator[int]:
        for i in ids:
            self.position += 1
            yield i
        self.position = 0

    def __len__(self) -> int:
        return self._epoch_length(self._start)

    def _epoch_length(self, start: int) -> int:
        """Ids of the epoch for this rank, when its ranks read from ``start`` of the job-wide order."""
        return samples_per_rank(self.num_samples - start, self.world_size, self.drop_last)

    def __repr__(self) -> str:
        return (
            f"Sampler(num_samples={self.num_samples}, rank={self.rank}, world_size={self.world_size}, "
            f"seed={self.seed}, shuffle={self.shuffle}, drop_last={self.drop_last}, epoch={self.epoch})"
        )


#: Ids a rank reads between two reports of its position.
POSITION_STEP = 16


class EpochReporter(Protocol):
    """Whoever tells a job which epoch its ranks are in, and how far they read
    (a :class:`~dataquay.client.Client`)."""

    def report_epoch(self, job_id: str, epoch: int, rank: int | None = None, wait_seconds: float = 0.0) -> None: ...

    def report_position(self, job_id: str, epoch: int, rank: int, position: int, done: bool) -> None: ...


class JobSampler(Sampler):
    """The ids one rank of a cluster job reads; from :meth:`Dataset.sampler` with a job.

    A :class:`Sampler` (same use, DistributedSampler's contract) whose orders
    come from the job's placement mode, so every rank and daemon of the job
    agrees on them, and whose :meth:`set_epoch` also tells the job the epoch,
    so the daemons can prepare the next one; as :attr:`position` moves, the
    reporter hears it every POSITION_STEP ids (a daemon deletes what it gave
    away once its ranks have read it). Its :meth:`state_dict` also
    names the job (``job``, the one string): another job's order may differ
    even where its sizes and seed match, so its state is refused.

    Args:
        job: the job as the directory returned it (every setting filled in).
        plan: its placement plan (:func:`dataquay.client.jobs.job_plan`).
        rank: this process's rank in the job.
        world_size: ranks this process was started with; must be the job's.
        reporter: reports each epoch (best effort); None reports nothing.
        wait_for_exchange: seconds :meth:`set_epoch` may wait, in a job whose
            owners move, until the exchange into the epoch has brought this
            rank's node every sample it takes in (0: never waits). By
            default nothing waits on the exchange, and a rank that gets to
            an epoch first reads what has not arrived from its previous
            owner. A job that trains little or not at all between batches
            (I/O-bound, a loading benchmark) outruns the exchange and reads
            much of each epoch from peers; with a wait it reads each epoch
            from its own node, and pays for it in the time the exchange
            still needed at each epoch boundary
            (``Client.stats().exchange_wait_seconds``; the daemon's
            ``dataquay_exchange_wait_seconds``). A wait that runs out
            (a sender down, a failed exchange) is logged by the daemon and
            the rank reads on as without one. A job with a training step
            longer than its exchange gains nothing from it.

    Raises:
        ValueError: ``world_size`` is not the job's nodes times ranks per
            node, ``rank`` is outside the job's world, or
            ``wait_for_exchange`` is negative.
    """

    def __init__(
        self,
        job: jpb.Job,
        plan: JobPlan,
        *,
        rank: int,
        world_size: int,
        reporter: EpochReporter | None = None,
        wait_for_exchange: float = 0.0,
    ) -> None:
        world = (
            f"{plan.world_size} = {plan.num_nodes} nodes x {plan.settings.ranks_per_node} ranks per node "
            f"of job {job.spec.job_id!r}"
        )
        if world_size != plan.world_size:
            raise ValueError(f"world size {world_size} does not match the job's {world}; start that many ranks")
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is outside the world: world size {world}")
        if not wait_for_exchange >= 0:
            raise ValueError(f"wait_for_exchange must be 0 or more seconds, not {wait_for_exchange!r}")
        super().__init__(
            plan.num_samples,
            rank=rank,
            world_size=world_size,
            seed=plan.settings.seed,
            drop_last=plan.settings.drop_last,
        )
        self.job = job
        self.plan = plan
        #: The node (0..M-1) this rank runs on, as the job places it.
        self.node = node_of_rank(plan, rank)
        self._reporter = reporter
        self.wait_for_exchange = float(wait_for_exchange)
        self._position_reported = 0
        # The last (epoch, owners) computed, where owners move: the next
        # epoch's then take one exchange step instead of a replay from epoch 0.
        self._owners: tuple[int, np.ndarray] | None = None
        self._length: int | None = None

    @property
    def job_id(self) -> str:
        return self.job.spec.job_id

    @property
    def position(self) -> int:
        """Ids of the current epoch read so far (see :class:`Sampler`)."""
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        self._position = value
        reporter = getattr(self, "_reporter", None)  # None while Sampler.__init__ runs
        if reporter is None:
            return
        if value < self._position_reported:
            self._position_reported = value
        elif value - self._position_reported >= POSITION_STEP or value == len(self):
            self._position_reported = value
            reporter.report_position(self.job_id, self.epoch, self.rank, value, value == len(self))

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch to read and reports it to the job (best effort).

        Raises:
            EpochTooFarError: ``epoch`` is too far past the job's current one
                as this rank knows it, or as the job does
                (:func:`~dataquay.client.jobs.check_epoch_ahead`); the
                sampler stays in its epoch.
        """
        settings = self.plan.settings
        check_epoch_ahead(self.job_id, settings.mode, epoch, max(self.job.epoch, self.epoch))
        if self._reporter is not None:
            self._reporter.report_epoch(self.job_id, epoch, self.rank, self.wait_for_exchange)
        super().set_epoch(epoch)

    def _identity(self) -> dict[str, int | str]:
        return {**super()._identity(), "job": self.job_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """As :meth:`Sampler.load_state_dict`; a state of another world size
        resumes only in mode ``global``, whose order is the job-wide one.

        Raises:
            ValueError: as :meth:`Sampler.load_state_dict`, or a state of
                another world size or rank in a mode that deals each node
                its own samples.
        """
        mode = self.plan.settings.mode
        moved = state.get("world_size") != self.world_size or state.get("rank") != self.rank
        if moved and mode != "global":
            raise ValueError(
                f"sampler state was saved by rank {state.get('rank')!r} of {state.get('world_size')!r}; "
                f"mode {mode} deals each node its own samples, so only mode global resumes on another rank "
                "or world size"
            )
        super().load_state_dict(state)

    def _compute_indices(self, epoch: int) -> np.ndarray:
        if self._start and epoch == self.epoch:
            return super()._compute_indices(epoch)  # mode global, resumed on another world size
        epoch_owners = self.owners(epoch) if MODES[self.plan.settings.mode].owners_move else None
        return rank_order(self.plan, epoch, self.rank, epoch_owners)

    def owners(self, epoch: int | None = None) -> np.ndarray:
        """The node that owns each sample in ``epoch`` (default: the current one), int32.

        Epochs read in order cost one exchange step each in mode ``partial``,
        whose owners the sampler keeps (read-only) for the next step.
        """
        epoch = self.epoch if epoch is None else epoch
        cached = self._owners
        if cached is not None and cached[0] == epoch:
            return cached[1]
        previous = cached[1] if cached is not None and cached[0] == epoch - 1 else None
        current = owners(self.plan, epoch, previous)
        if MODES[self.plan.settings.mode].owners_move:
            current.flags.writeable = False  # the next epoch steps from it
            self._owners = (epoch, current)
        return current

    def __len__(self) -> int:
        # The same every epoch, and an O(N) computation in the node-local modes.
        if self._start:
            return self._epoch_length(self._start)
        if self._length is None:
            self._length = rank_length(self.plan)
        return self._length

    def __repr__(self) -> str:
        return (
            f"JobSampler(job={self.job_id!r}, mode={self.plan.settings.mode!r}, rank={self.rank}, "
            f"world_size={self.world_size}, node={self.node}, num_samples={self.num_samples}, "
            f"epoch={self.epoch})"
        )
