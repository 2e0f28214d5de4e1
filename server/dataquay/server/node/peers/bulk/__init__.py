"""The bulk data path between daemons: a framed TCP stream beside gRPC for
payload bytes, near the socket's speed. :mod:`.frames` is the wire format,
:mod:`.server` the listener, :mod:`.client` the reading side, :mod:`.tls`
the TLS contexts. Control stays on gRPC; a peer without a bulk address is
read over gRPC."""
