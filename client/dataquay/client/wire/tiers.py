"""Where a sample was read from: one name per tier, the one that metrics
labels, status output, client stats and the docs all use.

* ``local``: the trainer read its node's cache itself, in-process, with no RPC;
* ``cache``: the node's daemon served it from its cache (``TIER_CACHE`` on the wire);
* ``peer``: another node's daemon served it from its cache;
* ``pfs``: a daemon read it from the PFS;
* ``fallback``: the trainer read the PFS itself while its daemon was unreachable.

Daemons count the three tiers they serve from (``dataquay_reads_total``);
clients count all five (``dataquay_client_reads_total``, ``Client.stats()``).
"""

from __future__ import annotations

from dataquay.protos import cache_pb2 as pb

LOCAL = "local"
CACHE = "cache"
PEER = "peer"
PFS = "pfs"
FALLBACK = "fallback"

#: Where a daemon served a sample from, by the tier's value on the wire.
SERVED_TIERS: dict[pb.Tier, str] = {pb.TIER_CACHE: CACHE, pb.TIER_PEER: PEER, pb.TIER_PFS: PFS}
#: Where a trainer's client read a sample from.
CLIENT_TIERS = (LOCAL, *SERVED_TIERS.values(), FALLBACK)
