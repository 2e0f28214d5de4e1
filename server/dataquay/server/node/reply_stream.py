"""A Read's reply as it is resolved: each window's messages, and before a
window is resolved, its leading payloads that have landed in the caller's
segment already.

A peer hit's payloads are received straight into the trainer's sealed memfd
segment (:mod:`dataquay.server.node.forward`), so once one is there and
checked, naming it is all that is left to do. Naming it only once the whole
window is resolved makes the trainer copy the window's payloads out after
the last one has crossed the network: a peer hit then costs both hops, one
after the other. Instead, each time another :data:`EARLY_BYTES` have landed
in place, the positions from the next one not sent yet up to the first that
has not landed go out in a message of their own, and the trainer copies them
out while the rest of the window is still on the wire. The peers are asked in
the order the trainer asked (:mod:`dataquay.server.node.reads`), so they land
in that order. The window's own messages then carry the positions not sent
early. Positions go out in request order, each once, as the client takes them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from dataquay.protos import cache_pb2 as pb
from dataquay.server.node.forward import ShmForward
from dataquay.server.node.reads import Window
from dataquay.server.node.replies import reply_chunks
from dataquay.server.proto_maps import TIER_TO_PROTO

#: Bytes landed in place that wake the reply to send what leads the window:
#: a few messages for a batch of 64 samples of 110 KiB, each costing the
#: daemon and the trainer a gRPC message (50-100 us).
EARLY_BYTES = 2 << 20
_PEER = TIER_TO_PROTO["peer"]


async def reply_stream(
    windows: AsyncIterator[Window], ids: Sequence[int], forward: ShmForward | None
) -> AsyncGenerator[pb.ReadChunk, None]:
    """The messages of the reply to ``ids``, whose windows ``windows`` resolves."""
    if forward is None or not forward.in_place:
        async for window in windows:
            offsets = forward.window(window.served) if forward is not None else [None] * len(window.served)
            for chunk in reply_chunks(window, offsets, forward.checked if forward is not None else ()):
                yield chunk
            del window  # not held while the next one is resolved
        return
    loop = asyncio.get_running_loop()
    landed = asyncio.Event()
    forward.listen(lambda: loop.call_soon_threadsafe(landed.set), EARLY_BYTES)
    start = sent = 0  # the first position of the window being resolved; the positions sent
    while True:
        resolving = asyncio.ensure_future(anext(windows))
        try:
            while not resolving.done():
                waiting = asyncio.ensure_future(landed.wait())
                await asyncio.wait((resolving, waiting), return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                landed.clear()
                early = forward.leading(ids, sent)
                if early:
                    chunk = pb.ReadChunk()
                    for sample_id, offset, length, digest in early:
                        chunk.samples.add(id=sample_id, tier=_PEER, checksum=digest, in_shm=True,
                                          shm_offset=offset, length=length, checked_in_place=True)
                    sent += len(early)
                    yield chunk
        finally:
            if not resolving.done():
                resolving.cancel()
                await asyncio.gather(resolving, return_exceptions=True)
        try:
            window = resolving.result()
        except StopAsyncIteration:
            return
        offsets = forward.window(window.served)
        for chunk in reply_chunks(window, offsets, forward.checked, skip=min(sent - start, len(window.index))):
            yield chunk
        start += len(window.index)
        sent = max(sent, start)
        del window  # not held while the next one is resolved
