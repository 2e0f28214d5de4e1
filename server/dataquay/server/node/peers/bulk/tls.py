"""TLS for the bulk data path, under the rules of the gRPC TCP port
(:func:`dataquay.server.auth.server_tls`): a server with a certificate speaks
TLS and, with a CA, requires its clients to present a certificate the CA
signed; a client with a CA verifies the server's certificate and host name,
presenting its own certificate when it has one."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BulkTls:
    """The server's and the client's TLS contexts; None where TLS is off."""

    server: ssl.SSLContext | None = None
    client: ssl.SSLContext | None = None

    @classmethod
    def from_files(cls, ca: Path | None, cert: Path | None, key: Path | None) -> BulkTls:
        server = client = None
        if cert is not None and key is not None:
            server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            server.load_cert_chain(cert, key)
            if ca is not None:
                server.load_verify_locations(ca)
                server.verify_mode = ssl.CERT_REQUIRED
        if ca is not None:
            client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            client.load_verify_locations(ca)
            if cert is not None and key is not None:
                client.load_cert_chain(cert, key)
        return cls(server, client)
