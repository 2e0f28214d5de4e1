"""The per-epoch exchange between daemons (modes whose owners move).

:mod:`.outbox` is the ledger of one node's give-aways (no I/O), :mod:`.sender`
ships them when the job enters an epoch, a stream per receiver (:mod:`.streams`)
over the bulk path or gRPC (:mod:`.calls`), :mod:`.receiver` commits what others
ship to this node. See docs/design.md, "The per-epoch exchange".
"""

from dataquay.server.node.exchange.receiver import ExchangeReceiver
from dataquay.server.node.exchange.sender import ExchangeRun, Exchanges

__all__ = ["ExchangeReceiver", "ExchangeRun", "Exchanges"]
