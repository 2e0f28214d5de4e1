"""A job's settings, the one shape every party holds them in.

The trainer that creates a job, the directory that records it, the daemons
that serve it, ``dataquay stage --job`` and ``dataquay simulate`` all read the
same fields with the same defaults and refuse the same values with the same
messages, so adding a setting means adding a field here and in ``JobSpec`` of
``jobs.proto``. Conversions to and from the proto go field by field by name.

A join names only some settings (the others are the job's); on the wire, the
proto's field presence says which. :func:`named_settings` reads it back.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, fields

from dataquay.client.placement import MODES, PARTITIONS
from dataquay.protos import jobs_pb2 as jpb

#: The exchange's schemes (the keys of the daemon's coded-shuffling planner).
EXCHANGE_CODINGS = ("none", "coded", "uber")


@dataclass(frozen=True)
class JobSettings:
    """A job's settings; every one has its default until a creator names it.

    Fields are in the order a join is compared with its job, so that a join
    differing in several is told about the same one first every time.

    Attributes:
        job_id: the job's name; not a setting, so never compared or checked here.
        dataset: the registered dataset the job reads.
        mode: a key of :data:`~dataquay.client.placement.MODES`.
        q: the fraction of its samples a node draws into each epoch's pool
            (``partial`` needs 0 < q <= 1); about q(1 - 1/M) leave it
            (:mod:`~dataquay.client.placement.exchange_q`).
        seed: the job's shuffle seed.
        drop_last: drop the tail that does not divide over the ranks instead
            of padding it with repeated ids.
        partition: a key of :data:`~dataquay.client.placement.PARTITIONS`.
        batch_size: b, the ids each rank reads per step; ``locality`` splits
            global batches of W * b and needs b >= 1, other modes ignore it.
        nodes: the job's node names in rank order, kept as a tuple whatever
            sequence is given (a JSON list, a repeated field); empty until the
            directory resolves them (a join naming none runs on every live node).
        ranks_per_node: g; rank r runs on node r // g. 0 while no rank has
            joined to say.
        exchange_coding: how the exchange moves samples whose new owner
            lacks them: ``none`` (a stream to each new owner), or ``coded``
            / ``uber`` (XOR packets multicast to groups of nodes first, where
            caches overlap; see docs/guides/coded-shuffling.md).
    """

    job_id: str = ""
    dataset: str = ""
    mode: str = "global"
    q: float = 0.0
    seed: int = 0
    drop_last: bool = False
    partition: str = "sample"
    batch_size: int = 0
    nodes: tuple[str, ...] = ()
    ranks_per_node: int = 0
    exchange_coding: str = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))

    def check_names(self) -> None:
        """Refuses a mode or partition that names nothing.

        Cheap and independent of the other settings, so a rank checks it
        before any call: a typo fails where it was made. The directory checks
        the rest (:meth:`check`) when it creates the job, since a join's
        unnamed settings are the job's, not these defaults.

        Raises:
            ValueError: the field and the names it may take.
        """
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}, not {self.partition!r}")
        if self.exchange_coding not in EXCHANGE_CODINGS:
            raise ValueError(
                f"exchange_coding must be one of {', '.join(EXCHANGE_CODINGS)}, not {self.exchange_coding!r}"
            )

    def check(self) -> None:
        """Refuses settings no job can run with, before any plan exists.

        The directory calls it when it creates a job, so that a job every rank
        would fail to plan is never recorded; every plan calls it again.

        Raises:
            ValueError: the first bad setting, named first in the message.
        """
        self.check_names()
        if not 0.0 <= self.q <= 1.0:
            raise ValueError(f"q {self.q} is not in [0, 1]")
        for name in ("seed", "batch_size", "ranks_per_node"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, not {getattr(self, name)}")
        MODES[self.mode].check_settings(self.q, self.batch_size)

    def to_proto(self, named: Collection[str] | None = None) -> jpb.JobSpec:
        """The settings as a ``JobSpec``; with ``named``, only those are set
        (besides the job id), the rest left unset for the job's to apply."""
        spec = jpb.JobSpec()
        for f in fields(self):
            if named is not None and f.name not in named and f.name != "job_id":
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                getattr(spec, f.name).extend(value)
            else:
                setattr(spec, f.name, value)
        return spec

    @classmethod
    def from_proto(cls, spec: jpb.JobSpec) -> JobSettings:
        """The settings of ``spec``, with the default for each it leaves unset."""
        return cls(**{name: getattr(spec, name) for name in named_settings(spec) | {"job_id"}})


#: The settings a join may name and compare with its job's, in comparison order.
SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(JobSettings) if f.name != "job_id")


def named_settings(spec: jpb.JobSpec) -> frozenset[str]:
    """The settings ``spec`` names: those present, and a non-empty dataset or node list.

    proto3 ``optional`` tells an unset setting from one set to its zero value;
    the dataset and the node list have no presence, so empty means unnamed.
    """
    present = {f.name for f, _ in spec.ListFields()}
    return frozenset(name for name in SETTINGS if name in present)
