"""Which nodes of a job whose owners move are absent, epoch by epoch.

In modes whose owners move, every node steps the holders of epoch e+1 from
those of epoch e while its exchange into e+1 runs, so the nodes must agree
on who holds what in each epoch, not only now. A node lost for longer than
``--heal-after`` is therefore recorded on the job, by the directory, as
absent from a fixed epoch on: :data:`LEAD_EPOCHS` past the job's epoch when
the loss is recorded, since the exchange into the next epoch may already be
under way with the node still in it. Its return is recorded the same way.
Every node computes the holders of an epoch from the same record (see
:mod:`dataquay.server.node.cluster.placements`); only which node holds a
sample changes, never which rank reads it.

Plain functions over plain values; the directory applies
:func:`follow_absences` at each epoch report.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

#: Epochs between the report that records a loss or a return and the first
#: epoch whose holders follow it.
LEAD_EPOCHS = 2
#: Epochs a closed absence is kept after it ended: placements of recent
#: epochs (an exchange's drops, a restarted daemon) are still computed with it.
KEPT_EPOCHS = 8


@dataclass(frozen=True)
class Absence:
    """``node`` holds nothing of the job from ``from_epoch`` up to
    ``until_epoch`` (0: not back yet)."""

    node: str
    from_epoch: int
    until_epoch: int = 0


class AbsenceLike(Protocol):
    """An :class:`Absence` or its protobuf message."""

    @property
    def node(self) -> str: ...
    @property
    def from_epoch(self) -> int: ...
    @property
    def until_epoch(self) -> int: ...


def absent_at(absences: Iterable[AbsenceLike], epoch: int) -> tuple[str, ...]:
    """The nodes absent in ``epoch``, sorted."""
    return tuple(
        sorted({a.node for a in absences if a.from_epoch <= epoch and (a.until_epoch == 0 or epoch < a.until_epoch)})
    )


def follow_absences(
    absences: tuple[Absence, ...], nodes: Collection[str], lost: Iterable[str], up: Collection[str], epoch: int
) -> tuple[Absence, ...]:
    """The absences of a job at ``epoch`` after a report naming ``lost``.

    A node of the job named ``lost`` and not ``up`` (as the directory lists
    it: a report does not make a live node absent) becomes absent from
    ``epoch`` + :data:`LEAD_EPOCHS`, unless it would leave no node present;
    an absent node that is ``up`` again is back from that epoch (an absence
    that never began is forgotten). Absences that ended more than
    :data:`KEPT_EPOCHS` before ``epoch`` are forgotten.
    """
    start = epoch + LEAD_EPOCHS
    kept: list[Absence] = []
    for absence in absences:
        if absence.until_epoch == 0 and absence.node in up:
            absence = replace(absence, until_epoch=start)
            if absence.until_epoch <= absence.from_epoch:
                continue
        if absence.until_epoch == 0 or absence.until_epoch + KEPT_EPOCHS > epoch:
            kept.append(absence)
    open_now = {a.node for a in kept if a.until_epoch == 0}
    for name in sorted(set(lost)):
        if name not in nodes or name in up or name in open_now:
            continue
        if len(open_now) + 1 >= len(nodes):
            break
        kept.append(Absence(name, start))
        open_now.add(name)
    return tuple(sorted(kept, key=lambda a: (a.node, a.from_epoch)))
