"""Node-set versions and the changes between them, so that a daemon fetches
what changed since the version it holds, not the whole node list.

Why: every daemon keeps a copy of the node list and refetches it when the
heartbeat reply says the node-set version moved. With a version per change,
a booting cluster of N nodes moves it N times and each time N daemons fetch
N entries: O(N^2) calls, O(N^3) entries. Here changes are marked as they
happen and published together as one version at most once per ``period``
(the heartbeat period): at once when the last version is a period old, else
by the first :meth:`NodeLog.publish` a period after it, which the directory
calls before it tells anyone the version. A daemon then asks for the
changes since its version, and gets the names of the nodes to fetch again.

The log keeps the names changed in each of its last ``history`` versions;
a caller with an older version, or one of another run of the directory,
gets the whole list instead (:meth:`NodeLog.changes_since` says None).
Versions are numbered per run (:func:`first_version`), so that a version a
restarted directory hands out never names another set the last run handed
out under the same number.

Pure logic: no clock (every method that depends on time takes ``now``), no
I/O, no messages.
"""

from __future__ import annotations

from collections import deque

#: Versions whose changes the log keeps; at one version per heartbeat
#: period, minutes of changes.
HISTORY = 64
#: Marks kept in order, for whoever follows every change (:meth:`NodeLog.marked_since`).
JOURNAL = 1024


def first_version(previous: int, now: float) -> int:
    """The node-set version a directory starts from at ``now`` (Unix seconds)
    when its last run had reached ``previous`` (as written to disk).

    Above ``previous``, and above every version the last run could have
    published after its last write: those count up from at most its own start
    in the high 32 bits, and a second later this one starts above them.
    """
    return max(previous + 1, int(now) << 32)


class NodeLog:
    """Published node-set versions and the names each one changed.

    Args:
        period: the least time between two versions, in seconds.
        version: the version before the first change (see :func:`first_version`).
        history: how many versions' changes are kept.
    """

    def __init__(self, period: float = 0.0, version: int = 0, history: int = HISTORY) -> None:
        self.period = period
        #: The latest published version.
        self.version = version
        #: How many changes were marked, published or not.
        self.marks = 0
        self._journal: deque[str] = deque(maxlen=JOURNAL)
        self._history: deque[tuple[int, frozenset[str]]] = deque(maxlen=history)
        self._floor = version
        self._pending: set[str] = set()
        self._published_at: float | None = None

    def mark(self, name: str) -> None:
        """Records that the node ``name`` changed (registered, went down, came back)."""
        self._pending.add(name)
        self._journal.append(name)
        self.marks += 1

    def marked_since(self, marks: int) -> list[str] | None:
        """The names marked after the first ``marks`` marks, published or not, in
        order; None when the journal no longer reaches back that far."""
        behind = self.marks - marks
        if not 0 <= behind <= len(self._journal):
            return None
        return [self._journal[-k] for k in range(behind, 0, -1)]

    def publish(self, now: float) -> bool:
        """Publishes the marked changes as one version, if there are any and the
        last version is at least a period old at ``now`` (or a clock set back
        makes it seem from the future); returns whether it did."""
        if not self._pending:
            return False
        if self._published_at is not None and 0 <= now - self._published_at < self.period:
            return False
        if len(self._history) == self._history.maxlen:
            self._floor = self._history[0][0]
        self.version += 1
        self._history.append((self.version, frozenset(self._pending)))
        self._pending.clear()
        self._published_at = now
        return True

    def changes_since(self, since: int) -> frozenset[str] | None:
        """The names changed in the versions after ``since`` up to :attr:`version`,
        or None when the caller needs the whole list: ``since`` is 0 (no copy),
        older than the history, or not one of this log's versions."""
        if since == 0 or not self._floor <= since <= self.version:
            return None
        names: set[str] = set()
        for version, changed in reversed(self._history):
            if version <= since:
                break
            names |= changed
        return frozenset(names)
