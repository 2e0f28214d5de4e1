"""The coded exchange's datagrams sealed with AES-256-GCM under a key of their pass.

Multicast reaches whoever joins the group, whatever the TCP path's TLS, and
coded packets carry sample bytes (a fetch is a whole cache value), so every
datagram is encrypted and authenticated. A pass (one job's coded exchange
into one epoch) has a random 64-bit id, drawn by the job's first node and
handed to the others over the authenticated TCP path
(:mod:`.pass_ids`); its key is HMAC-SHA256(token, ``dataquay-mcast`` + id).
A datagram of any other pass (an earlier epoch, another job, an earlier run
of this one) names another id, or fails GCM's tag under this key, and so
does one made without the token: replay across passes and forgery fail alike.

Layout: magic ``DQ``, version, the pass id and GCM's 12-byte nonce in the
clear (and authenticated), then the sealed message (:mod:`.mcast_wire`) and
its 16-byte tag. Nonces are random per datagram: several endpoints seal
under one pass key (every node, and a node again after a restart), so a
counter could repeat; 96 random bits repeat only after some 2**48 datagrams.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"DQ"
VERSION = 2
NONCE_BYTES = 12
TAG_BYTES = 16
_HEADER = struct.Struct(f"<2sBQ{NONCE_BYTES}s")  # magic, version, pass id, nonce
#: Bytes a sealed datagram adds to its message.
OVERHEAD_BYTES = _HEADER.size + TAG_BYTES
_KEY_CONTEXT = b"dataquay-mcast"


class SealError(ValueError):
    """A datagram that cannot be opened; ``reason`` is the drop counter's label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def pass_key(token: str, pass_id: int) -> bytes:
    """The AES-256 key of pass ``pass_id``: only holders of ``token`` can derive it."""
    return hmac.new(token.encode(), _KEY_CONTEXT + pass_id.to_bytes(8, "big"), hashlib.sha256).digest()


def pass_of(datagram: bytes) -> int:
    """The pass id a datagram names (not yet authenticated).

    Raises:
        SealError: ``malformed``: too short for a sealed datagram, or not ours.
    """
    if len(datagram) < OVERHEAD_BYTES:
        raise SealError("malformed", f"datagram of {len(datagram)} bytes is shorter than a sealed one")
    magic, version, pass_id, _ = _HEADER.unpack_from(datagram)
    if magic != MAGIC or version != VERSION:
        raise SealError("malformed", f"not a version {VERSION} dataquay datagram")
    return int(pass_id)


class PassSeal:
    """Seals and opens the datagrams of one pass.

    Args:
        token: the node token the key derives from ("" when the cluster has
            none: the datagrams are then sealed under a key anyone can derive).
        pass_id: the pass's id (64 bits).
    """

    def __init__(self, token: str, pass_id: int) -> None:
        self.pass_id = pass_id
        self._aead = AESGCM(pass_key(token, pass_id))

    def seal(self, message: bytes) -> bytes:
        header = _HEADER.pack(MAGIC, VERSION, self.pass_id, os.urandom(NONCE_BYTES))
        return header + self._aead.encrypt(header[-NONCE_BYTES:], message, header)

    def open(self, datagram: bytes) -> bytes:
        """The message of a datagram of this pass.

        Raises:
            SealError: ``malformed``, ``unknown_pass`` (another pass's id) or
                ``unauthenticated`` (the tag does not verify under this pass's key).
        """
        if pass_of(datagram) != self.pass_id:
            raise SealError("unknown_pass", "the datagram names another pass")
        header = bytes(memoryview(datagram)[: _HEADER.size])
        try:
            return self._aead.decrypt(header[-NONCE_BYTES:], bytes(memoryview(datagram)[_HEADER.size :]), header)
        except InvalidTag:
            raise SealError("unauthenticated", "the datagram's tag does not verify under the pass key") from None
