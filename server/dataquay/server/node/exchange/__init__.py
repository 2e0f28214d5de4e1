"""The per-epoch exchange between daemons (modes whose owners move).

:mod:`.outbox` is the ledger of one node's give-aways (no I/O), :mod:`.sender`
ships them when the job enters an epoch, a stream per receiver (:mod:`.streams`)
over the bulk path or gRPC (:mod:`.calls`), :mod:`.receiver` commits what others
ship to this node; the two sides share a :mod:`.broker`, built before either.
See docs/design.md, "The per-epoch exchange". It may import the cache,
cluster and peers rooms, node/'s datasets and :mod:`dataquay.server.planning`;
nothing of reads/, handoff/ or prep/.
"""

from dataquay.server.node.exchange.broker import ExchangeBroker
from dataquay.server.node.exchange.receiver import ExchangeReceiver
from dataquay.server.node.exchange.sender import ExchangeRun, Exchanges

__all__ = ["ExchangeBroker", "ExchangeReceiver", "ExchangeRun", "Exchanges"]
